"""The lift-splat encoder's depth supervision: HEAL's depth term (``point_pillar_depth_loss``,
its ``loss.args.depth``), a focal loss of each feature cell's depth distribution against the bin
of its measured depth, added to the detection loss with a weight.

The encoder (``opencood.models.lift_splat``, ``depth_supervision: true``) leaves its depth
logits and the bins of the batch's ``depth_maps`` (``input_source: [camera, depth]``) in the
model outputs (``depth_logits``, ``depth_target``, ``depth_valid``); without
``loss.args.depth`` the loss has no depth term and is what it always was.
"""
from __future__ import annotations

from typing import Literal, Mapping, Optional

import torch

from opencood.config_schema import non_negative, section, spec


@section
class DepthLossArgs:
    """``loss.args.depth`` (HEAL's key and weight; its ``smooth_target`` and ``use_fg_mask`` are
    not reproduced)."""

    weight: float = spec(1.0, check=non_negative)
    # which feature cells the mean runs over: "all", HEAL's (a depth outside the bins counts at
    # its clamped bin: dense depth images, whose sky is 255 m, the last bin); "measured", the
    # cells whose depth lies in the bins (sparse depth, the encoder's depth_sampling: cell_min)
    cells: Literal["all", "measured"] = "all"


def depth_focal_loss(logits: torch.Tensor, target: torch.Tensor, alpha: float = 0.25,
                     gamma: float = 2.0, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """HEAL's depth focal loss (``point_pillar_depth_loss``'s FocalLoss): logits (M, D, h, w),
    target bin indices (M, h, w) -> the mean over cells of ``-alpha (1 - p_t)^gamma log p_t``,
    p_t the softmax probability of the target bin. ``valid`` None: every cell counts; a bool
    mask (M, h, w): the mean over its cells (0 when it has none)."""
    log_probs = logits.log_softmax(1)
    log_target = log_probs.gather(1, target.unsqueeze(1)).squeeze(1)
    loss = -alpha * (1 - log_target.exp()) ** gamma * log_target
    if valid is None:
        return loss.mean()
    return (loss * valid).sum() / valid.sum().clamp(min=1)


def depth_term(outputs: Mapping[str, torch.Tensor], args: DepthLossArgs) -> torch.Tensor:
    """``weight`` x the depth focal loss of the model outputs (in float32, as the detection
    terms under AMP). ValueError when the outputs have no depth logits: a config whose loss
    asks for the term but whose encoder does not supervise depth."""
    if "depth_logits" not in outputs:
        raise ValueError("loss.args.depth needs the depth logits of a lift-splat encoder with "
                         "model.args.encoder.args.depth_supervision: true and depth maps "
                         "(input_source: [camera, depth])")
    valid = outputs["depth_valid"] if args.cells == "measured" else None
    return args.weight * depth_focal_loss(outputs["depth_logits"].float(),
                                          outputs["depth_target"], valid=valid)
