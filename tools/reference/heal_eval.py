#!/usr/bin/env python
"""HEAL's own DAIR-V2X-C evaluation run on made-up frames: the fixture tests/test_protocols.py
compares ``--protocol heal_dairv2x`` with (tests/fixtures/reference_eval/heal_eval.npz).

Runs in the side environment of tools/reference/compare_readers.py (its docstring makes it),
with the HEAL checkout first on PYTHONPATH, from outside our checkout. Exact command of the
committed fixture (HEAL at 96812ed5a41619bebb2af4f84b803b7b7468d1d3)::

    cd /work/side && env PYTHONPATH=/work/side/HEAL /work/side/venv-ref/bin/python \\
        <repo>/tools/reference/heal_eval.py <repo>/tests/fixtures/reference_eval/heal_eval.npz

The frames: tools/reference/v2v4real_eval.py's generator (seed ``SEED``) over +-112 x +-112 m
with centres' z in [-3.2, 1.0], so boxes lie across every edge of HEAL's inference range
[-102.4, -102.4, -3.5, 102.4, 102.4, 1.5] (``tools/inference.py``'s default ``--range`` on a
DAIR ``heter`` yaml, z from the yaml), some only by their z.

What runs is HEAL's code as its inference calls it: corners by ``box_utils.boxes_to_corners_3d``,
the prediction filter of ``VoxelPostprocessor.post_process`` (``mask_boxes_outside_range_numpy``
on the corners: all 8 in the range, z included), the GT filter of ``generate_gt_bbx_by_iou``
(``get_mask_for_boxes_within_range_torch``: 8 corners, x and y), then
``eval_utils.caluclate_tp_fp`` per frame at 0.3, 0.5 and 0.7 and ``eval_utils.calculate_ap``
(global score sort). Saved as v2v4real_eval.py saves, with ``ap_30`` too.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import v2v4real_eval  # noqa: E402  (the frame generator and the fixture layout)

SEED = 42
ORDER = "hwl"
HEAL_RANGE = [-102.4, -102.4, -3.5, 102.4, 102.4, 1.5]
THRESHOLDS = (0.3, 0.5, 0.7)


def evaluate(frames):
    """HEAL's evaluation of ``frames`` -> (pred masks, GT masks, {threshold: AP})."""
    import torch
    # numpy 2 removed the alias np.Inf that HEAL's modules still spell somewhere on import
    np.Inf = np.inf
    from opencood.utils import box_utils, eval_utils
    result_stat = {t: {"tp": [], "fp": [], "gt": 0, "score": []} for t in THRESHOLDS}
    pred_masks, gt_masks = [], []
    for pred, scores, gt, no_detections in frames:
        # copies: boxes_to_corners_3d reorders an hwl tensor's sizes in place
        gt_corners = box_utils.boxes_to_corners_3d(torch.from_numpy(gt.copy()), ORDER)
        gt_mask = box_utils.get_mask_for_boxes_within_range_torch(gt_corners, HEAL_RANGE)
        gt_corners = gt_corners[gt_mask]
        pred_box, pred_score = None, None
        if not no_detections:
            corners = box_utils.boxes_to_corners_3d(torch.from_numpy(pred.copy()), ORDER)
            kept, mask = box_utils.mask_boxes_outside_range_numpy(
                corners.numpy(), HEAL_RANGE, order=None, return_mask=True)
            pred_box = torch.from_numpy(kept)
            pred_score = torch.from_numpy(scores)[torch.from_numpy(mask)]
            pred_masks.append(np.asarray(mask))
        for threshold in THRESHOLDS:
            eval_utils.caluclate_tp_fp(pred_box, pred_score, gt_corners, result_stat, threshold)
        gt_masks.append(gt_mask.numpy())
    aps = {t: eval_utils.calculate_ap(result_stat, t)[0] for t in THRESHOLDS}
    return pred_masks, gt_masks, aps


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: heal_eval.py OUT.npz (HEAL first on PYTHONPATH)", file=sys.stderr)
        return 2
    frames = v2v4real_eval.make_frames(SEED, half_x=112.0, half_y=112.0, z_span=(-3.2, 1.0))
    pred_masks, gt_masks, aps = evaluate(frames)
    v2v4real_eval.save(Path(args[0]), frames, pred_masks, gt_masks, aps[0.5], aps[0.7])
    data = dict(np.load(args[0]))
    np.savez_compressed(args[0], **data, ap_30=np.float64(aps[0.3]))
    print(f"wrote {args[0]}: " + ", ".join(f"ap_{int(t * 100)} {ap:.6f}" for t, ap in aps.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
