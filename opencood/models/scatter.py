"""Scatter pillar vectors onto a dense BEV canvas per agent (PointPillars' pseudo-image)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from opencood.config_schema import positive, section, spec


@section
class ScatterArgs:
    """``model.args.point_pillar_scatter``."""

    num_features: int = spec(check=positive)      # = the last pillar_vfe filter


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
        # torch.channels_last: the canvas is returned NHWC (models.build.use_channels_last)
        self.memory_format = torch.contiguous_format

    def forward(self, pillar_features: torch.Tensor, voxel_coords: torch.Tensor,
                record_len: torch.Tensor, voxel_valid: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        """pillar_features (P, C), voxel_coords (P, 4), record_len (B,) -> (sum(record_len), C,
        ny, nx).

        ``voxel_valid`` (A, K) bool, P = A * K (static-shape pillars): padded pillars write
        into a spare cell cut off afterwards, and the agent count is A (a shape) instead of
        ``record_len.sum()`` (a host sync)."""
        cells_per_agent = self.ny * self.nx
        coords = voxel_coords.long()
        flat_index = coords[:, 0] * cells_per_agent + coords[:, 2] * self.nx + coords[:, 3]
        if voxel_valid is None:
            num_agents = int(record_len.sum())
            spare = 0
        else:
            num_agents, spare = voxel_valid.shape[0], 1
            flat_index = torch.where(voxel_valid.flatten(), flat_index,
                                     num_agents * cells_per_agent)
        canvas = pillar_features.new_zeros(num_agents * cells_per_agent + spare,
                                           pillar_features.shape[1])
        canvas = canvas.index_put((flat_index,), pillar_features)[:num_agents * cells_per_agent]
        canvas = canvas.view(num_agents, self.ny, self.nx, -1).permute(0, 3, 1, 2)
        return canvas.contiguous(memory_format=self.memory_format)    # NHWC: already so
