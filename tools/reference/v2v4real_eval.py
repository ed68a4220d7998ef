#!/usr/bin/env python
"""V2V4Real's own evaluation run on made-up frames: the fixture tests/test_protocols.py compares
``--protocol v2v4real`` with (tests/fixtures/reference_eval/v2v4real_eval.npz).

Runs in the side environment, never in CI, with the V2V4Real checkout first on PYTHONPATH (its
package is named ``opencood``: run from outside our checkout). Exact commands of the committed
fixture (V2V4Real at da1db75383c78ecc704cb2fcb28a65217206b38b)::

    python3 -m venv /work/side/venv-ref
    /work/side/venv-ref/bin/pip install torch==2.14.1 numpy pyyaml shapely opencv-python-headless \
        open3d matplotlib
    git --git-dir=/work/.mirror/ucla-mobility+V2V4Real/repo archive HEAD | tar -x -C /work/side/V2V4Real
    cd /work/side && env PYTHONPATH=/work/side/V2V4Real /work/side/venv-ref/bin/python \
        <repo>/tools/reference/v2v4real_eval.py <repo>/tests/fixtures/reference_eval/v2v4real_eval.npz

The frames (numpy only, seed ``SEED``): GT boxes spread over +-115 x +-46 m, so some lie across
the edges of V2V4Real's GT_RANGE [-100, -40, -5, 100, 40, 3] (its evaluation keeps a box only
with all 8 corners inside, x and y); detections are the GT jittered (IoU around 0.5 to 0.9),
missed at random, plus false positives, scores all distinct; one frame without detections
(V2V4Real's ``post_process`` then returns None), one without GT. Boxes are float32 values
[x, y, z, h, w, l, yaw] (``hwl``, the V2V4Real configs' order), as a model's are.

What runs is V2V4Real's code as its ``tools/inference.py`` calls it: corners by
``box_utils.boxes_to_corners_3d``, the prediction filter of ``VoxelPostprocessor.post_process``
and the GT filter of ``BasePostprocessor.generate_gt_bbx`` (both
``box_utils.get_mask_for_boxes_within_range_torch``), then ``eval_utils.caluclate_tp_fp`` per
frame at 0.5 and 0.7 and ``eval_utils.calculate_ap``. Saved: the frames (``frame_start`` /
``gt_start`` offsets into ``pred_boxes``, ``pred_scores``, ``gt_boxes``; ``no_detections`` marks
the None frame), the masks each filter kept, and ``ap_50``, ``ap_70``.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import stub_module  # noqa: E402  (tools/reference/side_env.py)

SEED = 41
FRAMES = 24
ORDER = "hwl"


def make_frames(seed: int = SEED, half_x: float = 115.0, half_y: float = 46.0,
                z_span=(-1.5, -0.5)):
    """[(pred (K, 7) float32, scores (K,) float32, gt (G, 7) float32, no_detections)]: boxes
    over +-half_x x +-half_y, centres' z in z_span (tools/reference/heal_eval.py widens them)."""
    rng = np.random.default_rng(seed)
    frames = []
    for index in range(FRAMES):
        count = 0 if index == 5 else int(rng.integers(3, 9))
        gt = np.column_stack([rng.uniform(-half_x, half_x, count),
                              rng.uniform(-half_y, half_y, count),
                              rng.uniform(*z_span, count), rng.uniform(1.4, 1.8, count),
                              rng.uniform(1.7, 2.1, count), rng.uniform(3.8, 5.0, count),
                              rng.uniform(-np.pi, np.pi, count)])
        seen = gt[rng.random(count) < 0.8]
        jitter = np.column_stack([rng.normal(0, 0.25, (len(seen), 2)),
                                  rng.normal(0, 0.1, len(seen)),
                                  np.zeros((len(seen), 3)), rng.normal(0, 0.04, len(seen))])
        false = int(rng.integers(0, 4))
        fp = np.column_stack([rng.uniform(-half_x, half_x, false),
                              rng.uniform(-half_y, half_y, false),
                              np.full(false, -1.0), np.full(false, 1.6), np.full(false, 1.9),
                              np.full(false, 4.4), rng.uniform(-np.pi, np.pi, false)])
        pred = np.vstack([seen + jitter, fp]).reshape(-1, 7)
        no_detections = index == 9
        if no_detections:
            pred = np.zeros((0, 7))
        scores = rng.permutation(np.linspace(0.11, 0.99, len(pred))) + index * 1e-4
        frames.append((pred.astype(np.float32), scores.astype(np.float32),
                       gt.astype(np.float32).reshape(-1, 7), no_detections))
    return frames


def evaluate(frames):
    """V2V4Real's evaluation of ``frames`` -> (pred masks, GT masks, ap_50, ap_70)."""
    import torch
    stub_module("opencood.utils.box_overlaps", bbox_overlaps=None)     # cython, anchor targets only
    # spconv's voxeliser, imported by the data sets' package (GT_RANGE lives there); unused
    stub_module("cumm", tensorview=None)
    stub_module("spconv")
    stub_module("spconv.utils", Point2VoxelCPU3d=None)
    # drawing only; it calls matplotlib's cm.get_cmap at import, which matplotlib 3.9 removed
    stub_module("opencood.visualization.vis_utils")
    from opencood.utils import box_utils, eval_utils
    result_stat = {0.5: {"tp": [], "fp": [], "gt": 0}, 0.7: {"tp": [], "fp": [], "gt": 0}}
    pred_masks, gt_masks = [], []
    for pred, scores, gt, no_detections in frames:
        # copies: boxes_to_corners_3d reorders an hwl tensor's sizes in place
        gt_corners = box_utils.boxes_to_corners_3d(torch.from_numpy(gt.copy()), ORDER)
        gt_mask = box_utils.get_mask_for_boxes_within_range_torch(gt_corners)
        gt_corners = gt_corners[gt_mask]
        pred_box, pred_score = None, None
        if not no_detections:
            pred_corners = box_utils.boxes_to_corners_3d(torch.from_numpy(pred.copy()), ORDER)
            pred_mask = box_utils.get_mask_for_boxes_within_range_torch(pred_corners)
            pred_box, pred_score = pred_corners[pred_mask], torch.from_numpy(scores)[pred_mask]
            pred_masks.append(pred_mask.numpy())
        for threshold in (0.5, 0.7):
            eval_utils.caluclate_tp_fp(pred_box, pred_score, gt_corners, result_stat, threshold)
        gt_masks.append(gt_mask.numpy())
    ap_50 = eval_utils.calculate_ap(result_stat, 0.5)[0]
    ap_70 = eval_utils.calculate_ap(result_stat, 0.7)[0]
    return pred_masks, gt_masks, ap_50, ap_70


def save(path: Path, frames, pred_masks, gt_masks, ap_50, ap_70) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    counts = np.array([len(f[0]) for f in frames])
    gt_counts = np.array([len(f[2]) for f in frames])
    np.savez_compressed(
        path, frame_start=np.concatenate([[0], np.cumsum(counts)]),
        gt_start=np.concatenate([[0], np.cumsum(gt_counts)]),
        pred_boxes=np.concatenate([f[0] for f in frames]).reshape(-1, 7),
        pred_scores=np.concatenate([f[1] for f in frames]),
        gt_boxes=np.concatenate([f[2] for f in frames]).reshape(-1, 7),
        no_detections=np.array([f[3] for f in frames]),
        pred_kept=np.concatenate(pred_masks), gt_kept=np.concatenate(gt_masks),
        ap_50=np.float64(ap_50), ap_70=np.float64(ap_70))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: v2v4real_eval.py OUT.npz (V2V4Real first on PYTHONPATH)", file=sys.stderr)
        return 2
    frames = make_frames()
    pred_masks, gt_masks, ap_50, ap_70 = evaluate(frames)
    save(Path(args[0]), frames, pred_masks, gt_masks, ap_50, ap_70)
    print(f"wrote {args[0]}: ap_50 {ap_50:.6f}, ap_70 {ap_70:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
