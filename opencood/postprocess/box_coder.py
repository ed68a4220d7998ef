"""Residual box coding against anchors, and the direction-bin trick (PointPillars / SECOND).

Boxes are ``[x, y, z, <sizes>, yaw]`` with the sizes in ``order`` ('hwl': h, w, l; 'lwh': l, w, h);
a box code keeps the same column order, so an 'lwh' code is the 'hwl' code with columns 3 and 5
swapped. The regression target for yaw is the plain difference ``yaw_gt - yaw_anchor``; since the
loss usually compares yaws through ``sin(a - b)``, which cannot tell ``yaw`` from ``yaw + pi``, a
separate classifier predicts a direction bin and :meth:`ResidualBoxCoder.apply_direction` puts the
decoded yaw into that bin.
"""
from __future__ import annotations

import math

import torch

from opencood.ops.transforms import limit_period, size_columns
from opencood.postprocess.layout import DIR_OFFSET, NUM_DIR_BINS, YAW_CODE

SIZE_CODES = (3, 4, 5)


class ResidualBoxCoder:
    """Encode/decode boxes as residuals to anchors; all methods broadcast over leading dims.

    Args:
        dir_offset: where the direction bins start (radians).
        num_dir_bins: direction bins over the full circle (2: forward / backward).
        order: 'hwl' or 'lwh', the column order of the sizes in boxes, anchors and codes.
    """

    def __init__(self, dir_offset: float = DIR_OFFSET, num_dir_bins: int = NUM_DIR_BINS,
                 order: str = "hwl"):
        if num_dir_bins < 1:
            raise ValueError(f"num_dir_bins must be >= 1, got {num_dir_bins}")
        self.dir_offset = float(dir_offset)
        self.num_dir_bins = int(num_dir_bins)
        self.order = order
        self.h_col, self.w_col, self.l_col = size_columns(order)

    @property
    def bin_width(self) -> float:
        return 2 * math.pi / self.num_dir_bins

    def encode(self, gt_boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """gt_boxes (..., 7), anchors (..., 7) (broadcastable) -> deltas (..., 7): centre offsets
        over the anchor's BEV diagonal (z over its height), log size ratios, yaw difference."""
        anchor, gt = anchors.unbind(-1), gt_boxes.unbind(-1)
        diagonal = torch.sqrt(anchor[self.l_col] ** 2 + anchor[self.w_col] ** 2)
        return torch.stack([
            (gt[0] - anchor[0]) / diagonal, (gt[1] - anchor[1]) / diagonal,
            (gt[2] - anchor[2]) / anchor[self.h_col],
            *(torch.log(gt[k] / anchor[k]) for k in SIZE_CODES),
            gt[YAW_CODE] - anchor[YAW_CODE]], dim=-1)

    def decode(self, deltas: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """deltas (..., 7), anchors (..., 7) (broadcastable) -> boxes (..., 7); inverts encode."""
        anchor, delta = anchors.unbind(-1), deltas.unbind(-1)
        diagonal = torch.sqrt(anchor[self.l_col] ** 2 + anchor[self.w_col] ** 2)
        return torch.stack([
            delta[0] * diagonal + anchor[0], delta[1] * diagonal + anchor[1],
            delta[2] * anchor[self.h_col] + anchor[2],
            *(torch.exp(delta[k]) * anchor[k] for k in SIZE_CODES),
            delta[YAW_CODE] + anchor[YAW_CODE]], dim=-1)

    def direction_targets(self, gt_yaw: torch.Tensor) -> torch.Tensor:
        """gt_yaw (...,) radians -> (...,) int64 bin in ``[0, num_dir_bins)``.

        ``bin = floor(limit_period(yaw - dir_offset, 0, 2 pi) / (2 pi / num_dir_bins))``.
        """
        shifted = limit_period(gt_yaw - self.dir_offset, 0.0, 2 * math.pi)
        bins = torch.floor(shifted / self.bin_width).to(torch.int64)
        # limit_period can return exactly 2*pi after float rounding of a tiny negative angle.
        return bins.clamp(0, self.num_dir_bins - 1)

    def apply_direction(self, boxes: torch.Tensor, dir_logits: torch.Tensor) -> torch.Tensor:
        """boxes (..., 7), dir_logits (..., num_dir_bins) -> boxes (..., 7), yaw moved into the
        predicted bin: ``limit_period(yaw - off, 0, w) + off + w * bin`` with ``w`` the bin width
        (for 2 bins ``w = pi``). The result lies in ``[off, off + 2 pi)``."""
        bins = dir_logits.argmax(dim=-1).to(boxes.dtype)
        width = self.bin_width
        yaw = limit_period(boxes[..., YAW_CODE] - self.dir_offset, 0.0, width) \
            + self.dir_offset + width * bins
        return torch.cat([boxes[..., :YAW_CODE], yaw.unsqueeze(-1)], dim=-1)
