"""Rotated bird's-eye-view IoU of boxes, in plain torch (DESIGN §1: no compiled extensions).

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

import numpy as np
import torch

from opencood.ops.transforms import boxes_to_bev_corners

# Pairs processed per batch of tensor ops: bounds the temporaries (about 3 KB per pair) to a few
# hundred MB while keeping each op large enough to amortise its launch overhead.
PAIRS_PER_CHUNK = 1 << 16

# Points up to this many machine epsilons (relative to the pair's coordinate scale) outside a
# polygon still count as inside: boundary points computed with rounding error must not be lost.
_TOLERANCE_EPS = 64.0

# Relative slack on the bounding-circle test, so rounding never drops a touching pair.
_CIRCLE_SLACK = 1e-3


def _cross(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z of the 2-D cross product of (..., 2) vectors -> (...)."""
    return u[..., 0] * v[..., 1] - u[..., 1] * v[..., 0]


def _signed_area(poly: torch.Tensor) -> torch.Tensor:
    """Shoelace signed area of (P, V, 2) polygons -> (P,), positive for counter-clockwise."""
    return 0.5 * _cross(poly, poly.roll(-1, dims=1)).sum(dim=1)


def _inside_mask(points: torch.Tensor, poly: torch.Tensor, orientation: torch.Tensor,
                 tolerance: torch.Tensor) -> torch.Tensor:
    """Which points lie inside (or on, within ``tolerance``) a convex quad.

    points (P, K, 2), poly (P, 4, 2), orientation (P,) +1 for CCW / -1 for CW, tolerance (P,)
    in length units -> (P, K) bool.
    """
    edges = poly.roll(-1, dims=1) - poly                                     # (P, 4, 2)
    to_points = points[:, :, None, :] - poly[:, None, :, :]                  # (P, K, 4, 2)
    # cross / |edge| is the signed distance to the edge's line, positive on the inner side.
    cross = _cross(edges[:, None], to_points) * orientation[:, None, None]
    edge_len = torch.linalg.vector_norm(edges, dim=-1)[:, None, :]          # (P, 1, 4)
    return (cross >= -tolerance[:, None, None] * edge_len).all(dim=-1)


def _edge_crossings(poly_a: torch.Tensor, poly_b: torch.Tensor):
    """Crossing points of every edge of A with every edge of B.

    poly_a, poly_b (P, 4, 2) -> points (P, 16, 2) and non-parallel mask (P, 16). Each point is
    taken on A's edge with its parameter clamped to the edge, so it always lies on A's boundary;
    the caller keeps it only if it is also inside B, which rejects parallel-edge noise safely.
    """
    dir_a = (poly_a.roll(-1, dims=1) - poly_a)[:, :, None, :]               # (P, 4, 1, 2)
    dir_b = (poly_b.roll(-1, dims=1) - poly_b)[:, None, :, :]               # (P, 1, 4, 2)
    start_gap = poly_b[:, None, :, :] - poly_a[:, :, None, :]              # (P, 4, 4, 2)
    denom = _cross(dir_a, dir_b)                                            # (P, 4, 4)
    eps = torch.finfo(poly_a.dtype).eps
    scale = torch.linalg.vector_norm(dir_a, dim=-1) * torch.linalg.vector_norm(dir_b, dim=-1)
    non_parallel = denom.abs() > eps * scale
    safe_denom = torch.where(non_parallel, denom, torch.ones_like(denom))
    along_a = (_cross(start_gap, dir_b) / safe_denom).clamp(0.0, 1.0)
    points = poly_a[:, :, None, :] + along_a[..., None] * dir_a             # (P, 4, 4, 2)
    return points.reshape(-1, 16, 2), non_parallel.reshape(-1, 16)


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
    scale = torch.cat([poly_a, poly_b], dim=1).abs().amax(dim=(1, 2))
    tolerance = _TOLERANCE_EPS * torch.finfo(poly_a.dtype).eps * scale
    orient_a = 1.0 - 2.0 * (_signed_area(poly_a) < 0).to(poly_a.dtype)     # +1 CCW, -1 CW
    orient_b = 1.0 - 2.0 * (_signed_area(poly_b) < 0).to(poly_b.dtype)
    a_in_b = _inside_mask(poly_a, poly_b, orient_b, tolerance)
    b_in_a = _inside_mask(poly_b, poly_a, orient_a, tolerance)
    crossings, non_parallel = _edge_crossings(poly_a, poly_b)
    crossing_valid = non_parallel & _inside_mask(crossings, poly_b, orient_b, tolerance)
    points = torch.cat([poly_a, poly_b, crossings], dim=1)                  # (P, 24, 2)
    valid = torch.cat([a_in_b, b_in_a, crossing_valid], dim=1)
    return _area_of_boundary_points(points, valid)


def _to_float_tensor(array):
    """numpy/torch -> (floating torch tensor, was_numpy)."""
    is_numpy = isinstance(array, np.ndarray)
    tensor = torch.as_tensor(array)
    if not tensor.is_floating_point():
        tensor = tensor.to(torch.get_default_dtype())
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


def _size_columns(order: str):
    """Column indices of (length, width) in a 7-value box."""
    if order == "hwl":
        return 5, 4
    if order == "lwh":
        return 3, 4
    raise ValueError(f"unknown box order {order!r}; expected 'hwl' or 'lwh'")


def _centred_bev_corners(boxes: torch.Tensor, order: str) -> torch.Tensor:
    """(N, 7) boxes -> (N, 4, 2) BEV corners relative to each box's own centre."""
    centred = boxes.clone()
    centred[:, :2] = 0.0
    return boxes_to_bev_corners(centred, order)


def _pair_iou(boxes_a, boxes_b, corners_a, corners_b, area_a, area_b, idx_a, idx_b):
    """IoU of the pairs (idx_a[k], idx_b[k]) -> (P,). Corners are centre-relative (N, 4, 2)."""
    # Translate B into A's centred frame: the subtraction of two nearby centres is exact-ish,
    # whereas absolute float32 corners at 100 m would already be rounded to ~1e-5 m.
    offset = boxes_b[idx_b, :2] - boxes_a[idx_a, :2]
    inter = _intersection_area_flat(corners_a[idx_a], corners_b[idx_b] + offset[:, None, :])
    union = area_a[idx_a] + area_b[idx_b] - inter
    iou = inter / union.clamp(min=torch.finfo(union.dtype).tiny)
    return torch.where(union > 0, iou, torch.zeros_like(iou)).clamp(0.0, 1.0)


def _prepare(boxes_a, boxes_b, order: str):
    """Common dtype/device, centred corners, polygon areas and bounding-circle radii."""
    boxes_a, is_numpy = _to_float_tensor(boxes_a)
    boxes_b, _ = _to_float_tensor(boxes_b)
    if boxes_a.shape[-1] != 7 or boxes_b.shape[-1] != 7:
        raise ValueError(f"boxes must be (N, 7); got {tuple(boxes_a.shape)} and "
                         f"{tuple(boxes_b.shape)}")
    dtype = torch.promote_types(boxes_a.dtype, boxes_b.dtype)
    boxes_a, boxes_b = boxes_a.to(dtype), boxes_b.to(dtype)
    length_col, width_col = _size_columns(order)
    prepared = []
    for boxes in (boxes_a, boxes_b):
        corners = _centred_bev_corners(boxes, order)
        area = _signed_area(corners).abs()
        radius = 0.5 * torch.hypot(boxes[:, length_col], boxes[:, width_col])
        prepared.append((boxes, corners, area, radius))
    return prepared, is_numpy


def _overlap_candidates(centre_a, radius_a, centre_b, radius_b):
    """Pairs whose bounding circles meet: only these can have a non-zero IoU.

    centre (N, 2) / (M, 2), radius (N,) / (M,) -> (idx_a, idx_b) LongTensors.
    """
    # Explicit differences rather than torch.cdist: cdist's matmul shortcut loses float32
    # digits at 100 m coordinates. The small slack keeps the filter a superset under rounding.
    diff = centre_a[:, None, :] - centre_b[None, :, :]
    gap = torch.hypot(diff[..., 0], diff[..., 1])
    reach = (radius_a[:, None] + radius_b[None, :]) * (1.0 + _CIRCLE_SLACK)
    return torch.nonzero(gap <= reach, as_tuple=True)


def boxes_bev_iou(boxes_a, boxes_b, order: str = "hwl", pairs_per_chunk: int = PAIRS_PER_CHUNK):
    """Rotated BEV IoU of every box in A with every box in B.

    boxes_a (N, 7), boxes_b (M, 7) -> (N, M) in the promoted float dtype, on the inputs' device
    (numpy in, numpy out). Pairs whose bounding circles do not meet are 0 without clipping;
    rows of A are processed in blocks so memory stays bounded for large N * M.
    """
    (a, b), is_numpy = _prepare(boxes_a, boxes_b, order)
    num_a, num_b = a[0].shape[0], b[0].shape[0]
    iou = a[0].new_zeros(num_a, num_b)
    rows_per_block = max(1, pairs_per_chunk // max(num_b, 1))
    for row_start in range(0, num_a, rows_per_block):
        rows = slice(row_start, row_start + rows_per_block)
        idx_a, idx_b = _overlap_candidates(a[0][rows, :2], a[3][rows], b[0][:, :2], b[3])
        idx_a = idx_a + row_start
        for start in range(0, idx_a.shape[0], pairs_per_chunk):
            chunk_a = idx_a[start:start + pairs_per_chunk]
            chunk_b = idx_b[start:start + pairs_per_chunk]
            iou[chunk_a, chunk_b] = _pair_iou(a[0], b[0], a[1], b[1], a[2], b[2], chunk_a, chunk_b)
    return iou.numpy() if is_numpy else iou


def boxes_bev_iou_aligned(boxes_a, boxes_b, order: str = "hwl",
                          pairs_per_chunk: int = PAIRS_PER_CHUNK):
    """Rotated BEV IoU of row-aligned pairs: boxes_a (N, 7), boxes_b (N, 7) -> (N,)."""
    (a, b), is_numpy = _prepare(boxes_a, boxes_b, order)
    if a[0].shape[0] != b[0].shape[0]:
        raise ValueError(f"aligned IoU needs equal counts; got {a[0].shape[0]} and {b[0].shape[0]}")
    gap = torch.linalg.vector_norm(a[0][:, :2] - b[0][:, :2], dim=1)
    candidates = torch.nonzero(gap <= (a[3] + b[3]) * (1.0 + _CIRCLE_SLACK), as_tuple=True)[0]
    iou = a[0].new_zeros(a[0].shape[0])
    for start in range(0, candidates.shape[0], pairs_per_chunk):
        chunk = candidates[start:start + pairs_per_chunk]
        iou[chunk] = _pair_iou(a[0], b[0], a[1], b[1], a[2], b[2], chunk, chunk)
    return iou.numpy() if is_numpy else iou
