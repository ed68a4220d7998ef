"""HEAL's pyramid loss (``loss/point_pillar_pyramid_loss.py``): the detection loss plus a focal
loss on every scale's occupancy logits of the pyramid fusion (``opencood.models.pyramid_fusion``).

Occupancy targets of an agent come from its anchor labels (N, H W A) at the head's resolution
(scale 0 of the pyramid): a cell is foreground when any of its first two anchors is positive,
background when both are negatives; at scale l the cells are max-pooled by
``relative_downsample[l]`` (foreground if any cell is, background only if all are). Per scale:
the focal loss (HEAL's detection ``cls`` alpha / gamma) weighted ``pos_cls_weight`` on foreground,
1 on background, 0 on the rest, divided by the agent's foreground cells (at least 1), summed over
the agents and divided by their number, times ``weight[l]``.

Which labels: ``heter_pyramid_single`` (each sample one agent): the samples' own ``labels``.
``heter_pyramid_collab``: each agent's own labels (``targets["agent_labels"]`` (N_agents, H W
A), HEAL's ``label_dict_single``, boxes of what that agent sees in its own frame), added with
``single_weight`` (HEAL's ``train_params.single_weight``, default 1) as HEAL's training loop adds
its ``_single`` loss.

With ``depth`` (HEAL's ``point_pillar_depth_loss`` part, which its pyramid loss inherits): each
depth-supervised camera type adds its depth term (``opencood.losses.depth``).
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F

from opencood.config_schema import Problems, positive, section, spec
from opencood.losses.detection_loss import (DetectionLoss, PointPillarLossArgs,
                                            sigmoid_focal_loss)
from opencood.losses.depth import depth_term
from opencood.registry import LOSSES


@section
class PyramidArgs:
    """``loss.args.pyramid`` (HEAL's keys)."""

    relative_downsample: Tuple[int, ...] = (1, 2, 4)
    weight: Tuple[float, ...] = (0.4, 0.2, 0.1)
    pos_cls_weight: float = spec(2.0, check=positive)     # HEAL's loss.args.pos_cls_weight
    single_weight: float = 1.0

    def problems(self) -> Problems:
        if len(self.weight) != len(self.relative_downsample):
            yield "weight", "needs one entry per relative_downsample entry"


@section
class PyramidLossArgs(PointPillarLossArgs):
    """``loss.args`` of ``point_pillar_pyramid_loss``: the detection loss's (its ``depth``:
    every depth-supervised camera type's term) and ``pyramid``."""

    pyramid: PyramidArgs


def occupancy_targets(labels: torch.Tensor, height: int, width: int) -> Tuple[torch.Tensor,
                                                                              torch.Tensor]:
    """labels (N, H W A) in {-1, 0, 1} -> (foreground, background) (N, 1, H, W) float: any of
    anchors 0 and 1 positive; both negative (HEAL reads the first two anchors)."""
    per_anchor = labels.view(labels.shape[0], height, width, -1)[..., :2]
    foreground = (per_anchor == 1).any(dim=-1)
    background = (per_anchor == 0).all(dim=-1)
    return foreground.unsqueeze(1).float(), background.unsqueeze(1).float()


def occupancy_loss(occupancy: Sequence[torch.Tensor], labels: torch.Tensor,
                   args: PyramidArgs, alpha: float, gamma: float) -> torch.Tensor:
    """occupancy: per scale (N, 1, H_l, W_l) logits, scale 0 at the labels' (H, W); labels (N,
    H W A) -> the weighted sum over scales (module doc), a scalar."""
    agents, _, height, width = occupancy[0].shape
    foreground, background = occupancy_targets(labels, height, width)
    total = occupancy[0].new_zeros(())
    for logits, pool, weight in zip(occupancy, args.relative_downsample, args.weight):
        positive = F.max_pool2d(foreground, pool).flatten(1)
        negative = 1 - F.max_pool2d(1 - background, pool).flatten(1)
        cell_weights = positive * args.pos_cls_weight + negative
        cell_weights = cell_weights / positive.sum(1, keepdim=True).clamp(min=1.0)
        focal = sigmoid_focal_loss(logits.flatten(1).float(), positive, alpha=alpha, gamma=gamma)
        total = total + weight * (focal * cell_weights).sum() / agents
    return total


@LOSSES.register("point_pillar_pyramid_loss", args=PyramidLossArgs)
class PyramidLoss(DetectionLoss):
    """``forward(outputs, targets) -> (total, terms)``: the detection terms, and ``pyramid_loss``
    when the outputs carry ``occupancy_maps`` (module doc for the labels)."""

    def __init__(self, args: PyramidLossArgs):
        super().__init__(args)
        self.pyramid = args.pyramid

    def depth_loss(self, outputs: dict) -> torch.Tensor:
        """HEAL's depth supervision: each depth-supervised camera type's term
        (``losses.depth.depth_term`` of its ``depth_outputs``), summed as HEAL sums its
        ``depth_items``; a one-encoder model's ``depth_logits`` as the detection loss takes them."""
        if "depth_outputs" not in outputs:
            return depth_term(outputs, self.depth)
        return sum(depth_term(items, self.depth)
                   for items in outputs["depth_outputs"].values())

    def pyramid_term(self, outputs: dict, targets: dict) -> torch.Tensor:
        occupancy = outputs["occupancy_maps"]
        if occupancy[0].shape[0] == targets["labels"].shape[0]:        # one agent per sample
            return occupancy_loss(occupancy, targets["labels"], self.pyramid,
                                  self.focal_alpha, self.focal_gamma)
        if "agent_labels" not in targets:
            raise ValueError("point_pillar_pyramid_loss: a fusing model's occupancy maps need "
                             "each agent's own labels (targets['agent_labels'])")
        return self.pyramid.single_weight * occupancy_loss(
            occupancy, targets["agent_labels"], self.pyramid, self.focal_alpha, self.focal_gamma)

    def forward(self, outputs: dict, targets: dict):
        total, terms = super().forward(outputs, targets)
        extra = {}
        if outputs.get("occupancy_maps") is not None:
            extra["pyramid_loss"] = self.pyramid_term(outputs, targets)
        if not extra:
            return total, terms
        total = total + sum(extra.values())
        terms = {**terms, **{k: v.detach() for k, v in extra.items()},
                 "total_loss": total.detach()}
        return total, terms
