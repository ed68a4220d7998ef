"""Benchmark: BEV AP with our vectorised rotated IoU vs a plain per-pair reference.

Builds random frames (fixed seed): ~30 GT boxes each and 50 detections (noisy copies of GT plus
clutter, scores rounded to 2 decimals so ties occur). Times ``APAccumulator`` against a
straightforward reference (per-pair Sutherland-Hodgman clipping, greedy matching and VOC AP in
pure Python loops), checks both give the same AP at every threshold, and times the IoU kernel
and the per-GT ego point count behind the ego-visible / ego-occluded split.

    python tools/bench_ap.py [--frames 1000] [--ref-frames 100] [--seed 0] [--threads N]

The reference is far slower, so by default it runs on the first ``--ref-frames`` frames and its
time is scaled to the full count (the output says so); both AP values are compared on that subset.
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np
import torch

from opencood.eval.ap import APAccumulator
from opencood.ops.iou import boxes_bev_iou, polygon_intersection_area
from opencood.ops.transforms import (boxes_to_bev_corners, count_points_in_boxes,
                                     points_in_boxes_mask)

THRESHOLDS = (0.3, 0.5, 0.7)


# ---- random data ----------------------------------------------------------------------------
def random_boxes(rng: np.random.Generator, count: int) -> np.ndarray:
    """(count, 7) hwl boxes scattered over a 200 x 80 m ego range."""
    return np.stack([rng.uniform(-100, 100, count), rng.uniform(-40, 40, count),
                     np.full(count, -1.0), np.full(count, 1.5), rng.uniform(1.6, 2.4, count),
                     rng.uniform(3.8, 6.0, count), rng.uniform(-math.pi, math.pi, count)], axis=1)


def random_frame(rng: np.random.Generator, num_gt: int = 30, num_det: int = 50,
                 num_true: int = 35):
    """One frame: detections near GT (some duplicated) plus clutter -> (pred, scores, gt)."""
    gt = random_boxes(rng, num_gt)
    near = gt[rng.integers(0, num_gt, num_true)].copy()
    near[:, :2] += rng.normal(0.0, 0.4, (num_true, 2))
    near[:, 4:6] *= rng.uniform(0.9, 1.1, (num_true, 2))
    near[:, 6] += rng.normal(0.0, 0.15, num_true)
    clutter = random_boxes(rng, num_det - num_true)
    pred = np.concatenate([near, clutter])
    scores = np.concatenate([rng.uniform(0.3, 1.0, num_true),
                             rng.uniform(0.0, 0.7, num_det - num_true)])
    return pred, np.round(scores, 2), gt


# ---- reference: one pair at a time, plain Python ---------------------------------------------
def ref_corners(box) -> list:
    """Counter-clockwise BEV corners of one hwl box, as a list of (x, y)."""
    x, y, _, _, w, l, yaw = (float(v) for v in box)
    cos, sin = math.cos(yaw), math.sin(yaw)
    local = [(l / 2, -w / 2), (l / 2, w / 2), (-l / 2, w / 2), (-l / 2, -w / 2)]
    return [(x + u * cos - v * sin, y + u * sin + v * cos) for u, v in local]


def ref_clip(subject: list, clip: list) -> list:
    """Sutherland-Hodgman: the part of convex polygon ``subject`` inside CCW convex ``clip``."""
    def side(p, a, b):
        return (b[0] - a[0]) * (p[1] - a[1]) - (b[1] - a[1]) * (p[0] - a[0])

    output = subject
    for i in range(len(clip)):
        a, b = clip[i], clip[(i + 1) % len(clip)]
        polygon, output = output, []
        for j in range(len(polygon)):
            cur, nxt = polygon[j], polygon[(j + 1) % len(polygon)]
            s_cur, s_nxt = side(cur, a, b), side(nxt, a, b)
            if s_cur >= 0:
                output.append(cur)
            if (s_cur >= 0) != (s_nxt >= 0):
                t = s_cur / (s_cur - s_nxt)
                output.append((cur[0] + t * (nxt[0] - cur[0]), cur[1] + t * (nxt[1] - cur[1])))
        if not output:
            return []
    return output


def ref_area(polygon: list) -> float:
    return abs(sum(p[0] * q[1] - q[0] * p[1]
                   for p, q in zip(polygon, polygon[1:] + polygon[:1]))) / 2.0


def ref_iou(box_a, box_b) -> float:
    inter = ref_area(ref_clip(ref_corners(box_a), ref_corners(box_b)))
    union = box_a[4] * box_a[5] + box_b[4] * box_b[5] - inter
    return inter / union if union > 0 else 0.0


def ref_iou_tables(frames) -> list:
    """Per frame, the K x G IoU table as nested lists, one pair at a time."""
    return [[[ref_iou(det, gt_box) for gt_box in gt] for det in pred] for pred, _, gt in frames]


def ref_ap(frames, iou_tables, threshold: float) -> float:
    """OPV2V-style greedy matching and VOC interpolation, all in loops."""
    records, num_gt = [], 0
    for frame_id, ((pred, scores, gt), table) in enumerate(zip(frames, iou_tables)):
        num_gt += len(gt)
        free_gt = list(range(len(gt)))
        for det in sorted(range(len(pred)), key=lambda k: (-scores[k], k)):
            ious = [table[det][g] for g in free_gt]
            is_tp = bool(ious) and max(ious) >= threshold
            if is_tp:
                free_gt.pop(int(np.argmax(ious)))
            records.append((-scores[det], frame_id, det, is_tp))
    records.sort()
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


# ---- timing ---------------------------------------------------------------------------------
def run_ours(frames) -> dict:
    accumulator = APAccumulator(THRESHOLDS)
    for frame_id, (pred, scores, gt) in enumerate(frames):
        accumulator.add_frame(torch.from_numpy(pred), torch.from_numpy(scores),
                              torch.from_numpy(gt), sample_key=frame_id)
    return accumulator.compute()


def time_call(fn, device: torch.device, repeats: int = 3) -> float:
    """Best wall time of ``repeats`` calls (after one warm-up), synchronising CUDA."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def bench_kernel(device: torch.device, rng: np.random.Generator) -> None:
    """IoU kernel: a dense all-overlapping pair batch, and a sparse scene matrix."""
    num_pairs = 200_000
    base = random_boxes(rng, num_pairs)
    base[:, :2] = 0.0
    other = base.copy()
    other[:, :2] = rng.normal(0.0, 1.0, (num_pairs, 2))
    other[:, 6] = rng.uniform(-math.pi, math.pi, num_pairs)
    poly_a = boxes_to_bev_corners(torch.from_numpy(base).float().to(device))
    poly_b = boxes_to_bev_corners(torch.from_numpy(other).float().to(device))
    seconds = time_call(lambda: polygon_intersection_area(poly_a, poly_b), device)
    print(f"  [{device.type}] polygon_intersection_area, {num_pairs:,} overlapping pairs (fp32): "
          f"{seconds * 1e3:.1f} ms = {num_pairs / seconds / 1e6:.2f} M pairs/s")
    scene = torch.from_numpy(random_boxes(rng, 2000)).float().to(device)
    seconds = time_call(lambda: boxes_bev_iou(scene, scene), device)
    print(f"  [{device.type}] boxes_bev_iou 2000 x 2000 scene boxes (fp32, circle pre-filter): "
          f"{seconds * 1e3:.1f} ms")


def bench_visibility_count(rng: np.random.Generator) -> None:
    """Ego points per GT box at OPV2V size (105k points, 60 boxes): ours (BEV buckets) against the
    dense (M, N) mask; both must agree."""
    count = 105_000
    points = np.stack([rng.uniform(-140, 140, count), rng.uniform(-40, 40, count),
                       rng.uniform(-3, 1, count), np.zeros(count)], axis=1).astype(np.float32)
    boxes = random_boxes(rng, 60)

    def dense():
        return points_in_boxes_mask(points, boxes, margin=0.1).sum(axis=1)

    def ours():
        return count_points_in_boxes(points, boxes, margin=0.1)

    np.testing.assert_array_equal(ours(), dense())
    ours_ms = time_call(ours, torch.device("cpu")) * 1e3
    dense_ms = time_call(dense, torch.device("cpu"), repeats=1) * 1e3
    print(f"ego points per GT box ({count:,} points x 60 boxes): ours {ours_ms:.1f} ms, dense "
          f"mask {dense_ms:.0f} ms ({dense_ms / ours_ms:.0f}x), same counts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=1000)
    parser.add_argument("--ref-frames", type=int, default=100,
                        help="frames the slow reference runs on (its time is scaled up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); 1 is steadier on a busy host")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    frames = [random_frame(rng) for _ in range(args.frames)]
    num_pairs = sum(len(p) * len(g) for p, _, g in frames)
    print(f"{args.frames} frames, {num_pairs:,} detection-GT pairs, seed {args.seed}")

    start = time.perf_counter()
    ours_full = run_ours(frames)
    ours_seconds = time.perf_counter() - start
    print(f"ours      ({args.frames} frames): {ours_seconds:.3f} s   "
          + "  ".join(f"AP@{t}={ours_full[f'ap_{round(t * 100)}']:.6f}" for t in THRESHOLDS))

    ref_count = min(args.ref_frames, args.frames)
    subset = frames[:ref_count]
    start = time.perf_counter()
    iou_tables = ref_iou_tables(subset)            # once, shared by the three thresholds
    ref_values = [ref_ap(subset, iou_tables, t) for t in THRESHOLDS]
    ref_seconds = time.perf_counter() - start
    ref_scaled = ref_seconds * args.frames / ref_count
    scaled_note = "" if ref_count == args.frames else \
        (f" on the first {ref_count} frames, scaled x{args.frames / ref_count:g}"
         f" -> {ref_scaled:.1f} s")
    print(f"reference ({ref_count} frames): {ref_seconds:.3f} s{scaled_note}")
    print(f"speed-up: {ref_scaled / ours_seconds:.0f}x")

    ours_subset = ours_full if ref_count == args.frames else run_ours(subset)
    for threshold, ref_value in zip(THRESHOLDS, ref_values):
        ours_value = ours_subset[f"ap_{round(threshold * 100)}"]
        print(f"  AP@{threshold} on {ref_count} frames: ours {ours_value:.8f}  reference "
              f"{ref_value:.8f}")
        assert abs(ours_value - ref_value) < 1e-6, f"AP mismatch at IoU {threshold}"
    print("AP agrees with the reference at every threshold (|diff| < 1e-6)")

    bench_visibility_count(rng)
    print(f"IoU kernel ({torch.get_num_threads()} CPU threads):")
    bench_kernel(torch.device("cpu"), rng)
    if torch.cuda.is_available():
        bench_kernel(torch.device("cuda", torch.cuda.current_device()), rng)
    else:
        print("  CUDA not available: GPU kernel time skipped")


if __name__ == "__main__":
    main()
