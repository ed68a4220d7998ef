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
    """

    def __init__(self, pillarize: PillarizeConfig, postprocessor, device: torch.device | str):
        self.pillarize = pillarize
        self.postprocessor = postprocessor
        self.device = torch.device(device)

    @classmethod
    def from_config(cls, cfg: dict, device, training: bool = True) -> "BatchPreparer":
        """``training`` picks the pillar cap ``preprocess.args.max_voxel_train`` (training
        steps) or ``max_voxel_test`` (validation and evaluation), as OpenCOOD does, and
        ``performance.static_pillars`` for training steps only: validation and evaluation keep
        every pillar up to ``max_voxel_test``, which a fixed training-sized cap could cut."""
        static_pillars = cfg["performance"]["static_pillars"] if training else 0
        return cls(pillarize=PillarizeConfig.from_config(cfg["preprocess"], training,
                                                         static_pillars),
                   postprocessor=build_postprocessor(cfg, torch.device(device)), device=device)

    def model_inputs(self, batch: Dict) -> Dict:
        """The model's input dict on the device (``opencood.batch_keys.MODEL_INPUT``): pillars
        of the batch's points (when it has points), the camera keys as they are, and
        ``record_len``, ``agent_types`` (V2X-ViT treats roadside units apart), ``shared_points``,
        ``transforms_to_ego``, ``agent_latency`` (V2X-ViT's delay encoding) and
        ``points_in_agent_frame`` (own-frame data, whose features the intermediate detector
        warps with ``transforms_to_ego``)."""
        inputs = {}
        if "points" in batch:
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

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every host-to-device copy of a batch: non-blocking, so that from the loader's pinned
        memory (``build_loader`` pins for CUDA) it queues behind the running step instead of
        waiting for the GPU to finish it."""
        return tensor.to(self.device, non_blocking=True)

    def targets(self, batch: Dict) -> Dict:
        """Anchor targets for the batch's GT (ego frame, or the CAV frame for late training)."""
        gt_boxes = self.to_device(batch["gt_boxes"])
        gt_mask = self.to_device(batch["gt_mask"])
        return self.postprocessor.targets(gt_boxes, gt_mask)

    def __call__(self, batch: Dict, with_targets: bool = True) -> Tuple[Dict, Dict | None]:
        inputs = self.model_inputs(batch)
        return inputs, (self.targets(batch) if with_targets else None)
