"""Warping BEV feature maps between agents' frames: metric 4x4 transforms -> ``affine_grid`` /
``grid_sample`` (bilinear, zeros outside the sender's map).

One place for it: the detector's own-frame path warps every agent's map into the ego frame
before fusing (:func:`warp_to_ego`, at whichever stage fusion runs), and V2VNet warps every
sender into every receiver (:func:`warp_to_receivers`). A map of any stage covers the model's
``lidar_range`` from its (xmin, ymin) corner with cells of voxel size x its stride
(:class:`BevGrid`), so one grid describes every scale.

Conventions: a map is (C, H, W) with row = y cell, column = x cell, cell (0, 0) at
(xmin, ymin) (the scatter's layout); ``align_corners=False`` throughout, so -1 and 1 are the
outer edges of the border cells and an integer-cell, 0/90-degree transform samples cell centres
exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple, Union

import torch
import torch.nn.functional as F


def bev_affine(sender_to_receiver: torch.Tensor, grid_hw: Sequence[int],
               cell_size: Union[float, Sequence[float]],
               grid_center: Sequence[float] = (0.0, 0.0)) -> torch.Tensor:
    """Metric 4x4 transforms -> ``affine_grid`` matrices that sample a sender's BEV map at the
    receiver's cells.

    sender_to_receiver (..., 4, 4): maps points of the sender's frame into the receiver's.
    grid_hw (H, W): feature map size; cell_size: metres per feature cell (voxel x stride), one
    number or (x, y); grid_center: (x, y) metres of the map centre in its own frame (0, 0 for
    a symmetric range). Returns (..., 2, 3): normalised receiver coordinates -> normalised
    sender coordinates (``align_corners=False``).
    """
    receiver_to_sender = torch.linalg.inv(sender_to_receiver.double())
    rotation = receiver_to_sender[..., :2, :2]
    translation = receiver_to_sender[..., :2, 3]
    height, width = grid_hw
    cell_x, cell_y = (cell_size, cell_size) if isinstance(cell_size, (int, float)) \
        else cell_size
    half_extent = torch.tensor([width * cell_x / 2, height * cell_y / 2],
                               dtype=torch.float64, device=rotation.device)
    center = torch.tensor(list(grid_center), dtype=torch.float64, device=rotation.device)
    # x_metric = c + S u  ->  u_sender = S^-1 (R (c + S u) + t - c)
    linear = rotation * half_extent[None, :] / half_extent[:, None]
    offset = (rotation @ center + translation - center) / half_extent
    return torch.cat([linear, offset.unsqueeze(-1)], dim=-1).to(sender_to_receiver.dtype)


def sample_maps(features: torch.Tensor, theta: torch.Tensor):
    """features (N, C, H, W), theta (N, 2, 3) -> (warped (N, C, H, W), zero outside the source
    map; covered (N, 1, H, W) bool: cells whose centre falls inside it)."""
    # The sampling grid in float32 at least: in bf16 (AMP) its 8-bit mantissa would misplace a
    # 704-cell map's samples by a third of a cell.
    # Autocast off: it would otherwise run them in its own lower precision.
    dtype = torch.promote_types(features.dtype, torch.float32)
    with torch.autocast(features.device.type, enabled=False):
        grid = F.affine_grid(theta.to(dtype), list(features.shape), align_corners=False)
        warped = F.grid_sample(features.to(dtype), grid, mode="bilinear", padding_mode="zeros",
                               align_corners=False)
    covered = (grid.abs() <= 1.0).all(dim=-1).unsqueeze(1)
    return warped.to(features.dtype), covered


def warp_to_receivers(features: torch.Tensor, theta: torch.Tensor):
    """Sample every sender's map at every receiver's cells.

    features (B, L, C, H, W) sender maps; theta (B, R, L, 2, 3) from ``bev_affine``, the
    first R agents (R <= L) as receivers.
    -> warped (B, R, L, C, H, W), zero outside the sender's map, and
       covered (B, R, L, 1, H, W) bool: receiver cells whose centre falls inside it.
    """
    batch, agents, channels, height, width = features.shape
    receivers = theta.shape[1]
    senders = features.unsqueeze(1).expand(-1, receivers, -1, -1, -1, -1)
    warped, covered = sample_maps(senders.reshape(-1, channels, height, width),
                                  theta.reshape(-1, 2, 3))
    shape = (batch, receivers, agents)
    return warped.view(*shape, channels, height, width), covered.view(*shape, 1, height, width)


@dataclass(frozen=True)
class BevGrid:
    """The model's BEV geometry: ``lidar_range`` [xmin, ymin, zmin, xmax, ymax, zmax] and the
    pillar grid (nx, ny) of ``voxel_size`` (x, y) cells; a map of (H, W) cells covers it from
    (xmin, ymin) with a stride of ny / H (rounded: a ceil-sized map keeps its cell size)."""

    lidar_range: Tuple[float, ...]
    voxel_size: Tuple[float, float]
    nx: int
    ny: int

    def cell_and_center(self, height: int, width: int):
        """-> ((cell x, cell y) metres, (x, y) metres of the map centre) of an (H, W) map."""
        stride_x, stride_y = round(self.nx / width), round(self.ny / height)
        cell = (self.voxel_size[0] * stride_x, self.voxel_size[1] * stride_y)
        center = (self.lidar_range[0] + width * cell[0] / 2,
                  self.lidar_range[1] + height * cell[1] / 2)
        return cell, center

    def affine(self, sender_to_receiver: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """:func:`bev_affine` for an (H, W) map of this grid."""
        cell, center = self.cell_and_center(height, width)
        return bev_affine(sender_to_receiver, (height, width), cell, center)


def warp_to_ego(features: torch.Tensor, to_ego: torch.Tensor, grid: BevGrid) -> torch.Tensor:
    """Every agent's map resampled in the ego frame of its sample.

    features (N_agents, C, H, W) each in its agent's frame; to_ego (N_agents, 4, 4) agent ->
    ego (the ego's own is the identity) -> (N_agents, C, H, W), zero where the agent's map does
    not reach.
    """
    theta = grid.affine(to_ego, features.shape[2], features.shape[3])
    return sample_maps(features, theta)[0]
