"""HEAL's depth supervision of the lift-splat encoder in training: the encoder's depth outputs
in the model outputs (the batch's ``depth_maps``, ``input_source: [camera, depth]``: the
readers' tests check those), and the loss's depth term (HEAL's ``loss.args.depth.weight``) by
hand; without ``loss.args.depth`` the loss is what it was."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from opencood.config import load_config
from opencood.config_schema import to_plain
from opencood.losses import build_loss
from opencood.losses.detection_loss import DetectionLoss, PointPillarLossArgs
from opencood.losses.depth import DepthLossArgs
from opencood.models.build import build_model
from opencood.utils.fake_batch import fake_camera_batch

CAMERA_SMALL = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / \
    "camera_small.yaml"


def detection_outputs_and_targets():
    """A 1-sample, 2 x 2-cell, 2-anchor head output with one positive anchor."""
    generator = torch.Generator().manual_seed(0)
    outputs = {"cls_preds": torch.randn(1, 2, 2, 2, generator=generator),
               "reg_preds": torch.randn(1, 14, 2, 2, generator=generator),
               "dir_preds": torch.randn(1, 4, 2, 2, generator=generator)}
    labels = torch.zeros(1, 8, dtype=torch.long)
    labels[0, 3] = 1
    targets = {"labels": labels, "reg_targets": torch.randn(1, 8, 7, generator=generator),
               "dir_targets": torch.zeros(1, 8, dtype=torch.long)}
    return outputs, targets


def test_depth_term_by_hand_and_absent_without_the_section():
    outputs, targets = detection_outputs_and_targets()
    plain_total, plain_terms = DetectionLoss()(outputs, targets)
    # two cameras' 1 x 2 cells, 4 bins: probabilities (0.5, 0.25, 0.125, 0.125) everywhere
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125])).view(1, 4, 1, 1).expand(2, 4, 1, 2)
    target = torch.tensor([[[0, 1]], [[3, 3]]])
    valid = torch.tensor([[[True, True]], [[False, True]]])
    depth = {"depth_logits": logits, "depth_target": target, "depth_valid": valid}

    def focal(p):
        return -0.25 * (1 - p) ** 2 * math.log(p)
    per_cell = [focal(0.5), focal(0.25), focal(0.125), focal(0.125)]
    measured = (per_cell[0] + per_cell[1] + per_cell[3]) / 3      # the second camera's first
    for cells, expected in (("all", sum(per_cell) / 4), ("measured", measured)):
        loss = DetectionLoss(PointPillarLossArgs(depth=DepthLossArgs(weight=0.5, cells=cells)))
        total, terms = loss({**outputs, **depth}, targets)
        assert terms["depth_loss"].item() == pytest.approx(0.5 * expected, rel=1e-6)
        assert total.item() == pytest.approx(plain_total.item() + 0.5 * expected, rel=1e-6)
        assert terms["cls_loss"] == plain_terms["cls_loss"]
    # off: no term, and the depth outputs change nothing (bit for bit)
    total, terms = DetectionLoss()({**outputs, **depth}, targets)
    assert "depth_loss" not in terms and torch.equal(total, plain_total)
    # asked for without the encoder's outputs: one line naming the keys to set
    with pytest.raises(ValueError, match="depth_supervision: true"):
        build_loss({"core_method": "point_pillar_loss",
                    "args": {"depth": {"weight": 1.0}}})(outputs, targets)


def test_camera_model_outputs_its_depth_logits_when_training_and_needs_no_depth_to_evaluate():
    torch.manual_seed(0)
    cfg = load_config(CAMERA_SMALL)
    assert "depth" in cfg["input_source"] and cfg["loss"]["args"]["depth"]["weight"] > 0
    model_cfg = to_plain(cfg["model"])          # a changed copy: the loaded config is read-only
    model_cfg["args"]["encoder"]["args"]["image_size"] = [32, 64]
    model_cfg["args"]["bev_range"] = [-12.8, -6.4, -3.0, 12.8, 6.4, 1.0]
    model = build_model(model_cfg)
    batch = {**fake_camera_batch(3, image_size=(32, 64), depth=True),
             "record_len": torch.tensor([1, 2]),
             "transforms_to_ego": torch.eye(4).repeat(3, 1, 1)}
    outputs = model(batch)
    assert outputs["depth_logits"].shape == (12, 24, 2, 4)
    assert outputs["depth_target"].shape == outputs["depth_valid"].shape == (12, 2, 4)
    without = {key: value for key, value in batch.items() if key != "depth_maps"}
    with pytest.raises(KeyError, match="input_source needs 'depth'"):
        model(without)
    model.eval()
    assert "depth_logits" not in model(without)


def test_trunk_width_narrows_the_heads_input_and_is_refused_for_the_resnet():
    from opencood.config_schema import SchemaError
    from opencood.models.lift_splat import LiftSplat, LiftSplatArgs
    from opencood.registry import ENCODERS
    args = {"image_size": [32, 64], "img_downsample": 16, "img_features": 8,
            "ddiscr": [2.0, 50.0, 6], "xbound": [-8.0, 8.0, 1.0], "ybound": [-8.0, 8.0, 1.0]}
    narrow = LiftSplat(LiftSplatArgs(**args, trunk_width=24))
    assert narrow.camera_encoder.up1.conv[3].out_channels == 24
    assert narrow.camera_encoder.depth_head.in_channels == 24
    bev = narrow(fake_camera_batch(1, image_size=(32, 64)))
    assert bev.shape == (1, 8, 16, 16)
    with pytest.raises(SchemaError, match="trunk_width"):
        ENCODERS.parse_args("lss", {**args, "img_downsample": 8, "camera_encoder": "Resnet101",
                                    "trunk_width": 24}, "model.args.encoder.args")
