"""Scatter pillar vectors onto a dense BEV canvas per agent (PointPillars' pseudo-image)."""
from __future__ import annotations

import torch
from torch import nn


class PointPillarScatter(nn.Module):
    """(P, C) pillar features + (P, 4) [agent, z, y, x] coords -> (num_agents, C, ny, nx).

    One ``index_put`` for the whole batch; pillar coordinates are unique per agent (the
    voxeliser guarantees it), so no accumulation is needed. Cells without a pillar stay zero.
    """

    def __init__(self, num_features: int, nx: int, ny: int):
        super().__init__()
        self.num_features = num_features
        self.nx = nx
        self.ny = ny

    @classmethod
    def from_config(cls, args: dict, nx: int, ny: int) -> "PointPillarScatter":
        return cls(num_features=args["num_features"], nx=nx, ny=ny)

    def forward(self, pillar_features: torch.Tensor, voxel_coords: torch.Tensor,
                record_len: torch.Tensor) -> torch.Tensor:
        """pillar_features (P, C), voxel_coords (P, 4), record_len (B,) -> (sum(record_len), C,
        ny, nx)."""
        num_agents = int(record_len.sum())
        cells_per_agent = self.ny * self.nx
        coords = voxel_coords.long()
        flat_index = coords[:, 0] * cells_per_agent + coords[:, 2] * self.nx + coords[:, 3]
        canvas = pillar_features.new_zeros(num_agents * cells_per_agent, pillar_features.shape[1])
        canvas = canvas.index_put((flat_index,), pillar_features)
        return canvas.view(num_agents, self.ny, self.nx, -1).permute(0, 3, 1, 2).contiguous()
