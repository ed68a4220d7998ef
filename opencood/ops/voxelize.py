"""Pillarisation of batched point clouds in torch (docs/DESIGN.md §4: pillarise on the training
device).

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

import functools
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


def _cell_keys(points: torch.Tensor, batch_index: torch.Tensor, lidar_range, voxel_size,
               grid) -> Tuple[torch.Tensor, torch.Tensor]:
    """points (N, C), batch_index (N,) -> (keys (N,) int64, inside (N,) bool).

    ``key = ((b * nz + z) * ny + y) * nx + x``, meaningful where ``inside``. Cell indices come
    from float64 arithmetic on the float32 coordinates (exact conversion), so boundary decisions
    match a plain-Python reference and are the same on every device.
    """
    low, high, voxel, last_cell, strides = _grid_constants(
        tuple(float(v) for v in lidar_range), tuple(float(v) for v in voxel_size), tuple(grid),
        points.device)
    coords = points[:, :3].to(torch.float64)                               # (N, 3) x, y, z
    inside = ((coords >= low) & (coords < high)).all(dim=1)
    # Clamped in float before the integer cast: a point a rounding error below ``high``
    # may land on index n, and far-away points must not overflow the cast.
    cells = torch.minimum(torch.floor((coords - low) / voxel).clamp_(min=0), last_cell)
    cells_per_batch = grid[0] * grid[1] * grid[2]
    offsets = (cells.to(torch.int64) * strides).sum(dim=1)             # z * nx * ny + y * nx + x
    keys = batch_index.to(torch.int64) * cells_per_batch + offsets
    return keys, inside


@functools.lru_cache(maxsize=16)
def _grid_constants(lidar_range: Tuple[float, ...], voxel_size: Tuple[float, ...],
                    grid: Tuple[int, int, int], device: torch.device):
    """The grid's per-axis constants as tensors on ``device``, made once (a tensor made from
    Python numbers on CUDA is a copy that waits for the device): low, high, voxel size, last
    cell index (float64, (3,) x, y, z) and the key's stride per axis (int64: 1, nx, nx * ny).
    One operator per step over (N, 3) instead of one per axis (issue 40)."""
    def as_tensor(values, dtype=torch.float64):
        return torch.tensor(values, dtype=dtype, device=device)

    return (as_tensor(lidar_range[:3]), as_tensor(lidar_range[3:]), as_tensor(voxel_size),
            as_tensor([float(cells - 1) for cells in grid]),
            as_tensor([1, grid[0], grid[0] * grid[1]], torch.int64))


def _point_keys(points: torch.Tensor, batch_index: torch.Tensor, lidar_range, voxel_size,
                grid) -> Tuple[torch.Tensor, int]:
    """points (N, C), batch_index (N,) -> (keys (N,), number of points inside the range).

    Points outside the range get a key past every pillar, so a sort puts them last. Keys are
    int32 when they fit (CPU sorts those ~3x faster).
    """
    keys, inside = _cell_keys(points, batch_index, lidar_range, voxel_size, grid)
    num_batches = int(batch_index.max()) + 1 if batch_index.numel() else 1
    outside_key = num_batches * grid[0] * grid[1] * grid[2]
    return _sortable_keys(keys, inside, outside_key), int(inside.sum())


def _sortable_keys(keys: torch.Tensor, inside: torch.Tensor, outside_key: int) -> torch.Tensor:
    """Keys (N,) with the points outside at ``outside_key`` (past every pillar: a sort puts
    them last), int32 when they fit (CPU sorts those ~3x faster)."""
    keys = keys.masked_fill_(~inside, outside_key)
    return keys.to(torch.int32) if outside_key < 2 ** 31 else keys


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


def _write_unique(buffer: torch.Tensor, size: int, target: torch.Tensor, write: torch.Tensor,
                  values: torch.Tensor) -> torch.Tensor:
    """``buffer`` (size + N, ...) with ``values[i]`` copied to row ``target[i]`` where
    ``write[i]``; (N,) target and write, (N, ...) values -> its first ``size`` rows.

    Rows not written go to a spare row of their own (``size + i``), cut off at the end: every
    row is written at most once, so the copy is deterministic on every device, and its size
    does not depend on how many rows are written (no host sync)."""
    spare = size + torch.arange(target.shape[0], device=target.device)
    return buffer.index_copy_(0, torch.where(write, target, spare), values)[:size]


def pillarize_static(points: torch.Tensor, batch_index: torch.Tensor, num_agents: int,
                     lidar_range: Sequence[float], voxel_size: Sequence[float],
                     max_points_per_pillar: int, pillars_per_agent: int,
                     max_pillars: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """:func:`pillarize` with output shapes fixed by the arguments alone: every agent gets
    ``pillars_per_agent`` (K) pillar slots, its real pillars first (in key order), then padded
    slots. No host sync and no data-dependent size, so a training step built on it can be
    captured in a CUDA graph or compiled without graph breaks.

    Why a fixed cap per agent rather than the batch's pillar count rounded up to a bucket:
    reading the count is itself a host sync, and every new bucket size is a new graph to
    capture or compile. With K per agent the shapes depend on the number of agents only.

    The real pillars (``voxel_valid``) are exactly :func:`pillarize`'s with ``max_pillars``
    replaced by ``min(K, max_pillars)``: equal to the dynamic output whenever no agent has more
    than K pillars (or K >= max_pillars).

    Args:
        points, batch_index, lidar_range, voxel_size, max_points_per_pillar, max_pillars: as
            :func:`pillarize`; ``batch_index`` values must be < ``num_agents``.
        num_agents: A, agents in the batch (a shape, not read from the data).
        pillars_per_agent: K, pillar slots per agent.

    Returns a dict, all on ``points.device``, P = A * K rows, agent a's slots at a*K..a*K+K-1:
        ``voxel_features`` (P, M, C), zero on padded slots;
        ``voxel_num_points`` (P,) int32, 0 on padded slots;
        ``voxel_coords`` (P, 4) int64 ``[agent, z, y, x]``, ``[agent, 0, 0, 0]`` on padded slots;
        ``voxel_valid`` (A, K) bool, True for real pillars.
    """
    grid = grid_size(lidar_range, voxel_size)
    cells = grid[0] * grid[1] * grid[2]
    limit = pillars_per_agent if max_pillars is None else min(pillars_per_agent, max_pillars)
    keys, inside = _cell_keys(points, batch_index, lidar_range, voxel_size, grid)
    # The same stable sort as pillarize; points outside sort last and are never kept.
    order = torch.argsort(_sortable_keys(keys, inside, num_agents * cells), stable=True)
    sorted_keys = keys.index_select(0, order)
    starts, ends, rank_in_pillar = _pillar_groups(sorted_keys)
    pillar_kept, slot, pillars_of_agent = _agent_slots(sorted_keys, starts, num_agents, cells,
                                                       pillars_per_agent, limit)
    slots, max_points = num_agents * pillars_per_agent, max_points_per_pillar
    num, channels = sorted_keys.shape[0], points.shape[1]
    features = _write_unique(points.new_zeros((slots * max_points + num, channels)),
                             slots * max_points, slot * max_points + rank_in_pillar,
                             pillar_kept & (rank_in_pillar < max_points),
                             points.index_select(0, order))
    # A pillar's last point knows the pillar's size; its first point knows the pillar's key.
    num_points = _write_unique(torch.zeros(slots + num, dtype=torch.int64, device=points.device),
                               slots, slot, pillar_kept & ends,
                               (rank_in_pillar + 1).clamp(max=max_points))
    slot_agent = torch.div(torch.arange(slots + num, device=points.device), pillars_per_agent,
                           rounding_mode="floor")
    pillar_keys = _write_unique(slot_agent * cells, slots, slot, pillar_kept & starts,
                                sorted_keys)
    valid = torch.arange(pillars_per_agent, device=points.device)[None, :] < \
        pillars_of_agent.clamp(max=limit)[:, None]
    return {
        "voxel_features": features.view(slots, max_points, channels),
        "voxel_num_points": num_points.to(torch.int32),
        "voxel_coords": _keys_to_coords(pillar_keys, grid),
        "voxel_valid": valid,
    }


def _pillar_groups(sorted_keys: torch.Tensor):
    """Sorted point keys (N,) -> (starts (N,) bool: first point of its key, ends (N,) bool:
    last one, rank_in_pillar (N,) int64: position inside its key's run).

    Segment arithmetic, no scan: a point's run begins where a binary search for its own key
    lands (the first equal key of a sorted array), so its rank is its position minus that.
    The running maximum of run starts this replaces (``cummax`` over every point) took 1.6 ms
    of an H100 step (issue 40)."""
    position = torch.arange(sorted_keys.shape[0], device=sorted_keys.device)
    rank_in_pillar = position - torch.searchsorted(sorted_keys, sorted_keys)
    starts = rank_in_pillar == 0
    ends = torch.ones_like(starts)
    ends[:-1] = starts[1:]
    return starts, ends, rank_in_pillar


def _agent_slots(sorted_keys: torch.Tensor, starts: torch.Tensor, num_agents: int, cells: int,
                 pillars_per_agent: int, limit: int):
    """Sorted point keys (N,) (points outside at ``num_agents * cells``), run starts (N,) ->
    (pillar_kept (N,) bool: the point's pillar is among its agent's first ``limit``,
    slot (N,) int64: that pillar's output row ``agent * pillars_per_agent + rank``, meaningful
    where kept, pillars_of_agent (A,) int64: the agent's pillars before any cap)."""
    is_inside = sorted_keys < num_agents * cells
    pillar_index = torch.cumsum(starts & is_inside, dim=0) - 1    # (N,) over the whole batch
    # Where each agent's points begin in the sorted order (the agent is the key's high part),
    # and so how many pillars the agents before it have.
    agent_starts = torch.searchsorted(sorted_keys, torch.arange(
        num_agents + 1, device=sorted_keys.device, dtype=sorted_keys.dtype) * cells)
    pillars_before = torch.cat([pillar_index.new_zeros(1), pillar_index + 1])
    first_of_agent = pillars_before.index_select(0, agent_starts)                  # (A + 1,)
    agent = torch.div(sorted_keys, cells, rounding_mode="floor").clamp_(max=num_agents - 1)
    rank_in_agent = pillar_index - first_of_agent.index_select(0, agent)
    pillar_kept = is_inside & (rank_in_agent < limit)
    return pillar_kept, agent * pillars_per_agent + rank_in_agent, first_of_agent.diff()


@dataclass(frozen=True)
class PillarizeConfig:
    """The pillarisation settings of one experiment; call it like :func:`pillarize`."""

    lidar_range: Tuple[float, ...]
    voxel_size: Tuple[float, ...]
    max_points_per_pillar: int = 32
    max_pillars: Optional[int] = None
    static_pillars: int = 0          # > 0: pillarize_static with this many slots per agent

    @classmethod
    def from_config(cls, preprocess: dict, training: bool,
                    static_pillars: int = 0) -> "PillarizeConfig":
        """From an OpenCOOD ``preprocess`` section: ``cav_lidar_range`` and ``args`` with
        ``voxel_size``, ``max_points_per_voxel``, ``max_voxel_train`` / ``max_voxel_test``;
        ``static_pillars``: ``performance.static_pillars``."""
        args = preprocess["args"]
        max_pillars = args["max_voxel_train" if training else "max_voxel_test"]
        return cls(lidar_range=tuple(float(v) for v in preprocess["cav_lidar_range"]),
                   voxel_size=tuple(float(v) for v in args["voxel_size"]),
                   max_points_per_pillar=int(args["max_points_per_voxel"]),
                   max_pillars=None if max_pillars is None else int(max_pillars),
                   static_pillars=int(static_pillars))

    @property
    def grid_size(self) -> Tuple[int, int, int]:
        return grid_size(self.lidar_range, self.voxel_size)

    def __call__(self, points: torch.Tensor, batch_index: torch.Tensor,
                 num_agents: Optional[int] = None) -> Dict[str, torch.Tensor]:
        """``num_agents`` (the agents of the batch) is needed with ``static_pillars`` only."""
        if self.static_pillars:
            if num_agents is None:
                raise ValueError("static pillars need num_agents (the agents of the batch)")
            return pillarize_static(points, batch_index, num_agents, self.lidar_range,
                                    self.voxel_size, self.max_points_per_pillar,
                                    self.static_pillars, self.max_pillars)
        return pillarize(points, batch_index, self.lidar_range, self.voxel_size,
                         self.max_points_per_pillar, self.max_pillars)
