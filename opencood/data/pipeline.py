"""On-device part of the data flow: move a collated batch, pillarise, assign targets.

DataLoader workers only read, project, augment and crop (``opencood.data.datasets``); the
scatter-based pillarisation and the batched target assignment run here, on the training device,
inside the training step. Targets come from the config's postprocessor
(``opencood.postprocess``), which also decodes the model's outputs at evaluation.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch

from opencood.batch_keys import CAMERA_TENSORS
from opencood.ops.voxelize import PillarizeConfig
from opencood.postprocess import build_postprocessor

# Batch keys the model gets as they are (moved to the device).
PASSED_KEYS = ("record_len", "agent_types", "shared_points", "transforms_to_ego",
               "agent_latency") + CAMERA_TENSORS


class BatchPreparer:
    """Turns a collated CPU batch into model inputs (and training targets) on ``device``.

    Args:
        pillarize: the pillar grid and the caps (points per pillar, pillars per agent).
        postprocessor: anchors and target assignment (e.g. ``VoxelPostprocessor``).
        device: where the batch goes.
        modality_pillarize: heterogeneous agents: each LiDAR modality's own grid (its
            ``heter.modality_setting.<m>.preprocess``), which its agents' points are
            pillarised on (``modality_pillars``).
    """

    def __init__(self, pillarize: PillarizeConfig, postprocessor, device: torch.device | str,
                 modality_pillarize: Dict[str, PillarizeConfig] | None = None):
        self.pillarize = pillarize
        self.postprocessor = postprocessor
        self.device = torch.device(device)
        self.modality_pillarize = dict(modality_pillarize or {})

    @classmethod
    def from_config(cls, cfg: dict, device, training: bool = True) -> "BatchPreparer":
        """``training`` picks the pillar cap ``preprocess.args.max_voxel_train`` (training
        steps) or ``max_voxel_test`` (validation and evaluation), as OpenCOOD does, and
        ``performance.static_pillars`` for training steps only: validation and evaluation keep
        every pillar up to ``max_voxel_test``, which a fixed training-sized cap could cut."""
        static_pillars = cfg["performance"]["static_pillars"] if training else 0
        return cls(pillarize=PillarizeConfig.from_config(cfg["preprocess"], training,
                                                         static_pillars),
                   postprocessor=build_postprocessor(cfg, torch.device(device)), device=device,
                   modality_pillarize=modality_grids(cfg, training))

    def model_inputs(self, batch: Dict) -> Dict:
        """The model's input dict on the device (``opencood.batch_keys.MODEL_INPUT``): pillars
        of the batch's points (when it has points), the camera keys as they are, and
        ``record_len``, ``agent_types`` (V2X-ViT treats roadside units apart), ``shared_points``,
        ``transforms_to_ego``, ``agent_latency`` (V2X-ViT's delay encoding) and
        ``points_in_agent_frame`` (own-frame data, whose features the intermediate detector
        warps with ``transforms_to_ego``)."""
        inputs = {}
        if "agent_modality" in batch:
            inputs.update(self.heter_inputs(batch))
        elif "points" in batch:
            points = self.to_device(batch["points"])
            agent_index = self.to_device(batch["agent_index"])
            # The agent count as a shape (no host sync): one transform per agent.
            num_agents = batch["transforms_to_ego"].shape[0]
            inputs.update(self.pillarize(points, agent_index, num_agents))
        for key in PASSED_KEYS:
            if key in batch:
                inputs[key] = self.to_device(batch[key])
        # The own-frame flag (fusion.args.proj_first: false): the detector warps with it.
        inputs["points_in_agent_frame"] = bool(batch.get("points_in_agent_frame", False))
        return inputs

    def heter_inputs(self, batch: Dict) -> Dict:
        """A heterogeneous batch's own keys: ``agent_modality``, ``modality_cameras`` on the
        device and ``modality_pillars``: each LiDAR modality's agents' points pillarised on its
        grid, ``voxel_coords[:, 0]`` the agent's rank among that modality's agents."""
        modalities = list(batch["agent_modality"])
        inputs = {"agent_modality": modalities,
                  "modality_cameras": {name: {key: self.to_device(tensor)
                                              for key, tensor in tensors.items()}
                                       for name, tensors in batch["modality_cameras"].items()}}
        if "points" not in batch:
            return inputs
        points = self.to_device(batch["points"])
        agent_index = self.to_device(batch["agent_index"])
        pillars = {}
        for name, pillarize in self.modality_pillarize.items():
            agents = [k for k, modality in enumerate(modalities) if modality == name]
            if not agents:
                continue
            # rank of each batch agent among this modality's (-1: another modality)
            rank = torch.full((len(modalities),), -1, dtype=torch.int64)
            rank[agents] = torch.arange(len(agents))
            point_rank = self.to_device(rank)[agent_index]
            mine = point_rank >= 0
            pillars[name] = pillarize(points[mine], point_rank[mine], len(agents))
        inputs["modality_pillars"] = pillars
        return inputs

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every host-to-device copy of a batch: non-blocking, so that from the loader's pinned
        memory (``build_loader`` pins for CUDA) it queues behind the running step instead of
        waiting for the GPU to finish it."""
        return tensor.to(self.device, non_blocking=True)

    def targets(self, batch: Dict) -> Dict:
        """Anchor targets for the batch's GT (ego frame, or the CAV frame for late training);
        a multi-class postprocessor also reads the GT's ``gt_classes``."""
        gt_boxes = self.to_device(batch["gt_boxes"])
        gt_mask = self.to_device(batch["gt_mask"])
        gt_classes = self.to_device(batch["gt_classes"]) if "gt_classes" in batch else None
        targets = self.postprocessor.targets(gt_boxes, gt_mask, gt_classes)
        if "agent_gt_boxes" in batch:       # each agent's own labels (the pyramid loss)
            targets["agent_labels"] = self.postprocessor.targets(
                self.to_device(batch["agent_gt_boxes"]),
                self.to_device(batch["agent_gt_mask"]))["labels"]
        return targets

    def __call__(self, batch: Dict, with_targets: bool = True) -> Tuple[Dict, Dict | None]:
        inputs = self.model_inputs(batch)
        return inputs, (self.targets(batch) if with_targets else None)


def modality_grids(cfg: dict, training: bool) -> Dict[str, PillarizeConfig]:
    """Each LiDAR modality's pillarisation of a ``heter`` config (its ``preprocess``, else the
    top-level one; the cap of ``training``); {} without ``heter``."""
    heter = cfg["heter"]
    if heter is None:
        return {}
    return {name: PillarizeConfig.from_config(setting["preprocess"] or cfg["preprocess"],
                                              training)
            for name, setting in heter["modality_setting"].items()
            if setting["sensor_type"] == "lidar"}
