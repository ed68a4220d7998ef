"""Rotated bird's-eye-view IoU of boxes, in plain torch (docs/DESIGN.md §1: no compiled
extensions).

The intersection of two convex quadrilaterals is the convex polygon whose vertices are
  * the corners of A that lie inside B,
  * the corners of B that lie inside A,
  * the points where an edge of A crosses an edge of B.
All of those points lie on the boundary of the intersection, so sorting them by angle around their
mean and applying the shoelace formula gives its area; duplicates (identical or touching boxes,
collinear edges) only add zero-area slivers. Every pair carries a fixed 24 candidate points with a
validity mask, so all pairs are processed as one batch of tensor ops.

Boxes are ``[x, y, z, h, w, l, yaw]`` (``order='hwl'``) or ``[x, y, z, l, w, h, yaw]`` (``'lwh'``),
as in :mod:`opencood.ops.transforms`. Functions are device- and dtype-agnostic (float32/float64,
CPU/CUDA); numpy in gives numpy out.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from opencood.ops.transforms import boxes_to_bev_corners, size_columns

# Pairs processed per batch of tensor ops: bounds the temporaries (a few KB per pair) to about
# 100 MB while keeping each op large enough to amortise its launch overhead.
PAIRS_PER_CHUNK = 1 << 15

# Points up to this many machine epsilons (times the pair's coordinate scale) outside a polygon
# still count as inside: a boundary point pushed out by rounding must not be lost, or a whole
# corner of the intersection goes with it. On adversarial cases (identical, touching, collinear,
# nearly identical, 300:1 thin boxes) 1 eps already suffices and 0.5 does not; 4 leaves a margin
# while the extra area it admits stays far below float32's own rounding of the inputs.
_TOLERANCE_EPS = 4.0

# Relative slack on the bounding-circle test, so rounding never drops a touching pair.
_CIRCLE_SLACK = 1e-3


def _cross(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z of the 2-D cross product of (..., 2) vectors -> (...)."""
    return u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0]


def _signed_area(poly: torch.Tensor) -> torch.Tensor:
    """Shoelace signed area of (P, V, 2) polygons -> (P,), positive for counter-clockwise."""
    return 0.5 * _cross(poly, poly.roll(-1, dims=1)).sum(dim=1)


def _edge_distances(points: torch.Tensor, poly: torch.Tensor,
                    orientation: torch.Tensor) -> torch.Tensor:
    """Signed distance of every point to the line of every edge of a convex quad.

    points (P, K, 2), poly (P, 4, 2), orientation (P,) +1 for CCW / -1 for CW -> (P, K, 4),
    positive on the polygon's inner side; edge k runs from vertex k to vertex k+1.
    """
    edges = poly.roll(-1, dims=1) - poly                                     # (P, 4, 2)
    to_points = points[:, :, None, :] - poly[:, None, :, :]                  # (P, K, 4, 2)
    cross = _cross(edges[:, None], to_points) * orientation[:, None, None]
    edge_len = torch.linalg.vector_norm(edges, dim=-1)[:, None, :]          # (P, 1, 4)
    return cross / edge_len.clamp(min=torch.finfo(poly.dtype).tiny)


def _edge_crossings(poly_a: torch.Tensor, dist_a_to_b: torch.Tensor, tolerance: torch.Tensor):
    """Points where edges of A cross edges of B, from A's vertex distances to B's edge lines.

    poly_a (P, 4, 2), dist_a_to_b (P, 4, 4) from :func:`_edge_distances`, tolerance (P,)
    -> points (P, 16, 2) and valid mask (P, 16), ordered (edge of A, edge of B).
    Edge i of A meets the line of B's edge j where the distance changes sign (the
    Sutherland-Hodgman crossing, so no division by a near-zero cross product for nearly
    parallel edges). Distance is linear along an edge, so the crossing's distances to all of
    B's edges are interpolated, and it counts only if it lies inside B, i.e. on B's edge j.
    """
    dist_start = dist_a_to_b                                                 # (P, 4 [i], 4 [j])
    dist_end = dist_a_to_b.roll(-1, dims=1)                                  # vertex i + 1
    crosses = (dist_start >= 0) != (dist_end >= 0)
    safe_gap = torch.where(crosses, dist_start - dist_end, torch.ones_like(dist_start))
    along = dist_start / safe_gap                                            # in [0, 1] if crosses
    # (P, i, j, k): distance of crossing (i, j) to B's edge k.
    slope = (dist_end - dist_start)[:, :, None, :]
    dist_cross = dist_start[:, :, None, :] + along[..., None] * slope
    inside_b = (dist_cross >= -tolerance[:, None, None, None]).all(dim=-1)
    direction_a = poly_a.roll(-1, dims=1) - poly_a
    points = poly_a[:, :, None, :] + along[..., None] * direction_a[:, :, None, :]
    return points.reshape(-1, 16, 2), (crosses & inside_b).reshape(-1, 16)


def _area_of_boundary_points(points: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Area of the convex polygon spanned by the valid boundary points.

    points (P, K, 2), valid (P, K) bool -> (P,). Points are sorted by angle around their mean;
    invalid slots are moved to the end and replaced by the first sorted point, so they add
    zero-area terms (including the closing edge back to the first point).
    """
    weights = valid.to(points.dtype)
    count = weights.sum(dim=1)
    mean = (points * weights[..., None]).sum(dim=1) / count.clamp(min=1.0)[:, None]
    offsets = points - mean[:, None, :]
    angle = torch.atan2(offsets[..., 1], offsets[..., 0])
    angle = torch.where(valid, angle, torch.full_like(angle, 4.0))          # > pi: sorts last
    order = angle.argsort(dim=1)
    offsets = torch.gather(offsets, 1, order[..., None].expand_as(offsets))
    valid_sorted = torch.gather(valid, 1, order)
    offsets = torch.where(valid_sorted[..., None], offsets, offsets[:, :1, :])
    twice_area = _cross(offsets, offsets.roll(-1, dims=1)).sum(dim=1)
    area = (0.5 * twice_area).clamp(min=0.0)
    return torch.where(count >= 3, area, torch.zeros_like(area))


def _intersection_area_flat(poly_a: torch.Tensor, poly_b: torch.Tensor) -> torch.Tensor:
    """Intersection area of (P, 4, 2) convex quads -> (P,); either orientation."""
    # Work relative to A's centre: absolute coordinates ~100 m would cost float32 digits.
    origin = poly_a.mean(dim=1, keepdim=True)
    poly_a, poly_b = poly_a - origin, poly_b - origin
    scale = torch.maximum(poly_a.abs().amax(dim=(1, 2)), poly_b.abs().amax(dim=(1, 2)))
    tolerance = _TOLERANCE_EPS * torch.finfo(poly_a.dtype).eps * scale
    orient_a = 1.0 - 2.0 * (_signed_area(poly_a) < 0).to(poly_a.dtype)     # +1 CCW, -1 CW
    orient_b = 1.0 - 2.0 * (_signed_area(poly_b) < 0).to(poly_b.dtype)
    dist_a_to_b = _edge_distances(poly_a, poly_b, orient_b)                 # (P, 4, 4)
    dist_b_to_a = _edge_distances(poly_b, poly_a, orient_a)
    a_in_b = (dist_a_to_b >= -tolerance[:, None, None]).all(dim=-1)
    b_in_a = (dist_b_to_a >= -tolerance[:, None, None]).all(dim=-1)
    crossings, crossing_valid = _edge_crossings(poly_a, dist_a_to_b, tolerance)
    points = torch.cat([poly_a, poly_b, crossings], dim=1)                  # (P, 24, 2)
    valid = torch.cat([a_in_b, b_in_a, crossing_valid], dim=1)
    return _area_of_boundary_points(points, valid)


def _to_float_tensor(array):
    """numpy/torch -> (torch tensor of at least float32 precision, was_numpy)."""
    is_numpy = isinstance(array, np.ndarray)
    # torch cannot wrap negative-stride views (e.g. reversed vertex order): copy those.
    tensor = torch.as_tensor(np.ascontiguousarray(array) if is_numpy else array)
    # Integers and half precision (AMP outputs) go to float32: a 16-bit eps of ~1e-3 would make
    # the inside tolerance centimetres wide.
    if not tensor.is_floating_point() or torch.finfo(tensor.dtype).bits < 32:
        tensor = tensor.to(torch.float32)
    return tensor, is_numpy


def polygon_intersection_area(poly_a, poly_b, pairs_per_chunk: int = PAIRS_PER_CHUNK):
    """Area of the intersection of convex quadrilaterals, pair by pair.

    poly_a, poly_b: (..., 4, 2) vertices in order (counter-clockwise as produced by
    ``boxes_to_bev_corners``; clockwise also works), broadcastable leading dims -> (...).
    """
    poly_a, is_numpy = _to_float_tensor(poly_a)
    poly_b, _ = _to_float_tensor(poly_b)
    dtype = torch.promote_types(poly_a.dtype, poly_b.dtype)
    poly_a, poly_b = torch.broadcast_tensors(poly_a.to(dtype), poly_b.to(dtype))
    batch_shape = poly_a.shape[:-2]
    flat_a, flat_b = poly_a.reshape(-1, 4, 2), poly_b.reshape(-1, 4, 2)
    areas = [_intersection_area_flat(flat_a[i:i + pairs_per_chunk], flat_b[i:i + pairs_per_chunk])
             for i in range(0, flat_a.shape[0], pairs_per_chunk)]
    area = torch.cat(areas) if areas else flat_a.new_zeros(0)
    area = area.reshape(batch_shape)
    return area.numpy() if is_numpy else area


class _BevBoxes(NamedTuple):
    """What the IoU of a set of boxes needs, computed once per set."""
    centres: torch.Tensor          # (N, 2) BEV centres
    corners: torch.Tensor          # (N, 4, 2) corners relative to each box's own centre
    areas: torch.Tensor            # (N,) footprint areas
    radii: torch.Tensor            # (N,) bounding-circle radii


def _as_box_tensor(boxes) -> tuple[torch.Tensor, bool]:
    """numpy/torch (N, 7) -> (float tensor, was_numpy); empty inputs of any shape become (0, 7)."""
    tensor, is_numpy = _to_float_tensor(boxes)
    if tensor.numel() == 0:
        tensor = tensor.reshape(0, 7)
    if tensor.ndim != 2 or tensor.shape[1] != 7:
        raise ValueError(f"boxes must be (N, 7); got {tuple(tensor.shape)}")
    return tensor, is_numpy


def _bev_boxes(boxes: torch.Tensor, order: str) -> _BevBoxes:
    _, width_col, length_col = size_columns(order)
    centred = boxes.clone()
    centred[:, :2] = 0.0
    corners = boxes_to_bev_corners(centred, order)
    return _BevBoxes(centres=boxes[:, :2], corners=corners, areas=_signed_area(corners).abs(),
                     radii=0.5 * torch.hypot(boxes[:, length_col], boxes[:, width_col]))


def _prepare(boxes_a, boxes_b, order: str) -> tuple[_BevBoxes, _BevBoxes, bool]:
    """Both box sets in a common float dtype -> (bev_a, bev_b, inputs_were_numpy)."""
    boxes_a, is_numpy = _as_box_tensor(boxes_a)
    boxes_b, _ = _as_box_tensor(boxes_b)
    dtype = torch.promote_types(boxes_a.dtype, boxes_b.dtype)
    return _bev_boxes(boxes_a.to(dtype), order), _bev_boxes(boxes_b.to(dtype), order), is_numpy


def _pair_iou(bev_a: _BevBoxes, bev_b: _BevBoxes, idx_a: torch.Tensor,
              idx_b: torch.Tensor) -> torch.Tensor:
    """IoU of the pairs (idx_a[k], idx_b[k]) -> (P,)."""
    # Translate B into A's centred frame: the difference of two nearby centres is exact in
    # float32, whereas absolute corners at 100 m would already be rounded to ~1e-5 m.
    offset = bev_b.centres[idx_b] - bev_a.centres[idx_a]
    inter = _intersection_area_flat(bev_a.corners[idx_a], bev_b.corners[idx_b] + offset[:, None])
    union = bev_a.areas[idx_a] + bev_b.areas[idx_b] - inter
    iou = inter / union.clamp(min=torch.finfo(union.dtype).tiny)
    return torch.where(union > 0, iou, torch.zeros_like(iou)).clamp(0.0, 1.0)


def _overlap_candidates(bev_a: _BevBoxes, bev_b: _BevBoxes, rows: slice):
    """Pairs (row of A in ``rows``, any B) whose bounding circles meet: only these can overlap.

    -> (idx_a, idx_b) LongTensors, idx_a counted from the start of A.
    """
    # Explicit differences rather than torch.cdist: cdist's matmul shortcut loses float32
    # digits at 100 m coordinates. The small slack keeps the filter a superset under rounding.
    gap_x = bev_a.centres[rows, None, 0] - bev_b.centres[None, :, 0]
    gap_y = bev_a.centres[rows, None, 1] - bev_b.centres[None, :, 1]
    reach = (bev_a.radii[rows, None] + bev_b.radii[None, :]) * (1.0 + _CIRCLE_SLACK)
    idx_a, idx_b = torch.nonzero(gap_x * gap_x + gap_y * gap_y <= reach * reach, as_tuple=True)
    return idx_a + rows.start, idx_b


def boxes_bev_iou(boxes_a, boxes_b, order: str = "hwl", pairs_per_chunk: int = PAIRS_PER_CHUNK):
    """Rotated BEV IoU of every box in A with every box in B.

    boxes_a (N, 7), boxes_b (M, 7) -> (N, M) in the promoted float dtype, on the inputs' device
    (numpy in, numpy out). Pairs whose bounding circles do not meet are 0 without clipping;
    rows of A are processed in blocks so memory stays bounded for large N * M.
    """
    bev_a, bev_b, is_numpy = _prepare(boxes_a, boxes_b, order)
    num_a, num_b = bev_a.areas.shape[0], bev_b.areas.shape[0]
    iou = bev_a.areas.new_zeros(num_a, num_b)
    rows_per_block = max(1, pairs_per_chunk // max(num_b, 1))
    for row_start in range(0, num_a, rows_per_block):
        rows = slice(row_start, row_start + rows_per_block)
        idx_a, idx_b = _overlap_candidates(bev_a, bev_b, rows)
        for start in range(0, idx_a.shape[0], pairs_per_chunk):
            chunk_a = idx_a[start:start + pairs_per_chunk]
            chunk_b = idx_b[start:start + pairs_per_chunk]
            iou[chunk_a, chunk_b] = _pair_iou(bev_a, bev_b, chunk_a, chunk_b)
    return iou.numpy() if is_numpy else iou


def _circles_meet(bev_a: _BevBoxes, bev_b: _BevBoxes, idx_a: torch.Tensor,
                  idx_b: torch.Tensor) -> torch.Tensor:
    """(P,) bool: do the bounding circles of the listed pairs meet (slack for rounding)?"""
    gap = bev_a.centres[idx_a] - bev_b.centres[idx_b]
    reach = (bev_a.radii[idx_a] + bev_b.radii[idx_b]) * (1.0 + _CIRCLE_SLACK)
    return (gap * gap).sum(dim=1) <= reach * reach


def boxes_bev_iou_pairs(boxes_a, boxes_b, idx_a, idx_b, order: str = "hwl",
                        pairs_per_chunk: int = PAIRS_PER_CHUNK):
    """Rotated BEV IoU of listed pairs (a sparse slice of the full matrix).

    boxes_a (N, 7), boxes_b (M, 7), idx_a (P,), idx_b (P,) integer indices -> (P,) with
    ``out[k] = IoU(boxes_a[idx_a[k]], boxes_b[idx_b[k]])``. Corners are built once per box, not
    once per pair, so many frames' pairs can be evaluated in one call.
    """
    bev_a, bev_b, is_numpy = _prepare(boxes_a, boxes_b, order)
    device = bev_a.areas.device
    idx_a = torch.as_tensor(idx_a, dtype=torch.long, device=device).reshape(-1)
    idx_b = torch.as_tensor(idx_b, dtype=torch.long, device=device).reshape(-1)
    if idx_a.shape != idx_b.shape:
        raise ValueError(f"idx_a and idx_b differ in length: {idx_a.shape[0]} vs {idx_b.shape[0]}")
    iou = bev_a.areas.new_zeros(idx_a.shape[0])
    # The circle test costs a few bytes per pair, so it runs on larger blocks than the clipping.
    filter_block = pairs_per_chunk * 8
    for block_start in range(0, idx_a.shape[0], filter_block):
        block_a = idx_a[block_start:block_start + filter_block]
        block_b = idx_b[block_start:block_start + filter_block]
        near = torch.nonzero(_circles_meet(bev_a, bev_b, block_a, block_b), as_tuple=True)[0]
        for start in range(0, near.shape[0], pairs_per_chunk):
            chunk = near[start:start + pairs_per_chunk]
            iou[block_start + chunk] = _pair_iou(bev_a, bev_b, block_a[chunk], block_b[chunk])
    return iou.numpy() if is_numpy else iou


def boxes_bev_iou_aligned(boxes_a, boxes_b, order: str = "hwl",
                          pairs_per_chunk: int = PAIRS_PER_CHUNK):
    """Rotated BEV IoU of row-aligned pairs: boxes_a (N, 7), boxes_b (N, 7) -> (N,)."""
    if len(boxes_a) != len(boxes_b):
        raise ValueError(f"aligned IoU needs equal counts; got {len(boxes_a)} and {len(boxes_b)}")
    rows = np.arange(len(boxes_a))
    return boxes_bev_iou_pairs(boxes_a, boxes_b, rows, rows, order, pairs_per_chunk)
