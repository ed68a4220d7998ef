"""Detection loss, weight initialisation and parameter/FLOP counting."""
import math

import pytest
import torch
from torch import nn
from torchvision.ops import sigmoid_focal_loss

from opencood.losses import DetectionLoss, PointPillarLossArgs, build_loss
from opencood.models.heads import AnchorHead
from opencood.utils.init import init_weights
from opencood.utils.model_stats import count_flops, count_parameters, format_model_summary

A, H, W = 2, 2, 3
N = H * W * A


def anchor_maps(per_anchor):
    """(B, N, K) rows in anchor order (H, W, A) -> head layout (B, K*A, H, W)."""
    batch, _, k = per_anchor.shape
    return per_anchor.reshape(batch, H, W, A * k).permute(0, 3, 1, 2)


def zero_outputs(batch=1):
    return {"cls_preds": torch.zeros(batch, A, H, W), "reg_preds": torch.zeros(batch, 7 * A, H, W),
            "dir_preds": torch.zeros(batch, 2 * A, H, W)}


def targets_with_one_positive(anchor=5, batch=1):
    labels = torch.zeros(batch, N, dtype=torch.long)
    labels[:, anchor] = 1
    labels[:, 0] = -1
    return {"labels": labels, "reg_targets": torch.zeros(batch, N, 7),
            "dir_targets": torch.zeros(batch, N, dtype=torch.long),
            "reg_weights": (labels == 1).float()}


@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_our_focal_loss_is_torchvisions(alpha):
    from opencood.losses.detection_loss import sigmoid_focal_loss as ours
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 4
    targets = (torch.rand(3, 50, generator=gen) > 0.7).float()
    torch.testing.assert_close(ours(logits, targets, alpha=alpha, gamma=2.0),
                               sigmoid_focal_loss(logits, targets, alpha=alpha, gamma=2.0,
                                                  reduction="none"), rtol=0, atol=1e-7)


def test_loss_terms_match_hand_computation_for_one_positive():
    loss_fn = DetectionLoss(PointPillarLossArgs(cls_weight=1.0, reg_weight=2.0, dir_weight=0.2))
    outputs = zero_outputs()
    reg_rows = torch.zeros(1, N, 7)
    reg_rows[0, 5, 0] = 1.0            # x residual off by 1 on the positive anchor
    reg_rows[0, 7, 0] = 5.0            # a negative anchor's regression must not count
    outputs["reg_preds"] = anchor_maps(reg_rows)
    dir_rows = torch.zeros(1, N, 2)
    dir_rows[0, 5] = torch.tensor([0.0, 1.0])      # positive anchor leans to the wrong bin
    outputs["dir_preds"] = anchor_maps(dir_rows)
    total, terms = loss_fn(outputs, targets_with_one_positive())

    # cls: logits 0 -> p = 0.5; positive: alpha * 0.5^2 * log 2; each of the 10 cared negatives
    # (anchor 0 ignored): (1 - alpha) * 0.5^2 * log 2; divided by 1 positive.
    expected_cls = (0.25 + 10 * 0.75) * 0.25 * math.log(2)
    # reg: smooth-L1 (beta 1/9) of 1.0 is 1 - 0.5/9; weight 2.
    expected_reg = 2.0 * (1.0 - 0.5 / 9.0)
    # dir: cross-entropy of logits [0, 1] against bin 0, weight 0.2.
    expected_dir = 0.2 * (math.log(1 + math.e) - 0.0)
    assert terms["cls_loss"].item() == pytest.approx(expected_cls, rel=1e-5)
    assert terms["reg_loss"].item() == pytest.approx(expected_reg, rel=1e-5)
    assert terms["dir_loss"].item() == pytest.approx(expected_dir, rel=1e-5)
    assert total.item() == pytest.approx(expected_cls + expected_reg + expected_dir, rel=1e-5)


def test_regression_uses_sine_difference_for_yaw():
    loss_fn = DetectionLoss(PointPillarLossArgs(cls_weight=0.0, dir_weight=0.0))
    targets = targets_with_one_positive()
    targets["reg_targets"][0, 5, 6] = 0.3
    outputs = zero_outputs()
    for yaw_pred, expected_small in [(0.3 + math.pi, True), (0.3 + math.pi / 2, False)]:
        reg_rows = torch.zeros(1, N, 7)
        reg_rows[0, 5, 6] = yaw_pred
        outputs["reg_preds"] = anchor_maps(reg_rows)
        reg_loss = loss_fn(outputs, targets)[1]["reg_loss"].item()
        # sin(p)cos(t) - cos(p)sin(t) = sin(p - t): 0 for a flip by pi, 1 for a quarter turn.
        assert (reg_loss < 1e-6) == expected_small
    assert reg_loss == pytest.approx(2.0 * (1.0 - 0.5 / 9.0), rel=1e-5)


def test_ignored_anchors_do_not_count_and_normaliser_is_the_positive_count():
    loss_fn = DetectionLoss()
    targets = targets_with_one_positive()
    outputs = zero_outputs()
    reference = loss_fn(outputs, targets)[0]
    cls_rows = torch.zeros(1, N, 1)
    cls_rows[0, 0] = 7.0                    # anchor 0 is ignored
    outputs["cls_preds"] = anchor_maps(cls_rows)
    assert loss_fn(outputs, targets)[0].item() == pytest.approx(reference.item())

    # Two copies of the sample in one micro-batch: twice the sum over twice the positives.
    doubled = loss_fn(zero_outputs(batch=2), targets_with_one_positive(batch=2))[0]
    assert doubled.item() == pytest.approx(reference.item(), rel=1e-6)
    # No positives at all: normalised by 1, not by 0.
    no_positive = targets_with_one_positive()
    no_positive["labels"][0, 5] = 0
    total, terms = loss_fn(zero_outputs(), no_positive)
    assert math.isfinite(total.item()) and terms["reg_loss"].item() == 0.0


def test_where2comm_confidence_is_supervised_with_its_sample_labels():
    loss_fn = build_loss({"core_method": "point_pillar_loss", "args": {"conf_weight": 0.5}})
    targets = targets_with_one_positive(batch=2)
    targets["labels"][1, 5] = 0                                   # sample 1: no positive
    conf = torch.randn(3, A, H, W)
    outputs = dict(zero_outputs(batch=2), conf_preds=conf,
                   conf_sample_index=torch.tensor([0, 0, 1]))
    _, terms = loss_fn(outputs, targets)
    labels = targets["labels"][[0, 0, 1]]
    logits = conf.permute(0, 2, 3, 1).reshape(3, N)
    focal = sigmoid_focal_loss(logits, (labels == 1).float(), reduction="none")
    expected = 0.5 * (focal * (labels >= 0)).sum() / (labels == 1).sum()
    assert terms["conf_loss"].item() == pytest.approx(expected.item(), rel=1e-5)



def one_positive_outputs(batch=1):
    """zero_outputs with sample 0's anchor 5 off by 1 in x and leaning to the wrong direction
    bin: the case test_loss_terms_match_hand_computation_for_one_positive computes by hand."""
    outputs = zero_outputs(batch)
    reg_rows = torch.zeros(batch, N, 7)
    reg_rows[0, 5, 0] = 1.0
    outputs["reg_preds"] = anchor_maps(reg_rows)
    dir_rows = torch.zeros(batch, N, 2)
    dir_rows[0, 5] = torch.tensor([0.0, 1.0])
    outputs["dir_preds"] = anchor_maps(dir_rows)
    return outputs


def test_per_sample_losses_hand_computed_with_a_sample_without_positives():
    loss_fn = DetectionLoss(PointPillarLossArgs(cls_weight=1.0, reg_weight=2.0, dir_weight=0.2))
    targets = targets_with_one_positive(batch=2)
    targets["labels"][1, 5] = 0          # sample 1: a frame without vehicles
    outputs = one_positive_outputs(batch=2)
    per_sample = loss_fn.per_sample_losses(outputs, targets)

    focal = 0.25 * math.log(2)           # p = 0.5: (alpha or 1 - alpha) * 0.5^2 * log 2
    sample_0 = ((0.25 + 10 * 0.75) * focal + 2.0 * (1.0 - 0.5 / 9.0)
                + 0.2 * math.log(1 + math.e))
    sample_1 = 11 * 0.75 * focal / 1.0   # 11 cared negatives over max(0 positives, 1)
    assert per_sample.dtype == torch.float64 and per_sample.shape == (2,)
    assert per_sample.tolist() == pytest.approx([sample_0, sample_1], rel=1e-6)
    # The training loss divides the micro-batch's sum by its 1 positive: the two samples add up
    # instead of averaging, which is why validation uses per-sample losses.
    total = loss_fn(outputs, targets)[0].item()
    assert total == pytest.approx(sample_0 + sample_1, rel=1e-6)


def _sample_alone(outputs: dict, targets: dict, sample: int):
    """The outputs and targets of a micro-batch holding ``sample`` alone."""
    alone = {key: outputs[key][sample:sample + 1] for key in ("cls_preds", "reg_preds",
                                                               "dir_preds")}
    agents = outputs["conf_sample_index"] == sample
    alone["conf_preds"] = outputs["conf_preds"][agents]
    alone["conf_sample_index"] = torch.zeros(int(agents.sum()), dtype=torch.long)
    return alone, {key: value[sample:sample + 1] for key, value in targets.items()}


def test_per_sample_losses_equal_the_loss_of_each_sample_alone():
    torch.manual_seed(3)
    loss_fn = build_loss({"core_method": "point_pillar_loss", "args": {"conf_weight": 0.5}})
    batch = 3
    labels = torch.randint(-1, 2, (batch, N))
    labels[1] = labels[1].clamp(max=0)   # no positive: normalised by 1
    targets = {"labels": labels, "reg_targets": torch.randn(batch, N, 7),
               "dir_targets": torch.randint(0, 2, (batch, N)),
               "reg_weights": torch.rand(batch, N)}
    outputs = {"cls_preds": torch.randn(batch, A, H, W),
               "reg_preds": torch.randn(batch, 7 * A, H, W),
               "dir_preds": torch.randn(batch, 2 * A, H, W),
               "conf_preds": torch.randn(6, A, H, W),       # 2, 1 and 3 agents
               "conf_sample_index": torch.tensor([0, 0, 1, 2, 2, 2])}
    per_sample = loss_fn.per_sample_losses(outputs, targets)
    alone = [loss_fn(*_sample_alone(outputs, targets, b))[0].item() for b in range(batch)]
    assert per_sample.tolist() == pytest.approx(alone, rel=1e-6)
    assert loss_fn(outputs, targets)[0].item() != pytest.approx(sum(alone) / batch, rel=1e-3)

def small_net():
    return nn.Sequential(nn.Conv2d(16, 32, 3), nn.BatchNorm2d(32), nn.ConvTranspose2d(32, 24, 2),
                         nn.Linear(24, 40), AnchorHead(24, num_anchors=2))


def test_xavier_uniform_within_bound_biases_zero_and_cls_prior():
    torch.manual_seed(0)
    net = small_net()
    for module in net.modules():
        if hasattr(module, "bias") and module.bias is not None:
            nn.init.constant_(module.bias, 3.0)
    init_weights(net, "xavier_uniform", cls_prior=0.01)
    conv, norm, _, linear, head = net
    for layer, fan_in, fan_out in [(conv, 16 * 9, 32 * 9), (linear, 24, 40)]:
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        assert layer.weight.abs().max() <= bound
        assert layer.weight.abs().max() > 0.9 * bound     # really uniform over the range
        assert torch.all(layer.bias == 0)
    assert torch.all(norm.weight == 1) and torch.all(norm.bias == 0)
    assert torch.allclose(head.cls_conv.bias, torch.full((2,), -math.log(99.0)))
    assert torch.all(head.reg_conv.bias == 0)


def test_xavier_normal_and_kaiming_std():
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 64, 3)
    init_weights(conv, "xavier_normal")
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2.0 / (2 * 64 * 9)), rel=0.05)
    init_weights(conv, "kaiming")
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2.0 / (64 * 9)), rel=0.05)


def test_default_init_keeps_pytorch_reset_and_applies_prior():
    torch.manual_seed(0)
    head = AnchorHead(32, num_anchors=2)
    head.cls_conv.bias.data.zero_()
    init_weights(head, "default", cls_prior=0.1)
    assert torch.allclose(head.cls_conv.bias, torch.full((2,), -math.log(9.0)))
    assert head.reg_conv.bias.abs().sum() > 0             # PyTorch's own bias init kept


def test_unknown_init_method_lists_options():
    with pytest.raises(ValueError, match="xavier_uniform, xavier_normal, kaiming, default"):
        init_weights(nn.Linear(2, 2), "orthogonal")


def test_flops_of_a_known_conv():
    conv = nn.Conv2d(3, 8, 3, padding=1)
    # 16x16 outputs x 8 channels, each 3*3*3 multiply-adds, 2 FLOPs each:
    # 2 * 3 * 8 * 9 * 16 * 16 = 110592 (bias adds not counted by FlopCounterMode).
    assert count_flops(conv, torch.randn(1, 3, 16, 16)) == 110592


def test_parameter_counts_and_summary():
    net = nn.Sequential(nn.Linear(10, 5), nn.Linear(5, 2))     # 55 + 12 parameters
    net[1].weight.requires_grad_(False)                        # 10 frozen
    assert count_parameters(net) == (67, 57)
    # FLOPs: 2 * 4 * (10*5 + 5*2) = 480
    assert count_flops(net, torch.randn(4, 10)) == 480

    wide = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 500))  # 1001000 + 500500
    wide[1].requires_grad_(False)
    # FLOPs: 2 * 3 * (1000*1000 + 1000*500) = 9e6 = 0.009 GFLOPs
    summary = format_model_summary(wide, torch.randn(3, 1000))
    assert summary == "Sequential: 1.502 M params (1.001 M trainable), 0.009 GFLOPs per forward"
