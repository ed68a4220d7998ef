"""CoAlign's uncertainty loss (opencood/losses/uncertainty.py) against the authors' formulas by
hand, its minimum at the true variance, and the von Mises term's stability."""
import math

import pytest
import torch

from opencood.losses.uncertainty import (UncertaintyLossArgs, uncertainty_loss,
                                         uncertainty_loss_map, von_mises_nll)


def codes(x, y, yaw):
    box = torch.zeros(7)
    box[0], box[1], box[6] = x, y, yaw
    return box


def test_terms_by_hand():
    pred, target = codes(0.3, -0.1, 0.2), codes(0.0, 0.0, 0.0)
    log_var = torch.tensor([0.5, -1.0, 0.0])
    loss = uncertainty_loss_map(pred, target, log_var, UncertaintyLossArgs())
    x = 0.5 * (math.exp(-0.5) * 0.09 + 0.5)
    y = 0.5 * (math.exp(1.0) * 0.01 - 1.0)
    # k = 1: log I0(1) - |cos 0.2| + 0.001 * elu(0 - 1)
    yaw = math.log(1.2660658777520082) - math.cos(0.2) + 0.001 * (math.exp(-1) - 1)
    torch.testing.assert_close(loss, torch.tensor([x, y, 0.5 * yaw]))
    plain = UncertaintyLossArgs(xy_loss_type="l1", angle_loss_type="l2")
    l1 = uncertainty_loss_map(pred, target, log_var, plain)
    torch.testing.assert_close(l1, torch.tensor([0.5 * math.exp(-0.5) * 0.3 + 0.5,
                                                 0.5 * math.exp(1.0) * 0.1 - 1.0,
                                                 0.5 * 0.5 * 0.04]))


def test_gaussian_term_is_least_at_the_true_variance():
    # The mean loss over residuals of variance 0.04 is least at s = log(0.04) (the sample's
    # variance, within its 2 % noise).
    diff = torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 0.2
    grid = torch.linspace(-4.5, -2, 51)
    preds = torch.nn.functional.pad(diff[None, :, None], (0, 6)).expand(len(grid), -1, 7)
    log_var = grid[:, None, None].expand(-1, len(diff), 2)
    mean_loss = uncertainty_loss_map(preds, torch.zeros_like(preds), log_var,
                                     UncertaintyLossArgs(dim=2))[..., 0].mean(dim=1)
    assert grid[int(mean_loss.argmin())].item() == pytest.approx(math.log(0.04), abs=0.05)


def test_flipped_yaw_costs_nothing_more_with_limit_period_and_no_overflow():
    s = torch.tensor([-1.0])
    same = von_mises_nll(torch.tensor([0.1]), s, 0.001, 1.0, True)
    flipped = von_mises_nll(torch.tensor([0.1 + math.pi]), s, 0.001, 1.0, True)
    torch.testing.assert_close(same, flipped)
    assert torch.isfinite(von_mises_nll(torch.tensor([0.0]), torch.tensor([-10.0]),
                                        0.001, 1.0, True)).all()


def test_weights_select_positives_and_nan_targets_cost_only_the_variance():
    preds = torch.stack([codes(1.0, 1.0, 0.0), codes(5.0, 5.0, 0.0)])[None]
    targets = torch.stack([codes(0.0, 0.0, 0.0), codes(float("nan"), 0.0, 0.0)])[None]
    log_var = torch.zeros(1, 2, 3)
    args = UncertaintyLossArgs(dim=2, weight=1.0)
    only_first = uncertainty_loss(preds, targets, log_var, torch.tensor([[1.0, 0.0]]), 1.0, args)
    assert only_first.item() == pytest.approx(1.0)            # 0.5 * 1 per coordinate
    second = uncertainty_loss(preds, targets, log_var, torch.tensor([[0.0, 1.0]]), 1.0, args)
    assert second.item() == pytest.approx(0.5 * 25)            # x ignored (NaN), y residual 5


def test_head_option_and_detection_loss_term_train_together():
    # A tiny pillar model with the uncertainty head, the loss built from a yaml-like section.
    from opencood.config import resolve_section
    from opencood.losses import build_loss
    from opencood.models import build_model
    from test_models import make_batch, make_targets, model_args
    torch.manual_seed(0)
    model = build_model(resolve_section("model", {
        "core_method": "point_pillar_intermediate",
        "args": {**model_args({"core_method": "fcooper", "args": {}}), "uncertainty_dim": 3}}))
    outputs = model(make_batch([2, 1]))
    assert outputs["unc_preds"].shape[:2] == (2, 3 * 2)
    loss_cfg = resolve_section("loss", {"core_method": "point_pillar_loss",
                                        "args": {"uncertainty": {"weight": 0.25}}})
    loss_fn = build_loss(loss_cfg)
    targets = make_targets(2)
    total, terms = loss_fn(outputs, targets)
    assert "unc_loss" in terms and terms["unc_loss"] != 0
    without = build_loss(resolve_section("loss", {"core_method": "point_pillar_loss"}))
    torch.testing.assert_close(total - terms["unc_loss"], without(outputs, targets)[0])
    total.backward()
    assert model.head.unc_conv.weight.grad.abs().sum() > 0
    # The per-sample validation total agrees with forward on a micro-batch of one sample.
    one = {key: value[:1] for key, value in outputs.items() if key.endswith("_preds")}
    one_targets = {key: value[:1] for key, value in targets.items()}
    torch.testing.assert_close(loss_fn.per_sample_losses(one, one_targets).float(),
                               loss_fn(one, one_targets)[0].detach()[None])


def test_the_uncertainty_loss_needs_the_head():
    from opencood.losses.detection_loss import DetectionLoss, PointPillarLossArgs
    from test_models import make_targets
    maps = {"cls_preds": torch.zeros(1, 2, 16, 16), "reg_preds": torch.zeros(1, 14, 16, 16),
            "dir_preds": torch.zeros(1, 4, 16, 16)}
    with pytest.raises(ValueError, match="uncertainty_dim"):
        DetectionLoss(PointPillarLossArgs(uncertainty=UncertaintyLossArgs()))(maps, make_targets(1))


def test_stage1_detections_carry_each_boxs_log_variance():
    # unc_preds copy the class logits into every channel: a kept box's log variances must then
    # equal the logit of its own score, whatever NMS and top-k reordered.
    from pathlib import Path
    from opencood.config import load_config
    from opencood.postprocess import build_postprocessor
    from opencood.postprocess.uncertain_detections import detections_with_uncertainty
    smoke = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"
    postprocessor = build_postprocessor(load_config(smoke, ["postprocess.pre_nms_max=40"]),
                                        torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    cls = torch.randn(2, 2, 16, 32, generator=gen) * 2
    outputs = {"cls_preds": cls, "reg_preds": torch.randn(2, 14, 16, 32, generator=gen) * 0.3,
               "dir_preds": torch.randn(2, 4, 16, 32, generator=gen),
               "unc_preds": cls.repeat_interleave(3, dim=1)}
    plain = [postprocessor.nms(*decoded) for decoded in postprocessor.decode(outputs)]
    for (boxes, scores, log_var), (ref_boxes, ref_scores, _) in zip(
            detections_with_uncertainty(postprocessor, outputs), plain):
        assert len(boxes) > 5 and log_var.shape == (len(boxes), 3)
        torch.testing.assert_close(boxes, ref_boxes)
        torch.testing.assert_close(scores, ref_scores)
        torch.testing.assert_close(log_var, torch.logit(scores)[:, None].expand(-1, 3),
                                   atol=1e-4, rtol=1e-4)
