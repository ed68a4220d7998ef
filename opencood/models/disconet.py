"""DiscoNet (Li et al., NeurIPS 2021): a learned, per-cell collaboration graph between agents.

Every agent of a sample is a node and the ego receives from every node, itself included (a
self-loop, so a lone ego still runs the same layers). The weight of edge (sender -> ego) is
learned per BEV cell: a small network of 1x1 convolutions scores the pair [ego map, sender map]
at each cell, the scores are normalised with a softmax over the sample's agents, and the fused
map is the weighted sum of the agents' maps. The weights therefore sum to 1 at every cell, and
an agent that sees nothing useful at a cell can be ignored there.

What makes the graph "distilled" is how it is trained, not its layers: the fused map is pulled
towards the BEV map of a frozen early-fusion teacher (``opencood.engine.teacher``), which saw
every agent's raw points. The detector returns the fused map as ``fused_features`` for that.

Our intermediate dataset projects every cloud into the ego frame before pillarisation
(OpenCOOD's ``proj_first``), so the agents' maps are already aligned and nothing is warped.

Bytes: every non-ego agent sends its whole (C, H, W) map, once.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch
from torch import nn

from opencood.config_schema import positive, section, spec
from opencood.models.fusion import (FP32_BYTES, FusionModule, FusionResult, agent_slots,
                                    dense_comm_bytes, pad_by_sample)
from opencood.registry import FUSIONS


class EdgeWeightNet(nn.Module):
    """Per-cell score of an edge: (M, 2C, H, W) [ego, sender] pairs -> (M, 1, H, W) logits.

    1x1 convolutions with BatchNorm and ReLU between them, no activation on the last: the
    softmax over agents normalises the scores. ``score_relu``: a ReLU on the last too, as the
    authors' code has it (``PixelWeightLayer``): negative scores all become 0, so where every
    agent scores below 0 the weights are uniform.
    """

    def __init__(self, in_channels: int, hidden: Sequence[int], score_relu: bool = False):
        super().__init__()
        layers, width = [], 2 * in_channels
        for out in hidden:
            layers += [nn.Conv2d(width, out, 1), nn.BatchNorm2d(out), nn.ReLU()]
            width = out
        layers.append(nn.Conv2d(width, 1, 1))
        if score_relu:
            layers.append(nn.ReLU())              # no parameters: state dict keys unchanged
        self.layers = nn.Sequential(*layers)

    def forward(self, pairs: torch.Tensor) -> torch.Tensor:
        return self.layers(pairs)


@section
class DiscoNetArgs:
    # Widths of the edge network's hidden 1x1 convolutions; the paper's code (and HEAL's):
    # 2C -> 128 -> 32 -> 8 -> 1.
    hidden: Tuple[int, ...] = (128, 32, 8)
    bytes_per_value: int = spec(FP32_BYTES, check=positive)   # what one sent value costs
    # True: a ReLU on the edge scores before the softmax, as in the authors' code (DiscoNet's
    # and CoAlign's PixelWeightLayer); ours leaves them signed (reference option).
    score_relu: bool = False


@FUSIONS.register("disconet", args=DiscoNetArgs)
class DiscoFusion(FusionModule):
    """DiscoNet's fusion at the backbone output: softmax-normalised learned edge weights per
    cell, weighted sum over the sample's agents, on (N, in_channels, H, W) maps."""

    supported_stages = ("backbone",)

    def __init__(self, args: DiscoNetArgs, in_channels: int, num_anchors: int):
        super().__init__(args.bytes_per_value)
        self.edge_net = EdgeWeightNet(in_channels, args.hidden, args.score_relu)

    def edge_logits(self, features: torch.Tensor, record_len: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) agents, ego first per sample -> (N, 1, H, W) score of each agent's edge
        to its sample's ego.

        Scored on the real agents only, not on the padded (B, L) layout: in training mode the
        BatchNorm statistics would otherwise depend on how much padding a batch holds.
        """
        sample_index, slot = agent_slots(record_len, features.shape[0])
        ego_row = torch.arange(features.shape[0], device=features.device) - slot
        pairs = torch.cat([features[ego_row], features], dim=1)
        return self.edge_net(pairs)

    def forward(self, features: torch.Tensor, record_len: torch.Tensor) -> FusionResult:
        """features (N, C, H, W), record_len (B,) -> FusionResult with the fused (B, C, H, W)
        map and aux ``edge_weights`` (B, L, H, W): each agent's weight per cell (0 for the
        padding slots of samples with fewer than L agents)."""
        logits, is_real = pad_by_sample(self.edge_logits(features, record_len), record_len)
        logits = logits.squeeze(2).masked_fill(~is_real[:, :, None, None], float("-inf"))
        weights = torch.softmax(logits, dim=1)              # the ego slot is always real
        padded, _ = pad_by_sample(features, record_len)
        fused = (weights.unsqueeze(2) * padded).sum(dim=1)
        return FusionResult(fused, dense_comm_bytes(features, record_len, self.bytes_per_value),
                            {"edge_weights": weights})
