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
    assert outputs["depth_logits"].shape == (12, 24, 4, 8)          # stride 8
    assert outputs["depth_target"].shape == outputs["depth_valid"].shape == (12, 4, 8)
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


def test_light_trunk_is_six_convs_to_stride_8_and_trains_in_the_encoder():
    """``camera_encoder: Light`` (ours): at stride 8, three stages of two 3x3 conv-BN-ReLU
    (16, 32, then trunk_width channels), the first of each strided. Hand numbers: its parameter
    count; with every conv averaging its 3 x 3 x C_in window (weights 1 / (9 C_in)) and BN at
    its initial running statistics, a constant image of 1 stays 1 / sqrt(1 + eps) per layer
    away from the border, (1 + 1e-5) ** -3 after six. In the encoder it writes the BEV map with
    a finite gradient for every parameter; an image size off the stride is refused."""
    from opencood.config_schema import SchemaError
    from opencood.models.camera_backbones import LightTrunk
    from opencood.models.lift_splat import LiftSplat, LiftSplatArgs
    from opencood.registry import ENCODERS
    trunk = LightTrunk(8, 24)
    convs = [m for m in trunk.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.stride[0]) for c in convs] == [
        (3, 16, 2), (16, 16, 1), (16, 32, 2), (32, 32, 1), (32, 24, 2), (24, 24, 1)]
    conv_weights = 9 * (3 * 16 + 16 * 16 + 16 * 32 + 32 * 32 + 32 * 24 + 24 * 24)
    assert sum(p.numel() for p in trunk.parameters()) == conv_weights + 2 * (16 + 16 + 32 + 32
                                                                             + 24 + 24)
    with torch.no_grad():
        for conv in convs:
            conv.weight.fill_(1.0 / (9 * conv.in_channels))
    trunk.eval()
    out = trunk(torch.ones(1, 3, 64, 64))
    assert out.shape == (1, 24, 8, 8)
    assert torch.allclose(out[0, :, 3, 3], torch.full((24,), (1 + 1e-5) ** -3), atol=1e-6)
    assert out[0, :, 0, 0].max() < 0.5             # the zero padding reaches the corner

    args = {"image_size": [32, 64], "img_downsample": 8, "img_features": 8,
            "ddiscr": [2.0, 50.0, 6], "xbound": [-8.0, 8.0, 1.0], "ybound": [-8.0, 8.0, 1.0],
            "camera_encoder": "Light", "trunk_width": 24}
    encoder = LiftSplat(LiftSplatArgs(**args))
    assert encoder.camera_encoder.depth_head.in_channels == 24
    bev = encoder(fake_camera_batch(1, image_size=(32, 64)))
    assert bev.shape == (1, 8, 16, 16)
    bev.square().sum().backward()
    grads = [p.grad for p in encoder.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(g.abs().sum() > 0 for g in grads)
    with pytest.raises(SchemaError, match="multiples of 8 for Light"):
        ENCODERS.parse_args("lss", {**args, "image_size": [36, 64]}, "model.args.encoder.args")
