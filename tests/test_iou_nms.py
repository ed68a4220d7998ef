"""Rotated BEV IoU and NMS against hand-computed geometry and, on random boxes, the polygon-clipping
reference (opencood/testing/reference_impls.py).

Boxes are [x, y, z, h, w, l, yaw] (order 'hwl'); only x, y, w, l, yaw matter in BEV.
"""
import math

import numpy as np
import pytest
import torch

from opencood.ops.iou import (boxes_bev_iou, boxes_bev_iou_aligned, boxes_bev_iou_pairs,
                               polygon_intersection_area)
from opencood.ops.nms import nms_rotated
from opencood.ops.transforms import boxes_to_bev_corners
from opencood.testing.reference_impls import reference_iou_table

SQRT2 = math.sqrt(2.0)


def box(x, y, w, l, yaw=0.0, dtype=torch.float64):
    """One hwl box as a (1, 7) tensor (z = 0, h = 1.5)."""
    return torch.tensor([[x, y, 0.0, 1.5, w, l, yaw]], dtype=dtype)


def iou_of(box_a, box_b):
    return boxes_bev_iou(box_a, box_b)[0, 0].item()


# ---- hand-computed cases --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("yaw", [0.0, 0.3, math.pi / 2, 2.5, -3.0, math.pi])
def test_identical_boxes_iou_one(dtype, yaw):
    # Far from the origin on purpose: float32 keeps only ~1e-5 m there.
    car = box(-97.3, 38.1, 1.9, 4.6, yaw, dtype)
    assert iou_of(car, car) == pytest.approx(1.0, abs=1e-5)


def test_disjoint_and_touching_boxes_iou_zero():
    square = box(0, 0, 2, 2)
    assert iou_of(square, box(5, 0, 2, 2)) == 0.0
    # Bounding circles (radius sqrt(2) each) overlap but the squares do not: clipping says 0.
    assert iou_of(square, box(2.5, 0, 2, 2, math.pi / 4)) == 0.0
    # Shared edge x = 1, and a shared corner (1, 1): zero area either way.
    assert iou_of(square, box(2, 0, 2, 2)) == pytest.approx(0.0, abs=1e-12)
    assert iou_of(square, box(2, 2, 2, 2)) == pytest.approx(0.0, abs=1e-12)


def test_square_rotated_45_degrees_gives_octagon():
    # Square [-1, 1]^2 and the same square turned 45 deg: the turned one's edge x + y = sqrt(2)
    # cuts each corner of the first off as a right triangle with legs 1 - (sqrt(2) - 1) =
    # 2 - sqrt(2), area (2 - sqrt(2))^2 / 2 = 3 - 2 sqrt(2). Octagon = 4 - 4 (3 - 2 sqrt(2))
    # = 8 (sqrt(2) - 1) = 3.3137; union = 8 - 3.3137 = 4.6863;
    # IoU = (sqrt(2) - 1) / (2 - sqrt(2)) = 1 / sqrt(2) = 0.70711.
    octagon_area = 8 * (SQRT2 - 1)
    square, diamond = box(0, 0, 2, 2), box(0, 0, 2, 2, math.pi / 4)
    area = polygon_intersection_area(boxes_to_bev_corners(square), boxes_to_bev_corners(diamond))
    assert area.item() == pytest.approx(octagon_area, abs=1e-12)
    assert iou_of(square, diamond) == pytest.approx(octagon_area / (8 - octagon_area), abs=1e-12)
    assert iou_of(square, diamond) == pytest.approx(1 / SQRT2, abs=1e-12)


def test_off_centre_diamond():
    # Diamond (2x2 square at 45 deg) centred at (1, 0) against [-1, 1]^2: the part with x <= 1
    # is the triangle (1 - sqrt(2), 0), (1, +-sqrt(2)) of area sqrt(2) * sqrt(2) = 2; y <= 1 and
    # y >= -1 each cut a right triangle with legs sqrt(2) - 1, area (3 - 2 sqrt(2)) / 2.
    # Intersection 2 - (3 - 2 sqrt(2)) = 2 sqrt(2) - 1 = 1.8284; IoU = 1.8284 / 6.1716 = 0.29627.
    inter = 2 * SQRT2 - 1
    assert iou_of(box(0, 0, 2, 2), box(1, 0, 2, 2, math.pi / 4)) == pytest.approx(
        inter / (8 - inter), abs=1e-12)


@pytest.mark.parametrize("inner_yaw", [0.0, math.pi / 6])
def test_contained_box(inner_yaw):
    # A 2x2 square (circumradius sqrt(2) < 2) lies inside a 4x4 one at any yaw: IoU = 4 / 16.
    inner = box(0.3, -0.2, 2, 2, inner_yaw)
    assert iou_of(box(0, 0, 4, 4), inner) == pytest.approx(0.25, abs=1e-12)
    # Inner box touching the outer boundary from inside (edge on the line x = 2): still 0.25.
    assert iou_of(box(0, 0, 4, 4), box(1, 0, 2, 2)) == pytest.approx(0.25, abs=1e-12)


def test_half_overlapping_axis_aligned():
    # 2x2 squares at x = 0 and x = 1 share a 1 x 2 strip: 2 / (4 + 4 - 2) = 1/3.
    assert iou_of(box(0, 0, 2, 2), box(1, 0, 2, 2)) == pytest.approx(1 / 3, abs=1e-12)
    # Same along the heading of a rotated 2 x 4 box (collinear long edges): shift 2 of 4 ->
    # 2 x 2 = 4 shared, 4 / (8 + 8 - 4) = 1/3.
    yaw = 0.7
    shifted = box(2 * math.cos(yaw), 2 * math.sin(yaw), 2, 4, yaw)
    assert iou_of(box(0, 0, 2, 4, yaw), shifted) == pytest.approx(1 / 3, abs=1e-12)


def test_lwh_order_matches_hwl():
    hwl = torch.tensor([[0.0, 0.0, 0.0, 1.5, 2.0, 4.0, 0.2], [1.0, 0.5, 0.0, 1.5, 1.8, 5.0, 1.0]])
    lwh = hwl[:, [0, 1, 2, 5, 4, 3, 6]]
    assert torch.allclose(boxes_bev_iou(lwh, lwh, order="lwh"), boxes_bev_iou(hwl, hwl))
    # The off-diagonal value is a real overlap, so a wrong column would show.
    assert boxes_bev_iou(hwl, hwl)[0, 1] > 0.2


# ---- properties on random boxes -------------------------------------------------------------
def random_scene(count, seed, spread=6.0):
    """(count, 7) float64 hwl boxes packed close enough that many pairs overlap."""
    gen = torch.Generator().manual_seed(seed)
    boxes = torch.zeros(count, 7, dtype=torch.float64)
    boxes[:, :2] = (torch.rand(count, 2, generator=gen, dtype=torch.float64) - 0.5) * spread
    boxes[:, 3] = 1.5
    boxes[:, 4] = 1.5 + torch.rand(count, generator=gen, dtype=torch.float64)
    boxes[:, 5] = 3.5 + 2 * torch.rand(count, generator=gen, dtype=torch.float64)
    boxes[:, 6] = (torch.rand(count, generator=gen, dtype=torch.float64) - 0.5) * 2 * math.pi
    return boxes


def test_symmetric_and_yaw_pi_invariant():
    boxes_a, boxes_b = random_scene(40, seed=0), random_scene(30, seed=1)
    iou = boxes_bev_iou(boxes_a, boxes_b)
    assert (iou > 0).sum() > 100                       # the test must see real overlaps
    assert torch.allclose(iou, boxes_bev_iou(boxes_b, boxes_a).T, atol=1e-12)
    flipped = boxes_b.clone()
    flipped[:, 6] += math.pi                           # same footprint, heading reversed
    assert torch.allclose(iou, boxes_bev_iou(boxes_a, flipped), atol=1e-12)
    assert torch.allclose(boxes_bev_iou(boxes_a, boxes_a).diagonal(),
                          torch.ones(40, dtype=torch.float64), atol=1e-12)


def test_matches_the_polygon_clipping_reference():
    boxes_a, boxes_b = random_scene(30, seed=7), random_scene(25, seed=8)
    reference = torch.tensor(reference_iou_table(boxes_a.tolist(), boxes_b.tolist()),
                             dtype=torch.float64)
    partial = (reference > 0.01) & (reference < 0.99)
    assert partial.sum() > 100                         # real, partial overlaps at many angles
    assert torch.allclose(boxes_bev_iou(boxes_a, boxes_b), reference, atol=1e-9)


def test_float32_agrees_with_float64_and_aligned_matches_matrix():
    boxes_a, boxes_b = random_scene(40, seed=2), random_scene(40, seed=3)
    boxes_a[:, :2] += 80.0                               # large coordinates, as in a real scene
    boxes_b[:, :2] += 80.0
    iou64 = boxes_bev_iou(boxes_a, boxes_b)
    iou32 = boxes_bev_iou(boxes_a.float(), boxes_b.float())
    assert iou32.dtype == torch.float32
    assert torch.allclose(iou32.double(), iou64, atol=1e-5)
    aligned = boxes_bev_iou_aligned(boxes_a, boxes_b)
    assert torch.allclose(aligned, iou64.diagonal(), atol=1e-12)


def test_chunking_and_numpy_round_trip():
    boxes_a, boxes_b = random_scene(25, seed=4), random_scene(20, seed=5)
    reference = boxes_bev_iou(boxes_a, boxes_b)
    assert torch.equal(boxes_bev_iou(boxes_a, boxes_b, pairs_per_chunk=7), reference)
    as_numpy = boxes_bev_iou(boxes_a.numpy(), boxes_b.numpy())
    assert isinstance(as_numpy, np.ndarray)
    np.testing.assert_array_equal(as_numpy, reference.numpy())
    # Listed pairs (repeats allowed) read the same entries of the matrix.
    idx_a, idx_b = torch.tensor([0, 3, 3, 24, 7]), torch.tensor([19, 0, 0, 5, 7])
    pairs = boxes_bev_iou_pairs(boxes_a, boxes_b, idx_a, idx_b, pairs_per_chunk=2)
    assert torch.equal(pairs, reference[idx_a, idx_b])


def test_empty_inputs():
    some = random_scene(3, seed=6)
    assert boxes_bev_iou(torch.zeros(0, 7), some).shape == (0, 3)
    assert boxes_bev_iou(some, torch.zeros(0, 7)).shape == (3, 0)
    assert boxes_bev_iou_aligned(torch.zeros(0, 7), torch.zeros(0, 7)).shape == (0,)
    assert polygon_intersection_area(torch.zeros(0, 4, 2), torch.zeros(0, 4, 2)).shape == (0,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    boxes_a, boxes_b = random_scene(50, seed=7), random_scene(60, seed=8)
    device = torch.device("cuda", torch.cuda.current_device())
    on_gpu = boxes_bev_iou(boxes_a.to(device), boxes_b.to(device))
    assert on_gpu.device.type == "cuda"
    assert torch.allclose(on_gpu.cpu(), boxes_bev_iou(boxes_a, boxes_b), atol=1e-10)
    keep_gpu = nms_rotated(boxes_a.to(device), torch.linspace(1, 0, 50, device=device), 0.3)
    assert torch.equal(keep_gpu.cpu(), nms_rotated(boxes_a, torch.linspace(1, 0, 50), 0.3))


# ---- NMS ------------------------------------------------------------------------------------
def test_nms_two_clusters():
    # Cluster 1, 2 x 4 boxes along x (overlap of boxes shifted by d is (4 - d) x 2):
    #   0: x=0.0, s=0.90 | 1: x=0.5, s=0.80 | 2: x=1.5, s=0.70
    #   IoU(0,1) = 7/9 = 0.78 -> 1 suppressed; IoU(0,2) = 5/11 = 0.45 -> 2 survives box 0;
    #   IoU(1,2) = 6/10 = 0.6 but box 1 is already suppressed, so it suppresses nothing.
    # Cluster 2 at x = 20, boxes turned 90 deg and shifted 0.4 along their length:
    #   3: s=0.60 | 4: s=0.95, IoU = 3.6*2 / (16 - 7.2) = 0.82 -> 3 suppressed.
    boxes = torch.cat([box(0, 0, 2, 4), box(0.5, 0, 2, 4), box(1.5, 0, 2, 4),
                       box(20, 0, 2, 4, math.pi / 2), box(20, 0.4, 2, 4, math.pi / 2)])
    scores = torch.tensor([0.90, 0.80, 0.70, 0.60, 0.95])
    keep = nms_rotated(boxes, scores, iou_threshold=0.5)
    assert keep.dtype == torch.long
    assert keep.tolist() == [4, 0, 2]
    # A stricter threshold (0.4) also drops box 2 (0.45 with box 0).
    assert nms_rotated(boxes, scores, iou_threshold=0.4).tolist() == [4, 0]


def test_nms_ties_and_empty():
    # Identical boxes with equal scores: the first in input order wins.
    boxes = torch.cat([box(0, 0, 2, 4), box(0, 0, 2, 4), box(10, 0, 2, 4)])
    assert nms_rotated(boxes, torch.tensor([0.5, 0.5, 0.4]), 0.5).tolist() == [0, 2]
    empty = nms_rotated(torch.zeros(0, 7), torch.zeros(0), 0.5)
    assert empty.dtype == torch.long and empty.shape == (0,)
