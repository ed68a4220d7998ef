"""HEAL's pyramid fusion (Lu et al., ICLR 2024, ``fuse_modules/pyramid_fuse.py``): a multi-scale
ResNet(-eXt) backbone whose every scale predicts a per-agent foreground ("occupancy") map; the
maps weight the agents' features of that scale in a softmax over the agents of a sample.

Per scale l (features of each agent computed independently, in its own frame, as the backbone's
down stages go):

* ``occupancy[l]`` = a 1x1 conv of the scale's map to one logit per cell (N_agents, 1, H_l, W_l),
  supervised by the pyramid loss (``opencood.losses.pyramid``);
* score = sigmoid(logit) + 1e-4, times a camera agent's valid window in evaluation
  (:func:`camera_valid_masks`, HEAL's ``cam_crop_info``);
* features and scores are warped into the ego frame (``opencood.models.warp``), a score of
  exactly 0 (outside the agent's map, or its camera mask) is out of the softmax, a cell no agent
  reaches gets 0;
* the fused scale goes through its up block; the up blocks' outputs are concatenated (B, C, H, W).

A single agent (:meth:`PyramidFusion.forward_single`, HEAL's ``forward_single``) skips the
weighting: the same occupancy maps, its own maps through the up blocks.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from opencood.config_schema import Problems, section
from opencood.models.backbone import BackboneArgs, BaseBEVBackbone
from opencood.models.fusion import FP32_BYTES, pad_by_sample
from opencood.models.warp import BevGrid, warp_to_ego

SCORE_FLOOR = 1e-4          # HEAL's: every cell of an agent's own map keeps a little weight
CAMERA_EDGE_CELLS = 4       # HEAL drops this many cells inside a camera map's edge (unstable)


@section
class PyramidFusionArgs(BackboneArgs):
    """``model.args.fusion_backbone``: HEAL's pyramid (ResNet stages, ``resnext`` for its
    configs' ResNeXt, up blocks to a common stride). ``align_corners`` is HEAL's key; only its
    default (False) is reproduced."""

    align_corners: bool = False

    def problems(self) -> Problems:
        yield from super().problems()
        if not (self.resnet or self.resnext):
            yield "resnet", "must be true (or resnext: true): the pyramid has residual stages"
        if not self.upsample_strides:
            yield "upsample_strides", "is needed: the pyramid brings every scale to one stride"
        if self.align_corners:
            yield "align_corners", "true is not reproduced (HEAL's default false is)"


def camera_valid_masks(agent_modalities: Sequence[str], crop_ratios: Dict[str, Tuple[float,
                       float]], height: int, width: int, device) -> torch.Tensor:
    """(N_agents, 1, H, W) float: 1 where an agent's score counts. A camera agent's map (padded
    out to the LiDAR range by its crop, ratio (H, W) = range / camera range) keeps only its
    camera window less ``CAMERA_EDGE_CELLS`` cells, centred, bounds as HEAL rounds them; other
    agents everywhere."""
    masks = torch.ones(len(agent_modalities), 1, height, width, device=device)
    for index, modality in enumerate(agent_modalities):
        if modality not in crop_ratios:
            continue
        ratio_h, ratio_w = crop_ratios[modality]
        crop_h = height / ratio_h - CAMERA_EDGE_CELLS
        crop_w = width / ratio_w - CAMERA_EDGE_CELLS
        top, bottom = int(height // 2 - crop_h // 2), int(height // 2 + crop_h // 2)
        left, right = int(width // 2 - crop_w // 2), int(width // 2 + crop_w // 2)
        window = torch.zeros(height, width, device=device)
        window[top:bottom, left:right] = 1
        masks[index, 0] = window
    return masks


def weighted_fuse(features: torch.Tensor, scores: torch.Tensor, record_len: torch.Tensor,
                  to_ego: Optional[torch.Tensor], grid: BevGrid) -> torch.Tensor:
    """features (N, C, H, W) and scores (N, 1, H, W) in their agents' frames (``to_ego`` (N, 4,
    4), None: already in the ego frame) -> (B, C, H, W): per cell, the agents' features weighted
    by the softmax of their warped scores over the agents that reach the cell (score != 0)."""
    maps = torch.cat([features, scores], dim=1)
    if to_ego is not None:         # one resampling for both (grid_sample is per channel)
        maps = warp_to_ego(maps, to_ego, grid)
    padded, is_real = pad_by_sample(maps, record_len)
    padded_features, padded_scores = padded[:, :, :-1], padded[:, :, -1:]
    absent = (padded_scores == 0) | ~is_real[:, :, None, None, None]
    weights = torch.softmax(padded_scores.masked_fill(absent, float("-inf")), dim=1)
    weights = torch.nan_to_num(weights, nan=0.0)       # cells no agent reaches
    return (padded_features * weights).sum(dim=1)


class PyramidFusion(nn.Module):
    """(N_agents, C_in, H, W) per-agent maps -> fused (B, C_out, H', W') and the occupancy logits
    of every scale (list of (N_agents, 1, H_l, W_l)). ``C_out`` = ``out_channels``."""

    def __init__(self, args: PyramidFusionArgs, in_channels: int):
        super().__init__()
        self.backbone = BaseBEVBackbone(args, in_channels)
        self.occupancy_heads = nn.ModuleList(
            nn.Conv2d(channels, 1, 1) for channels in self.backbone.scale_channels)
        self.out_channels = self.backbone.out_channels

    def scales(self, features: torch.Tensor) -> List[torch.Tensor]:
        """Each down stage's output, every agent on its own."""
        outputs = []
        for block in self.backbone.blocks:
            features = block(features)
            outputs.append(features)
        return outputs

    def decode(self, scale_maps: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([deblock(x) for deblock, x in zip(self.backbone.deblocks, scale_maps)],
                         dim=1)

    def forward_single(self, features: torch.Tensor):
        scale_maps = self.scales(features)
        occupancy = [head(x) for head, x in zip(self.occupancy_heads, scale_maps)]
        return self.decode(scale_maps), occupancy

    def forward_collab(self, features: torch.Tensor, record_len: torch.Tensor,
                       to_ego: Optional[torch.Tensor], grid: BevGrid,
                       agent_modalities: Sequence[str] = (),
                       crop_ratios: Optional[Dict[str, Tuple[float, float]]] = None):
        """``crop_ratios``: camera modality -> (H, W) crop ratio; their agents' scores are masked
        to the camera window in evaluation (as HEAL: not in training)."""
        fused, occupancy = [], []
        for head, x in zip(self.occupancy_heads, self.scales(features)):
            logits = head(x)
            occupancy.append(logits)
            scores = torch.sigmoid(logits) + SCORE_FLOOR
            if crop_ratios and not self.training:
                scores = scores * camera_valid_masks(agent_modalities, crop_ratios,
                                                     *scores.shape[2:], device=scores.device)
            fused.append(weighted_fuse(x, scores, record_len, to_ego, grid))
        return self.decode(fused), occupancy

    def comm_bytes(self, occupancy: Sequence[torch.Tensor], record_len: torch.Tensor):
        """(B,) float: each non-ego agent sends every scale's map (dense, fp32)."""
        per_agent = sum(channels * o.shape[2] * o.shape[3] for channels, o in
                        zip(self.backbone.scale_channels, occupancy)) * FP32_BYTES
        return (record_len > 1).to(torch.float32) * float(per_agent)
