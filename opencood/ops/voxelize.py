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


def _point_keys(points: torch.Tensor, batch_index: torch.Tensor, lidar_range, voxel_size,
                grid) -> Tuple[torch.Tensor, int]:
    """points (N, C), batch_index (N,) -> (keys (N,), number of points inside the range).

    ``key = ((b * nz + z) * ny + y) * nx + x``; points outside the range get a key past every
    pillar, so a sort puts them last. Cell indices come from float64 arithmetic on the float32
    coordinates (exact conversion), so boundary decisions match a plain-Python reference and
    are the same on every device. Keys are int32 when they fit (CPU sorts those ~3x faster).
    """
    batch_index = batch_index.to(torch.int64)
    keys = batch_index
    inside = torch.ones_like(batch_index, dtype=torch.bool)
    for axis in (2, 1, 0):                       # z, y, x: most to least significant
        coord = points[:, axis].to(torch.float64)
        low, high = float(lidar_range[axis]), float(lidar_range[axis + 3])
        inside &= (coord >= low) & (coord < high)
        # Clamped in float before the integer cast: a point a rounding error below ``high``
        # may land on index n, and far-away points must not overflow the cast.
        cell = torch.floor((coord - low) / float(voxel_size[axis])).clamp_(0, grid[axis] - 1)
        keys = keys * grid[axis] + cell.to(torch.int64)
    num_batches = int(batch_index.max()) + 1 if batch_index.numel() else 1
    outside_key = num_batches * grid[0] * grid[1] * grid[2]
    keys = keys.masked_fill_(~inside, outside_key)
    if outside_key < 2 ** 31:
        keys = keys.to(torch.int32)
    return keys, int(inside.sum())


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


def _slots_of_kept_points(points_per_pillar: torch.Tensor, keep_pillar: Optional[torch.Tensor],
                          num_points: int, max_points: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sorted points grouped in pillars of sizes (P,) -> (kept (K,) positions in the sorted
    order, slot (K,) = output pillar * max_points + rank in pillar)."""
    pillar_of_point = torch.repeat_interleave(
        torch.arange(points_per_pillar.numel(), device=points_per_pillar.device),
        points_per_pillar, output_size=num_points)
    rank = _rank_in_group(points_per_pillar, num_points)
    keep = rank < max_points
    output_pillar = pillar_of_point
    if keep_pillar is not None:
        keep &= keep_pillar.index_select(0, pillar_of_point)
        output_pillar = (torch.cumsum(keep_pillar, dim=0) - 1).index_select(0, pillar_of_point)
    kept = torch.nonzero(keep).squeeze(1)
    slot = output_pillar.index_select(0, kept) * max_points + rank.index_select(0, kept)
    return kept, slot


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
    keys, num_inside = _point_keys(points, batch_index, lidar_range, voxel_size, grid)
    if num_inside == 0:
        return _empty_output(points, max_points_per_pillar)

    # A stable sort keeps input order inside each pillar, which decides who is "first";
    # points outside the range sort last and are cut off.
    order = torch.argsort(keys, stable=True)[:num_inside]
    pillar_keys, points_per_pillar = torch.unique_consecutive(keys.index_select(0, order),
                                                              return_counts=True)
    keep_pillar = None
    if max_pillars is not None:
        keep_pillar = _first_pillars_per_batch(pillar_keys, grid, max_pillars)
    kept, slot = _slots_of_kept_points(points_per_pillar, keep_pillar, num_inside,
                                       max_points_per_pillar)
    if keep_pillar is not None:
        pillar_keys, points_per_pillar = pillar_keys[keep_pillar], points_per_pillar[keep_pillar]

    num_pillars, channels = pillar_keys.numel(), points.shape[1]
    features = points.new_zeros((num_pillars * max_points_per_pillar, channels))
    # Every slot is written at most once, so the scatter is deterministic on every device.
    features.index_copy_(0, slot, points.index_select(0, order.index_select(0, kept)))
    return {
        "voxel_features": features.view(num_pillars, max_points_per_pillar, channels),
        "voxel_num_points": points_per_pillar.clamp(max=max_points_per_pillar).to(torch.int32),
        "voxel_coords": _keys_to_coords(pillar_keys, grid),
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
