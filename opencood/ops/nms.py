"""Greedy non-maximum suppression with rotated BEV IoU (torch, any device)."""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from opencood.ops.iou import boxes_bev_iou


def _greedy_keep(overlaps: np.ndarray) -> np.ndarray:
    """Greedy pass over boxes already sorted by descending score.

    overlaps (N, N) bool, True where IoU exceeds the threshold -> (K,) int64 positions kept.
    A box survives if no earlier *kept* box overlaps it; suppressed boxes suppress nothing.
    """
    suppressed = np.zeros(overlaps.shape[0], dtype=bool)
    kept = []
    for position in range(overlaps.shape[0]):
        if suppressed[position]:
            continue
        kept.append(position)
        suppressed |= overlaps[position]
    return np.asarray(kept, dtype=np.int64)


def nms_rotated(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float,
                order: str = "hwl", classes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Indices of the boxes kept by greedy rotated NMS, by descending score.

    boxes (N, 7), scores (N,) -> LongTensor (K,) on the boxes' device. A box is dropped when its
    BEV IoU with a higher-scored kept box is strictly greater than ``iou_threshold``; equal
    scores keep input order (stable sort). The caller applies any score threshold or top-k first:
    the IoU matrix is N x N. ``classes`` (N,) int: per-class NMS, a box only suppresses boxes of
    its own class (a pedestrian beside a truck survives); None: every box one class.
    """
    boxes = torch.as_tensor(boxes)
    scores = torch.as_tensor(scores, device=boxes.device)
    if boxes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=boxes.device)
    order_by_score = torch.sort(scores, descending=True, stable=True).indices
    sorted_boxes = boxes[order_by_score]
    # One IoU matrix, one device->host copy of a bool matrix; the greedy walk itself is
    # inherently sequential and cheap on the host, where it causes no per-step device syncs.
    overlapping = boxes_bev_iou(sorted_boxes, sorted_boxes, order) > iou_threshold
    if classes is not None:
        sorted_classes = torch.as_tensor(classes, device=boxes.device)[order_by_score]
        overlapping &= sorted_classes[:, None] == sorted_classes[None, :]
    overlaps = overlapping.cpu().numpy()
    kept_positions = torch.from_numpy(_greedy_keep(overlaps)).to(boxes.device)
    return order_by_score[kept_positions]
