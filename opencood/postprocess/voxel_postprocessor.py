"""OpenCOOD's ``VoxelPostprocessor``: the anchor-based detection contract in one object.

It owns the anchors, the box coder (box order, direction bins), target assignment, decoding of
the head outputs (:mod:`opencood.postprocess.layout`), rotated NMS and the late-fusion merge, so
the data pipeline, the evaluation and the benchmarks ask it instead of re-assembling them.
"""
from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from opencood.errors import ConfigError
from opencood.ops.nms import nms_rotated
from opencood.ops.transforms import boxes_to_corners_3d
from opencood.postprocess.anchors import generate_anchors
from opencood.postprocess.box_coder import ResidualBoxCoder
from opencood.postprocess.layout import BOX_CODE_SIZE, flatten_anchor_maps
from opencood.postprocess.target_assigner import (assign_class_targets, assign_targets,
                                                  standup_bev)
from opencood.registry import POSTPROCESSORS

BYTES_PER_BOX = 8 * 4  # late fusion sends 7 box numbers and a score, float32


class Detections(NamedTuple):
    """One frame's (or agent's) boxes: boxes (K, 7), scores (K,), classes (K,) int64 class ids
    (index into ``postprocess.classes``; all 0 with one class)."""
    boxes: torch.Tensor
    scores: torch.Tensor
    classes: torch.Tensor


class FrameDetections(NamedTuple):
    """A sample's detections in the ego frame after NMS (``VoxelPostprocessor.detections``):
    boxes (K, 7), scores (K,), the bytes each agent sent, classes (K,) int64."""
    boxes: torch.Tensor
    scores: torch.Tensor
    sent: float
    classes: torch.Tensor


def boxes_to_ego(boxes: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """(K, 7) boxes in an agent frame -> ego frame with a (4, 4) transform (BEV yaw rotation).

    Roll and pitch between agents are a fraction of a degree, so rotating the centre fully and
    adding the transform's heading to the yaw is what box-level (late) fusion needs. The sizes
    are copied as they are, so this holds for either box order.
    """
    transform = transform.to(boxes)
    centers = boxes[:, :3] @ transform[:3, :3].T + transform[:3, 3]
    heading = torch.atan2(transform[1, 0], transform[0, 0])
    return torch.cat([centers, boxes[:, 3:6], boxes[:, 6:7] + heading], dim=1)


# OpenCOOD's post_process (box_utils.remove_large_pred_bbx, remove_bbx_abnormal_z, nms_rotated).
REFERENCE_MAX_EXTENT = 6.0          # metres along x and along y (corner spread, ego frame)
REFERENCE_Z_RANGE = (-3.0, 1.0)     # every corner's z
REFERENCE_PRE_NMS = 1000           # its NMS candidates: what an import sets pre_nms_max to
# postprocess.filters: ours; OpenCOOD's post_process; V2X-Real's (its box filters allow 100 m
# and drop nothing, its NMS of the 1000 best is class-agnostic and keeps every survivor)
FILTERS = ("ours", "reference", "v2xreal")


def reference_plausible(boxes: torch.Tensor, order: str) -> torch.Tensor:
    """(K, 7) boxes -> (K,) bool: OpenCOOD's test-time filter, the corners' spread along x and
    along y at most 6 m and every corner's z within [-3, 1] m (its z-length test reads the y
    coordinates and only drops a box of zero width, so it is left out)."""
    corners = boxes_to_corners_3d(boxes, order)                        # (K, 8, 3)
    spread = corners[..., :2].amax(dim=1) - corners[..., :2].amin(dim=1)
    low, high = REFERENCE_Z_RANGE
    return ((spread <= REFERENCE_MAX_EXTENT).all(dim=1)
            & (corners[..., 2] >= low).all(dim=1) & (corners[..., 2] <= high).all(dim=1))


def top_indices(scores: torch.Tensor, limit: int) -> torch.Tensor:
    """Indices of the ``limit`` best of (K,) scores (all of them, in order, if K <= limit)."""
    if scores.shape[0] <= limit:
        return torch.arange(scores.shape[0], device=scores.device)
    return torch.topk(scores, limit).indices


def anchors_from_config(anchor_args: dict, bev_grid: dict, order: str, device=None,
                        classes: Optional[Sequence[dict]] = None) -> torch.Tensor:
    """Anchors (H, W, A, 7) from the resolved ``postprocess.anchor_args`` (``h``, ``w``, ``l``,
    ``z``, ``r`` yaws in degrees, ``feature_stride``) on the resolved ``bev_grid`` section
    (``range``, ``cell_size``). OpenCOOD's ``W``/``H``/``D`` and ``cav_lidar_range`` entries
    of ``anchor_args`` are not read: the grid is derived (docs/DESIGN.md §5).

    ``classes`` (``postprocess.classes``): each class's sizes and z on the shared yaws,
    class-major per cell: A = K x yaws, anchor ``k * yaws + r`` (V2X-Real's layout)."""
    grid_range = bev_grid["range"]
    # One cell over the whole height: anchors use the x and y cells only.
    cell = (*bev_grid["cell_size"], grid_range[5] - grid_range[2])
    shapes = [anchor_args] if classes is None else classes
    per_class = [generate_anchors(
        grid_range, cell, feature_stride=anchor_args["feature_stride"],
        anchor_hwl=tuple(shape[key] for key in "hwl"),
        anchor_z=shape["z"], yaws=tuple(math.radians(y) for y in anchor_args["r"]),
        order=order, device=device, placement=anchor_args["placement"]) for shape in shapes]
    return per_class[0] if classes is None else torch.cat(per_class, dim=2)


@POSTPROCESSORS.register("VoxelPostprocessor")
class VoxelPostprocessor:
    """Anchors, targets, decoding, NMS and the late-fusion merge of an anchor head.

    Args:
        anchors: (H, W, A, 7) in ``box_coder.order``, on the device the head runs on.
        box_coder: residual coding, direction bins and the box order.
        pos_iou / neg_iou: target assignment thresholds (standup BEV IoU) of one class.
        score_threshold: detections need a sigmoid score above it.
        nms_thresh: rotated BEV IoU above which NMS drops the lower-scored box.
        max_num: detections kept per frame after NMS.
        pre_nms_max: best-scored candidates that enter NMS (rotated NMS is quadratic in them),
            under either filters (OpenCOOD's number is REFERENCE_PRE_NMS).
        filters: "ours", "reference" (OpenCOOD's: implausible boxes dropped before NMS, no
            max_num cap) or "v2xreal" (V2X-Real's: no box dropped, one class-agnostic NMS, no
            max_num cap); ``postprocess.filters`` in the config schema.
        class_thresholds: multi-class: per class (pos_iou, neg_iou), K entries, the anchors
            class-major per cell (``anchors_from_config``); pos_iou / neg_iou are then unused.
            None: one class.
    """

    def __init__(self, anchors: torch.Tensor, box_coder: ResidualBoxCoder, pos_iou: float,
                 neg_iou: float, score_threshold: float, nms_thresh: float, max_num: int,
                 pre_nms_max: int, filters: str = "ours",
                 class_thresholds: Optional[Sequence[Tuple[float, float]]] = None):
        self.anchors = anchors
        self.box_coder = box_coder
        self._anchor_rects: Dict[tuple, torch.Tensor] = {}       # see anchor_rects
        self.pos_iou, self.neg_iou = float(pos_iou), float(neg_iou)
        self.class_thresholds = None if class_thresholds is None else \
            tuple((float(pos), float(neg)) for pos, neg in class_thresholds)
        if self.num_classes > 1 and anchors.shape[2] % self.num_classes:
            raise ValueError(f"{anchors.shape[2]} anchors per cell do not split into "
                             f"{self.num_classes} classes")
        self.score_threshold = float(score_threshold)
        self.nms_thresh, self.max_num = float(nms_thresh), int(max_num)
        self.pre_nms_max = int(pre_nms_max)
        if filters not in FILTERS:
            raise ValueError(f"filters must be one of {', '.join(FILTERS)}, got {filters!r}")
        self.filters = filters

    @classmethod
    def from_config(cls, cfg: dict, device) -> "VoxelPostprocessor":
        """From the resolved config's ``postprocess`` section (``anchor_args``, ``target_args``,
        ``order``, ``nms_thresh``, ``max_num``, ``pre_nms_max``; the schema checks them), the
        ``bev_grid``, and ``loss.args.dir_offset`` (where OpenCOOD keeps it)."""
        post = cfg["postprocess"]
        target_args = post["target_args"]
        classes = post["classes"]
        return cls(
            anchors=anchors_from_config(post["anchor_args"], cfg["bev_grid"], post["order"],
                                        device, classes=classes),
            # The one registered loss (point_pillar_loss) has dir_offset; OpenCOOD keeps it there.
            box_coder=ResidualBoxCoder(dir_offset=cfg["loss"]["args"]["dir_offset"],
                                       order=post["order"]),
            pos_iou=target_args["pos_threshold"], neg_iou=target_args["neg_threshold"],
            score_threshold=target_args["score_threshold"],
            nms_thresh=post["nms_thresh"], max_num=post["max_num"],
            # An untrained model firing everywhere would otherwise spend seconds per frame in
            # rotated NMS on CPU.
            pre_nms_max=post["pre_nms_max"], filters=post["filters"],
            class_thresholds=None if classes is None else [
                (entry["pos_threshold"], entry["neg_threshold"]) for entry in classes])

    @property
    def order(self) -> str:
        """Box order of GT, anchors and detections: 'hwl' or 'lwh'."""
        return self.box_coder.order

    @property
    def num_anchors_per_location(self) -> int:
        return self.anchors.shape[2]

    @property
    def num_classes(self) -> int:
        """K: class logits per anchor (1 without ``postprocess.classes``)."""
        return 1 if self.class_thresholds is None else len(self.class_thresholds)

    def targets(self, gt_boxes: torch.Tensor, gt_mask: torch.Tensor,
                gt_classes: Optional[torch.Tensor] = None) -> Dict[str, torch.Tensor]:
        """gt_boxes (B, Mmax, 7), gt_mask (B, Mmax) -> anchor targets, see
        :func:`opencood.postprocess.target_assigner.assign_targets`; multi-class: gt_classes
        (B, Mmax) int64 is required (:func:`~opencood.postprocess.target_assigner.
        assign_class_targets`, which adds ``class_targets``)."""
        rects = self.anchor_rects(gt_boxes.device, gt_boxes.dtype)
        if self.class_thresholds is None:
            return assign_targets(self.anchors, gt_boxes, gt_mask, pos_iou=self.pos_iou,
                                  neg_iou=self.neg_iou, box_coder=self.box_coder,
                                  anchor_rects=rects)
        if gt_classes is None:
            raise ConfigError(f"postprocess.classes lists {self.num_classes} classes but the "
                              f"batch has no gt_classes (the data set's reader labels none)")
        return assign_class_targets(self.anchors, gt_boxes, gt_mask, gt_classes,
                                    self.class_thresholds, box_coder=self.box_coder,
                                    anchor_rects=rects)

    def anchor_rects(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(N, 4) standup rectangles of the flattened anchors, computed once per device and
        dtype (21 operators of every training step's target assignment otherwise)."""
        key = (device, dtype)
        if key not in self._anchor_rects:
            anchors = self.anchors.reshape(-1, 7).to(device=device, dtype=dtype)
            rects = standup_bev(anchors, self.box_coder.order)
            # Column-major: standup_iou reads each coordinate column contiguous, no copy.
            self._anchor_rects[key] = rects.t().contiguous().t()
        return self._anchor_rects[key]

    def decode(self, outputs: Dict[str, torch.Tensor]) -> List[Detections]:
        """Head outputs (cls_preds, reg_preds, optional dir_preds; layout in
        :mod:`opencood.postprocess.layout`) -> per batch element ``Detections`` (boxes (K, 7),
        scores (K,), classes (K,)) with sigmoid score > score_threshold, direction applied,
        before NMS. An anchor's score is its best class's sigmoid and its class that class
        (V2X-Real's decoding). Decoding runs in the anchors' dtype (float32 even under AMP)."""
        anchors_flat = self.anchors.reshape(-1, 7)
        reg = flatten_anchor_maps(outputs["reg_preds"], BOX_CODE_SIZE)
        if reg.shape[1] != anchors_flat.shape[0]:
            raise ValueError(f"the head gives {reg.shape[1]} anchors per sample but the "
                             f"postprocessor has {anchors_flat.shape[0]} (anchors "
                             f"{tuple(self.anchors.shape)}): anchor_args and the model disagree")
        anchors_flat = anchors_flat.to(device=reg.device)
        boxes = self.box_coder.decode(reg.to(anchors_flat.dtype), anchors_flat[None])
        if outputs.get("dir_preds") is not None:
            direction = flatten_anchor_maps(outputs["dir_preds"], self.box_coder.num_dir_bins)
            boxes = self.box_coder.apply_direction(boxes, direction)
        scores, classes = self.class_scores(outputs["cls_preds"], anchors_flat.dtype)
        keep = scores > self.score_threshold
        return [Detections(boxes[b][keep[b]], scores[b][keep[b]], classes[b][keep[b]])
                for b in range(scores.shape[0])]

    def class_scores(self, cls_preds: torch.Tensor, dtype: torch.dtype):
        """cls_preds (B, K*A, H, W) -> (scores (B, N) sigmoid of the best class in ``dtype``,
        classes (B, N) int64 its id)."""
        if self.num_classes == 1:
            scores = torch.sigmoid(flatten_anchor_maps(cls_preds, 1).to(dtype))
            return scores, torch.zeros(scores.shape, dtype=torch.int64, device=scores.device)
        probabilities = torch.sigmoid(flatten_anchor_maps(cls_preds, self.num_classes).to(dtype))
        return probabilities.max(dim=-1)

    def nms(self, boxes: torch.Tensor, scores: torch.Tensor,
            classes: Optional[torch.Tensor] = None) -> Detections:
        """(K, 7) boxes, (K,) scores, (K,) classes (None: all 0) -> the ``Detections`` kept by
        :meth:`nms_indices`, by descending score."""
        if classes is None:
            classes = torch.zeros(scores.shape, dtype=torch.int64, device=scores.device)
        keep = self.nms_indices(boxes, scores, classes)
        return Detections(boxes[keep], scores[keep], classes[keep])

    def nms_indices(self, boxes: torch.Tensor, scores: torch.Tensor,
                    classes: torch.Tensor) -> torch.Tensor:
        """Indices of the at most ``max_num`` boxes kept by per-class rotated NMS over the
        ``pre_nms_max`` best, by descending score (``filters: reference``: OpenCOOD's,
        ``v2xreal``: V2X-Real's, see the class docstring)."""
        candidates = torch.arange(scores.shape[0], device=scores.device)
        if self.filters == "reference":
            candidates = candidates[reference_plausible(boxes, self.order)]
        candidates = candidates[top_indices(scores[candidates], self.pre_nms_max)]
        # One class (or V2X-Real's class-agnostic NMS): no class mask.
        per_class = classes[candidates] if self.num_classes > 1 and \
            self.filters != "v2xreal" else None
        keep = nms_rotated(boxes[candidates], scores[candidates], self.nms_thresh,
                           order=self.order, classes=per_class)
        if self.filters == "ours":
            keep = keep[:self.max_num]
        return candidates[keep]

    def detections(self, outputs: Dict[str, torch.Tensor], record_len: torch.Tensor,
                   transforms_to_ego: torch.Tensor, late: bool) -> List[FrameDetections]:
        """Model outputs -> per sample ``FrameDetections`` (boxes (K, 7) ego frame, scores (K,),
        bytes per agent, classes (K,)).

        record_len (B,): agents per sample; transforms_to_ego (sum(record_len), 4, 4). With
        ``late`` the outputs hold one row per agent and are merged per sample
        (:meth:`merge_late`); otherwise one row per sample, and the bytes come from the model's
        ``comm_bytes`` (intermediate fusion) or are 0.
        """
        decoded = self.decode(outputs)
        if late:
            return self.merge_late(decoded, record_len, transforms_to_ego)
        comm = outputs.get("comm_bytes")
        results = []
        for sample, frame in enumerate(decoded):
            kept = self.nms(*frame)
            results.append(FrameDetections(kept.boxes, kept.scores,
                                           float(comm[sample]) if comm is not None else 0.0,
                                           kept.classes))
        return results

    def merge_late(self, decoded: Sequence[Detections], record_len: torch.Tensor,
                   transforms_to_ego: torch.Tensor) -> List[FrameDetections]:
        """Late fusion: every agent's NMS-ed boxes moved to the ego frame, then NMS per sample.

        decoded: per agent ``Detections`` in its own frame, agents of a sample consecutive.
        The bytes of a sample are the mean over its non-ego agents of the boxes they send.
        """
        results, first = [], 0
        for count in record_len.tolist():
            agents = range(first, first + count)
            kept = [self.nms(*decoded[agent]) for agent in agents]
            boxes = torch.cat([boxes_to_ego(agent.boxes, transforms_to_ego[index])
                               for index, agent in zip(agents, kept)])
            scores = torch.cat([agent.scores for agent in kept])
            classes = torch.cat([agent.classes for agent in kept])
            sent = [agent.boxes.shape[0] * BYTES_PER_BOX for agent in kept[1:]]
            merged = self.nms(boxes, scores, classes)
            results.append(FrameDetections(merged.boxes, merged.scores,
                                           float(np.mean(sent)) if sent else 0.0,
                                           merged.classes))
            first += count
        return results
