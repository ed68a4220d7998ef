"""Pillar feature net (PointPillars / OpenCOOD ``PillarVFE``): points of a pillar -> one vector."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class PillarLayer(nn.Module):
    """Linear + BatchNorm1d + ReLU over the real points of every pillar, then max over points.

    Padded points are dropped before the linear layer (rather than zeroed after it, as OpenCOOD
    does) so they neither shift the BatchNorm statistics nor reach the max.
    """

    def __init__(self, in_channels: int, out_channels: int, last_layer: bool):
        super().__init__()
        self.last_layer = last_layer
        # A non-last layer concatenates its per-point output with the pillar max (PointPillars),
        # so it computes half the channels to hand out_channels to the next layer.
        hidden = out_channels if last_layer else out_channels // 2
        self.linear = nn.Linear(in_channels, hidden, bias=False)
        self.norm = nn.BatchNorm1d(hidden, eps=1e-3, momentum=0.01)
        self.out_channels = out_channels if last_layer else 2 * hidden

    def forward(self, point_features: torch.Tensor, point_mask: torch.Tensor) -> torch.Tensor:
        """(P, M, C_in) features, (P, M) bool mask -> (P, C_out) if last else (P, M, C_out)."""
        real_points = torch.relu(self.norm(self.linear(point_features[point_mask])))
        per_point = real_points.new_zeros(*point_mask.shape, real_points.shape[-1])
        per_point = per_point.index_put((point_mask,), real_points)
        # ReLU outputs are >= 0, so the zeros left at padded slots never win the max.
        pillar_max = per_point.amax(dim=1)
        if self.last_layer:
            return pillar_max
        repeated_max = pillar_max.unsqueeze(1).expand_as(per_point)
        return torch.cat([per_point, repeated_max], dim=-1) * point_mask.unsqueeze(-1)


class PillarVFE(nn.Module):
    """Decorates each point with offsets to its pillar's point mean and centre, encodes, pools.

    Point channels: [x, y, z, intensity, x-x_mean, y-y_mean, z-z_mean, x-x_c, y-y_c, z-z_c]
    (plus ||xyz|| when ``with_distance``).
    """

    def __init__(self, voxel_size: Sequence[float], lidar_range: Sequence[float],
                 in_channels: int = 4, num_filters: Sequence[int] = (64,),
                 with_distance: bool = False):
        super().__init__()
        self.with_distance = with_distance
        self.register_buffer("voxel_size", torch.tensor(voxel_size[:3], dtype=torch.float32),
                             persistent=False)
        self.register_buffer("range_min", torch.tensor(lidar_range[:3], dtype=torch.float32),
                             persistent=False)
        channels = in_channels + 6 + int(with_distance)
        layers = []
        for index, width in enumerate(num_filters):
            layer = PillarLayer(channels, width, last_layer=index == len(num_filters) - 1)
            layers.append(layer)
            channels = layer.out_channels
        self.layers = nn.ModuleList(layers)
        self.out_channels = channels

    @classmethod
    def from_config(cls, args: dict, voxel_size, lidar_range) -> "PillarVFE":
        return cls(voxel_size, lidar_range, in_channels=args.get("in_channels", 4),
                   num_filters=tuple(args.get("num_filters", (64,))),
                   with_distance=args.get("with_distance", False))

    def decorate(self, voxel_features: torch.Tensor, voxel_num_points: torch.Tensor,
                 voxel_coords: torch.Tensor, point_mask: torch.Tensor) -> torch.Tensor:
        """(P, M, C) raw points -> (P, M, C + 6 [+1]) decorated, padded points zeroed."""
        xyz = voxel_features[..., :3]
        valid = point_mask.unsqueeze(-1).to(xyz.dtype)
        counts = voxel_num_points.clamp(min=1).to(xyz.dtype).view(-1, 1, 1)
        offset_to_mean = xyz - (xyz * valid).sum(dim=1, keepdim=True) / counts
        # voxel_coords is [agent, z, y, x]; flip to (x, y, z) to match the point channels.
        cell_xyz = voxel_coords[:, [3, 2, 1]].to(xyz.dtype)
        pillar_centre = (cell_xyz + 0.5) * self.voxel_size.to(xyz.dtype) + self.range_min.to(
            xyz.dtype)
        parts = [voxel_features, offset_to_mean, xyz - pillar_centre.unsqueeze(1)]
        if self.with_distance:
            parts.append(xyz.norm(dim=-1, keepdim=True))
        return torch.cat(parts, dim=-1) * valid

    def forward(self, voxel_features: torch.Tensor, voxel_num_points: torch.Tensor,
                voxel_coords: torch.Tensor) -> torch.Tensor:
        """(P, M, 4), (P,), (P, 4) [agent, z, y, x] -> (P, C) pillar features."""
        slots = torch.arange(voxel_features.shape[1], device=voxel_features.device)
        point_mask = slots.unsqueeze(0) < voxel_num_points.unsqueeze(1)
        features = self.decorate(voxel_features, voxel_num_points, voxel_coords, point_mask)
        for layer in self.layers:
            features = layer(features, point_mask)
        return features
