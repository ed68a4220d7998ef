"""Inference over a split: decode, fuse (late), NMS, gather across ranks, AP (DESIGN §7).

Each rank runs its unpadded shard; per-sample results are keyed by (scenario, timestamp),
gathered to rank 0, checked to hold every sample exactly once, and AP is computed once there.
"""
from __future__ import annotations

import time
from typing import Dict, List, Tuple

import numpy as np
import torch

from opencood.eval.ap import APAccumulator
from opencood.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS, APProtocol
from opencood.ops.nms import nms_rotated
from opencood.ops.target_assigner import decode_predictions
from opencood.utils import dist as dist_utils

BYTES_PER_BOX = 8 * 4  # late fusion sends 7 box numbers and a score, float32


def postprocess_settings(cfg: Dict) -> Dict:
    post = cfg.get("postprocess", {})
    return {"score_threshold": float(post.get("target_args", {}).get("score_threshold", 0.2)),
            "nms_thresh": float(post.get("nms_thresh", 0.15)),
            "max_num": int(post.get("max_num", 100)),
            # Rotated NMS is quadratic in the candidates: an untrained model firing everywhere
            # would otherwise spend seconds per frame on CPU.
            "pre_nms_max": int(post.get("pre_nms_max", 500)),
            "order": post.get("order", "hwl")}


def boxes_to_ego(boxes: torch.Tensor, transform: torch.Tensor) -> torch.Tensor:
    """(K, 7) boxes in an agent frame -> ego frame with a (4, 4) transform (BEV yaw rotation).

    Roll and pitch between agents are a fraction of a degree, so rotating the centre fully and
    adding the transform's heading to the yaw is what box-level (late) fusion needs.
    """
    transform = transform.to(boxes)
    centers = boxes[:, :3] @ transform[:3, :3].T + transform[:3, 3]
    heading = torch.atan2(transform[1, 0], transform[0, 0])
    return torch.cat([centers, boxes[:, 3:6], boxes[:, 6:7] + heading], dim=1)


def select_top(boxes: torch.Tensor, scores: torch.Tensor, limit: int):
    if scores.shape[0] <= limit:
        return boxes, scores
    top = torch.topk(scores, limit).indices
    return boxes[top], scores[top]


def nms_detections(boxes, scores, settings) -> Tuple[torch.Tensor, torch.Tensor]:
    boxes, scores = select_top(boxes, scores, settings["pre_nms_max"])
    keep = nms_rotated(boxes, scores, settings["nms_thresh"], order=settings["order"])
    keep = keep[:settings["max_num"]]
    return boxes[keep], scores[keep]


def detections_per_sample(outputs: Dict, inputs: Dict, preparer, settings: Dict,
                          late: bool) -> List[Tuple[torch.Tensor, torch.Tensor, float]]:
    """Model outputs -> per sample (boxes (K, 7) ego frame, scores (K,), bytes per agent)."""
    decoded = decode_predictions(outputs["cls_preds"], outputs["reg_preds"],
                                 outputs.get("dir_preds"), preparer.anchors,
                                 preparer.box_coder, settings["score_threshold"])
    record_len = inputs["record_len"].tolist()
    comm = outputs.get("comm_bytes")
    results = []
    if not late:
        for sample, (boxes, scores) in enumerate(decoded):
            boxes, scores = nms_detections(boxes, scores, settings)
            results.append((boxes, scores, float(comm[sample]) if comm is not None else 0.0))
        return results
    transforms = inputs["transforms_to_ego"]
    first = 0
    for count in record_len:
        agent_boxes, agent_scores, sent = [], [], []
        for agent in range(first, first + count):
            boxes, scores = nms_detections(*decoded[agent], settings)
            agent_boxes.append(boxes_to_ego(boxes, transforms[agent]))
            agent_scores.append(scores)
            if agent > first:
                sent.append(boxes.shape[0] * BYTES_PER_BOX)
        boxes, scores = nms_detections(torch.cat(agent_boxes), torch.cat(agent_scores), settings)
        results.append((boxes, scores, float(np.mean(sent)) if sent else 0.0))
        first += count
    return results


def late_model_inputs(inputs: Dict) -> Dict:
    """Late fusion runs the single-agent model on every agent's own cloud: each agent is its
    own sample for the model (record_len all ones); ``inputs`` keeps the per-sample record_len
    that groups the agents' boxes afterwards."""
    num_agents = int(inputs["record_len"].sum())
    model_inputs = {k: v for k, v in inputs.items() if k != "shared_points"}
    model_inputs["record_len"] = inputs["record_len"].new_ones(num_agents)
    return model_inputs


@torch.no_grad()
def run_inference(model, loader, preparer, cfg: Dict, device, fusion_method: str | None = None,
                  on_sample=None, protocol: APProtocol = PROTOCOLS[DEFAULT_PROTOCOL]) -> Dict:
    """This rank's shard -> {"accumulator": APAccumulator, "frames", "seconds", "bytes_sum"}.

    ``on_sample(key, batch_row, boxes, scores)`` is called per sample (e.g. to draw pictures).
    ``protocol`` sets the detection sort and range of the AP (opencood.eval.protocols).
    """
    settings = postprocess_settings(cfg)
    late = (fusion_method or cfg["fusion"]["core_method"]) == "late"
    accumulator = APAccumulator(order=settings["order"], **protocol.accumulator_args())
    was_training = model.training
    model.eval()
    frames, bytes_sum, seconds = 0, 0.0, 0.0
    for batch in loader:
        start = time.perf_counter()
        inputs, _ = preparer(batch, with_targets=False)
        outputs = model(late_model_inputs(inputs) if late else inputs)
        results = detections_per_sample(outputs, inputs, preparer, settings, late)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds += time.perf_counter() - start
        for row, (boxes, scores, sent) in enumerate(results):
            gt = batch["gt_boxes"][row][batch["gt_mask"][row]]
            key = tuple(batch["sample_keys"][row])
            ego_points = batch["gt_ego_points"][row] if "gt_ego_points" in batch else None
            accumulator.add_frame(boxes.float().cpu(), scores.float().cpu(), gt, sample_key=key,
                                  gt_ego_points=ego_points)
            bytes_sum += sent
            frames += 1
            if on_sample is not None:
                on_sample(key, batch, row, boxes.cpu(), scores.cpu())
    model.train(was_training)
    return {"accumulator": accumulator, "frames": frames, "seconds": seconds,
            "bytes_sum": bytes_sum}


def gather_results(local: Dict, expected_frames: int) -> Dict | None:
    """Merge every rank's results on rank 0 (None elsewhere); every sample exactly once.

    All ranks call it; if rank 0 fails to merge or compute, every rank raises (see
    ``dist_utils.run_together``) instead of the others waiting for it.
    """
    payload = {"state": local["accumulator"].state_dict(), "frames": local["frames"],
               "seconds": local["seconds"], "bytes_sum": local["bytes_sum"]}
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
    return metrics


def evaluate_loader(model, loader, preparer, cfg: Dict, device, fusion_method=None,
                    on_sample=None, protocol: APProtocol = PROTOCOLS[DEFAULT_PROTOCOL]
                    ) -> Dict | None:
    """Run, gather, compute. All ranks must call it; rank 0 gets the metrics, others None.

    A failure on any rank (inference on its shard, rank 0's AP) raises on every rank.
    """
    local = dist_utils.run_together(
        lambda: run_inference(model, loader, preparer, cfg, device, fusion_method, on_sample,
                              protocol),
        "inference")
    return gather_results(local, expected_frames=len(loader.dataset))
