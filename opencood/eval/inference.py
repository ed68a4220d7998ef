"""Inference over a split: model, postprocess, gather across ranks, AP (docs/DESIGN.md §7).

Decoding, NMS and the late-fusion merge belong to the config's postprocessor
(``preparer.postprocessor``, :mod:`opencood.postprocess`).

Each rank runs its unpadded shard; per-sample results are keyed by (scenario, timestamp),
gathered to rank 0, checked to hold every sample exactly once, and AP is computed once there.
"""
from __future__ import annotations

import time
from typing import Dict, List, Mapping, Optional, Tuple

import torch

from opencood.eval.ap import APAccumulator
from opencood.eval.pose_correction import correction_pairs
from opencood.eval.pose_error import PoseErrorTally
from opencood.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, APProtocol
from opencood.utils import dist as dist_utils


def detect(model, batch: Dict, preparer, strategy, corrector=None) -> Tuple[List, Dict]:
    """The timed part of inference on one collated batch: pillarise (+ the pose correction's
    stage 1 and pose graph) + forward + decode + NMS (and the late-fusion merge) -> (per sample
    ``FrameDetections`` (boxes, scores, bytes sent, classes), the prepared inputs as used).
    Under the caller's ``torch.no_grad`` (tools/bench.py times it alone).

    ``corrector``: a ``PoseCorrector`` (``opencood.eval.pose_correction``) or None; with one,
    the inputs' ``transforms_to_ego`` are the corrected ones and ``transforms_to_ego_reported``
    the noisy ones they replaced."""
    inputs, _ = preparer(batch, with_targets=False)
    if corrector is not None:
        inputs = corrector(batch, inputs)
    outputs = model(strategy.model_inputs(inputs))
    return strategy.detections(preparer.postprocessor, outputs, inputs), inputs


def detection_class_names(postprocess: Mapping) -> Optional[List[str]]:
    """The names of a resolved ``postprocess`` section's ``classes`` (class id k is entry k),
    None without a class list (one class)."""
    classes = postprocess.get("classes")
    return None if classes is None else [entry["name"] for entry in classes]


def frame_classes(batch: Dict, row: int, detections) -> Dict:
    """``add_frame``'s class ids of one sample: the detections' ``classes`` (K,) and the GT's
    (``gt_classes``, the rows ``gt_mask`` keeps), those present."""
    classes = {}
    if getattr(detections, "classes", None) is not None:
        classes["pred_classes"] = detections.classes.cpu()
    if "gt_classes" in batch:
        classes["gt_classes"] = batch["gt_classes"][row][batch["gt_mask"][row]]
    return classes


def tally_pose_errors(tally: PoseErrorTally, batch: Dict, inputs: Dict) -> None:
    """Add a batch's relative pose errors (reported, and corrected if a correction ran) against
    the true transforms (``transforms_to_ego_clean``; batches without it are skipped)."""
    if "transforms_to_ego_clean" not in batch:
        return
    record_len = batch["record_len"].tolist()
    pairs = correction_pairs(inputs)
    tally.add(record_len, batch["transforms_to_ego_clean"], *[t.cpu() for t in pairs])
    if "stage1_boxes" in inputs:
        tally.add_stage1_boxes(record_len, batch["transforms_to_ego_clean"],
                               inputs["stage1_boxes"])


@torch.no_grad()
def run_inference(model, loader, preparer, device, strategy, on_sample=None,
                  protocol: APProtocol = PROTOCOLS[DEFAULT_PROTOCOL], corrector=None,
                  class_names: Optional[List[str]] = None) -> Dict:
    """This rank's shard -> {"accumulator": APAccumulator, "frames", "seconds", "bytes_sum",
    "pose_errors": PoseErrorTally}.

    ``strategy``: the engine's fusion strategy (``opencood.strategies.choose_strategy``): its
    model-input adapter and its box merge.
    ``on_sample(key, batch, row, boxes, scores)`` is called per sample (e.g. to draw pictures;
    with ``class_names``, also ``classes=`` the detections' class ids).
    ``protocol`` sets the detection sort and range of the AP (opencood.eval.protocols).
    ``corrector``: the pose correction of intermediate runs (``detect``).
    ``class_names``: the detector's classes (``detection_class_names``); with two or more, AP
    is scored per class (``opencood.eval.ap``) from the detections' and the GT's class ids
    (None: one class, ids not read).
    """
    postprocessor = preparer.postprocessor
    accumulator = APAccumulator(order=postprocessor.order, class_names=class_names,
                                **protocol.accumulator_args())
    pose_errors = PoseErrorTally()
    was_training = model.training
    model.eval()
    frames, bytes_sum, seconds = 0, 0.0, 0.0
    for batch in loader:
        start = time.perf_counter()
        results, inputs = detect(model, batch, preparer, strategy, corrector)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        tally_pose_errors(pose_errors, batch, inputs)
        for row, detections in enumerate(results):
            boxes, scores, sent = detections[:3]
            gt = batch["gt_boxes"][row][batch["gt_mask"][row]]
            key = tuple(batch["sample_keys"][row])
            ego_points = batch["gt_ego_points"][row] if "gt_ego_points" in batch else None
            accumulator.add_frame(boxes.float().cpu(), scores.float().cpu(), gt, sample_key=key,
                                  gt_ego_points=ego_points,
                                  **(frame_classes(batch, row, detections) if class_names
                                     else {}))
            bytes_sum += sent
            frames += 1
            if on_sample is not None:
                ids = {"classes": detections.classes.cpu()} if class_names else {}
                on_sample(key, batch, row, boxes.cpu(), scores.cpu(), **ids)
    model.train(was_training)
    return {"accumulator": accumulator, "frames": frames, "seconds": seconds,
            "bytes_sum": bytes_sum, "pose_errors": pose_errors}


def gather_results(local: Dict, expected_frames: int) -> Dict | None:
    """Merge every rank's results on rank 0 (None elsewhere); every sample exactly once.

    All ranks call it; if rank 0 fails to merge or compute, every rank raises (see
    ``dist_utils.run_together``) instead of the others waiting for it.
    """
    payload = {"state": local["accumulator"].state_dict(), "frames": local["frames"],
               "seconds": local["seconds"], "bytes_sum": local["bytes_sum"],
               "pose_errors": local["pose_errors"].state_dict()}
    gathered = dist_utils.gather_object_to_main(payload)
    return dist_utils.run_together(
        lambda: None if gathered is None else merge_gathered(gathered, expected_frames),
        "evaluation")


def merge_gathered(gathered: List[Dict], expected_frames: int) -> Dict:
    """Rank 0: the payloads of every rank -> metrics; refuses a sample lost or seen twice."""
    merged = APAccumulator.from_state_dict(gathered[0]["state"])
    for other in gathered[1:]:
        try:
            merged.merge(other["state"])   # refuses a sample key seen twice
        except ValueError as error:
            raise RuntimeError(f"evaluation gathered a sample from two ranks: {error}") from None
    frames = sum(g["frames"] for g in gathered)
    if frames != expected_frames or len(merged) != expected_frames:
        raise RuntimeError(f"evaluation gathered {frames} frames ({len(merged)} distinct) but the "
                           f"split has {expected_frames}: a sample was lost or duplicated")
    metrics = merged.compute()
    # Ranks run in parallel: throughput is frames over the slowest rank's time.
    slowest = max(g["seconds"] for g in gathered)
    metrics["frames_per_s"] = frames / slowest if slowest > 0 else float("nan")
    metrics["bytes_per_agent"] = sum(g["bytes_sum"] for g in gathered) / max(frames, 1)
    pose_errors = PoseErrorTally()
    for payload in gathered:
        pose_errors.merge(payload["pose_errors"])
    metrics["pose_error"] = pose_errors.summary()
    return metrics


def evaluate_loader(model, loader, preparer, device, strategy, on_sample=None,
                    protocol: APProtocol = PROTOCOLS[DEFAULT_PROTOCOL],
                    corrector=None, class_names: Optional[List[str]] = None) -> Dict | None:
    """Run, gather, compute. All ranks must call it; rank 0 gets the metrics, others None.

    A failure on any rank (inference on its shard, rank 0's AP) raises on every rank.
    """
    local = dist_utils.run_together(
        lambda: run_inference(model, loader, preparer, device, strategy, on_sample, protocol,
                              corrector, class_names),
        "inference")
    return gather_results(local, expected_frames=len(loader.dataset))
