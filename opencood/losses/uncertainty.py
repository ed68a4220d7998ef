"""CoAlign's uncertainty loss (the authors' ``KLLoss`` of ``point_pillar_uncertainty_loss.py``):
the head predicts per anchor the log variance s of its x, y (and yaw) regression targets, and
the loss is the negative log-likelihood of the residual under that variance, so that the pose
graph (``opencood.ops.pose_graph``) can weigh each box by exp(-s).

* x, y, ``l2``: 0.5 (exp(-s) d^2 + s) (a Gaussian); ``l1``: 0.5 exp(-s) |d| + s (the authors'
  expression as written);
* yaw, ``von-mise``: log I0(k) - k cos(d) + lambda_V elu(s - s0) with k = exp(-s) the
  concentration; with ``limit_period`` the cosine is |cos(d)| and detached (a box off by pi is
  as good, and the yaw regression learns from the box loss only); log I0(k) is computed as
  log(i0e(k)) + k, which does not overflow (the authors' log(i0e(k) exp(k)) does for k > ~700).

d is the raw residual of the box code (prediction - target, target NaN: no loss); every
anchor's loss is weighted by its regression weight, summed, scaled by ``weight``.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from opencood.config_schema import non_negative, section, spec
from opencood.postprocess.layout import YAW_CODE


@section
class UncertaintyLossArgs:
    """``loss.args.uncertainty`` with the authors' names and their OPV2V values."""
    weight: float = spec(0.25, check=non_negative)
    angle_weight: float = spec(0.5, check=non_negative)
    dim: Literal[2, 3] = 3                                  # x, y (2) or x, y, yaw (3)
    xy_loss_type: Literal["l2", "l1"] = "l2"
    angle_loss_type: Literal["von-mise", "l2"] = "von-mise"
    lambda_V: float = spec(0.001, check=non_negative)       # pull of s towards s0 (ELU)
    s0: float = 1.0
    limit_period: bool = True                               # yaw off by pi is no error


def gaussian_nll(diff: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """The authors' ``kl_loss_l2``: 0.5 (exp(-s) d^2 + s), elementwise."""
    return 0.5 * (torch.exp(-log_var) * diff ** 2 + log_var)


def laplace_like_nll(diff: torch.Tensor, log_var: torch.Tensor) -> torch.Tensor:
    """The authors' ``kl_loss_l1``: 0.5 exp(-s) |d| + s, elementwise."""
    return 0.5 * torch.exp(-log_var) * diff.abs() + log_var


def von_mises_nll(diff: torch.Tensor, log_var: torch.Tensor, lambda_v: float, s0: float,
                  limit_period: bool) -> torch.Tensor:
    """The authors' ``kl_loss_angular``: log I0(k) - k cos(d) + lambda_V elu(s - s0), with
    k = exp(-s)."""
    concentration = torch.exp(-log_var)
    log_i0 = torch.log(torch.special.i0e(concentration)) + concentration
    cosine = torch.cos(diff).abs().detach() if limit_period else torch.cos(diff)
    return log_i0 - concentration * cosine + lambda_v * F.elu(log_var - s0)


def uncertainty_loss_map(box_preds: torch.Tensor, box_targets: torch.Tensor,
                         log_var: torch.Tensor, args: UncertaintyLossArgs) -> torch.Tensor:
    """(..., 7) box codes predicted and targeted, (..., dim) predicted log variances ->
    (..., dim) per-anchor loss before weighting."""
    box_targets = torch.where(torch.isnan(box_targets), box_preds, box_targets)
    diff = box_preds - box_targets
    xy_loss = gaussian_nll if args.xy_loss_type == "l2" else laplace_like_nll
    parts = [xy_loss(diff[..., :2], log_var[..., :2])]
    if args.dim == 3:
        yaw_diff, yaw_log_var = diff[..., YAW_CODE:YAW_CODE + 1], log_var[..., 2:3]
        if args.angle_loss_type == "von-mise":
            yaw_loss = von_mises_nll(yaw_diff, yaw_log_var, args.lambda_V, args.s0,
                                     args.limit_period)
        else:
            yaw_loss = gaussian_nll(yaw_diff, yaw_log_var)
        parts.append(args.angle_weight * yaw_loss)
    return torch.cat(parts, dim=-1)


def uncertainty_loss(box_preds: torch.Tensor, box_targets: torch.Tensor, log_var: torch.Tensor,
                     weights: torch.Tensor, normaliser, args: UncertaintyLossArgs) -> torch.Tensor:
    """(B, N, 7) codes, (B, N, dim) log variances, (B, N) regression weights (0 off the
    positives) -> () ``weight`` * sum of weighted per-anchor losses / ``normaliser`` (the
    authors: per-sample positives in the weights, then / batch size; pass the detection loss's
    normaliser to keep its convention)."""
    per_anchor = uncertainty_loss_map(box_preds.float(), box_targets.float(), log_var.float(),
                                      args)
    return args.weight * (per_anchor * weights.unsqueeze(-1)).sum() / normaliser
