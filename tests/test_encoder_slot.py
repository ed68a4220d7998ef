"""The encoder slot (opencood.models.encoders) and the bev_grid section: both config forms build
the same network, old checkpoints load through one prefix rule, mismatched grids are refused."""

import pytest
import torch

from opencood.config import load_config
from opencood.config_schema import to_plain
from opencood.data.pipeline import BatchPreparer
from opencood.errors import ConfigError
from opencood.models import build_model
from opencood.models.encoders import PillarEncoder
from opencood.registry import ENCODERS
from opencood.utils.fake_batch import fake_collated_batch

SMOKE = "hypes_yaml/synthetic/point_pillar_attfuse.yaml"


def encoder_form(cfg):
    """The resolved config's model section with its pillar keys moved under ``encoder``."""
    model = to_plain(cfg["model"])
    args = model["args"]
    args["encoder"] = {"core_method": "pillar",
                       "args": {"pillar_vfe": args.pop("pillar_vfe"),
                                "point_pillar_scatter": args.pop("point_pillar_scatter")}}
    return model


def model_inputs(cfg):
    batch = fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=2,
                                pillars_per_agent=200, points_per_pillar=3)
    return BatchPreparer.from_config(cfg, "cpu", training=False).model_inputs(batch)


def test_the_pillar_encoder_is_registered_and_in_the_detectors():
    cfg = load_config(SMOKE)
    model = build_model(cfg["model"])
    assert ENCODERS.get("pillar") is PillarEncoder
    assert isinstance(model.encoder, PillarEncoder)
    assert model.encoder.out_channels == cfg["model"]["args"]["point_pillar_scatter"][
        "num_features"]


def test_both_config_forms_build_the_same_network_with_the_same_outputs():
    cfg = load_config(SMOKE)
    torch.manual_seed(0)
    legacy = build_model(cfg["model"]).eval()
    torch.manual_seed(0)
    slotted = build_model(encoder_form(cfg)).eval()
    assert list(legacy.state_dict()) == list(slotted.state_dict())
    for key, value in legacy.state_dict().items():
        assert torch.equal(value, slotted.state_dict()[key]), key
    inputs = model_inputs(cfg)
    with torch.no_grad():
        assert torch.equal(legacy(inputs)["cls_preds"], slotted(inputs)["cls_preds"])


def test_a_checkpoint_from_before_the_slot_loads_by_one_prefix_rule():
    cfg = load_config(SMOKE)
    torch.manual_seed(1)
    model = build_model(cfg["model"]).eval()
    old = {(key[len("encoder."):] if key.startswith("encoder.") else key): value
           for key, value in model.state_dict().items()}
    assert any(key.startswith("vfe.") for key in old)
    torch.manual_seed(2)
    fresh = build_model(cfg["model"]).eval()
    fresh.load_state_dict(old)                              # strict
    inputs = model_inputs(cfg)
    with torch.no_grad():
        assert torch.equal(fresh(inputs)["cls_preds"], model(inputs)["cls_preds"])


def test_an_unknown_encoder_and_two_forms_at_once_are_one_line_errors(tmp_path):
    cfg = load_config(SMOKE)
    with pytest.raises(ConfigError, match="model.args.encoder.core_method.*registered encoder"):
        load_config(SMOKE, ["model.args.encoder={core_method: radar, args: {}}"])
    both = encoder_form(cfg)
    both["args"]["pillar_vfe"] = cfg["model"]["args"]["pillar_vfe"]
    with pytest.raises(Exception, match="pillar_vfe.*belongs in model.args.encoder.args"):
        build_model(both)


def test_the_bev_grid_feeds_the_anchors_and_must_match_the_pillars():
    cfg = load_config(SMOKE)
    anchors_default = BatchPreparer.from_config(cfg, "cpu").postprocessor.anchors
    # A BEV grid of the same size elsewhere moves the anchors with it (the pillar grid does not
    # define them any more) ...
    shifted = load_config(SMOKE, ["bev_grid.range=[-50.4, -25.6, -3, 52.0, 25.6, 1]"])
    anchors_shifted = BatchPreparer.from_config(shifted, "cpu").postprocessor.anchors
    assert anchors_shifted.shape == anchors_default.shape
    assert torch.allclose(anchors_shifted[..., 0], anchors_default[..., 0] + 0.8)
    # ... and a pillar encoder refuses to write a map that is not the BEV grid.
    finer = load_config(SMOKE, ["bev_grid.cell_size=[0.4, 0.4]"])
    with pytest.raises(ValueError, match="pillar grid .* must be the BEV grid"):
        build_model(finer["model"])
