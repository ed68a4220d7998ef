"""V2VNet (Wang et al., ECCV 2020): spatially aware graph message passing between agents.

Every agent is a node whose state starts as its BEV map. In each of K rounds (``num_iteration``)
every agent i receives, from every agent j of its sample (itself included, as OpenCOOD does, so a
lone agent still runs the same layers), a message computed by a CNN over [receiver state,
sender state warped into the receiver's frame], masked to the cells the sender's map covers;
the messages are averaged over senders and a ConvGRU updates the receiver's state from
[mean message, initial state]. The ego's final state, through a per-cell linear layer, feeds the
head. ``round_update: reference`` reproduces OpenCOOD's wiring instead (``V2VNetArgs``).

Warping uses the pairwise transforms between the agents' feature frames (``affine_grid`` /
``grid_sample``, ``opencood.models.warp``). With ``proj_first`` data (OpenCOOD's, which its
V2VNet config also uses) every cloud is projected into the ego frame before pillarisation, so
all feature frames coincide and the detector passes no transform: warping is then the identity
and skipped. With own-frame data (``fusion.args.proj_first: false``) the detector passes
``pairwise`` (agent j -> agent i) and its BEV grid, and every message is warped.

Two exact savings over evaluating the rounds literally: in one shared frame the message CNN
(one linear convolution) is split into a receiver and a sender half, and the last round updates
only the ego, whose state alone reaches the head (``tests/test_baselines.py`` checks both
against the literal evaluation).

Bytes: every agent broadcasts its current state once per round, so a non-ego agent sends
K x C x H x W values (nothing when K = 0 or when the ego is alone).
"""
from __future__ import annotations

from typing import Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import non_negative, positive, section, spec
from opencood.models.fusion import FP32_BYTES, FusionModule, FusionResult, pad_by_sample
from opencood.models.warp import BevGrid, bev_affine, warp_to_receivers
from opencood.registry import FUSIONS


class ConvGRUCell(nn.Module):
    """Convolutional GRU: (x (N, C_in, H, W), h (N, C, H, W)) -> new h (N, C, H, W)."""

    def __init__(self, input_channels: int, hidden_channels: int, kernel_size: int = 3):
        super().__init__()
        padding = kernel_size // 2
        both = input_channels + hidden_channels
        self.gates = nn.Conv2d(both, 2 * hidden_channels, kernel_size, padding=padding)
        self.candidate = nn.Conv2d(both, hidden_channels, kernel_size, padding=padding)

    def forward(self, x: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        reset, update = torch.sigmoid(self.gates(torch.cat([x, hidden], 1))).chunk(2, dim=1)
        candidate = torch.tanh(self.candidate(torch.cat([x, reset * hidden], 1)))
        return (1 - update) * hidden + update * candidate


@section
class V2VNetArgs:
    # K rounds of message passing (0: the ego's own map, through the output layer)
    num_iteration: int = spec(2, check=non_negative)
    kernel_size: int = spec(3, check=positive)           # of the ConvGRU convolutions
    # metres per feature cell and the map's centre in the ego frame (metres), for warping with
    # explicit pairwise transforms when the caller gives no grid (the detector gives its own)
    cell_size: float = spec(0.8, check=positive)
    grid_center: Tuple[float, float] = (0.0, 0.0)
    bytes_per_value: int = spec(FP32_BYTES, check=positive)
    # How a round updates a state. "gru_on_state": the ConvGRU reads [mean message, initial
    # map] with the current state as its hidden state (the paper's recurrent update).
    # "reference": OpenCOOD's wiring, which weights trained there expect: the GRU reads
    # [current state, mean message] with a zero hidden state, its output the new state, and
    # the mean message divides by every real sender (also those whose map misses the cell).
    round_update: Literal["gru_on_state", "reference"] = "gru_on_state"


@FUSIONS.register("v2vnet", args=V2VNetArgs)
class V2VNetFusion(FusionModule):
    """V2VNet message passing at the backbone output (after the optional shrink header), on
    (N, in_channels, H, W) maps. With ``num_iteration`` 0 no message CNN or GRU is built."""

    supported_stages = ("backbone",)
    warps_itself = True         # own-frame data: the detector passes pairwise transforms

    def __init__(self, args: V2VNetArgs, in_channels: int, num_anchors: int):
        num_iteration, kernel_size = args.num_iteration, args.kernel_size
        cell_size, grid_center = args.cell_size, args.grid_center
        super().__init__(args.bytes_per_value)
        if num_iteration < 0:
            raise ValueError(f"v2vnet num_iteration must be >= 0, got {num_iteration}")
        self.num_iteration = num_iteration
        self.round_update = args.round_update
        self.cell_size = float(cell_size)
        self.grid_center = tuple(float(v) for v in grid_center)
        # Only the rounds use the message CNN and the GRU: built without rounds they would get no
        # gradient, which DDP (without its unused-parameter search) refuses at the next step.
        has_rounds = num_iteration > 0
        self.message_cnn = nn.Conv2d(2 * in_channels, in_channels, 3, padding=1) \
            if has_rounds else None
        self.gru = ConvGRUCell(2 * in_channels, in_channels, kernel_size) if has_rounds else None
        self.output = nn.Conv2d(in_channels, in_channels, 1)   # OpenCOOD's per-cell linear

    def mean_messages(self, states: torch.Tensor, is_real: torch.Tensor,
                      theta: Optional[torch.Tensor], receivers: int) -> torch.Tensor:
        """The first ``receivers`` agents' mean message over their real senders.

        states (B, L, C, H, W); is_real (B, L) bool; theta (B, L, L, 2, 3), or None when the
        maps share one frame -> (B, receivers, C, H, W).
        """
        if theta is None:
            return self.mean_messages_in_one_frame(states, is_real, receivers)
        batch, agents, channels, height, width = states.shape
        senders, covered = warp_to_receivers(states, theta[:, :receivers])
        receiver_maps = states[:, :receivers].unsqueeze(2).expand_as(senders)
        pairs = torch.cat([receiver_maps, senders], dim=3)
        messages = self.message_cnn(pairs.reshape(-1, 2 * channels, height, width))
        messages = messages.view(batch, receivers, agents, channels, height, width)
        # A sender counts where it is a real agent and its map covers the receiver's cell.
        weight = (covered & is_real[:, None, :, None, None, None]).to(states.dtype)
        if self.round_update == "reference":
            # OpenCOOD: torch.mean over the sample's agents of the masked messages.
            senders = is_real.sum(1).to(states.dtype).view(batch, 1, 1, 1, 1)
            return (messages * weight).sum(2) / senders
        return (messages * weight).sum(2) / weight.sum(2).clamp(min=1.0)

    def mean_messages_in_one_frame(self, states: torch.Tensor, is_real: torch.Tensor,
                                   receivers: int) -> torch.Tensor:
        """``mean_messages`` for maps in one frame (no warp, every cell covered).

        The message CNN is one linear convolution, so over the concatenation [h_i, h_j] it is
        conv_receiver(h_i) + conv_sender(h_j) + bias, and the mean over senders j is
        conv_receiver(h_i) + bias + mean_j conv_sender(h_j): 2L convolutions over C channels
        instead of L^2 over 2C, the same messages up to float rounding.
        """
        batch, agents, channels, height, width = states.shape
        conv = self.message_cnn
        weight_receiver, weight_sender = conv.weight[:, :channels], conv.weight[:, channels:]
        from_receivers = F.conv2d(states[:, :receivers].reshape(-1, channels, height, width),
                                  weight_receiver, conv.bias, padding=conv.padding)
        from_senders = F.conv2d(states.reshape(-1, channels, height, width), weight_sender,
                                None, padding=conv.padding).view_as(states)
        real = is_real[:, :, None, None, None].to(states.dtype)
        sender_mean = (from_senders * real).sum(1, keepdim=True) / real.sum(1, keepdim=True)
        return from_receivers.view(batch, receivers, channels, height, width) + sender_mean

    def message_round(self, states: torch.Tensor, initial: torch.Tensor,
                      is_real: torch.Tensor, theta: Optional[torch.Tensor],
                      receivers: int) -> torch.Tensor:
        """One round: states and initial maps (B, L, C, H, W) -> the first ``receivers``
        agents' updated states (B, receivers, C, H, W)."""
        batch, _, channels, height, width = states.shape
        mean_message = self.mean_messages(states, is_real, theta, receivers)
        flat = (batch * receivers, channels, height, width)
        if self.round_update == "reference":
            gru_input = torch.cat([states[:, :receivers].reshape(flat),
                                   mean_message.reshape(flat)], dim=1)
            new_states = self.gru(gru_input, states.new_zeros(flat))
            return new_states.view(batch, receivers, channels, height, width)
        gru_input = torch.cat([mean_message.reshape(flat),
                               initial[:, :receivers].reshape(flat)], dim=1)
        hidden = states[:, :receivers].reshape(flat)
        return self.gru(gru_input, hidden).view(batch, receivers, channels, height, width)

    def forward(self, features: torch.Tensor, record_len: torch.Tensor,
                pairwise: Optional[torch.Tensor] = None,
                grid: Optional[BevGrid] = None) -> FusionResult:
        """features (N, C, H, W), record_len (B,); pairwise (B, L, L, 4, 4) optional, entry
        [b, i, j] maps agent j's feature frame into agent i's (None: frames coincide); grid:
        the detector's BEV geometry (None: this module's ``cell_size`` and ``grid_center``).
        -> FusionResult with the ego's final state through the output layer (B, C, H, W)."""
        padded, is_real = pad_by_sample(features, record_len)
        theta = None
        if pairwise is not None and grid is not None:
            theta = grid.affine(pairwise, *features.shape[2:])
        elif pairwise is not None:
            theta = bev_affine(pairwise, features.shape[2:], self.cell_size, self.grid_center)
        states = padded
        for round_index in range(self.num_iteration):
            # Only the ego's state after the last round reaches the head, so that round
            # updates the ego alone (the other agents' last updates would be discarded).
            last = round_index == self.num_iteration - 1
            states = self.message_round(states, padded, is_real, theta,
                                        receivers=1 if last else states.shape[1])
        fused = self.output(states[:, 0])
        map_bytes = float(features[0].numel() * self.bytes_per_value * self.num_iteration)
        comm_bytes = (record_len > 1).to(torch.float32) * map_bytes
        return FusionResult(fused, comm_bytes, {})
