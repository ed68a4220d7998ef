"""Plain-Python reference implementations: the definitions our vectorised code is checked against.

Each walks its definition one element at a time (a point, a box pair, an anchor-GT pair) in
Python loops, so that it is easy to read and hard to get wrong; the tests compare our code with
it on random inputs, and ``tools/bench.py`` times our code against it (speed ratios on the same
input). It imports nothing from the tests, pytest or the code it checks (only ``grid_size``,
which the tests pin by hand).

Boxes are ``[x, y, z, h, w, l, yaw]`` (hwl order, yaw in radians) throughout.
"""
from __future__ import annotations

import math

import torch

from opencood.ops.voxelize import grid_size


# ---- pillarisation ---------------------------------------------------------------------------

def reference_pillarize(points, batch_index, lidar_range, voxel_size, max_points,
                        max_pillars=None):
    """A dict from (batch, z, y, x) to the points of that voxel in input order.

    points (P, C) tensor, batch_index (P,) -> features (V, max_points, C), counts (V,) int32,
    coords (V, 4) int64 ``[batch, z, y, x]`` sorted by key; at most ``max_pillars`` voxels per
    batch element (the first in key order) when given.
    """
    grid = grid_size(lidar_range, voxel_size)
    pillars = {}
    for row, batch in zip(points.tolist(), batch_index.tolist()):
        cell = []
        for axis in range(3):
            low, high = lidar_range[axis], lidar_range[axis + 3]
            if not low <= row[axis] < high:
                break
            cell.append(min(math.floor((row[axis] - low) / voxel_size[axis]), grid[axis] - 1))
        else:
            pillars.setdefault((batch, cell[2], cell[1], cell[0]), []).append(row)
    keys = sorted(pillars)
    if max_pillars is not None:
        kept, per_batch = [], {}
        for key in keys:
            per_batch[key[0]] = per_batch.get(key[0], 0) + 1
            if per_batch[key[0]] <= max_pillars:
                kept.append(key)
        keys = kept
    features = torch.zeros((len(keys), max_points, points.shape[1]), dtype=points.dtype)
    for pillar, key in enumerate(keys):
        rows = pillars[key][:max_points]
        features[pillar, :len(rows)] = torch.tensor(rows, dtype=points.dtype)
    counts = torch.tensor([min(len(pillars[k]), max_points) for k in keys], dtype=torch.int32)
    coords = torch.tensor(keys, dtype=torch.int64).reshape(-1, 4)
    return features, counts, coords


# ---- rotated BEV IoU by polygon clipping -----------------------------------------------------

def bev_corners(box) -> list:
    """Counter-clockwise BEV corners of one box, as a list of four (x, y)."""
    x, y, _, _, width, length, yaw = (float(v) for v in box)
    cos, sin = math.cos(yaw), math.sin(yaw)
    local = [(length / 2, -width / 2), (length / 2, width / 2), (-length / 2, width / 2),
             (-length / 2, -width / 2)]
    return [(x + u * cos - v * sin, y + u * sin + v * cos) for u, v in local]


def clip_convex(subject: list, clip: list) -> list:
    """Sutherland-Hodgman: the part of convex polygon ``subject`` inside CCW convex ``clip``."""
    def side(point, start, end):
        return ((end[0] - start[0]) * (point[1] - start[1])
                - (end[1] - start[1]) * (point[0] - start[0]))

    output = subject
    for i in range(len(clip)):
        start, end = clip[i], clip[(i + 1) % len(clip)]
        polygon, output = output, []
        for j in range(len(polygon)):
            current, following = polygon[j], polygon[(j + 1) % len(polygon)]
            side_current, side_following = side(current, start, end), side(following, start, end)
            if side_current >= 0:
                output.append(current)
            if (side_current >= 0) != (side_following >= 0):
                t = side_current / (side_current - side_following)
                output.append((current[0] + t * (following[0] - current[0]),
                               current[1] + t * (following[1] - current[1])))
        if not output:
            return []
    return output


def polygon_area(polygon: list) -> float:
    """Shoelace area of a simple polygon given as a list of (x, y)."""
    return abs(sum(p[0] * q[1] - q[0] * p[1]
                   for p, q in zip(polygon, polygon[1:] + polygon[:1]))) / 2.0


def reference_bev_iou(box_a, box_b) -> float:
    """Rotated BEV IoU of two boxes: clipped footprint area over the union of the footprints."""
    inter = polygon_area(clip_convex(bev_corners(box_a), bev_corners(box_b)))
    union = float(box_a[4]) * float(box_a[5]) + float(box_b[4]) * float(box_b[5]) - inter
    return inter / union if union > 0 else 0.0


def reference_iou_table(boxes_a, boxes_b) -> list:
    """(K, 7) and (G, 7) boxes -> K x G IoU as nested lists, one pair at a time."""
    return [[reference_bev_iou(a, b) for b in boxes_b] for a in boxes_a]


# ---- average precision -----------------------------------------------------------------------

def reference_ap(frames, thresholds, sort: str = "global") -> dict:
    """OPV2V-style AP in loops: {threshold: AP}.

    frames: [(pred (K, 7), scores (K,), gt (G, 7))]. Per frame, detections in descending score
    (ties: lower index) take the free GT of highest IoU if it reaches the threshold; over all
    frames detections are ranked by score (ties: frame, then detection index) and AP is the VOC
    all-point interpolated area under precision/recall. ``sort="per_frame"`` ranks them as
    OpenCOOD does instead: frame by frame, by score within a frame.
    """
    tables = [reference_iou_table(pred, gt) for pred, _, gt in frames]
    return {threshold: _ap_at(frames, tables, threshold, sort) for threshold in thresholds}


def _ap_at(frames, tables, threshold: float, sort: str) -> float:
    records, num_gt = [], 0
    for frame_id, ((pred, scores, gt), table) in enumerate(zip(frames, tables)):
        num_gt += len(gt)
        free_gt = list(range(len(gt)))
        for det in sorted(range(len(pred)), key=lambda k: (-float(scores[k]), k)):
            ious = [table[det][g] for g in free_gt]
            best = max(ious, default=-1.0)
            is_tp = best >= threshold
            if is_tp:
                free_gt.pop(ious.index(best))
            records.append((-float(scores[det]), frame_id, det, is_tp))
    if num_gt == 0:
        return 0.0
    # records are (-score, frame, detection, is_tp)
    records.sort(key=None if sort == "global" else lambda r: (r[1], r[0], r[2]))
    recall, precision, tp_count = [0.0], [0.0], 0
    for rank, record in enumerate(records, start=1):
        tp_count += record[3]
        recall.append(tp_count / num_gt)
        precision.append(tp_count / rank)
    recall.append(1.0)
    precision.append(0.0)
    for i in range(len(precision) - 2, -1, -1):
        precision[i] = max(precision[i], precision[i + 1])
    return sum((recall[i + 1] - recall[i]) * precision[i + 1] for i in range(len(recall) - 1))


# ---- anchor target assignment ----------------------------------------------------------------

def standup_rect(box) -> tuple:
    """(xmin, ymin, xmax, ymax) of the axis-aligned rectangle enclosing a box's BEV footprint."""
    x, y, _, _, width, length, yaw = (float(v) for v in box)
    cos, sin = abs(math.cos(yaw)), abs(math.sin(yaw))
    half_x = cos * length / 2 + sin * width / 2
    half_y = sin * length / 2 + cos * width / 2
    return x - half_x, y - half_y, x + half_x, y + half_y


def rect_iou(rect_a: tuple, rect_b: tuple) -> float:
    overlap_x = max(min(rect_a[2], rect_b[2]) - max(rect_a[0], rect_b[0]), 0.0)
    overlap_y = max(min(rect_a[3], rect_b[3]) - max(rect_a[1], rect_b[1]), 0.0)
    inter = overlap_x * overlap_y
    union = ((rect_a[2] - rect_a[0]) * (rect_a[3] - rect_a[1])
             + (rect_b[2] - rect_b[0]) * (rect_b[3] - rect_b[1]) - inter)
    return inter / union if union > 0 else 0.0


def reference_assign_targets(anchors, gt_boxes, pos_iou: float, neg_iou: float) -> tuple:
    """Anchor labels of one sample by standup-rectangle IoU, one anchor-GT pair at a time.

    anchors (N, 7), gt_boxes (G, 7) real boxes only -> (labels, matched_gt), two lists of N ints:
    label 1 positive, 0 negative, -1 ignored; matched_gt the GT a positive regresses to, else -1.
    An anchor is positive when its best IoU reaches ``pos_iou``, or when it is the best anchor of
    a GT (first anchor on ties, IoU > 0; if several GT claim it, the higher IoU wins, then the
    lower GT index), and then regresses to that claiming GT; negative when not positive and its
    best IoU is below ``neg_iou``.
    """
    gt_rects = [standup_rect(box) for box in gt_boxes]
    ious = [[rect_iou(standup_rect(anchor), rect) for rect in gt_rects] for anchor in anchors]
    claims = {}                                  # anchor -> (IoU, GT) of its winning claim
    for gt in range(len(gt_rects)):
        column = [row[gt] for row in ious]
        best = max(column)
        anchor = column.index(best)
        if best > 0 and (anchor not in claims or best > claims[anchor][0]):
            claims[anchor] = (best, gt)
    labels, matched_gt = [], []
    for anchor, row in enumerate(ious):
        best = max(row, default=0.0)
        if anchor in claims:
            labels.append(1)
            matched_gt.append(claims[anchor][1])
        elif best >= pos_iou:
            labels.append(1)
            matched_gt.append(row.index(best))
        else:
            labels.append(0 if best < neg_iou else -1)
            matched_gt.append(-1)
    return labels, matched_gt
