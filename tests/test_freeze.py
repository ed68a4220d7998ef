"""``train_params.fix_modules`` (opencood.engine.freeze): HEAL's backward alignment as a config.

Real runs of the trainer on tiny data (smoke.yaml's PointPillar; freezing is model-agnostic):
the frozen parts' weights and BatchNorm statistics stay bit-identical through training,
validation and a resume, the trained part moves and the optimizer holds only what trains.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from opencood.config import ConfigError
from opencood.engine import trainer
from opencood.engine.freeze import freeze_parameters, load_base_weights, train_keeping_frozen
from opencood.engine.hooks import TrainHooks
from opencood.utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from opv2v_factory import frame_stamps, write_simple_split

SMOKE_YAML = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"
# HEAL's stage two in smoke.yaml's names: the "fusion side" (backbone, heads) fixed, the
# encoder (with a BatchNorm of its own) trained.
FROZEN = ("backbone", "head")
FIX = ["--set", f"train_params.fix_modules=[{', '.join(FROZEN)}]"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("synthetic")
    for split, count in (("train4", 4), ("validate2", 2)):
        write_simple_split(root / split, num_cavs=2, timestamps=frame_stamps(count))
    return root


def _data(root: Path, validate=True):
    return ["--set", f"root_dir={root / 'train4'}",
            "--set", f"validate_dir={root / 'validate2'}" if validate else "validate_dir=null",
            "--set", f"test_dir={root / 'validate2'}"]


def _frozen(name: str) -> bool:
    return any(name == part or name.startswith(part + ".") for part in FROZEN)


class PartsSpy:
    """What build_training_parts handed the run: the weights before any step, which
    parameters require gradients and which the optimizer holds (by name)."""

    def __init__(self):
        self.seen = []

    def __call__(self, parts, info):
        model = parts.model_without_ddp
        names = {id(param): name for name, param in model.named_parameters()}
        self.seen.append({
            "state": {key: value.clone() for key, value in model.state_dict().items()},
            "requires_grad": {name for name, param in model.named_parameters()
                              if param.requires_grad},
            "optimized": {names[id(param)] for group in parts.optimizer.param_groups
                          for param in group["params"]},
            "all": set(names.values())})


class TickingClock:
    """A stand-in for the trainer's ``time`` module: ``perf_counter`` advances 1 s per call."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now


def test_frozen_parts_stay_bit_identical_through_training_validation_and_resume(
        data_root, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the trainer's clock ticks 1 s per reading: an epoch of 2 steps reads it 6 times (its
    # start, 2 per step, its end), so it lasts 5 s whatever the machine's load
    monkeypatch.setattr(trainer, "time", TickingClock())
    run_dir, spy = tmp_path / "run", PartsSpy()
    # 2 epochs x 2 steps with validation between them (validation's eval/train toggling must
    # not leave the frozen BatchNorms in train mode), then a resume for a third epoch.
    trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir), *FIX,
                  "--set", "train_params.epoches=2", *_data(data_root)],
                 hooks=TrainHooks(on_parts=spy))
    # what the run cost (HEAL's table: an aligned type's cost against the base's)
    cost = yaml.safe_load((run_dir / "train_cost.yaml").read_text())
    assert (cost["steps"], cost["epochs"], cost["fix_modules"]) == (4, 2, list(FROZEN))
    assert cost["init_checkpoint"] is None and cost["train_seconds"] == 10.0
    # A resume keeps the folder's frozen set: changing it is refused (another run's recipe).
    with pytest.raises(SystemExit) as raised:
        trainer.main(["--model_dir", str(run_dir), "--set", "train_params.epoches=3",
                      "--set", "train_params.fix_modules=[head]"])
    assert "train_params.fix_modules" in str(raised.value.code)
    assert "\n" not in str(raised.value.code)
    result = trainer.main(["--model_dir", str(run_dir), "--set", "train_params.epoches=3"],
                          hooks=TrainHooks(on_parts=spy))
    assert result["step"] == 6
    first, resumed = spy.seen
    resumed_cost = yaml.safe_load((run_dir / "train_cost.yaml").read_text())
    assert (resumed_cost["steps"], resumed_cost["epochs"]) == (6, 3)
    assert resumed_cost["train_seconds"] == 15.0        # summed over the resume
    sizes = {name: first["state"][name].numel() for name in first["all"]}
    assert resumed_cost["frozen_parameters"] == sum(
        size for name, size in sizes.items() if _frozen(name)) > 0
    assert resumed_cost["trainable_parameters"] == sum(
        size for name, size in sizes.items() if not _frozen(name)) > 0
    trainable = {name for name in first["all"] if not _frozen(name)}
    assert trainable and len(trainable) < len(first["all"])
    for seen in (first, resumed):                      # the resumed run freezes the same set
        assert seen["requires_grad"] == trainable
        assert seen["optimized"] == trainable
    before, after = first["state"], load_checkpoint(run_dir / "last.pth")["model"]
    frozen_keys = [key for key in before if _frozen(key)]
    # Weights and BatchNorm buffers (running mean / var, batch counts) of the frozen parts.
    assert any(key.endswith("running_var") for key in frozen_keys)
    changed_frozen = [key for key in frozen_keys if not torch.equal(before[key], after[key])]
    assert changed_frozen == []
    # The trained part moved, its BatchNorm statistics included.
    assert not torch.equal(before["encoder.vfe.layers.0.norm.running_mean"],
                           after["encoder.vfe.layers.0.norm.running_mean"])
    moved = [key for key in before if not _frozen(key) and before[key].is_floating_point()
             and not torch.equal(before[key], after[key])]
    assert len(moved) == len([key for key in before if not _frozen(key)
                              and before[key].is_floating_point()])


def test_train_mode_keeps_frozen_batchnorms_in_eval():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 1), torch.nn.BatchNorm2d(2),
                                torch.nn.Sequential(torch.nn.Conv2d(2, 2, 1),
                                                    torch.nn.BatchNorm2d(2)))
    assert freeze_parameters(model, ["2"]) == ["2.0.weight", "2.0.bias", "2.1.weight",
                                                "2.1.bias"]
    model.eval()
    train_keeping_frozen(model, model, ["2"])
    # Only the frozen part's BatchNorm is in eval (HEAL's fix_bn): the trained one and the
    # frozen convolution follow train().
    assert [module.training for module in model.modules()] == [True, True, True, True, True,
                                                               False]


def test_a_prefix_matching_no_parameter_is_one_line_naming_the_key(data_root, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as raised:          # through the trainer: the model's parts
        trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
                      "--set", "train_params.fix_modules=[heads]", *_data(data_root, False)])
    assert str(raised.value.code) == (
        "error: train_params.fix_modules: 'heads' matches no parameter of the model (its "
        "parts: backbone.blocks, backbone.deblocks, encoder.vfe, head.cls_conv, head.dir_conv, "
        "head.reg_conv)")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError) as error:
        freeze_parameters(model, ["0", "heads"])
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("train_params.fix_modules: 'heads' matches no parameter")
    # A prefix is whole name parts: "0.w" is not a part of "0.weight".
    with pytest.raises(ConfigError, match="'0.w' matches no parameter"):
        freeze_parameters(model, ["0.w"])
    with pytest.raises(ConfigError, match="freezes every parameter"):
        freeze_parameters(model, ["0", "1"])
    assert all(param.requires_grad for param in model.parameters())   # refused before freezing


def test_a_new_run_aligns_against_the_bases_weights(data_root, tmp_path, monkeypatch):
    """HEAL's stage two: a base trained, then a new run starting from its checkpoint
    (``init.checkpoint``) with the fusion side frozen keeps the base's tensors there exactly."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "base"),
                  "--set", "train_params.epoches=1", *_data(data_root, False)])
    base = load_checkpoint(tmp_path / "base" / "last.pth")["model"]
    trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "align"), *FIX,
                  "--set", f"init.checkpoint={tmp_path / 'base' / 'last.pth'}",
                  "--set", "train_params.epoches=1", *_data(data_root, False)])
    aligned = load_checkpoint(tmp_path / "align" / "last.pth")["model"]
    same = {key for key in base if torch.equal(base[key], aligned[key])}
    assert {key for key in base if _frozen(key)} <= same
    assert "encoder.vfe.layers.0.norm.running_mean" not in same
    assert "loaded" in (tmp_path / "align" / "train.log").read_text()


def test_a_base_checkpoint_without_the_frozen_parts_is_one_line(tmp_path):
    """Freezing what the checkpoint does not hold would keep fresh weights fixed: refused."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 3))
    path = tmp_path / "base.pth"
    save_checkpoint(path, {"model": {"0.weight": torch.ones(2, 2), "0.bias": torch.ones(2)}})
    load_base_weights(model, str(path), ["0"])
    assert torch.equal(model[0].weight, torch.ones(2, 2))
    with pytest.raises(CheckpointError, match=r"lacks 2 tensors of the parts train_params\."
                                              r"fix_modules freezes: 1\.weight, 1\.bias"):
        load_base_weights(model, str(path), ["1"])
    save_checkpoint(path, {"model": {"1.weight": torch.ones(2, 2)}})
    with pytest.raises(CheckpointError, match=r"1\.weight \(2, 2\) vs model \(3, 2\)"):
        load_base_weights(model, str(path), [])


# The 2-rank DDP run with a frozen part shares the spawned ranks of tests/test_train.py's
# two_rank_runs session (job "frozen"): test_a_frozen_part_trains_under_ddp_without_unused_search.
