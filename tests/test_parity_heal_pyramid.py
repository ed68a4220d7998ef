"""Our heterogeneous pyramid models against HEAL's (github.com/yifanlu0227/HEAL), issue 37
point 3.

``tests/fixtures/parity/heal_pyramid.pt`` was made by running HEAL's own ``HeterPyramidCollab``
and ``HeterPyramidSingle`` and its pyramid loss (``tools/reference/make_heal_pyramid_fixture.py``,
never run in CI) on three agent types: a PointPillar LiDAR (m1), a lift-splat camera with the
ResNet-101 trunk and its own smaller grid, padded to the LiDAR range (m2), and a second
PointPillar with its own weights (m3, the 32-beam agent); ConvNeXt and identity aligners, a
ResNeXt (collab) and a ResNet (single) pyramid. Samples of 4, 1 and 3 agents, each in its own
frame; generated weights, pillars, images and labels.

Here HEAL's ``model.args`` go through :func:`model_args_from_heal` and its state dict through
:func:`heal_state_to_ours` (strict) into our models, which must give the fused map, every
scale's occupancy logits, the heads and the pyramid loss within 1e-5 relative, in eval mode
(camera score masks on) and train mode (BatchNorm batch statistics). Each defining piece is
shown to matter: the camera padding, the evaluation-only camera mask, the warp into the ego
frame, the zero-score exclusion from the softmax.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from opencood.engine.freeze import freeze_parameters, train_keeping_frozen
from opencood.engine.optim import build_optimizer
from opencood.interop.heal_heter import (camera_encoders_of, heal_state_to_ours,
                                         model_args_from_heal)
from opencood.interop.opencood_ckpt import InteropError, state_shapes
from opencood.losses import build_loss
from opencood.models import heter_pyramid, pyramid_fusion
from opencood.registry import MODELS
from parity_weights import generated_tensor, materialize
from tests.reference_fixtures import load_parity_fixture

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "parity" / "heal_pyramid.pt"
TOLERANCE = 1e-5
BROKEN = 1e-3
CAMERA_KEYS = {"imgs": "images", "intrins": "intrinsics", "extrinsics": "extrinsics",
               "post_rots": "post_rots", "post_trans": "post_trans"}


pytestmark = pytest.mark.usefixtures("one_thread")     # as the fixture was made (conftest)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return load_parity_fixture(FIXTURE, "make_heal_pyramid_fixture.py")


def our_inputs(heal_inputs: dict) -> dict:
    """HEAL's ``inputs_<m>`` of one modality -> our encoder's keys."""
    if "imgs" not in heal_inputs:
        return dict(heal_inputs)
    inputs = {ours: heal_inputs[theirs] for theirs, ours in CAMERA_KEYS.items()}
    recipe = heal_inputs["imgs"]
    inputs["images"] = generated_tensor(recipe["key"], recipe["shape"])
    return inputs


def modality_groups(heal_inputs: dict) -> dict:
    """HEAL's ``inputs_<m>`` of every modality -> our ``modality_pillars`` / ``modality_cameras``."""
    groups = {"modality_pillars": {}, "modality_cameras": {}}
    for name, value in heal_inputs.items():
        group = "modality_cameras" if "imgs" in value else "modality_pillars"
        groups[group][name] = our_inputs(value)
    return groups


def our_model(case: dict, name: str):
    heal_args = case["heal_args"]
    args = model_args_from_heal(heal_args)
    model = MODELS.build(name, args, "model.args")
    state = heal_state_to_ours(materialize(case["state_dict"]), camera_encoders_of(heal_args),
                               state_shapes(model.state_dict()), list(args["modalities"]))
    model.load_state_dict(state, strict=True)
    return model


def relative(ours: torch.Tensor, expected: torch.Tensor) -> float:
    assert ours.shape == expected.shape
    return float((ours - expected).abs().max() / expected.abs().max())


def differences(outputs: dict, expected: dict) -> dict:
    diffs = {}
    for key, value in expected.items():
        if key == "occupancy":
            for level, (ours, theirs) in enumerate(zip(outputs["occupancy_maps"], value)):
                diffs[f"occupancy{level}"] = relative(ours, theirs)
        else:
            diffs[key] = relative(outputs[key], value)
    return diffs


class Collab:
    def __init__(self, fixture: dict):
        self.case = fixture["collab"]
        self.model = our_model(self.case, "heter_pyramid_collab")
        self.batch = {"record_len": self.case["record_len"],
                      "transforms_to_ego": self.case["transforms_to_ego"].float(),
                      "points_in_agent_frame": True,
                      "agent_modality": self.case["agent_modality_list"],
                      **modality_groups(self.case["inputs"])}

    def run(self, mode: str = "eval", batch: dict | None = None) -> dict:
        """Train mode runs on a copy: its BatchNorm statistics updates stay out of later runs."""
        model = copy.deepcopy(self.model) if mode == "train" else self.model
        model.train(mode == "train")
        with torch.no_grad():
            return model(batch or self.batch)


@pytest.fixture(scope="module")
def collab(fixture) -> Collab:
    return Collab(fixture)


def test_fixture_exercises_what_matters(fixture):
    case = fixture["collab"]
    assert set(case["agent_modality_list"]) == {"m1", "m2", "m3"}
    assert sorted(case["record_len"].tolist()) == [1, 3, 4]
    assert case["heal_args"]["fusion_backbone"]["resnext"]
    assert not fixture["single"]["heal_args"]["fusion_backbone"]["resnext"]
    to_ego = case["transforms_to_ego"]
    assert (to_ego[:, :2, 3].abs() > 0.4).any()           # off the grid's cells
    assert (to_ego[:, 0, 1].abs() > 0.01).any()            # rotated
    labels = case["labels"]
    assert (labels == 1).any() and (labels == -1).any() and (labels == 0).any()


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_collab_parity(collab, mode):
    """Fused map, every scale's occupancy and (eval) the heads, 8 agents of three types."""
    expected = collab.case["outputs"][mode]
    diffs = differences(collab.run(mode), expected)
    assert len(diffs) >= 4 and max(diffs.values()) <= TOLERANCE, diffs


def test_collab_pyramid_loss_parity(fixture, collab):
    """HEAL's ``_single`` pass of its pyramid loss on the eval occupancy maps (per-agent labels),
    through our loss registry."""
    loss = build_loss({"core_method": "point_pillar_pyramid_loss",
                       "args": {"pyramid": fixture["loss_args"]["pyramid"]}})
    outputs = collab.run("eval")
    labels = collab.case["labels"].long()
    record_len = collab.case["record_len"]
    sample_labels = torch.zeros(len(record_len), labels.shape[1], dtype=torch.long)
    ours = loss.pyramid_term(outputs, {"labels": sample_labels, "agent_labels": labels})
    assert relative(ours, collab.case["pyramid_loss"]) <= TOLERANCE


def test_single_parity(fixture):
    """HEAL runs one modality per batch; ours one mixed batch of single-agent samples (the late
    strategy's): the same per-agent outputs, and the occupancy loss over all of them."""
    case = fixture["single"]
    model = our_model(case, "heter_pyramid_single").eval()
    modalities = [batch["modality"] for batch in case["batches"]]
    batch = {"record_len": torch.ones(len(modalities), dtype=torch.long),
             "agent_modality": modalities,
             **modality_groups({b["modality"]: b["inputs"] for b in case["batches"]})}
    with torch.no_grad():
        outputs = model(batch)
    for index, expected in enumerate(case["outputs"]):
        one = {key: (value[index:index + 1] if key != "occupancy_maps"
                     else [o[index:index + 1] for o in value])
               for key, value in outputs.items() if key in
               ("cls_preds", "reg_preds", "dir_preds", "fused_features", "occupancy_maps")}
        diffs = differences(one, expected)
        assert max(diffs.values()) <= TOLERANCE, (modalities[index], diffs)
    loss = build_loss({"core_method": "point_pillar_pyramid_loss",
                       "args": {"pyramid": fixture["loss_args"]["pyramid"]}})
    term = loss.pyramid_term(outputs, {"labels": case["labels"].long()})
    assert relative(term, case["occupancy_loss"]) <= TOLERANCE


def test_late_model_parity(fixture):
    """HEAL's HeterModelLate (a detector per type) on a mixed batch of single-agent samples;
    its never-run first ``layers`` stages are dropped by name, anything else strictly placed."""
    from opencood.interop.heal_heter import heal_late_state_to_ours, late_model_args_from_heal
    case = fixture["late"]
    args = late_model_args_from_heal(case["heal_args"])
    model = MODELS.build("heter_model_late", args, "model.args").eval()
    heal_state = materialize(case["state_dict"])
    assert any(".resnet.layer0." in key for key in heal_state if key.startswith("layers_"))
    model.load_state_dict(heal_late_state_to_ours(
        heal_state, camera_encoders_of(case["heal_args"]), state_shapes(model.state_dict()),
        list(args["modalities"])), strict=True)
    modalities = [batch["modality"] for batch in case["batches"]]
    batch = {"record_len": torch.ones(len(modalities), dtype=torch.long),
             "agent_modality": modalities,
             **modality_groups({b["modality"]: b["inputs"] for b in case["batches"]})}
    with torch.no_grad():
        outputs = model(batch)
    for index, expected in enumerate(case["outputs"]):
        diffs = {key: relative(outputs[key][index:index + 1], value)
                 for key, value in expected.items()}
        assert max(diffs.values()) <= TOLERANCE, (modalities[index], diffs)
    # training: every parameter is reached (all three types in the batch)
    model.train()
    outputs = model(batch)
    sum(outputs[key].square().mean() for key in ("cls_preds", "reg_preds", "dir_preds")).backward()
    assert not [key for key, p in model.named_parameters() if p.grad is None]


# -- each defining piece matters -------------------------------------------------------------

def test_camera_mask_only_in_evaluation(collab, monkeypatch):
    """HEAL masks camera agents' scores to their window in eval only: without the mask the eval
    fused map moves; the train-mode parity above ran without it."""
    monkeypatch.setattr(pyramid_fusion, "camera_valid_masks",
                        lambda modalities, ratios, h, w, device: torch.ones(
                            len(modalities), 1, h, w, device=device))
    expected = collab.case["outputs"]["eval"]["fused_features"]
    assert relative(collab.run("eval")["fused_features"], expected) > BROKEN


def test_warp_matters(collab):
    batch = dict(collab.batch, points_in_agent_frame=False)
    expected = collab.case["outputs"]["eval"]["fused_features"]
    assert relative(collab.run("eval", batch)["fused_features"], expected) > BROKEN


def test_camera_padding_matters(collab, monkeypatch):
    """The camera map padded about its centre (torchvision's CenterCrop): one cell off moves the
    fused map."""
    def shifted(features, height, width):
        padded = torch.nn.functional.pad(features, (0, width - features.shape[-1],
                                                    0, height - features.shape[-2]))
        return padded
    monkeypatch.setattr(heter_pyramid, "center_crop", shifted)
    expected = collab.case["outputs"]["eval"]["fused_features"]
    assert relative(collab.run("eval")["fused_features"], expected) > BROKEN


def test_zero_scores_leave_the_softmax(collab, monkeypatch):
    """A warped score of exactly 0 (outside the agent's map) is out of HEAL's softmax; kept in,
    it takes weight from the agents that do reach the cell."""
    def keep_all(features, scores, record_len, to_ego, grid):
        maps = torch.cat([features, scores], 1)
        if to_ego is not None:
            maps = pyramid_fusion.warp_to_ego(maps, to_ego, grid)
        padded, is_real = pyramid_fusion.pad_by_sample(maps, record_len)
        weights = torch.softmax(padded[:, :, -1:].masked_fill(
            ~is_real[:, :, None, None, None], float("-inf")), dim=1)
        return (padded[:, :, :-1] * weights).sum(1)
    monkeypatch.setattr(pyramid_fusion, "weighted_fuse", keep_all)
    expected = collab.case["outputs"]["eval"]["fused_features"]
    assert relative(collab.run("eval")["fused_features"], expected) > BROKEN


def test_center_crop_is_torchvisions():
    """Odd and even differences, padding and cropping, against hand-placed values."""
    x = torch.arange(1, 7.).view(1, 1, 2, 3)
    padded = heter_pyramid.center_crop(x, 5, 4)
    assert padded.shape == (1, 1, 5, 4)
    # height 2 -> 5: 1 row above, 2 below; width 3 -> 4: 0 left, 1 right
    assert padded[0, 0, 1:3, 0:3].tolist() == x[0, 0].tolist() and padded.sum() == x.sum()
    cropped = heter_pyramid.center_crop(torch.arange(25.).view(1, 1, 5, 5), 2, 3)
    # round((5 - 2) / 2) = 2 (Python rounds half to even), round((5 - 3) / 2) = 1
    assert cropped[0, 0].tolist() == [[11, 12, 13], [16, 17, 18]]


def test_a_tampered_key_is_refused(fixture, collab):
    case = fixture["collab"]
    state = materialize(case["state_dict"])
    state["pyramid_backbone.single_head_9.weight"] = state.pop(
        "pyramid_backbone.single_head_0.weight")
    args = model_args_from_heal(case["heal_args"])
    with pytest.raises(InteropError, match="single_head_9"):
        heal_state_to_ours(state, camera_encoders_of(case["heal_args"]),
                           state_shapes(collab.model.state_dict()), list(args["modalities"]))


# -- training: every parameter is used ---------------------------------------------------------

# test_models' coverage (heter_model_late: test_late_model_parity)
HETER_MODELS = ("heter_pyramid_collab", "heter_pyramid_single", "heter_model_late")


def detection_targets(batch: int, anchors: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(-1, 2, (batch, anchors), generator=generator)
    positive = (labels == 1).float()
    return {"labels": labels, "reg_targets": torch.randn(batch, anchors, 7, generator=generator),
            "dir_targets": torch.randint(0, 2, (batch, anchors), generator=generator),
            "reg_weights": positive}


@pytest.mark.parametrize("name", HETER_MODELS[:2])
def test_forward_backward_reaches_every_parameter(fixture, collab, name):
    """One training step's loss (detection + pyramid) gives every parameter a gradient when all
    three agent types are in the batch: DDP needs no unused-parameter search."""
    model = copy.deepcopy(collab.model) if name == "heter_pyramid_collab" else \
        our_model(fixture["collab"], name)
    model.train()
    batch = dict(collab.batch)
    if name == "heter_pyramid_single":
        batch["record_len"] = torch.ones(len(batch["agent_modality"]), dtype=torch.long)
    outputs = model(batch)
    samples, anchors = outputs["cls_preds"].shape[0], outputs["cls_preds"][0].numel()
    targets = detection_targets(samples, anchors, seed=1)
    targets["agent_labels"] = collab.case["labels"].long()
    loss = build_loss({"core_method": "point_pillar_pyramid_loss", "args": {}})
    total, terms = loss(outputs, targets)
    assert terms["pyramid_loss"] > 0 and torch.isfinite(total)
    total.backward()
    missing = [key for key, p in model.named_parameters() if p.grad is None]
    assert not missing, missing[:5]


def test_depth_supervision_joins_the_loss(collab):
    """A camera type with depth supervision adds HEAL's depth term: ``depth.weight`` x the focal
    loss of its depth logits (``depth_focal_loss``, equal to HEAL's in test_parity_lss.py), and
    its gradient reaches the depth head."""
    import dataclasses
    from opencood.losses.depth import depth_focal_loss
    model = copy.deepcopy(collab.model).train()
    encoder = model.branches["m2"].encoder
    encoder.args = dataclasses.replace(encoder.args, depth_supervision=True)
    cameras = dict(collab.batch["modality_cameras"]["m2"])
    images = cameras["images"]
    cameras["depth_maps"] = 1 + 30 * generated_tensor("depth", [*images.shape[:2],
                                                               *images.shape[3:]]).abs()
    batch = dict(collab.batch, modality_cameras={"m2": cameras})
    outputs = model(batch)
    samples, anchors = outputs["cls_preds"].shape[0], outputs["cls_preds"][0].numel()
    targets = dict(detection_targets(samples, anchors, seed=2),
                   agent_labels=collab.case["labels"].long())
    loss = build_loss({"core_method": "point_pillar_pyramid_loss",
                       "args": {"depth": {"weight": 0.5}}})
    total, terms = loss(outputs, targets)
    items = outputs["depth_outputs"]["m2"]
    expected = 0.5 * depth_focal_loss(items["depth_logits"], items["depth_target"]).detach()
    assert float(terms["depth_loss"]) == pytest.approx(float(expected), rel=1e-6)
    assert float(terms["total_loss"]) == pytest.approx(
        sum(float(v) for k, v in terms.items() if k != "total_loss"), rel=1e-6)
    total.backward()
    assert encoder.camera_encoder.depth_head.weight.grad.abs().sum() > 0


def test_a_lidar_type_encodes_on_the_grid_the_data_side_pillarises_it_on():
    """A LiDAR type's pillar grid comes from its heter preprocess (the grid of its
    modality_pillars); types whose maps would not meet in one size are refused at build."""
    from opencood.config import load_config, replaced
    from opencood.models import build_model
    yaml = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / \
        "heter_pyramid_collab.yaml"
    finer = ("heter.modality_setting.m3.preprocess={args: {voxel_size: [0.4, 0.4, 4]}, "
             "cav_lidar_range: [-51.2, -25.6, -3, 51.2, 25.6, 1]}")
    cfg = load_config(yaml, [finer])
    modalities = cfg["model"]["args"]["modalities"]
    assert modalities["m3"]["voxel_size"] == [0.4, 0.4, 4.0]
    assert modalities["m1"]["voxel_size"] == cfg["preprocess"]["args"]["voxel_size"]
    with pytest.raises(ValueError, match="one map size"):
        build_model(cfg["model"])
    cfg = replaced(cfg, {"model.args.modalities.m3.backbone.layer_strides": [4]})  # 0.4 m x 4
    model = build_model(cfg["model"])                                             # = 0.8 m x 2
    assert (model.branches["m3"].encoder.scatter.nx, model.branches["m1"].encoder.scatter.nx) \
        == (256, 128)
    assert model.branches["m3"].map_size == model.branches["m1"].map_size == (32, 64)


def test_backward_alignment_trains_only_the_new_type(collab):
    """HEAL's stage two (HeterPyramidSingle.fix_modules: pyramid fusion, shrink header, heads;
    here with the base's other types, whose branches our collab model holds, fixed too) as
    ``train_params.fix_modules``: one Adam step on the three-type batch changes exactly the
    camera type's branch, and leaves the fixed parts' weights and BatchNorm statistics exact."""
    model = copy.deepcopy(collab.model)
    fixed = ["pyramid", "shrink", "head", "branches.m1", "branches.m3"]
    frozen = set(freeze_parameters(model, fixed))
    trained = {name for name, _ in model.named_parameters()} - frozen
    assert trained and all(name.startswith("branches.m2.") for name in trained)
    train_keeping_frozen(model, model, fixed)
    assert [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.BatchNorm2d) and not module.training] == \
        [name for name, module in model.named_modules()
         if isinstance(module, torch.nn.BatchNorm2d) and not name.startswith("branches.m2.")]
    before = {key: value.clone() for key, value in model.state_dict().items()}
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad],
                                {"core_method": "Adam", "lr": 1e-3, "args": {}})
    outputs = model(collab.batch)
    samples, anchors = outputs["cls_preds"].shape[0], outputs["cls_preds"][0].numel()
    targets = detection_targets(samples, anchors, seed=1)
    targets["agent_labels"] = collab.case["labels"].long()
    loss = build_loss({"core_method": "point_pillar_pyramid_loss", "args": {}})
    loss(outputs, targets)[0].backward()
    assert {name for name, p in model.named_parameters() if p.grad is not None} == trained
    optimizer.step()
    changed = {key for key, value in model.state_dict().items()
               if not torch.equal(value, before[key])}
    assert changed and all(key.startswith("branches.m2.") for key in changed), changed
    assert any(key.endswith("running_mean") for key in changed)
    assert trained <= changed
