"""Pillarisation of batched point clouds in torch (DESIGN §4: pillarise on the training device).

A point cloud batch is one ``(N, C)`` tensor ``[x, y, z, intensity, ...]`` plus ``batch_index``
``(N,)``, the agent/sample each point belongs to. :func:`pillarize` groups points into voxels of
``voxel_size`` inside ``lidar_range`` with sorts and scatters only (no Python loop over points or
pillars), so it runs unchanged on CPU and CUDA and gives identical results on both.

Semantics (the contract the models and datasets code against):

* A point is inside when ``lo <= p < hi`` on each of x, y, z (half open); others are dropped.
  Its cell index is ``floor((p - lo) / voxel)``, computed in float64 from the float32 point so the
  result does not depend on the device, clamped to ``n - 1`` for the rare point a rounding error
  pushes to ``n`` just below ``hi``.
* Pillars are ordered by the linear key ``((batch * nz + z) * ny + y) * nx + x``.
* Inside a pillar the first ``max_points_per_pillar`` points **in input order** are kept.
* With ``max_pillars`` set, each batch element keeps its first ``max_pillars`` pillars in key
  order (deterministic and cheap; unlike spconv's first-come order it does not depend on how the
  points happened to be shuffled).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch

# A range that is not a whole number of voxels is a config mistake; this much slack absorbs
# float noise such as 281.6 / 0.4 = 703.9999999999999.
_GRID_TOLERANCE = 1e-3


def grid_size(lidar_range: Sequence[float], voxel_size: Sequence[float]) -> Tuple[int, int, int]:
    """``(nx, ny, nz)`` cells of ``voxel_size`` in ``lidar_range = [xmin, ymin, zmin, xmax, ymax,
    zmax]``, by rounding (``int()`` would turn 2.9999999999999996 cells into 2).

    Raises ValueError when an extent is not a whole number of voxels.
    """
    sizes = []
    for axis, name in enumerate("xyz"):
        cells = (float(lidar_range[axis + 3]) - float(lidar_range[axis])) / float(voxel_size[axis])
        rounded = int(round(cells))
        if rounded < 1 or abs(cells - rounded) > _GRID_TOLERANCE:
            raise ValueError(
                f"lidar_range {list(lidar_range)} along {name} is {cells:.6f} voxels of "
                f"{voxel_size[axis]}; it must be a positive whole number")
        sizes.append(rounded)
    return tuple(sizes)


def _cell_indices(xyz: torch.Tensor, lidar_range, voxel_size, grid) -> Tuple[torch.Tensor,
                                                                                 torch.Tensor]:
    """xyz (N, 3) -> (cell (N, 3) int64 [x, y, z] index, inside (N,) bool).

    Float64 makes the boundary decisions match a plain-Python reference and the same on every
    device (float32 points convert exactly).
    """
    xyz64 = xyz.to(torch.float64)
    low = torch.tensor(lidar_range[:3], dtype=torch.float64, device=xyz.device)
    high = torch.tensor(lidar_range[3:6], dtype=torch.float64, device=xyz.device)
    size = torch.tensor(voxel_size[:3], dtype=torch.float64, device=xyz.device)
    inside = ((xyz64 >= low) & (xyz64 < high)).all(dim=1)
    cell = torch.floor((xyz64 - low) / size).to(torch.int64)
    last_cell = torch.tensor(grid, dtype=torch.int64, device=xyz.device) - 1
    return torch.minimum(cell, last_cell), inside


def _linear_keys(batch_index: torch.Tensor, cell: torch.Tensor, inside: torch.Tensor,
                 grid) -> torch.Tensor:
    """(N,) key ``((b * nz + z) * ny + y) * nx + x``; points outside the range get a key past
    every pillar, so a sort puts them last. int32 when it fits (CPU sorts it ~3x faster)."""
    nx, ny, nz = grid
    keys = ((batch_index * nz + cell[:, 2]) * ny + cell[:, 1]) * nx + cell[:, 0]
    num_batches = int(batch_index.max()) + 1 if batch_index.numel() else 1
    outside_key = num_batches * nx * ny * nz
    keys = torch.where(inside, keys, torch.full_like(keys, outside_key))
    if outside_key < 2 ** 31:
        keys = keys.to(torch.int32)
    return keys


def _keys_to_coords(keys: torch.Tensor, grid) -> torch.Tensor:
    """Pillar keys (P,) -> coords (P, 4) int64 ``[batch, z, y, x]``."""
    nx, ny, nz = grid
    keys = keys.to(torch.int64)
    x = keys % nx
    y = (keys // nx) % ny
    z = (keys // (nx * ny)) % nz
    batch = keys // (nx * ny * nz)
    return torch.stack([batch, z, y, x], dim=1)


def _rank_in_group(group_sizes: torch.Tensor, total: int) -> torch.Tensor:
    """Sizes (G,) of consecutive groups, ``total = sum(sizes)`` (passed in: no device sync)
    -> (total,) position of each element inside its group."""
    starts = torch.cumsum(group_sizes, dim=0) - group_sizes
    positions = torch.arange(total, device=group_sizes.device)
    return positions - torch.repeat_interleave(starts, group_sizes, output_size=total)


def _first_pillars_per_batch(pillar_keys: torch.Tensor, grid, max_pillars: int) -> torch.Tensor:
    """Sorted pillar keys (P,) -> (P,) bool keeping each batch element's first ``max_pillars``."""
    nx, ny, nz = grid
    pillar_batch = pillar_keys.to(torch.int64) // (nx * ny * nz)
    _, pillars_per_batch = torch.unique_consecutive(pillar_batch, return_counts=True)
    return _rank_in_group(pillars_per_batch, pillar_keys.numel()) < max_pillars


def _empty_output(points: torch.Tensor, max_points: int) -> Dict[str, torch.Tensor]:
    device = points.device
    return {
        "voxel_features": points.new_zeros((0, max_points, points.shape[1])),
        "voxel_num_points": torch.zeros(0, dtype=torch.int32, device=device),
        "voxel_coords": torch.zeros((0, 4), dtype=torch.int64, device=device),
    }


def pillarize(points: torch.Tensor, batch_index: torch.Tensor, lidar_range: Sequence[float],
              voxel_size: Sequence[float], max_points_per_pillar: int = 32,
              max_pillars: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Group a batch of points into pillars (voxels); see the module docstring for the rules.

    Args:
        points: (N, C>=4) float ``[x, y, z, intensity, ...]``.
        batch_index: (N,) int, >= 0, the batch element (agent) of each point.
        lidar_range: ``[xmin, ymin, zmin, xmax, ymax, zmax]``.
        voxel_size: ``[vx, vy, vz]``.
        max_points_per_pillar: points kept per pillar (the first ones in input order).
        max_pillars: if set, pillars kept per batch element (the first ones in key order).

    Returns a dict, all on ``points.device``:
        ``voxel_features`` (P, max_points_per_pillar, C) points.dtype, zero padded;
        ``voxel_num_points`` (P,) int32, points stored per pillar (<= max_points_per_pillar);
        ``voxel_coords`` (P, 4) int64 ``[batch_index, z_idx, y_idx, x_idx]``, sorted.
    """
    grid = grid_size(lidar_range, voxel_size)
    cell, inside = _cell_indices(points[:, :3], lidar_range, voxel_size, grid)
    keys = _linear_keys(batch_index.to(torch.int64), cell, inside, grid)
    num_inside = int(inside.sum())
    if num_inside == 0:
        return _empty_output(points, max_points_per_pillar)

    # A stable sort keeps input order inside each pillar, which decides who is "first";
    # points outside the range sort last and are cut off.
    order = torch.argsort(keys, stable=True)[:num_inside]
    pillar_keys, points_per_pillar = torch.unique_consecutive(keys[order], return_counts=True)
    point_pillar = torch.repeat_interleave(
        torch.arange(pillar_keys.numel(), device=keys.device), points_per_pillar,
        output_size=num_inside)
    point_rank = _rank_in_group(points_per_pillar, num_inside)

    keep_pillar = torch.ones_like(pillar_keys, dtype=torch.bool)
    if max_pillars is not None:
        keep_pillar = _first_pillars_per_batch(pillar_keys, grid, max_pillars)
    new_pillar_id = torch.cumsum(keep_pillar, dim=0) - 1
    kept = torch.nonzero((point_rank < max_points_per_pillar) & keep_pillar[point_pillar])
    kept = kept.squeeze(1)

    num_pillars = int(new_pillar_id[-1]) + 1
    features = points.new_zeros((num_pillars, max_points_per_pillar, points.shape[1]))
    # Every (pillar, rank) slot is written at most once, so the scatter is deterministic.
    features[new_pillar_id[point_pillar[kept]], point_rank[kept]] = points[order[kept]]
    return {
        "voxel_features": features,
        "voxel_num_points": points_per_pillar[keep_pillar].clamp(max=max_points_per_pillar)
                                                          .to(torch.int32),
        "voxel_coords": _keys_to_coords(pillar_keys[keep_pillar], grid),
    }


@dataclass(frozen=True)
class PillarizeConfig:
    """The pillarisation settings of one experiment; call it like :func:`pillarize`."""

    lidar_range: Tuple[float, ...]
    voxel_size: Tuple[float, ...]
    max_points_per_pillar: int = 32
    max_pillars: Optional[int] = None

    @classmethod
    def from_config(cls, preprocess: dict, training: bool) -> "PillarizeConfig":
        """From an OpenCOOD ``preprocess`` section: ``cav_lidar_range`` and ``args`` with
        ``voxel_size``, ``max_points_per_voxel``, ``max_voxel_train`` / ``max_voxel_test``."""
        args = preprocess["args"]
        max_pillars = args.get("max_voxel_train" if training else "max_voxel_test")
        return cls(lidar_range=tuple(float(v) for v in preprocess["cav_lidar_range"]),
                   voxel_size=tuple(float(v) for v in args["voxel_size"]),
                   max_points_per_pillar=int(args.get("max_points_per_voxel", 32)),
                   max_pillars=None if max_pillars is None else int(max_pillars))

    @property
    def grid_size(self) -> Tuple[int, int, int]:
        return grid_size(self.lidar_range, self.voxel_size)

    def __call__(self, points: torch.Tensor, batch_index: torch.Tensor) -> Dict[str, torch.Tensor]:
        return pillarize(points, batch_index, self.lidar_range, self.voxel_size,
                         self.max_points_per_pillar, self.max_pillars)
