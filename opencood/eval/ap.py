"""Average precision in BEV, the way OPV2V reports it (DESIGN §7).

* Per frame, detections are matched greedily in descending score order: each takes the still
  unmatched GT box with the highest rotated BEV IoU if that IoU is >= the threshold (TP), else it
  is a false positive. Matching is done independently for every IoU threshold.
* Over the whole split, detections are sorted globally by score (never per frame); precision and
  recall follow, and AP is the VOC all-point interpolated area (:func:`voc_ap`).
* A split with no GT at all has AP 0.0 by definition (recall is undefined; reporting 0 keeps the
  table numeric and never flatters a model).

The accumulator keeps only plain per-frame records (scores, distances, matched GT indices), so
per-rank accumulators can be gathered (``state_dict`` -> ``all_gather_object``) and merged.
"""
from __future__ import annotations

import numpy as np
import torch

from opencood.ops.iou import boxes_bev_iou


def voc_ap(recall, precision) -> float:
    """VOC all-point interpolated AP.

    recall, precision: (D,) values at each detection of the score-sorted list. The curve is
    padded as recall [0, ..., 1] / precision [0, ..., 0], precision is made non-increasing from the
    right (its upper envelope), and the area is summed where recall changes.
    """
    recall = np.asarray(recall, dtype=np.float64).reshape(-1)
    precision = np.asarray(precision, dtype=np.float64).reshape(-1)
    padded_recall = np.concatenate([[0.0], recall, [1.0]])
    padded_precision = np.concatenate([[0.0], precision, [0.0]])
    envelope = np.maximum.accumulate(padded_precision[::-1])[::-1]
    steps = np.flatnonzero(padded_recall[1:] != padded_recall[:-1])
    return float(np.sum((padded_recall[steps + 1] - padded_recall[steps]) * envelope[steps + 1]))


def ap_from_sorted_tp(is_tp: np.ndarray, num_gt: int) -> float:
    """AP of a score-sorted (D,) bool TP list against ``num_gt`` GT boxes; 0.0 when num_gt is 0."""
    if num_gt == 0:
        return 0.0
    tp_cumulative = np.cumsum(is_tp, dtype=np.float64)
    recall = tp_cumulative / num_gt
    precision = tp_cumulative / np.arange(1, is_tp.shape[0] + 1, dtype=np.float64)
    return voc_ap(recall, precision)


def greedy_match(iou: np.ndarray, scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Match one frame's detections to its GT, for every threshold at once.

    iou (K, G), scores (K,), thresholds (T,) -> (T, K) int64 index of the matched GT, -1 for a
    false positive. Detections are visited by descending score (ties: lower index first).
    """
    num_det, num_gt = iou.shape
    matched = np.full((thresholds.shape[0], num_det), -1, dtype=np.int64)
    if num_det == 0 or num_gt == 0:
        return matched
    visit_order = np.argsort(-scores, kind="stable")
    # A detection below the lowest threshold against every GT is an FP everywhere: skip it.
    can_match = iou.max(axis=1) >= thresholds.min()
    taken = np.zeros((thresholds.shape[0], num_gt), dtype=bool)
    threshold_rows = np.arange(thresholds.shape[0])
    for det in visit_order[can_match[visit_order]]:
        free_iou = np.where(taken, -1.0, iou[det][None, :])                  # (T, G)
        best_gt = free_iou.argmax(axis=1)
        hit = free_iou[threshold_rows, best_gt] >= thresholds
        matched[hit, det] = best_gt[hit]
        taken[threshold_rows[hit], best_gt[hit]] = True
    return matched


def _as_boxes(boxes, name: str) -> torch.Tensor:
    """(K, 7) float64 tensor (device kept); an empty input of any shape becomes (0, 7)."""
    boxes = torch.as_tensor(boxes)
    if boxes.numel() == 0:
        return torch.zeros(0, 7, dtype=torch.float64, device=boxes.device)
    if boxes.ndim != 2 or boxes.shape[1] != 7:
        raise ValueError(f"{name} must be (K, 7); got {tuple(boxes.shape)}")
    return boxes.to(torch.float64)


def _sorted_keys(keys: list) -> list:
    """Deterministic order of sample keys, also for mixed key types."""
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda key: (type(key).__name__, repr(key)))


def _key_name(threshold: float) -> str:
    return f"ap_{int(round(threshold * 100))}"


class APAccumulator:
    """Collects per-frame matches and computes overall and per-distance AP.

    Per-distance rule (bins are half-open ``[low, high)`` of the ego distance sqrt(x^2 + y^2)):
    a bin counts only the GT whose centre lies in it; a TP belongs to the bin of the GT it matched
    (so a good detection of a far car is judged with the far cars), an FP to the bin of its own
    centre. Matching itself is done once against all GT of the frame, so a bin never turns a TP
    into an FP. GT beyond the last bin count only in the overall AP.

    Ordering: detections with equal scores are ordered by (sample key, index in the frame), so
    the result does not depend on the order frames were added. Frames added without a
    ``sample_key`` come after keyed ones in insertion order (only ties among them can then
    depend on the order). Keys must be unique; ``merge`` refuses duplicates, which would count a
    sample twice.
    """

    def __init__(self, iou_thresholds=(0.3, 0.5, 0.7), distance_bins=((0, 30), (30, 50), (50, 100)),
                 order: str = "hwl"):
        self.iou_thresholds = tuple(float(t) for t in iou_thresholds)
        self.distance_bins = tuple((float(low), float(high)) for low, high in distance_bins)
        self.order = order
        self._frames: list[dict] = []
        self._keys: set = set()

    def __len__(self) -> int:
        return len(self._frames)

    def add_frame(self, pred_boxes, pred_scores, gt_boxes, sample_key=None) -> None:
        """Match one frame: pred_boxes (K, 7), pred_scores (K,), gt_boxes (G, 7), in the ego frame.

        Tensors (any device) or numpy. IoU is computed on the predictions' device in float64.
        """
        pred = _as_boxes(pred_boxes, "pred_boxes")
        gt = _as_boxes(gt_boxes, "gt_boxes").to(pred.device)
        scores = torch.as_tensor(pred_scores).detach().reshape(-1).to("cpu", torch.float64).numpy()
        if scores.shape[0] != pred.shape[0]:
            raise ValueError(f"{pred.shape[0]} boxes but {scores.shape[0]} scores")
        iou = boxes_bev_iou(pred, gt, self.order).cpu().numpy()
        pred_xy, gt_xy = pred[:, :2].cpu().numpy(), gt[:, :2].cpu().numpy()
        record = {
            "key": sample_key,
            "scores": scores,
            "det_distance": np.hypot(pred_xy[:, 0], pred_xy[:, 1]),
            "gt_distance": np.hypot(gt_xy[:, 0], gt_xy[:, 1]),
            "matched_gt": greedy_match(iou, scores, np.asarray(self.iou_thresholds)),
        }
        self._append(record)

    def _append(self, record: dict) -> None:
        key = record["key"]
        if key is not None:
            if key in self._keys:
                raise ValueError(f"sample {key!r} was already added; each sample counts once")
            self._keys.add(key)
        self._frames.append(record)

    # ---- plain-data state, for gathering across ranks ------------------------------------------
    def state_dict(self) -> dict:
        """Plain lists/floats/ints only: safe to pickle, gather, or dump as JSON (if keys are)."""
        frames = [{"key": f["key"], "scores": f["scores"].tolist(),
                   "det_distance": f["det_distance"].tolist(),
                   "gt_distance": f["gt_distance"].tolist(),
                   "matched_gt": f["matched_gt"].tolist()} for f in self._frames]
        return {"iou_thresholds": list(self.iou_thresholds),
                "distance_bins": [list(b) for b in self.distance_bins],
                "order": self.order, "frames": frames}

    @classmethod
    def from_state_dict(cls, state: dict) -> "APAccumulator":
        accumulator = cls(state["iou_thresholds"], state["distance_bins"], state.get("order", "hwl"))
        accumulator._merge_frames(state["frames"])
        return accumulator

    def merge(self, other) -> "APAccumulator":
        """Add the frames of another accumulator (or its ``state_dict``) to this one, in place."""
        state = other.state_dict() if isinstance(other, APAccumulator) else other
        same_thresholds = tuple(float(t) for t in state["iou_thresholds"]) == self.iou_thresholds
        same_bins = tuple(tuple(map(float, b)) for b in state["distance_bins"]) == self.distance_bins
        if not (same_thresholds and same_bins):
            raise ValueError("cannot merge accumulators with different thresholds or bins")
        self._merge_frames(state["frames"])
        return self

    def _merge_frames(self, frames: list) -> None:
        num_thresholds = len(self.iou_thresholds)
        for frame in frames:
            self._append({
                "key": frame["key"],
                "scores": np.asarray(frame["scores"], dtype=np.float64),
                "det_distance": np.asarray(frame["det_distance"], dtype=np.float64),
                "gt_distance": np.asarray(frame["gt_distance"], dtype=np.float64),
                "matched_gt": np.asarray(frame["matched_gt"], dtype=np.int64).reshape(
                    num_thresholds, -1),
            })

    # ---- AP ------------------------------------------------------------------------------------
    def _frames_in_tie_order(self) -> list:
        keyed = {f["key"]: f for f in self._frames if f["key"] is not None}
        unkeyed = [f for f in self._frames if f["key"] is None]
        return [keyed[k] for k in _sorted_keys(list(keyed))] + unkeyed

    def _flatten(self) -> dict:
        """All detections of the split, sorted globally by (-score, frame rank, index)."""
        frames = self._frames_in_tie_order()
        num_thresholds = len(self.iou_thresholds)
        gt_offsets = np.cumsum([0] + [f["gt_distance"].shape[0] for f in frames])
        empty = np.zeros(0)
        scores = np.concatenate([f["scores"] for f in frames] + [empty])
        frame_rank = np.concatenate([np.full(f["scores"].shape[0], r) for r, f in enumerate(frames)]
                                    + [empty])
        det_index = np.concatenate([np.arange(f["scores"].shape[0]) for f in frames] + [empty])
        det_distance = np.concatenate([f["det_distance"] for f in frames] + [empty])
        gt_distance = np.concatenate([f["gt_distance"] for f in frames] + [empty])
        # Matched GT as an index into the split-wide GT list (-1 stays -1).
        matched = np.concatenate(
            [np.where(f["matched_gt"] >= 0, f["matched_gt"] + offset, -1)
             for f, offset in zip(frames, gt_offsets)] + [np.zeros((num_thresholds, 0))], axis=1
        ).astype(np.int64)
        order = np.lexsort((det_index, frame_rank, -scores))
        matched = matched[:, order]
        # The distance that places a detection in a bin: its GT's if a TP, its own if an FP.
        # The appended 0 is what index -1 (an FP) reads, so the lookup also works with no GT.
        matched_gt_distance = np.append(gt_distance, 0.0)[matched]
        bin_distance = np.where(matched >= 0, matched_gt_distance, det_distance[order][None, :])
        return {"is_tp": matched >= 0, "bin_distance": bin_distance, "gt_distance": gt_distance}

    def compute(self) -> dict:
        """-> {"ap_30": float, ..., "num_gt", "num_det", "num_frames",
        "distance": {"0-30": {"ap_30": float, ..., "num_gt": int}, ...}}."""
        flat = self._flatten()
        result = {}
        for t, threshold in enumerate(self.iou_thresholds):
            result[_key_name(threshold)] = ap_from_sorted_tp(flat["is_tp"][t],
                                                             flat["gt_distance"].shape[0])
        result["num_gt"] = int(flat["gt_distance"].shape[0])
        result["num_det"] = int(flat["is_tp"].shape[1])
        result["num_frames"] = len(self._frames)
        result["distance"] = {}
        for low, high in self.distance_bins:
            gt_in_bin = (flat["gt_distance"] >= low) & (flat["gt_distance"] < high)
            row = {}
            for t, threshold in enumerate(self.iou_thresholds):
                det_in_bin = (flat["bin_distance"][t] >= low) & (flat["bin_distance"][t] < high)
                row[_key_name(threshold)] = ap_from_sorted_tp(flat["is_tp"][t][det_in_bin],
                                                              int(gt_in_bin.sum()))
            row["num_gt"] = int(gt_in_bin.sum())
            result["distance"][f"{low:g}-{high:g}"] = row
        return result
