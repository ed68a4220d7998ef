"""On-device part of the data flow: move a collated batch, pillarise, assign targets.

DataLoader workers only read, project, augment and crop (``opencood.data.datasets``); the
scatter-based pillarisation and the batched target assignment run here, on the training device,
inside the training step.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch

from opencood.ops.anchors import generate_anchors
from opencood.ops.box_coder import ResidualBoxCoder
from opencood.ops.target_assigner import assign_targets
from opencood.ops.voxelize import grid_size, pillarize


class BatchPreparer:
    """Turns a collated CPU batch into model inputs (and training targets) on ``device``.

    Args:
        lidar_range: [xmin, ymin, zmin, xmax, ymax, zmax] of the pillar grid.
        voxel_size: [vx, vy, vz] pillar size.
        max_points_per_voxel: points kept per pillar.
        anchor_hwl, anchor_z, anchor_yaws_deg, feature_stride: anchor layout.
        pos_iou, neg_iou: target assignment thresholds.
    """

    def __init__(self, lidar_range, voxel_size, max_points_per_voxel: int = 32,
                 anchor_hwl=(1.56, 1.6, 3.9), anchor_z: float = -1.0,
                 anchor_yaws_deg=(0.0, 90.0), feature_stride: int = 2,
                 pos_iou: float = 0.6, neg_iou: float = 0.45, dir_offset: float = 0.7854,
                 device: torch.device | str = "cpu"):
        self.lidar_range = [float(v) for v in lidar_range]
        self.voxel_size = [float(v) for v in voxel_size]
        self.max_points_per_voxel = int(max_points_per_voxel)
        self.grid = grid_size(self.lidar_range, self.voxel_size)
        self.device = torch.device(device)
        self.box_coder = ResidualBoxCoder(dir_offset=dir_offset)
        self.pos_iou, self.neg_iou = float(pos_iou), float(neg_iou)
        self.anchors = generate_anchors(
            self.lidar_range, self.voxel_size, feature_stride=feature_stride,
            anchor_hwl=tuple(anchor_hwl), anchor_z=anchor_z,
            yaws=tuple(math.radians(y) for y in anchor_yaws_deg), device=self.device)

    @classmethod
    def from_config(cls, cfg: dict, device) -> "BatchPreparer":
        preprocess = cfg["preprocess"]
        anchor_args = cfg["postprocess"].get("anchor_args", {})
        target_args = cfg["postprocess"].get("target_args", {})
        return cls(lidar_range=preprocess["cav_lidar_range"],
                   voxel_size=preprocess["args"]["voxel_size"],
                   max_points_per_voxel=preprocess["args"].get("max_points_per_voxel", 32),
                   anchor_hwl=(anchor_args.get("h", 1.56), anchor_args.get("w", 1.6),
                               anchor_args.get("l", 3.9)),
                   anchor_z=anchor_args.get("z", -1.0),
                   anchor_yaws_deg=anchor_args.get("r", [0, 90]),
                   feature_stride=anchor_args.get("feature_stride", 2),
                   pos_iou=target_args.get("pos_threshold", 0.6),
                   neg_iou=target_args.get("neg_threshold", 0.45),
                   dir_offset=cfg.get("loss", {}).get("args", {}).get("dir_offset", 0.7854),
                   device=device)

    @property
    def num_anchors_per_location(self) -> int:
        return self.anchors.shape[2]

    def model_inputs(self, batch: Dict) -> Dict:
        """Pillarise on the device. Returns the model's input dict (see opencood.models), with
        ``agent_types`` (sum(record_len),) int64 (0 vehicle, 1 infrastructure) for models that
        treat roadside units apart (V2X-ViT); the others ignore it."""
        points = batch["points"].to(self.device, non_blocking=True)
        agent_index = batch["agent_index"].to(self.device, non_blocking=True)
        pillars = pillarize(points, agent_index, self.lidar_range, self.voxel_size,
                            max_points_per_pillar=self.max_points_per_voxel)
        inputs = dict(pillars)
        inputs["record_len"] = batch["record_len"].to(self.device)
        inputs["agent_types"] = batch["agent_types"].to(self.device)
        if "agent_latency" in batch:        # V2X-ViT's delay encoding
            inputs["agent_latency"] = batch["agent_latency"].to(self.device)
        inputs["shared_points"] = batch["shared_points"].to(self.device)
        inputs["transforms_to_ego"] = batch["transforms_to_ego"].to(self.device)
        return inputs

    def targets(self, batch: Dict) -> Dict:
        """Anchor targets for the batch's GT (ego frame, or the CAV frame for late training)."""
        gt_boxes = batch["gt_boxes"].to(self.device, non_blocking=True)
        gt_mask = batch["gt_mask"].to(self.device, non_blocking=True)
        return assign_targets(self.anchors, gt_boxes, gt_mask, pos_iou=self.pos_iou,
                              neg_iou=self.neg_iou, box_coder=self.box_coder)

    def __call__(self, batch: Dict, with_targets: bool = True) -> Tuple[Dict, Dict | None]:
        inputs = self.model_inputs(batch)
        return inputs, (self.targets(batch) if with_targets else None)
