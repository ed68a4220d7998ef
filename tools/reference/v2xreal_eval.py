#!/usr/bin/env python
"""V2X-Real's own per-class evaluation run on made-up frames: the fixture tests/test_protocols.py
compares ``--protocol v2xreal`` with (tests/fixtures/reference_eval/v2xreal_eval.npz).

Runs in a side environment, never in CI, with the V2X-Real checkout first on PYTHONPATH (its
package is named ``opencood``: run from outside our checkout). Exact commands of the committed
fixture (V2X-Real at b6d5be142a92beaba129bb9da40855d647df35ea)::

    python3 -m venv /work/side/venv-v2xreal
    /work/side/venv-v2xreal/bin/pip install torch==2.14.1 numpy shapely pyyaml scipy
    mkdir -p /work/side/V2X-Real
    git --git-dir=/work/.mirror/ucla-mobility+V2X-Real/repo archive HEAD opencood \
        | tar -x -C /work/side/V2X-Real
    cd /work/side && env PYTHONPATH=/work/side/V2X-Real /work/side/venv-v2xreal/bin/python \
        <repo>/tools/reference/v2xreal_eval.py <repo>/tests/fixtures/reference_eval/v2xreal_eval.npz

The frames (numpy only, seed ``SEED``): GT of V2X-Real's three meta-classes (its
``SUPER_CLASS_MAP`` keys, in order: vehicle, pedestrian, truck) with class-typical sizes, spread
over +-115 x +-46 m so some lie across the edges of its GT_RANGE [-100, -40, -15, 100, 40, 15]
(boxes are kept with all 8 corners inside, x and y); detections are the GT jittered in
proportion to its size, missed at random, some given another class (an FP of that class and a
miss of the true one), plus false positives of every class; scores distinct. Every frame has
detections (V2X-Real's ``post_process`` returns None for a frame without any, which its
``inference.py`` cannot index). Boxes are float32 [x, y, z, h, w, l, yaw] (``hwl``, its configs'
order); class ids are ours, 0-based (0 vehicle, 1 pedestrian, 2 truck), V2X-Real's labels
those + 1 (``build_class_name2int_map``; 0 is its background).

What runs is V2X-Real's code as its ``tools/inference.py`` calls it: corners by
``box_utils.boxes_to_corners_3d``, the range filter of ``VoxelPostprocessor.post_process`` and
``BasePostprocessor.generate_gt_bbx`` (``box_utils.get_mask_for_boxes_within_range_torch``, with
GT_RANGE read from its ``data_utils/datasets/__init__.py``), the per-class loop of its
``inference.py`` (``pred_score[:, -1] == class_id`` / ``gt_label_tensor == class_id``, then
``eval_utils.caluclate_tp_fp`` at 0.3, 0.5, 0.7 on that class), and
``eval_utils.eval_final_results``: its per-class APs read back from the ``eval.yaml`` it writes,
its mean as its loop forms it (the sum over every class / the class count; it prints the mean
with 3 decimals only, which is checked against). A second case drops every truck (GT and
detections): V2X-Real then scores the truck class 0 and counts it in the mean.

Saved: the frames (``frame_start`` / ``gt_start`` offsets into ``pred_boxes``, ``pred_scores``,
``pred_classes``, ``gt_boxes``, ``gt_classes``), the masks each range filter kept
(``pred_kept``, ``gt_kept``), ``ap`` (3 classes, 3 thresholds) and ``mean_ap`` (3 thresholds),
and ``ap_no_truck`` / ``mean_ap_no_truck`` of the second case.
"""
import ast
import contextlib
import io
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

SEED = 38
FRAMES = 20
ORDER = "hwl"
THRESHOLDS = (0.3, 0.5, 0.7)
CLASS_NAMES = ("vehicle", "pedestrian", "truck")
# (h, w, l) ranges per class: cars, people on foot or on two wheels, trucks and buses
SIZES = {0: ((1.4, 1.8), (1.7, 2.1), (3.8, 5.0)),
         1: ((1.5, 1.9), (0.5, 0.9), (0.5, 1.9)),
         2: ((2.5, 3.6), (2.3, 2.6), (6.0, 12.0))}


def _boxes(rng, classes, half_x, half_y):
    """(N, 7) boxes of the given classes over +-half_x x +-half_y, class-typical sizes."""
    rows = []
    for label in classes.tolist():
        (h_lo, h_hi), (w_lo, w_hi), (l_lo, l_hi) = SIZES[label]
        rows.append([rng.uniform(-half_x, half_x), rng.uniform(-half_y, half_y),
                     rng.uniform(-1.5, -0.5), rng.uniform(h_lo, h_hi), rng.uniform(w_lo, w_hi),
                     rng.uniform(l_lo, l_hi), rng.uniform(-np.pi, np.pi)])
    return np.array(rows, dtype=np.float64).reshape(-1, 7)


def make_frames(seed: int = SEED, half_x: float = 115.0, half_y: float = 46.0):
    """[(pred (K, 7) f32, scores (K,) f32, pred classes (K,) i64, gt (G, 7) f32, gt classes
    (G,) i64)]."""
    rng = np.random.default_rng(seed)
    frames = []
    for index in range(FRAMES):
        gt_classes = rng.choice(3, size=int(rng.integers(3, 10)), p=[0.5, 0.3, 0.2])
        gt = _boxes(rng, gt_classes, half_x, half_y)
        seen = rng.random(len(gt)) < 0.8
        pred = gt[seen].copy()
        sizes = pred[:, [4, 5]].max(axis=1)
        pred[:, :2] += rng.normal(0, 1, (len(pred), 2)) * 0.07 * sizes[:, None]
        pred[:, 2] += rng.normal(0, 0.1, len(pred))
        pred[:, 6] += rng.normal(0, 0.04, len(pred))
        pred_classes = gt_classes[seen].copy()
        relabelled = rng.random(len(pred)) < 0.12
        shift = rng.integers(1, 3, relabelled.sum())       # to one of the other two classes
        pred_classes[relabelled] = (pred_classes[relabelled] + shift) % 3
        false_classes = rng.choice(3, size=int(rng.integers(1, 4)))
        pred = np.vstack([pred, _boxes(rng, false_classes, half_x, half_y)])
        pred_classes = np.concatenate([pred_classes, false_classes])
        scores = rng.permutation(np.linspace(0.11, 0.99, len(pred))) + index * 1e-4
        frames.append((pred.astype(np.float32), scores.astype(np.float32),
                       pred_classes.astype(np.int64), gt.astype(np.float32),
                       gt_classes.astype(np.int64)))
    return frames


def without_class(frames, label: int):
    """The frames with every box of class ``label`` (GT and detections) removed."""
    kept = []
    for pred, scores, pred_classes, gt, gt_classes in frames:
        keep_pred, keep_gt = pred_classes != label, gt_classes != label
        kept.append((pred[keep_pred], scores[keep_pred], pred_classes[keep_pred],
                     gt[keep_gt], gt_classes[keep_gt]))
    return kept


def _install_gt_range(repo: Path) -> None:
    """``opencood.data_utils.datasets`` holds GT_RANGE but imports every dataset (open3d,
    spconv, ...) on the way: a module with just GT_RANGE, its value read from that file."""
    source = (repo / "opencood" / "data_utils" / "datasets" / "__init__.py").read_text()
    value = None
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["GT_RANGE"]:
            value = ast.literal_eval(node.value)
    module = types.ModuleType("opencood.data_utils.datasets")
    module.GT_RANGE = value
    sys.modules["opencood.data_utils.datasets"] = module


def evaluate(frames):
    """V2X-Real's evaluation of ``frames`` -> (pred masks, GT masks, ap (3, 3), mean (3,))."""
    import torch
    import opencood
    import opencood.data_utils
    _install_gt_range(Path(opencood.__file__).resolve().parent.parent)
    from opencood.utils import box_utils, eval_utils
    assert tuple(opencood.data_utils.SUPER_CLASS_MAP) == CLASS_NAMES
    # inference.py's result_stat
    result_stat = {name: {t: {"tp": [], "fp": [], "gt": 0} for t in THRESHOLDS}
                   for name in opencood.data_utils.SUPER_CLASS_MAP.keys()}
    pred_masks, gt_masks = [], []
    for pred, scores, pred_classes, gt, gt_classes in frames:
        # copies: boxes_to_corners_3d reorders an hwl tensor's sizes in place
        gt_corners = box_utils.boxes_to_corners_3d(torch.from_numpy(gt.copy()), ORDER)
        gt_mask = box_utils.get_mask_for_boxes_within_range_torch(gt_corners)
        gt_box_tensor = gt_corners[gt_mask]
        gt_label_tensor = torch.from_numpy(gt_classes + 1).float()[gt_mask]
        pred_corners = box_utils.boxes_to_corners_3d(torch.from_numpy(pred.copy()), ORDER)
        pred_mask = box_utils.get_mask_for_boxes_within_range_torch(pred_corners)
        pred_box_tensor = pred_corners[pred_mask]
        # post_process's score_labels: (K, 2) [score, label]
        pred_score = torch.stack([torch.from_numpy(scores),
                                  torch.from_numpy(pred_classes + 1).float()], dim=1)[pred_mask]
        for class_id, class_name in enumerate(result_stat.keys()):       # inference.py's loop
            class_id += 1
            for iou_threshold in result_stat[class_name].keys():
                keep_index_pred = pred_score[:, -1] == class_id
                keep_index_gt = gt_label_tensor == class_id
                eval_utils.caluclate_tp_fp(pred_box_tensor[keep_index_pred, ...],
                                           pred_score[keep_index_pred, 0],
                                           gt_box_tensor[keep_index_gt, ...],
                                           result_stat[class_name], iou_threshold)
        pred_masks.append(pred_mask.numpy())
        gt_masks.append(gt_mask.numpy())
    ap, mean = final_results(eval_utils, result_stat)
    return np.concatenate(pred_masks), np.concatenate(gt_masks), ap, mean


def final_results(eval_utils, result_stat):
    """``eval_final_results`` -> (ap (classes, thresholds) from its eval.yaml, the mean its
    loop forms), checked against the 3-decimal mean it prints."""
    import yaml
    with tempfile.TemporaryDirectory() as folder:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            eval_utils.eval_final_results(result_stat, folder)
        dump = yaml.safe_load((Path(folder) / "eval.yaml").read_text())
    ap = np.array([[dump[name][t]["ap"] for t in THRESHOLDS] for name in result_stat])
    mean = []
    for t in THRESHOLDS:                    # eval_final_results' mAP loop
        total = 0
        for name in result_stat:
            total += dump[name][t]["ap"]
        mean.append(total / len(result_stat))
        assert f"mAP@{t} is {mean[-1]:.3f}" in printed.getvalue(), printed.getvalue()
    return ap, np.array(mean)


def save(path: Path, frames, pred_kept, gt_kept, results, results_no_truck) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    column = {name: np.concatenate([f[i] for f in frames]) for i, name in
              enumerate(("pred_boxes", "pred_scores", "pred_classes", "gt_boxes", "gt_classes"))}
    np.savez_compressed(
        path, frame_start=np.concatenate([[0], np.cumsum([len(f[0]) for f in frames])]),
        gt_start=np.concatenate([[0], np.cumsum([len(f[3]) for f in frames])]),
        **column, pred_kept=pred_kept, gt_kept=gt_kept, ap=results[0], mean_ap=results[1],
        ap_no_truck=results_no_truck[0], mean_ap_no_truck=results_no_truck[1],
        class_names=np.array(CLASS_NAMES), thresholds=np.array(THRESHOLDS))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: v2xreal_eval.py OUT.npz (V2X-Real first on PYTHONPATH)", file=sys.stderr)
        return 2
    frames = make_frames()
    pred_kept, gt_kept, ap, mean = evaluate(frames)
    _, _, ap_no_truck, mean_no_truck = evaluate(without_class(frames, 2))
    save(Path(args[0]), frames, pred_kept, gt_kept, (ap, mean), (ap_no_truck, mean_no_truck))
    print(f"wrote {args[0]}\nAP (rows {', '.join(CLASS_NAMES)}; columns AP@{THRESHOLDS}):\n{ap}"
          f"\nmean {mean}\nwithout trucks: AP\n{ap_no_truck}\nmean {mean_no_truck}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
