"""CoBEVT's FuseBEVT (Xu et al., CoRL 2022), the LiDAR variant as in OpenCOOD.

Fused axial attention over the per-agent BEV maps (B, L, C, H, W): each of ``depth`` blocks runs
1. local window attention: the tokens of one w x w window of *every* agent attend to each other
   (L x w x w tokens), then a feed-forward layer;
2. global sparse grid attention: the map is split into a w x w grid of dilated cells (stride
   H / w), and the tokens of one grid group of every agent attend to each other, so information
   crosses the whole map in one step; then a feed-forward layer.
Every step is pre-norm with a residual. Attention carries a learned relative-position bias per
head. The agents' maps are then averaged over the real agents of the sample, normalised and
projected (OpenCOOD's ``mlp_head``).

Two deliberate departures from OpenCOOD, both for the ego's output to be independent of the
order of the non-ego agents: the bias's agent term distinguishes only "same agent" from "other
agent" (OpenCOOD indexes the agent offset, which depends on the arbitrary order), and the final
mean is over real agents only (OpenCOOD also averages the padded slots). Padded agent slots and
the zero padding that makes H, W multiples of w are masked as keys. The reference options
``agent_bias: slot_offset`` (with ``max_agents``, OpenCOOD's ``agent_size``) and
``mean_over: all_slots`` restore OpenCOOD's: agents padded to ``max_agents`` slots, its 3-D
bias table indexed by (slot, dy, dx) of query minus key, the mean over every slot.
Bytes: a non-ego agent sends its whole (C, H, W) map once.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from typing import Literal, Optional

from opencood.config_schema import Problems, non_negative, positive, section, spec
from opencood.models.fusion import (FP32_BYTES, FusionModule, FusionResult, dense_comm_bytes,
                                    pad_by_sample)
from opencood.registry import FUSIONS


def to_windows(x: torch.Tensor, window: int, grid: bool) -> torch.Tensor:
    """(B, L, Hp, Wp, D) -> (B, nH, nW, L, w*w, D) token groups.

    grid=False: local windows (contiguous w x w blocks). grid=True: sparse global grid, group
    (y, x) holds the cells (y + i * nH, x + j * nW), i, j < w (OpenCOOD's '(w1 x)' layout).
    """
    batch, agents, height, width, dim = x.shape
    n_h, n_w = height // window, width // window
    if grid:
        x = x.view(batch, agents, window, n_h, window, n_w, dim).permute(0, 3, 5, 1, 2, 4, 6)
    else:
        x = x.view(batch, agents, n_h, window, n_w, window, dim).permute(0, 2, 4, 1, 3, 5, 6)
    return x.reshape(batch, n_h, n_w, agents, window * window, dim)


def from_windows(x: torch.Tensor, height: int, width: int, grid: bool) -> torch.Tensor:
    """Inverse of ``to_windows``: (B, nH, nW, L, w*w, D) -> (B, L, Hp, Wp, D)."""
    batch, n_h, n_w, agents, cells, dim = x.shape
    window = int(round(math.sqrt(cells)))
    x = x.view(batch, n_h, n_w, agents, window, window, dim)
    if grid:
        x = x.permute(0, 3, 4, 1, 5, 2, 6)
    else:
        x = x.permute(0, 3, 1, 4, 2, 5, 6)
    return x.reshape(batch, agents, height, width, dim)


def relative_index(window: int) -> torch.Tensor:
    """Bias-table index of a (query cell, key cell) pair: (2, w*w, w*w), [0] when both tokens
    belong to the same agent, [1] when to different agents, each by the cell offset (dy, dx).
    Which agent slots the tokens occupy does not enter (order invariance)."""
    rows, cols = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    cells = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    offset = cells[None, :, :] - cells[:, None, :] + window - 1
    flat = offset[..., 0] * (2 * window - 1) + offset[..., 1]
    per_agent = (2 * window - 1) ** 2
    return torch.stack([flat, flat + per_agent])


def slot_offset_index(slots: int, window: int) -> torch.Tensor:
    """OpenCOOD's ``relative_position_index``: (S*w*w, S*w*w) bias-table index of a (query,
    key) token pair, tokens ordered (slot, row, col), from the offset query minus key in each
    of the three, shifted to start at 0: table size (2S - 1) (2w - 1)^2."""
    slot, row, col = torch.meshgrid(torch.arange(slots), torch.arange(window),
                                    torch.arange(window), indexing="ij")
    tokens = torch.stack([slot.flatten(), row.flatten(), col.flatten()])         # (3, S*w*w)
    offset = tokens[:, :, None] - tokens[:, None, :]
    offset[0] += slots - 1
    offset[1:] += window - 1
    span = 2 * window - 1
    return offset[0] * span * span + offset[1] * span + offset[2]


class AgentWindowAttention(nn.Module):
    """Multi-head attention among the L x w x w tokens of each window (or grid) group.

    forward: groups (B, nH, nW, L, w*w, C), keep (B, nH, nW, L, w*w) bool keys -> same shape.
    ``slots``: OpenCOOD's agent-slot bias (``slot_offset_index``), for at most ``slots``
    agents; None: same/other agent (``relative_index``).
    """

    def __init__(self, dim: int, dim_head: int, window: int, dropout: float = 0.0,
                 slots: Optional[int] = None):
        super().__init__()
        if dim % dim_head:
            raise ValueError(f"cobevt dim ({dim}) must be divisible by dim_head ({dim_head})")
        self.heads, self.dim_head = dim // dim_head, dim_head
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Dropout(dropout))
        self.slots = slots
        if slots is None:
            self.bias_table = nn.Embedding(2 * (2 * window - 1) ** 2, self.heads)
            self.register_buffer("index", relative_index(window), persistent=False)
        else:
            self.bias_table = nn.Embedding((2 * slots - 1) * (2 * window - 1) ** 2, self.heads)
            # Persistent, as OpenCOOD's (its checkpoints carry it): imported, never learnt.
            self.register_buffer("slot_index", slot_offset_index(slots, window))

    def position_bias(self, agents: int) -> torch.Tensor:
        """(heads, L*w*w, L*w*w) learned bias: same/other agent (or slot offset) and cell
        offset."""
        if self.slots is not None:
            tokens = agents * self.slot_index.shape[0] // self.slots   # the first L slots
            return self.bias_table(self.slot_index[:tokens, :tokens]).permute(2, 0, 1)
        same = torch.eye(agents, dtype=torch.bool, device=self.index.device)
        index = torch.where(same[:, None, :, None], self.index[0][None, :, None, :],
                            self.index[1][None, :, None, :])          # (L, w*w, L, w*w)
        cells = self.index.shape[-1]
        bias = self.bias_table(index.reshape(agents * cells, agents * cells))
        return bias.permute(2, 0, 1)

    def forward(self, groups: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        shape = groups.shape
        tokens = groups.flatten(3, 4)                                  # (B, nH, nW, N, C)
        q, k, v = self.to_qkv(tokens).unflatten(-1, (3, self.heads, self.dim_head)).unbind(-3)
        scores = torch.einsum("bxyimd,bxyjmd->bxymij", q, k) / math.sqrt(self.dim_head)
        scores = scores + self.position_bias(shape[3])
        keep = keep.flatten(3, 4)[:, :, :, None, None, :]
        attention = torch.softmax(
            scores.masked_fill(~keep, torch.finfo(scores.dtype).min), dim=-1)
        out = torch.einsum("bxymij,bxyjmd->bxyimd", attention, v).flatten(-2)
        return self.to_out(out).view(shape)


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(hidden, dim), nn.Dropout(dropout))


class FusedAxialBlock(nn.Module):
    """Window attention + FFN, then grid attention + FFN, each pre-norm residual.
    forward: x (B, L, Hp, Wp, C), keep (B, L, Hp, Wp) bool -> same shape as x."""

    def __init__(self, dim: int, mlp_dim: int, dim_head: int, window: int, dropout: float = 0.0,
                 slots: Optional[int] = None):
        super().__init__()
        self.window = window
        self.window_norm = nn.LayerNorm(dim)
        self.window_attention = AgentWindowAttention(dim, dim_head, window, dropout, slots)
        self.window_ffn = nn.Sequential(nn.LayerNorm(dim), FeedForward(dim, mlp_dim, dropout))
        self.grid_norm = nn.LayerNorm(dim)
        self.grid_attention = AgentWindowAttention(dim, dim_head, window, dropout, slots)
        self.grid_ffn = nn.Sequential(nn.LayerNorm(dim), FeedForward(dim, mlp_dim, dropout))

    def attend(self, x, keep, norm, attention, grid: bool):
        height, width = x.shape[2:4]
        groups = to_windows(norm(x), self.window, grid)
        keep_groups = to_windows(keep.unsqueeze(-1), self.window, grid)[..., 0]
        return x + from_windows(attention(groups, keep_groups), height, width, grid)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.attend(x, keep, self.window_norm, self.window_attention, grid=False)
        x = x + self.window_ffn(x)
        x = self.attend(x, keep, self.grid_norm, self.grid_attention, grid=True)
        return x + self.grid_ffn(x)


@section
class CoBEVTArgs:
    depth: int = spec(3, check=positive)            # fused axial blocks
    window: int = spec(4, check=positive)           # w of the local windows and the global grid
    dim_head: int = spec(32, check=positive)        # width per head (heads = C / dim_head)
    mlp_dim: int = spec(256, check=positive)        # feed-forward width
    dropout: float = spec(0.0, check=non_negative)  # everywhere
    bytes_per_value: int = spec(FP32_BYTES, check=positive)
    # Reference options (module docstring): "slot_offset" needs max_agents (OpenCOOD's
    # agent_size, its max_cav), the slots agents are padded to.
    agent_bias: Literal["same_other", "slot_offset"] = "same_other"
    mean_over: Literal["real_agents", "all_slots"] = "real_agents"
    max_agents: Optional[int] = spec(None, check=positive)

    def problems(self) -> Problems:
        if (self.agent_bias == "slot_offset" or self.mean_over == "all_slots") and \
                self.max_agents is None:
            yield "max_agents", "is required by agent_bias slot_offset / mean_over all_slots"


@FUSIONS.register("cobevt", args=CoBEVTArgs)
class FuseBEVT(FusionModule):
    """FuseBEVT at the backbone output (after the optional shrink header), on (N, in_channels,
    H, W) maps."""

    supported_stages = ("backbone",)

    def __init__(self, args: CoBEVTArgs, in_channels: int, num_anchors: int):
        super().__init__(args.bytes_per_value)
        self.window = args.window
        self.max_agents = args.max_agents
        self.mean_over = args.mean_over
        slots = args.max_agents if args.agent_bias == "slot_offset" else None
        self.blocks = nn.ModuleList(
            FusedAxialBlock(in_channels, args.mlp_dim, args.dim_head, args.window, args.dropout,
                            slots)
            for _ in range(args.depth))
        self.head_norm = nn.LayerNorm(in_channels)
        self.head = nn.Linear(in_channels, in_channels)

    def forward(self, features: torch.Tensor, record_len: torch.Tensor) -> FusionResult:
        """features (N, C, H, W), record_len (B,) -> FusionResult, fused map (B, C, H, W)."""
        height, width = features.shape[2:]
        if self.max_agents is not None and int(record_len.max()) > self.max_agents:
            raise ValueError(f"cobevt: a sample has {int(record_len.max())} agents, more than "
                             f"max_agents ({self.max_agents})")
        padded, is_real = pad_by_sample(features, record_len, self.max_agents)
        pad_h, pad_w = (-height) % self.window, (-width) % self.window
        x = F.pad(padded.permute(0, 1, 3, 4, 2), (0, 0, 0, pad_w, 0, pad_h))  # (B, L, Hp, Wp, C)
        in_map = torch.zeros(x.shape[2:4], dtype=torch.bool, device=x.device)
        in_map[:height, :width] = True
        keep = is_real[:, :, None, None] & in_map
        for block in self.blocks:
            x = block(x, keep)
        x = x[:, :, :height, :width]
        # OpenCOOD's mean takes every slot, padded ones (their outputs are not zero) included.
        weight = (is_real if self.mean_over == "real_agents" else torch.ones_like(is_real)
                  ).to(x.dtype)[:, :, None, None, None]
        mean = (x * weight).sum(1) / weight.sum(1)                           # (B, H, W, C)
        fused = self.head(self.head_norm(mean)).permute(0, 3, 1, 2).contiguous()
        return FusionResult(fused, dense_comm_bytes(features, record_len, self.bytes_per_value),
                            {})
