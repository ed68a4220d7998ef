"""BEV pictures of evaluated samples: every agent's points in the ego frame, GT and detections."""
from __future__ import annotations

from pathlib import Path
from typing import Dict

import numpy as np
import torch

from opencood.data.datasets import INFRASTRUCTURE
from opencood.ops.transforms import apply_transform_torch
from opencood.utils.vis_bev import render_bev, save_image


def agent_label(position: int, agent_type: int) -> str:
    """"ego", "cav k" or "RSU k": the name of the agent at ``position`` in its sample."""
    if position == 0:
        return "ego"
    return f"{'RSU' if agent_type == INFRASTRUCTURE else 'cav'} {position}"


def sample_agent_points(batch: Dict, row: int) -> Dict[str, torch.Tensor]:
    """{agent label: (N_k, 4) points in the ego frame} for batch element ``row``; {} for a
    batch without points (camera inputs only)."""
    if "points" not in batch:
        return {}
    record_len = batch["record_len"].tolist()
    first = sum(record_len[:row])
    agent_types = batch.get("agent_types")
    points_by_agent = {}
    for position, agent in enumerate(range(first, first + record_len[row])):
        points = batch["points"][batch["agent_index"] == agent]
        if batch.get("points_in_agent_frame", False):
            points = apply_transform_torch(points, batch["transforms_to_ego"][agent])
        agent_type = int(agent_types[agent]) if agent_types is not None else 0
        points_by_agent[agent_label(position, agent_type)] = points
    return points_by_agent


def frame_title(key) -> str:
    """The frame a picture shows, from its sample key (scenario, timestamp)."""
    return " ".join(str(part) for part in key)


def render_detection_sample(batch: Dict, row: int, boxes: torch.Tensor, bev_range,
                            title: str | None = None):
    """(H, W, 3) uint8 BGR picture over ``bev_range``: points coloured per agent, GT green (GT
    with no ego return lavender, when the batch counts them), detections red, ``title`` (the
    frame) in a corner."""
    points_by_agent = sample_agent_points(batch, row)
    gt = batch["gt_boxes"][row][batch["gt_mask"][row]].numpy()
    occluded = np.zeros(len(gt), dtype=bool)
    if "gt_ego_points" in batch:
        occluded = np.asarray(batch["gt_ego_points"][row]) == 0
    return render_bev({k: v.numpy() for k, v in points_by_agent.items()}, bev_range,
                      gt_boxes=gt[~occluded], pred_boxes=boxes.numpy(), pixels_per_meter=8.0,
                      occluded_gt_boxes=gt[occluded], title=title)


def draw_detection_sample(path: Path, batch: Dict, row: int, boxes: torch.Tensor,
                          scores: torch.Tensor, bev_range, title: str | None = None) -> None:
    """Write :func:`render_detection_sample` as a PNG."""
    save_image(path, render_detection_sample(batch, row, boxes, bev_range, title))
