"""CoAlign's stage 1 at inference: every agent's own detections with the head's log variances of
x, y (, yaw) carried through decoding and NMS, box for box, for the pose graph
(``opencood.ops.pose_graph.box_align_lidar_poses``).

The postprocessor's ``decode`` / ``nms`` return ``Detections`` (boxes, scores, classes); this
follows the same selection (``nms_indices``) by index so the log variances stay aligned with the
boxes, without changing the ``Detections`` type.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from opencood.postprocess.layout import flatten_anchor_maps

UncertainDetections = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # boxes, scores, log_var


def detections_with_uncertainty(postprocessor, outputs: Dict[str, torch.Tensor]
                                ) -> List[UncertainDetections]:
    """Head outputs of N agents, each in its own frame (cls_preds, reg_preds, dir_preds,
    unc_preds (N, dim * A, H, W)) -> per agent ``(boxes (K, 7), scores (K,), log_var (K, dim))``
    after NMS, the boxes and scores exactly those of ``postprocessor.decode`` + ``nms``."""
    anchors_per_cell = postprocessor.num_anchors_per_location
    dim = outputs["unc_preds"].shape[1] // anchors_per_cell
    log_var = flatten_anchor_maps(outputs["unc_preds"], dim).float()          # (N, anchors, dim)
    scores_all, _ = postprocessor.class_scores(outputs["cls_preds"], torch.float32)
    decoded = postprocessor.decode(outputs)
    results = []
    for agent, (boxes, scores, classes) in enumerate(decoded):
        agent_log_var = log_var[agent][scores_all[agent] > postprocessor.score_threshold]
        chosen = postprocessor.nms_indices(boxes, scores, classes)
        results.append((boxes[chosen], scores[chosen], agent_log_var[chosen.to(log_var.device)]))
    return results
