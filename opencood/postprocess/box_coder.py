"""Residual box coding against anchors, and the direction-bin trick (PointPillars / SECOND).

Boxes are ``[x, y, z, h, w, l, yaw]``. The regression target for yaw is the plain difference
``yaw_gt - yaw_anchor``; since the loss usually compares yaws through ``sin(a - b)``, which
cannot tell ``yaw`` from ``yaw + pi``, a separate classifier predicts a direction bin and
:meth:`ResidualBoxCoder.apply_direction` puts the decoded yaw into that bin.
"""
from __future__ import annotations

import math

import torch

from opencood.ops.transforms import limit_period


class ResidualBoxCoder:
    """Encode/decode boxes as residuals to anchors; all methods broadcast over leading dims.

    Args:
        dir_offset: where the direction bins start (radians); the default pi/4 keeps the bin
            borders away from the 0 and 90 degree yaws that most cars have relative to a lane.
        num_dir_bins: direction bins over the full circle (2: forward / backward).
    """

    code_size = 7

    def __init__(self, dir_offset: float = 0.7854, num_dir_bins: int = 2):
        if num_dir_bins < 1:
            raise ValueError(f"num_dir_bins must be >= 1, got {num_dir_bins}")
        self.dir_offset = float(dir_offset)
        self.num_dir_bins = int(num_dir_bins)

    @classmethod
    def from_config(cls, dir_args: dict | None) -> "ResidualBoxCoder":
        """From an OpenCOOD-style ``dir_args`` dict (``dir_offset``, ``num_bins``), or None."""
        dir_args = dir_args or {}
        return cls(dir_offset=float(dir_args.get("dir_offset", 0.7854)),
                   num_dir_bins=int(dir_args.get("num_bins", 2)))

    @property
    def bin_width(self) -> float:
        return 2 * math.pi / self.num_dir_bins

    def encode(self, gt_boxes: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """gt_boxes (..., 7), anchors (..., 7) (broadcastable) -> deltas (..., 7)."""
        x_a, y_a, z_a, h_a, w_a, l_a, yaw_a = anchors.unbind(-1)
        x_g, y_g, z_g, h_g, w_g, l_g, yaw_g = gt_boxes.unbind(-1)
        diagonal = torch.sqrt(l_a ** 2 + w_a ** 2)
        return torch.stack([
            (x_g - x_a) / diagonal, (y_g - y_a) / diagonal, (z_g - z_a) / h_a,
            torch.log(h_g / h_a), torch.log(w_g / w_a), torch.log(l_g / l_a),
            yaw_g - yaw_a], dim=-1)

    def decode(self, deltas: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """deltas (..., 7), anchors (..., 7) (broadcastable) -> boxes (..., 7)."""
        x_a, y_a, z_a, h_a, w_a, l_a, yaw_a = anchors.unbind(-1)
        dx, dy, dz, dh, dw, dl, dyaw = deltas.unbind(-1)
        diagonal = torch.sqrt(l_a ** 2 + w_a ** 2)
        return torch.stack([
            dx * diagonal + x_a, dy * diagonal + y_a, dz * h_a + z_a,
            torch.exp(dh) * h_a, torch.exp(dw) * w_a, torch.exp(dl) * l_a,
            dyaw + yaw_a], dim=-1)

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
        yaw = limit_period(boxes[..., 6] - self.dir_offset, 0.0, width) \
            + self.dir_offset + width * bins
        return torch.cat([boxes[..., :6], yaw.unsqueeze(-1)], dim=-1)
