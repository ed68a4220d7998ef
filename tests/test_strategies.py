"""Fusion strategies (opencood/strategies): one object per fusion.core_method, pairing its dataset,
model-input adapter, postprocess merge and model check; a new strategy is one registered class."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import opencood.data.datasets  # noqa: F401  (registers the datasets)
from opencood.config import load_config
from opencood.errors import ConfigError
from opencood.registry import DATASETS, STRATEGIES
from opencood.strategies import FusionStrategy, get_strategy, strategy_names

SMOKE_YAML = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"


class SingleAgent(torch.nn.Module):
    fusion = None


class Fusing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fusion = torch.nn.Identity()


def test_the_four_strategies_and_their_datasets():
    assert strategy_names() == ["early", "intermediate", "late", "late_box_align", "no"]
    for name in strategy_names():
        assert get_strategy(name).dataset_name in DATASETS
    assert get_strategy("late").loss_dataset_args() == {"per_cav": True}
    assert get_strategy("intermediate").loss_dataset_args() == {}
    assert get_strategy("late").merges_late and not get_strategy("early").merges_late


@pytest.mark.parametrize("name,single_ok,fusing_ok", [
    ("no", True, True), ("early", True, True), ("late", True, False),
    ("intermediate", False, True)])
def test_each_strategy_checks_the_model_it_runs(name, single_ok, fusing_ok):
    strategy = get_strategy(name)
    for model, ok in ((SingleAgent(), single_ok), (Fusing(), fusing_ok)):
        if ok:
            strategy.check_model(model, "m")
        else:
            with pytest.raises(ConfigError, match=f"fusion method '{name}' needs"):
                strategy.check_model(model, "m")


def test_late_runs_every_agent_alone_and_other_strategies_pass_inputs_through():
    inputs = {"record_len": torch.tensor([3, 1]), "shared_points": torch.zeros(1), "x": 1}
    assert get_strategy("late").model_inputs(inputs)["record_len"].tolist() == [1, 1, 1, 1]
    assert "shared_points" not in get_strategy("late").model_inputs(inputs)
    assert get_strategy("intermediate").model_inputs(inputs) is inputs


def test_a_new_strategy_is_one_registered_class():
    """Registering a class is all the config and the dataset builder need."""

    class EgoOnly(FusionStrategy):
        name, dataset_name = "ego_only", "no"

    STRATEGIES.add("ego_only", EgoOnly)
    try:
        cfg = load_config(SMOKE_YAML, ["fusion.core_method=ego_only"])
        assert cfg["fusion"]["core_method"] == "ego_only"
        assert isinstance(get_strategy("ego_only"), EgoOnly)
    finally:
        STRATEGIES._entries.pop("ego_only")
    with pytest.raises(ConfigError, match="'fusion.core_method' is not a registered fusion method; expected one of early"):
        load_config(SMOKE_YAML, ["fusion.core_method=ego_only"])
