"""Average precision in BEV, the way OPV2V reports it (docs/DESIGN.md §7).

* Per frame, detections are matched greedily in descending score order: each takes the still
  unmatched GT box with the highest rotated BEV IoU if that IoU is >= the threshold (TP), else it
  is a false positive. Matching is done independently for every IoU threshold.
* Over the whole split, detections are sorted globally by score (never per frame); precision and
  recall follow, and AP is the VOC all-point interpolated area (:func:`voc_ap`).
* A split with no GT at all has AP 0.0 by definition (recall is undefined; reporting 0 keeps the
  table numeric and never flatters a model).
* Several classes (``class_names`` of two or more): a detection matches only GT of its own
  class; each class gets its AP from its own detections and GT, and the headline AP is the class
  mean (:meth:`APAccumulator.compute`).

The accumulator's state is plain per-frame records (scores, distances, matched GT indices), so
per-rank accumulators can be gathered (``state_dict`` -> ``all_gather_object``) and merged.
Frames are matched in batches: one IoU call covers the detection-GT pairs of many frames.
"""
from __future__ import annotations

import numpy as np
import torch

from opencood.eval.report import mean_of_known
from opencood.ops.iou import boxes_bev_iou_pairs
from opencood.ops.transforms import (boxes_to_bev_corners, boxes_to_corners_3d,
                                     corners_in_range_mask)


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


def group_ap(is_tp: np.ndarray, num_gt: int) -> float | None:
    """AP of a subgroup of the GT (a distance bin, a visibility group): None when the group has
    no GT, where AP is undefined (printed "–", null in yaml) rather than a misleading 0."""
    return None if num_gt == 0 else ap_from_sorted_tp(is_tp, num_gt)


def greedy_match(iou: np.ndarray, scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """Match one frame's detections to its GT, for every threshold at once.

    iou (K, G), scores (K,), thresholds (T,) -> (T, K) int64 index of the matched GT, -1 for a
    false positive. Detections are visited by descending score (ties: lower index first); each
    takes the free GT with the highest IoU (ties: lower GT index) if that IoU >= the threshold.
    """
    matched = np.full((thresholds.shape[0], iou.shape[0]), -1, dtype=np.int64)
    # Only pairs above the lowest threshold can ever match: usually a handful per frame, so the
    # sequential greedy walk runs over short Python lists instead of numpy rows.
    det_ids, gt_ids = np.nonzero(iou >= thresholds.min())
    values = iou[det_ids, gt_ids]
    by_det_then_iou = np.lexsort((gt_ids, -values, det_ids))
    options: dict[int, list] = {}
    for det, gt, value in zip(det_ids[by_det_then_iou].tolist(), gt_ids[by_det_then_iou].tolist(),
                              values[by_det_then_iou].tolist()):
        options.setdefault(det, []).append((gt, value))
    taken = [set() for _ in range(thresholds.shape[0])]
    for det in np.argsort(-scores, kind="stable").tolist():
        for level, threshold in enumerate(thresholds.tolist()):
            for gt, value in options.get(det, ()):
                if value < threshold:
                    break                       # sorted by IoU: nothing free is high enough
                if gt not in taken[level]:
                    matched[level, det] = gt
                    taken[level].add(gt)
                    break
    return matched


def frame_iou_tables(pred_per_frame: list, gt_per_frame: list, order: str = "hwl") -> list:
    """IoU tables of many frames in one batched call.

    pred_per_frame[f] (K_f, 7), gt_per_frame[f] (G_f, 7) float64 numpy -> list of (K_f, G_f).
    Only detection-GT pairs of the same frame are listed; the IoU op skips the (many) pairs whose
    bounding circles do not meet, so the cost is per overlapping pair, not per frame.
    """
    det_counts = np.array([p.shape[0] for p in pred_per_frame], dtype=np.int64)
    gt_counts = np.array([g.shape[0] for g in gt_per_frame], dtype=np.int64)
    gt_count_of_det = np.repeat(gt_counts, det_counts)                        # (D,)
    first_gt_of_det = np.repeat(np.cumsum(gt_counts) - gt_counts, det_counts)
    first_pair_of_det = np.cumsum(gt_count_of_det) - gt_count_of_det
    num_pairs = int(gt_count_of_det.sum())
    # Pair p of detection d is GT (first_gt_of_det[d] + p - first_pair_of_det[d]): row-major
    # (K_f, G_f) blocks, frame after frame.
    det_of_pair = np.repeat(np.arange(det_counts.sum()), gt_count_of_det)
    gt_of_pair = np.arange(num_pairs) + np.repeat(first_gt_of_det - first_pair_of_det,
                                                  gt_count_of_det)
    flat_iou = boxes_bev_iou_pairs(np.concatenate(pred_per_frame + [np.zeros((0, 7))]),
                                   np.concatenate(gt_per_frame + [np.zeros((0, 7))]),
                                   det_of_pair, gt_of_pair, order)
    block_ends = np.cumsum(det_counts * gt_counts)
    blocks = np.split(flat_iou, block_ends[:-1])
    return [block.reshape(k, g) for block, k, g in zip(blocks, det_counts, gt_counts)]


def _as_boxes(boxes, name: str) -> np.ndarray:
    """(K, 7) float64 numpy copy; an empty input of any shape becomes (0, 7)."""
    boxes = torch.as_tensor(boxes).detach()
    if boxes.numel() == 0:
        return np.zeros((0, 7))
    if boxes.ndim != 2 or boxes.shape[1] != 7:
        raise ValueError(f"{name} must be (K, 7); got {tuple(boxes.shape)}")
    return boxes.to("cpu", torch.float64).numpy().copy()


def _sorted_keys(keys: list) -> list:
    """Deterministic order of sample keys, also for mixed key types."""
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=lambda key: (type(key).__name__, repr(key)))


def _concat(arrays: list) -> np.ndarray:
    """np.concatenate that also accepts an empty list (-> float64 (0,))."""
    return np.concatenate(arrays + [np.zeros(0)])


def _ego_points_or_unknown(gt_ego_points, num_gt: int) -> np.ndarray:
    """(G,) int64 ego point counts; -1 (unknown) for every GT when ``gt_ego_points`` is None."""
    if gt_ego_points is None:
        return np.full(num_gt, -1, dtype=np.int64)
    counts = np.asarray(torch.as_tensor(gt_ego_points).cpu(), dtype=np.int64).reshape(-1)
    if counts.shape[0] != num_gt:
        raise ValueError(f"{num_gt} GT boxes but {counts.shape[0]} gt_ego_points")
    return counts


DETECTION_SORTS = ("global", "per_frame")


def boxes_inside_bev_range(boxes: np.ndarray, box_range, order: str) -> np.ndarray:
    """boxes (K, 7) -> (K,) bool: every BEV corner within [x0, y0, _, x1, y1, _] (edges in)."""
    if boxes.shape[0] == 0:
        return np.zeros(0, dtype=bool)
    corners = boxes_to_bev_corners(boxes, order)                            # (K, 4, 2)
    low, high = np.asarray(box_range[:2]), np.asarray(box_range[3:5])
    return ((corners >= low) & (corners <= high)).all(axis=(1, 2))


def _key_name(threshold: float) -> str:
    return f"ap_{int(round(threshold * 100))}"


def _class_ids(classes, count: int, num_classes: int, name: str) -> np.ndarray:
    """(count,) int64 class ids in [0, num_classes); None: every box of class 0 (one class)."""
    if classes is None:
        if num_classes > 1:
            raise ValueError(f"{name} needed: the accumulator scores {num_classes} classes")
        return np.zeros(count, dtype=np.int64)
    ids = torch.as_tensor(classes).detach().reshape(-1).cpu()
    if ids.is_floating_point() and not bool((ids == ids.round()).all()):
        raise ValueError(f"{name} must be whole class ids; got {ids.tolist()[:5]}")
    ids = ids.to(torch.int64).numpy().copy()
    if ids.shape[0] != count:
        raise ValueError(f"{count} boxes but {ids.shape[0]} {name}")
    if ids.shape[0] and (ids.min() < 0 or ids.max() >= num_classes):
        raise ValueError(f"{name} must lie in [0, {num_classes}); got {ids.min()}..{ids.max()}")
    return ids


class APAccumulator:
    """Collects per-frame matches and computes overall and per-distance AP.

    Per-distance rule (bins are half-open ``[low, high)`` of the ego distance sqrt(x^2 + y^2)):
    a bin counts only the GT whose centre lies in it; a TP belongs to the bin of the GT it matched
    (so a good detection of a far car is judged with the far cars), an FP to the bin of its own
    centre. Matching itself is done once against all GT of the frame, so a bin never turns a TP
    into an FP. GT beyond the last bin count only in the overall AP.

    Visibility rule (when every frame was added with ``gt_ego_points``, the ego's own LiDAR
    points inside each GT box): GT with fewer than ``visible_min_points`` are "ego-occluded",
    the others "ego-visible" — the objects only cooperation can reveal, and the rest. A group's
    AP counts its GT; a detection matched to a GT of the other group is ignored (neither TP nor
    FP, as KITTI treats "don't care" objects); an unmatched detection is an FP in both groups.

    Detection order (``detection_sort``): "global" sorts every detection of the split by score
    (VOC, CoAlign/HEAL); "per_frame" sorts within each frame and concatenates the frames in
    sample-key order (OpenCOOD / the OPV2V paper). ``detection_range`` [x0, y0, z0, x1, y1, z1]
    drops, before matching, detections with a BEV corner outside it (those code bases filter
    predictions to their GT range); None keeps every detection; ``detection_range_z`` also drops
    those with a corner outside its z range (HEAL's filter). ``gt_range`` does the same to
    the GT (V2V4Real's evaluation: its data sets keep boxes with 2 corners in range, its
    evaluation only those with all 8); None keeps the GT the data set gave.

    Classes (``class_names``, a list of names; ``add_frame``'s ``pred_classes`` / ``gt_classes``
    are 0-based indices into it): a detection matches only GT of its class. With two or more
    classes ``compute`` scores each class alone and reports the class mean (below); None or one
    name: the single-class result, unchanged. ``empty_class_ap`` is the AP of a class without GT:
    None (undefined, left out of the mean), or 0.0 counted in it (V2X-Real's evaluation).

    Ordering: detections with equal scores are ordered by (sample key, index in the frame), so
    the result does not depend on the order frames were added. Frames added without a
    ``sample_key`` come after keyed ones in insertion order (only ties among them can then
    depend on the order). Keys must be unique; ``merge`` refuses duplicates, which would count a
    sample twice.
    """

    def __init__(self, iou_thresholds=(0.3, 0.5, 0.7), distance_bins=((0, 30), (30, 50), (50, 100)),
                 order: str = "hwl", match_batch_frames: int = 256, visible_min_points: int = 1,
                 detection_sort: str = "global", detection_range=None, gt_range=None,
                 detection_range_z: bool = False, class_names=None,
                 empty_class_ap: float | None = None):
        if detection_sort not in DETECTION_SORTS:
            raise ValueError(f"detection_sort {detection_sort!r}: expected one of "
                             f"{', '.join(DETECTION_SORTS)}")
        self.detection_sort = detection_sort
        self.detection_range = None if detection_range is None else [
            float(v) for v in detection_range]
        self.gt_range = None if gt_range is None else [float(v) for v in gt_range]
        self.detection_range_z = bool(detection_range_z)
        self.class_names = None if class_names is None else [str(n) for n in class_names]
        self.empty_class_ap = None if empty_class_ap is None else float(empty_class_ap)
        self.visible_min_points = int(visible_min_points)
        self.iou_thresholds = tuple(float(t) for t in iou_thresholds)
        self.distance_bins = tuple((float(low), float(high)) for low, high in distance_bins)
        self.order = order
        self.match_batch_frames = match_batch_frames
        self._frames: list[dict] = []       # matched records, plain data
        self._pending: list[dict] = []      # frames added but not matched yet (boxes kept)
        self._keys: set = set()

    def __len__(self) -> int:
        return len(self._frames) + len(self._pending)

    @property
    def num_classes(self) -> int:
        return 1 if self.class_names is None else len(self.class_names)

    def add_frame(self, pred_boxes, pred_scores, gt_boxes, sample_key=None,
                  gt_ego_points=None, pred_classes=None, gt_classes=None) -> None:
        """Add one frame: pred_boxes (K, 7), pred_scores (K,), gt_boxes (G, 7), in the ego frame;
        gt_ego_points (G,) ego points inside each GT box (None or negative: unknown);
        pred_classes (K,) and gt_classes (G,) 0-based class ids (None: all class 0; needed
        with two or more ``class_names``).

        Tensors (any device) or numpy; copied to CPU float64. Matching runs in batches of
        ``match_batch_frames`` frames (one IoU call for all of them: per-frame calls would be
        dominated by op overhead), and at the latest on ``compute``/``state_dict``/``merge``.
        """
        pred = _as_boxes(pred_boxes, "pred_boxes")
        gt = _as_boxes(gt_boxes, "gt_boxes")
        scores = torch.as_tensor(pred_scores).detach().reshape(-1).to("cpu", torch.float64).numpy()
        if scores.shape[0] != pred.shape[0]:
            raise ValueError(f"{pred.shape[0]} boxes but {scores.shape[0]} scores")
        ego_points = _ego_points_or_unknown(gt_ego_points, gt.shape[0])
        det_class = _class_ids(pred_classes, pred.shape[0], self.num_classes, "pred_classes")
        gt_class = _class_ids(gt_classes, gt.shape[0], self.num_classes, "gt_classes")
        if self.detection_range is not None:
            inside = boxes_inside_bev_range(pred, self.detection_range, self.order)
            if self.detection_range_z and pred.shape[0]:
                inside &= corners_in_range_mask(boxes_to_corners_3d(pred, self.order),
                                                self.detection_range, min_corners=8)
            pred, scores, det_class = pred[inside], scores[inside], det_class[inside]
        if self.gt_range is not None:
            inside = boxes_inside_bev_range(gt, self.gt_range, self.order)
            gt, ego_points, gt_class = gt[inside], ego_points[inside], gt_class[inside]
        self._register_key(sample_key)
        self._pending.append({"key": sample_key, "pred_boxes": pred, "scores": scores.copy(),
                              "gt_boxes": gt, "gt_ego_points": ego_points,
                              "det_class": det_class, "gt_class": gt_class})
        if len(self._pending) >= self.match_batch_frames:
            self._match_pending()

    def _match_pending(self) -> None:
        """Turn pending frames into matched records (their boxes are dropped)."""
        if not self._pending:
            return
        tables = frame_iou_tables([f["pred_boxes"] for f in self._pending],
                                  [f["gt_boxes"] for f in self._pending], self.order)
        thresholds = np.asarray(self.iou_thresholds)
        for frame, iou in zip(self._pending, tables):
            pred_xy, gt_xy = frame["pred_boxes"][:, :2], frame["gt_boxes"][:, :2]
            # -1 is below every threshold: a detection never matches GT of another class
            iou = np.where(frame["det_class"][:, None] == frame["gt_class"][None, :], iou, -1.0)
            self._frames.append({
                "key": frame["key"],
                "scores": frame["scores"],
                "det_distance": np.hypot(pred_xy[:, 0], pred_xy[:, 1]),
                "gt_distance": np.hypot(gt_xy[:, 0], gt_xy[:, 1]),
                "gt_ego_points": frame["gt_ego_points"],
                "matched_gt": greedy_match(iou, frame["scores"], thresholds),
                "det_class": frame["det_class"], "gt_class": frame["gt_class"],
            })
        self._pending = []

    def _register_key(self, key) -> None:
        if key is None:
            return
        if key in self._keys:
            raise ValueError(f"sample {key!r} was already added; each sample counts once")
        self._keys.add(key)

    # ---- plain-data state, for gathering across ranks ------------------------------------------
    def state_dict(self) -> dict:
        """Plain lists/floats/ints only: safe to pickle, gather, or dump as JSON (if keys are)."""
        self._match_pending()
        frames = [{"key": f["key"], "scores": f["scores"].tolist(),
                   "det_distance": f["det_distance"].tolist(),
                   "gt_distance": f["gt_distance"].tolist(),
                   "gt_ego_points": f["gt_ego_points"].tolist(),
                   "matched_gt": f["matched_gt"].tolist()} for f in self._frames]
        if self.class_names is not None:        # single-class states keep their old layout
            for plain_frame, frame in zip(frames, self._frames):
                plain_frame["det_class"] = frame["det_class"].tolist()
                plain_frame["gt_class"] = frame["gt_class"].tolist()
        state = {"iou_thresholds": list(self.iou_thresholds),
                "distance_bins": [list(b) for b in self.distance_bins],
                "visible_min_points": self.visible_min_points,
                "order": self.order, "detection_sort": self.detection_sort,
                "detection_range": self.detection_range, "gt_range": self.gt_range,
                "detection_range_z": self.detection_range_z}
        if self.class_names is not None:
            state.update(class_names=self.class_names, empty_class_ap=self.empty_class_ap)
        return {**state, "frames": frames}

    @classmethod
    def from_state_dict(cls, state: dict) -> "APAccumulator":
        accumulator = cls(state["iou_thresholds"], state["distance_bins"],
                          state.get("order", "hwl"),
                          visible_min_points=state.get("visible_min_points", 1),
                          detection_sort=state.get("detection_sort", "global"),
                          detection_range=state.get("detection_range"),
                          gt_range=state.get("gt_range"),
                          detection_range_z=state.get("detection_range_z", False),
                          class_names=state.get("class_names"),
                          empty_class_ap=state.get("empty_class_ap"))
        accumulator._merge_frames(state["frames"])
        return accumulator

    def merge(self, other) -> "APAccumulator":
        """Add the frames of another accumulator (or its ``state_dict``) to this one, in place."""
        self._match_pending()           # keeps insertion order for frames without a key
        state = other.state_dict() if isinstance(other, APAccumulator) else other
        same_thresholds = tuple(float(t) for t in state["iou_thresholds"]) == self.iou_thresholds
        bins = tuple((float(low), float(high)) for low, high in state["distance_bins"])
        same_bins = bins == self.distance_bins
        same_visibility = int(state.get("visible_min_points", 1)) == self.visible_min_points
        same_protocol = (state.get("detection_sort", "global") == self.detection_sort
                         and state.get("detection_range") == self.detection_range
                         and state.get("gt_range") == self.gt_range
                         and state.get("detection_range_z", False) == self.detection_range_z
                         and state.get("empty_class_ap") == self.empty_class_ap)
        same_classes = state.get("class_names") == self.class_names
        if not (same_thresholds and same_bins and same_visibility and same_protocol
                and same_classes):
            raise ValueError("cannot merge accumulators with different thresholds or bins "
                             "(or visible_min_points, detection sort or range, GT range, "
                             "classes)")
        self._merge_frames(state["frames"])
        return self

    def _merge_frames(self, frames: list) -> None:
        num_thresholds = len(self.iou_thresholds)
        for frame in frames:
            # A JSON round trip turns tuple keys such as (scenario, timestamp) into lists.
            key = tuple(frame["key"]) if isinstance(frame["key"], list) else frame["key"]
            self._register_key(key)
            num_det, num_gt = len(frame["scores"]), len(frame["gt_distance"])
            self._frames.append({
                "key": key,
                "scores": np.asarray(frame["scores"], dtype=np.float64),
                "det_distance": np.asarray(frame["det_distance"], dtype=np.float64),
                "gt_distance": np.asarray(frame["gt_distance"], dtype=np.float64),
                "gt_ego_points": _ego_points_or_unknown(frame.get("gt_ego_points"),
                                                        len(frame["gt_distance"])),
                "matched_gt": np.asarray(frame["matched_gt"], dtype=np.int64).reshape(
                    num_thresholds, -1),
                "det_class": np.asarray(frame.get("det_class", np.zeros(num_det)), np.int64),
                "gt_class": np.asarray(frame.get("gt_class", np.zeros(num_gt)), np.int64),
            })

    # ---- AP ------------------------------------------------------------------------------------
    def _frames_in_tie_order(self) -> list:
        keyed = {f["key"]: f for f in self._frames if f["key"] is not None}
        unkeyed = [f for f in self._frames if f["key"] is None]
        return [keyed[k] for k in _sorted_keys(list(keyed))] + unkeyed

    def _flatten(self) -> dict:
        """All detections of the split in the protocol's order (``detection_sort``).

        -> is_tp (T, D) bool, matched (T, D) split-wide GT index (-1 for an FP) and bin_distance
        (T, D) in that order; gt_distance (G,) and gt_ego_points (G,) over the split's GT.
        Global order: descending score, then frame rank (sorted sample key), then index in the
        frame. Per-frame order: frame rank, then descending score, then index in the frame.
        """
        frames = self._frames_in_tie_order()
        scores = _concat([f["scores"] for f in frames])
        frame_rank = _concat([np.full(f["scores"].shape[0], r) for r, f in enumerate(frames)])
        det_index = _concat([np.arange(f["scores"].shape[0]) for f in frames])
        det_distance = _concat([f["det_distance"] for f in frames])
        gt_distance = _concat([f["gt_distance"] for f in frames])
        det_class = _concat([f["det_class"] for f in frames]).astype(np.int64)
        gt_class = _concat([f["gt_class"] for f in frames]).astype(np.int64)
        if self.detection_sort == "global":
            order = np.lexsort((det_index, frame_rank, -scores))
        else:
            order = np.lexsort((det_index, -scores, frame_rank))
        matched = self._split_wide_matches(frames)[:, order]                   # (T, D)
        # The distance that places a detection in a bin: its GT's if a TP, its own if an FP.
        # The appended 0 is what index -1 (an FP) reads, so the lookup also works with no GT.
        matched_gt_distance = np.append(gt_distance, 0.0)[matched]
        bin_distance = np.where(matched >= 0, matched_gt_distance, det_distance[order][None, :])
        gt_ego_points = np.concatenate([f["gt_ego_points"] for f in frames]
                                       + [np.zeros(0, dtype=np.int64)])
        return {"is_tp": matched >= 0, "matched": matched, "bin_distance": bin_distance,
                "gt_distance": gt_distance, "gt_ego_points": gt_ego_points,
                "det_class": det_class[order], "gt_class": gt_class}

    def _split_wide_matches(self, frames: list) -> np.ndarray:
        """Per-frame matched GT indices -> (T, D) indices into the split's GT list, -1 for FP."""
        gt_offsets = np.cumsum([0] + [f["gt_distance"].shape[0] for f in frames])
        shifted = [np.where(f["matched_gt"] >= 0, f["matched_gt"] + offset, -1)
                   for f, offset in zip(frames, gt_offsets)]
        empty = np.zeros((len(self.iou_thresholds), 0), dtype=np.int64)
        return np.concatenate(shifted + [empty], axis=1).astype(np.int64)

    def compute(self) -> dict:
        """-> {"ap_30": float, ..., "num_gt", "num_det", "num_frames",
        "distance": {"0-30": {"ap_30": float or None (no GT in the bin), ..., "num_gt": int}, ...},
        "visibility": {"ego-visible": {...}, "ego-occluded": {...}} (only when every GT's ego
        point count is known)}.

        Two or more classes: every AP above is the mean over the classes of that class's AP
        (classes without an AP left out; the headline AP, with none, 0.0) and ``num_gt`` the
        sum; added are "per_class": {name: {"ap_30", ..., "num_gt", "num_det"}} (a class
        without GT: ``empty_class_ap``) and "class_mean": {"ap_30", ..., "classes": the names
        averaged}.
        """
        self._match_pending()
        flat = self._flatten()
        if self.num_classes < 2:
            every_det = np.ones(flat["is_tp"].shape[1], dtype=bool)
            every_gt = np.ones(flat["gt_distance"].shape[0], dtype=bool)
            summary = self._summary(flat, every_det, every_gt, empty_ap=0.0)
        else:
            summary = self._class_mean_summary(flat)
        result = {key: summary.pop(key) for key in self._ap_keys()}
        result["num_gt"] = int(flat["gt_distance"].shape[0])
        result["num_det"] = int(flat["is_tp"].shape[1])
        result["num_frames"] = len(self._frames)
        result.update(summary)
        return result

    def _ap_keys(self) -> list:
        return [_key_name(threshold) for threshold in self.iou_thresholds]

    def _summary(self, flat: dict, det_kept: np.ndarray, gt_kept: np.ndarray,
                 empty_ap: float | None) -> dict:
        """AP over the detections ``det_kept`` (D,) and GT ``gt_kept`` (G,) of ``flat`` (one
        class, or all): {"ap_30", ..., "distance", "visibility" (when known)}; ``empty_ap`` is
        the overall AP when no GT is kept."""
        is_tp = flat["is_tp"][:, det_kept]
        num_gt = int(gt_kept.sum())
        summary = {}
        for t, key in enumerate(self._ap_keys()):
            summary[key] = empty_ap if num_gt == 0 else ap_from_sorted_tp(is_tp[t], num_gt)
        summary["distance"] = {}
        for low, high in self.distance_bins:
            gt_in_bin = gt_kept & (flat["gt_distance"] >= low) & (flat["gt_distance"] < high)
            row = {}
            for t, key in enumerate(self._ap_keys()):
                bin_distance = flat["bin_distance"][t][det_kept]
                det_in_bin = (bin_distance >= low) & (bin_distance < high)
                row[key] = group_ap(is_tp[t][det_in_bin], int(gt_in_bin.sum()))
            row["num_gt"] = int(gt_in_bin.sum())
            summary["distance"][f"{low:g}-{high:g}"] = row
        visibility = self._visibility_rows(flat, det_kept, gt_kept)
        if visibility is not None:
            summary["visibility"] = visibility
        return summary

    def _class_mean_summary(self, flat: dict) -> dict:
        """Every class scored alone (``_summary``), then each AP averaged over the classes."""
        per_class, summaries = {}, []
        for class_id, name in enumerate(self.class_names):
            det_kept, gt_kept = flat["det_class"] == class_id, flat["gt_class"] == class_id
            summary = self._summary(flat, det_kept, gt_kept, empty_ap=self.empty_class_ap)
            summaries.append(summary)
            per_class[name] = {**{key: summary[key] for key in self._ap_keys()},
                               "num_gt": int(gt_kept.sum()), "num_det": int(det_kept.sum())}
        result = {}
        for key in self._ap_keys():
            mean = mean_of_known([summary[key] for summary in summaries])
            result[key] = 0.0 if mean is None else mean
        result["distance"] = {name: self._mean_row([s["distance"][name] for s in summaries])
                              for name in summaries[0]["distance"]}
        if all("visibility" in summary for summary in summaries):
            result["visibility"] = {
                group: self._mean_row([s["visibility"][group] for s in summaries])
                for group in summaries[0]["visibility"]}
        result["per_class"] = per_class
        result["class_mean"] = {**{key: result[key] for key in self._ap_keys()},
                                "classes": list(self.class_names)}
        return result

    def _mean_row(self, rows: list) -> dict:
        """One breakdown row (a distance bin, a visibility group) of every class -> the mean AP
        of the classes with GT in it, and their GT count."""
        mean = {key: mean_of_known([row[key] for row in rows]) for key in self._ap_keys()}
        return {**mean, "num_gt": sum(row["num_gt"] for row in rows)}

    def _visibility_rows(self, flat: dict, det_kept: np.ndarray,
                         gt_kept: np.ndarray) -> dict | None:
        """AP of ego-visible and ego-occluded GT (class docstring), None if counts are unknown."""
        ego_points = flat["gt_ego_points"]
        if ego_points.shape[0] == 0 or (ego_points < 0).any():
            return None
        occluded = ego_points < self.visible_min_points
        rows = {}
        for name, in_group in (("ego-visible", ~occluded), ("ego-occluded", occluded)):
            in_group = in_group & gt_kept
            # Index -1 (an FP) reads the appended False: FPs are never "in the other group".
            other_group = np.append(~in_group, False)[flat["matched"]]            # (T, D)
            row = {}
            for t, key in enumerate(self._ap_keys()):
                counted = ~other_group[t] & det_kept
                row[key] = group_ap(flat["is_tp"][t][counted], int(in_group.sum()))
            row["num_gt"] = int(in_group.sum())
            rows[name] = row
        return rows
