"""Anchor target assignment, batched over the samples of a batch.

Matching uses BEV IoU of the axis-aligned rectangles enclosing the rotated boxes ("standup"
boxes), as PointPillars and OpenCOOD do: cheap, and good enough to pick which anchors learn.
GT are padded to ``Mmax`` with a mask, and everything follows the device of ``gt_boxes``.
Anchor ``n`` is row ``n`` of ``anchors.reshape(-1, 7)``, the row order of the flattened head
outputs (:mod:`opencood.postprocess.layout`).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch

from opencood.ops.transforms import size_columns
from opencood.postprocess.box_coder import ResidualBoxCoder


def standup_bev(boxes: torch.Tensor, order: str = "hwl") -> torch.Tensor:
    """Boxes (..., 7) of ``order`` -> (..., 4) ``[xmin, ymin, xmax, ymax]`` of the axis-aligned
    rectangle enclosing the rotated BEV box."""
    _, width_col, length_col = size_columns(order)
    cos, sin = torch.cos(boxes[..., 6]).abs(), torch.sin(boxes[..., 6]).abs()
    half_l, half_w = boxes[..., length_col] / 2, boxes[..., width_col] / 2
    half_x = cos * half_l + sin * half_w
    half_y = sin * half_l + cos * half_w
    x, y = boxes[..., 0], boxes[..., 1]
    return torch.stack([x - half_x, y - half_y, x + half_x, y + half_y], dim=-1)


def standup_iou(anchor_rects: torch.Tensor, gt_rects: torch.Tensor) -> torch.Tensor:
    """anchor_rects (N, 4), gt_rects (B, M, 4) -> IoU (B, N, M); zero-area GT give 0.

    Memory is a few (B, N, M) float tensors; keep ``M`` (padded GT) small.
    """
    # Contiguous coordinate columns: broadcasting strided last-dim slices is several times
    # slower on CPU.
    ax1, ay1, ax2, ay2 = (c.contiguous().view(1, -1, 1) for c in anchor_rects.unbind(-1))
    gx1, gy1, gx2, gy2 = (c.contiguous().unsqueeze(1) for c in gt_rects.unbind(-1))
    overlap_x = torch.minimum(ax2, gx2).sub_(torch.maximum(ax1, gx1)).clamp_(min=0)
    overlap_y = torch.minimum(ay2, gy2).sub_(torch.maximum(ay1, gy1)).clamp_(min=0)
    intersection = overlap_x.mul_(overlap_y)                              # (B, N, M)
    area_a = (ax2 - ax1) * (ay2 - ay1)                                   # (1, N, 1)
    area_g = (gx2 - gx1) * (gy2 - gy1)                                   # (B, 1, M)
    union = (area_a + area_g).sub_(intersection)
    return intersection.div_(union.clamp_(min=torch.finfo(union.dtype).tiny))


def _gt_claiming_each_anchor(iou: torch.Tensor, gt_mask: torch.Tensor) -> torch.Tensor:
    """iou (B, N, M), gt_mask (B, M) -> (B, N) int64: the GT that claims this anchor as its
    best anchor, or -1.

    Each valid GT with a non-zero best IoU claims its best anchor (first one on ties). When
    several GTs claim the same anchor the one with the highest IoU wins (lowest index on ties);
    resolving this on the small (B, M, M) table first keeps the scatter free of duplicate
    writes, hence deterministic on CUDA.
    """
    batch, num_anchors, num_gt = iou.shape
    best_iou, best_anchor = iou.max(dim=1)                               # (B, M)
    claims = gt_mask & (best_iou > 0)
    same_anchor = best_anchor[:, :, None] == best_anchor[:, None, :]    # (B, M, M') m vs m'
    gt_order = torch.arange(num_gt, device=iou.device)
    other_beats = (best_iou[:, None, :] > best_iou[:, :, None]) | (
        (best_iou[:, None, :] == best_iou[:, :, None]) & (gt_order[None, :] < gt_order[:, None]))
    beaten = (same_anchor & claims[:, None, :] & other_beats).any(dim=2)
    wins = claims & ~beaten
    # Losers write into a spare column num_anchors that is cut off afterwards.
    target_column = torch.where(wins, best_anchor, torch.full_like(best_anchor, num_anchors))
    forced = torch.full((batch, num_anchors + 1), -1, dtype=torch.int64, device=iou.device)
    forced.scatter_(1, target_column, gt_order.expand(batch, num_gt).contiguous())
    return forced[:, :num_anchors]


def assign_targets(anchors: torch.Tensor, gt_boxes: torch.Tensor, gt_mask: torch.Tensor,
                   pos_iou: float = 0.6, neg_iou: float = 0.45,
                   box_coder: Optional[ResidualBoxCoder] = None,
                   anchor_rects: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
    """Label anchors and build regression/direction targets for a padded batch of GT boxes.

    Args:
        anchors: (H, W, A, 7) (or any (..., 7)), flattened to N = H*W*A anchors.
        gt_boxes: (B, Mmax, 7) in ``box_coder.order``, padded rows arbitrary.
        gt_mask: (B, Mmax) bool, True for real boxes.
        pos_iou / neg_iou: positive if max standup IoU >= pos_iou, negative if < neg_iou, else
            ignored. Each GT also makes its best anchor positive (if that IoU > 0), regressing to
            that GT even when the anchor overlaps another GT more.
        box_coder: encodes the targets and says the box order; defaults to
            ``ResidualBoxCoder()`` ('hwl').
        anchor_rects: (N, 4) ``standup_bev`` of the flattened anchors on ``gt_boxes``' device
            and dtype, when the caller keeps them (the anchors are fixed: VoxelPostprocessor
            computes them once, not in every step).

    Returns a dict on ``gt_boxes.device``:
        ``labels`` (B, N) int64 in {-1 ignore, 0 negative, 1 positive};
        ``reg_targets`` (B, N, 7) encoded boxes, exactly 0 where not positive;
        ``dir_targets`` (B, N) int64 direction bin of the matched GT, 0 where not positive;
        ``reg_weights`` (B, N) float, 1 for positives else 0;
        ``num_positives`` (B,) int64;
        ``matched_gt`` (B, N) int64 index into Mmax of the GT a positive regresses to, else -1.
    """
    box_coder = box_coder or ResidualBoxCoder()
    anchors_flat = anchors.reshape(-1, 7).to(device=gt_boxes.device, dtype=gt_boxes.dtype)
    gt_mask = gt_mask.to(device=gt_boxes.device, dtype=torch.bool)
    if gt_boxes.shape[1] == 0:                       # keep max() over GT well defined
        gt_boxes = gt_boxes.new_zeros((gt_boxes.shape[0], 1, 7))
        gt_mask = gt_mask.new_zeros((gt_boxes.shape[0], 1))

    # Padded GT become the zero-area rectangle at the origin: IoU exactly 0 with everything.
    gt_rects = torch.where(gt_mask[..., None], standup_bev(gt_boxes, box_coder.order), 0.0)
    if anchor_rects is None:
        anchor_rects = standup_bev(anchors_flat, box_coder.order)
    iou = standup_iou(anchor_rects, gt_rects)                             # (B, N, M)
    max_iou, best_gt = iou.max(dim=2)                                     # (B, N)
    forced_gt = _gt_claiming_each_anchor(iou, gt_mask)
    forced = forced_gt >= 0
    positive = forced | (max_iou >= pos_iou)
    negative = ~positive & (max_iou < neg_iou)
    matched_gt = torch.where(forced, forced_gt, best_gt)

    matched_boxes = torch.gather(
        gt_boxes, 1, matched_gt[..., None].expand(-1, -1, 7))             # (B, N, 7)
    # Non-positives encode the anchor against itself: exact zeros, no log(0) of padded rows.
    target_boxes = torch.where(positive[..., None], matched_boxes, anchors_flat[None])
    labels = torch.full_like(matched_gt, -1)
    labels = labels.masked_fill(negative, 0).masked_fill(positive, 1)
    dir_targets = box_coder.direction_targets(target_boxes[..., 6]).masked_fill(~positive, 0)
    return {
        "labels": labels,
        "reg_targets": box_coder.encode(target_boxes, anchors_flat[None]),
        "dir_targets": dir_targets,
        "reg_weights": positive.to(gt_boxes.dtype),
        "num_positives": positive.sum(dim=1),
        "matched_gt": matched_gt.masked_fill(~positive, -1),
    }


def assign_class_targets(anchors: torch.Tensor, gt_boxes: torch.Tensor, gt_mask: torch.Tensor,
                         gt_classes: torch.Tensor, thresholds: Sequence[Tuple[float, float]],
                         box_coder: Optional[ResidualBoxCoder] = None,
                         anchor_rects: Optional[torch.Tensor] = None
                         ) -> Dict[str, torch.Tensor]:
    """Multi-class :func:`assign_targets`: the anchors of class k only see the GT of class k,
    with class k's thresholds (V2X-Real's ``generate_label``).

    Args:
        anchors: (H, W, K*R, 7), class-major per cell (anchor ``k * R + r``: class k, yaw r).
        gt_boxes (B, Mmax, 7), gt_mask (B, Mmax): as :func:`assign_targets`.
        gt_classes: (B, Mmax) int64 class id of each GT row (padded rows arbitrary).
        thresholds: per class (pos_iou, neg_iou), K entries.
        anchor_rects: (N, 4) standup rectangles of the flattened anchors, if kept.

    Returns :func:`assign_targets`' dict over all N = H*W*K*R anchors (``matched_gt`` indexes
    the full Mmax rows) and ``class_targets`` (B, N) int64: the class of a positive anchor's GT
    (its anchor's class), 0 where not positive.
    """
    num_classes = len(thresholds)
    height, width, per_cell = anchors.shape[:3]
    if per_cell % num_classes:
        raise ValueError(f"{per_cell} anchors per cell do not split into {num_classes} classes")
    yaws = per_cell // num_classes
    cells = height * width
    class_anchors = anchors.reshape(cells, num_classes, yaws, 7)
    if anchor_rects is None:
        anchor_rects = standup_bev(anchors.reshape(-1, 7).to(gt_boxes),
                                   (box_coder or ResidualBoxCoder()).order)
    class_rects = anchor_rects.reshape(cells, num_classes, yaws, 4)
    gt_classes = gt_classes.to(gt_boxes.device)
    gt_mask = gt_mask.to(device=gt_boxes.device, dtype=torch.bool)
    per_class = []
    for k, (pos_iou, neg_iou) in enumerate(thresholds):
        targets = assign_targets(class_anchors[:, k], gt_boxes, gt_mask & (gt_classes == k),
                                 pos_iou=pos_iou, neg_iou=neg_iou, box_coder=box_coder,
                                 anchor_rects=class_rects[:, k].reshape(-1, 4))
        targets["class_targets"] = torch.where(targets["labels"] == 1, k, 0)
        per_class.append(targets)
    merged = {}
    for key, first in per_class[0].items():
        if key == "num_positives":
            merged[key] = sum(targets[key] for targets in per_class)
            continue
        # (B, cells * R, ...) per class -> (B, cells, K, R, ...) -> (B, N, ...): the anchor order.
        rest = first.shape[2:]
        stacked = torch.stack([targets[key].reshape(first.shape[0], cells, yaws, *rest)
                               for targets in per_class], dim=2)
        merged[key] = stacked.reshape(first.shape[0], -1, *rest)
    return merged
