"""V2X-ViT (Xu et al., ECCV 2022): a transformer over agents and space for V2X fusion.

Per-agent BEV maps (B, L, H, W, C) first get a delay-aware positional encoding: a fixed
sinusoid of each agent's latency (``agent_latency`` frames x ``rte_ratio``, OpenCOOD's RTE with
ratio 2 = 50 ms units for 100 ms frames) through a learned linear layer, added to every cell.
Then ``depth`` encoder layers, each ``num_blocks`` x [heterogeneous multi-agent self-attention
(HMSA), multi-scale window self-attention (MSwin)] and a feed-forward layer, all pre-norm with
residuals. The ego's map of the last layer feeds the head.

* HMSA, per BEV cell across the agents of a sample: queries, keys, values and the output use
  separate projections per agent type (vehicle, infrastructure = negative cav id), and every
  (receiver type, sender type) pair has its own attention and message matrices per head.
  Padded agent slots are masked as senders.
* MSwin, per agent: self-attention inside non-overlapping windows at several sizes (more heads
  for the small windows), each with a learned relative-position bias, merged by split attention
  (a softmax over the branches driven by the map's mean feature). Maps not divisible by a window
  size are zero-padded and the padding masked as keys.

* STTF (spatial-temporal transformation), after the delay encoding and before the first layer:
  every non-ego map is warped by its ``spatial_correction_matrix`` (B, L, 4, 4): the transform
  from the ego pose at the time the agent's data was taken (its delayed frame, where our
  proj_first points put its map) to the ego's current pose. The ego's map is never warped. With
  ``roi_mask`` a sender's cells that the warp brings in from outside its map are masked in
  HMSA (V2X-ViT's ROI mask). An absent matrix is the identity: no warp, nothing masked.
  ``warp: centred`` samples with ``bev_affine`` (rotation about the map centre);
  ``warp: reference`` reproduces the authors' discretisation exactly (``reference_sttf_theta``:
  rotation about cell index (W/2, H/2), half a cell off the centre, ``align_corners=True``,
  ROI by a nearest-neighbour warp of ones). Pure translations give the same map either way.

Bytes: a non-ego agent sends its whole (C, H, W) map once.
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import non_negative, positive, section, spec
from opencood.models.fusion import (FP32_BYTES, FusionModule, FusionResult, dense_comm_bytes,
                                    pad_by_sample)
from opencood.models.warp import bev_affine, warp_to_receivers
from opencood.registry import FUSIONS

NUM_AGENT_TYPES = 2          # 0 vehicle, 1 infrastructure (opencood.data.datasets)


def masked_softmax(scores: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim with ``keep`` False entries excluded (finite fill, so a row
    with nothing kept stays finite; such rows are padding and thrown away)."""
    return torch.softmax(scores.masked_fill(~keep, torch.finfo(scores.dtype).min), dim=-1)


def sinusoid_table(length: int, dim: int) -> torch.Tensor:
    """(length, dim) transformer sinusoids, scaled by 1/sqrt(dim) as OpenCOOD's RTE."""
    position = torch.arange(length, dtype=torch.float32).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : dim // 2]
    return table / math.sqrt(dim)


def reference_sttf_theta(correction: torch.Tensor, grid_hw: Sequence[int],
                         cell_size: float) -> torch.Tensor:
    """The authors' STTF sampling matrices (v2x-vit ``get_discretized_transformation_matrix``,
    ``get_transformation_matrix``, ``warp_affine``), for ``align_corners=True``.

    correction (N, 4, 4) metric; grid_hw (H, W); cell_size metres per cell (their voxel size x
    downsample rate). Their pixel map is T(p) = R (p - c) + c + t / cell_size, p = (column, row)
    index, c = (W / 2, H / 2) (half a cell off the map's centre, which is ((W-1)/2, (H-1)/2)),
    and output(p) = input(T^-1 p). Returns (N, 2, 3): normalised output -> normalised input
    coordinates, x_norm = 2 p / (size - 1) - 1. Composed in float64 (they invert in fp32: the
    grids agree to ~1e-6 of a cell).
    """
    height, width = grid_hw
    count = correction.shape[0]
    pixel = torch.eye(3, dtype=torch.float64, device=correction.device).repeat(count, 1, 1)
    rotation = correction[:, :2, :2].double()
    centre = torch.tensor([width / 2, height / 2], dtype=torch.float64, device=correction.device)
    pixel[:, :2, :2] = rotation
    pixel[:, :2, 2] = centre - rotation @ centre + correction[:, :2, 3].double() / cell_size
    normalise = torch.eye(3, dtype=torch.float64, device=correction.device)
    normalise[0, 0], normalise[1, 1] = 2.0 / max(width - 1, 1e-14), 2.0 / max(height - 1, 1e-14)
    normalise[:2, 2] = -1.0
    theta = normalise @ torch.linalg.inv(pixel) @ torch.linalg.inv(normalise)
    return theta[:, :2].to(torch.float32)


def reference_sttf(x: torch.Tensor, correction: torch.Tensor, cell_size: float):
    """Warp x (N, C, H, W) by correction (N, 4, 4) as the authors' STTF does -> (warped,
    roi (N, H, W) bool: cells whose nearest source cell lies inside the map)."""
    count, channels, height, width = x.shape
    theta = reference_sttf_theta(correction, (height, width), cell_size).to(x.dtype)
    grid = F.affine_grid(theta, [count, channels, height, width], align_corners=True)
    warped = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
    ones = torch.ones(count, 1, height, width, dtype=x.dtype, device=x.device)
    roi = F.grid_sample(ones, grid, mode="nearest", padding_mode="zeros", align_corners=True)
    return warped, roi[:, 0] > 0.5


def apply_sttf(x: torch.Tensor, correction: torch.Tensor, cell_size: float, warp: str):
    """STTF on x (B, L, H, W, C): warp every non-ego map by its correction (B, L, 4, 4) ->
    (x, roi (B, H, W, L) bool; the ego's all True)."""
    batch, agents, height, width, channels = x.shape
    others = x[:, 1:].permute(0, 1, 4, 2, 3).reshape(-1, channels, height, width)
    matrices = correction[:, 1:agents].reshape(-1, 4, 4)
    if warp == "reference":
        warped, roi = reference_sttf(others, matrices, cell_size)
    else:
        theta = bev_affine(matrices.double(), (height, width), cell_size).to(x.dtype)
        warped, covered = warp_to_receivers(others[None], theta[None, None])
        warped, roi = warped[0, 0], covered[0, 0, :, 0]
    warped = warped.view(batch, agents - 1, channels, height, width).permute(0, 1, 3, 4, 2)
    roi = roi.view(batch, agents - 1, height, width)
    ego_roi = torch.ones_like(roi[:, :1])
    return (torch.cat([x[:, :1], warped], dim=1),
            torch.cat([ego_roi, roi], dim=1).permute(0, 2, 3, 1))


class DelayEncoding(nn.Module):
    """x (B, L, H, W, C) + Linear(table[delay x ratio]) per agent; delay (B, L) int frames.

    ``learned_table``: the sinusoid table is a trained parameter (saved in checkpoints), as
    the authors' ``nn.Embedding`` is (their ``requires_grad = False`` lands on the module, not
    on its weight); otherwise a fixed buffer."""

    def __init__(self, dim: int, rte_ratio: int = 2, max_len: int = 100,
                 learned_table: bool = False):
        super().__init__()
        self.rte_ratio = int(rte_ratio)
        if learned_table:
            self.table = nn.Parameter(sinusoid_table(max_len, dim))
        else:
            self.register_buffer("table", sinusoid_table(max_len, dim), persistent=False)
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, delay: torch.Tensor) -> torch.Tensor:
        index = (delay.long() * self.rte_ratio).clamp(0, self.table.shape[0] - 1)
        encoding = self.linear(self.table[index].to(x.dtype))          # (B, L, C)
        return x + encoding[:, :, None, None, :]


def typed_linear(x: torch.Tensor, layers: nn.ModuleList, types: torch.Tensor) -> torch.Tensor:
    """Per-agent choice among ``layers`` (one nn.Linear per agent type).

    x (B, L, H, W, C_in), types (B, L) -> (B, L, H, W, C_out). The weights are stacked and
    indexed rather than looped over, so every type's layer is in the graph (a zero gradient when
    no agent has that type: DDP runs without unused-parameter search).
    """
    weight = torch.stack([layer.weight for layer in layers])[types]          # (B, L, out, in)
    bias = torch.stack([layer.bias for layer in layers])[types]              # (B, L, out)
    return torch.einsum("blhwi,bloi->blhwo", x, weight) + bias[:, :, None, None, :]


class HeteroAgentAttention(nn.Module):
    """HMSA: per-cell attention across agents with type-specific projections and relations.

    forward: x (B, L, H, W, C), types (B, L) int, senders (B, H or 1, W or 1, L) bool (which
    agents may send at each cell: real and, with STTF, inside their warped map)
    -> (B, L, H, W, C). score(i <- j) = q_i^T W_att[t_i, t_j] k_j / sqrt(d) per head;
    message(i <- j) = W_msg[t_i, t_j] v_j; output of agent i through its type's output
    projection.
    """

    def __init__(self, dim: int, heads: int = 8, dim_head: int = 32, dropout: float = 0.0,
                 num_types: int = NUM_AGENT_TYPES):
        super().__init__()
        inner = heads * dim_head
        self.heads, self.dim_head, self.num_types = heads, dim_head, num_types
        self.to_q = nn.ModuleList(nn.Linear(dim, inner) for _ in range(num_types))
        self.to_k = nn.ModuleList(nn.Linear(dim, inner) for _ in range(num_types))
        self.to_v = nn.ModuleList(nn.Linear(dim, inner) for _ in range(num_types))
        self.to_out = nn.ModuleList(nn.Linear(inner, dim) for _ in range(num_types))
        relations = num_types * num_types          # index: receiver_type * num_types + sender
        self.relation_att = nn.Parameter(torch.empty(relations, heads, dim_head, dim_head))
        self.relation_msg = nn.Parameter(torch.empty(relations, heads, dim_head, dim_head))
        for relation in (self.relation_att, self.relation_msg):
            nn.init.xavier_uniform_(relation.view(-1, dim_head, dim_head))
        self.dropout = nn.Dropout(dropout)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, self.dim_head))             # (B, L, H, W, M, d)

    def relate(self, relation: torch.Tensor, senders: torch.Tensor,
               types: torch.Tensor) -> torch.Tensor:
        """Apply W[t, t_j] to sender j's (B, L, H, W, M, d) for every receiver type t.
        -> (T, B, L, H, W, M, d)."""
        matrices = relation.view(self.num_types, self.num_types, *relation.shape[1:])
        matrices = matrices[:, types]                                    # (T, B, L, M, d, d)
        return torch.einsum("tblmpq,blhwmq->tblhwmp", matrices, senders)

    def forward(self, x: torch.Tensor, types: torch.Tensor, senders: torch.Tensor):
        q = self.split_heads(typed_linear(x, self.to_q, types))
        k = self.split_heads(typed_linear(x, self.to_k, types))
        v = self.split_heads(typed_linear(x, self.to_v, types))
        # Each receiver uses the rows of its own type: one-hot over the T candidates.
        receiver_type = F.one_hot(types, self.num_types).to(x.dtype)          # (B, L, T)
        keys = self.relate(self.relation_att, k, types)
        scores = torch.einsum("bihwmp,tbjhwmp->tbhwmij", q, keys) / math.sqrt(self.dim_head)
        scores = torch.einsum("bit,tbhwmij->bhwmij", receiver_type, scores)
        attention = masked_softmax(scores, senders[:, :, :, None, None, :])
        messages = self.relate(self.relation_msg, v, types)
        out = torch.einsum("bhwmij,tbjhwmd->tbihwmd", attention, messages)
        out = torch.einsum("bit,tbihwmd->bihwmd", receiver_type, out).flatten(-2)
        return self.dropout(typed_linear(out, self.to_out, types))


def pad_to_windows(x: torch.Tensor, window: int):
    """(B, L, H, W, C) -> zero-padded (B, L, Hp, Wp, C) with Hp, Wp multiples of ``window``,
    and (Hp, Wp) bool of real cells."""
    height, width = x.shape[2:4]
    pad_h, pad_w = (-height) % window, (-width) % window
    padded = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    real = torch.zeros(height + pad_h, width + pad_w, dtype=torch.bool, device=x.device)
    real[:height, :width] = True
    return padded, real


def relative_offsets(window: int) -> torch.Tensor:
    """(w*w, w*w, 2) offsets (dy, dx) + w - 1 between the cells of a window (>= 0)."""
    rows, cols = torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")
    cells = torch.stack([rows.flatten(), cols.flatten()], dim=-1)
    return cells[None, :, :] - cells[:, None, :] + window - 1


class WindowAttention(nn.Module):
    """Self-attention inside each agent's non-overlapping w x w windows, with a learned bias per
    relative (dy, dx) offset shared by the heads (OpenCOOD). (B, L, H, W, C) -> same shape."""

    def __init__(self, dim: int, heads: int, dim_head: int, window: int, dropout: float = 0.0):
        super().__init__()
        self.heads, self.dim_head, self.window = heads, dim_head, window
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.position_bias = nn.Parameter(torch.randn(2 * window - 1, 2 * window - 1))
        self.register_buffer("offsets", relative_offsets(window), persistent=False)
        self.to_out = nn.Sequential(nn.Linear(heads * dim_head, dim), nn.Dropout(dropout))

    def partition(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, Hp, Wp, D) -> (B, L, nH, nW, w*w, D)."""
        batch, agents, height, width, dim = x.shape
        w = self.window
        x = x.view(batch, agents, height // w, w, width // w, w, dim).transpose(3, 4)
        return x.reshape(batch, agents, height // w, width // w, w * w, dim)

    def merge(self, x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Inverse of ``partition``: (B, L, nH, nW, w*w, D) -> (B, L, Hp, Wp, D)."""
        batch, agents, n_h, n_w, _, dim = x.shape
        w = self.window
        x = x.view(batch, agents, n_h, n_w, w, w, dim).transpose(3, 4)
        return x.reshape(batch, agents, height, width, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        height, width = x.shape[2:4]
        padded, real = pad_to_windows(x, self.window)
        windows = self.partition(self.to_qkv(padded))
        q, k, v = windows.unflatten(-1, (3, self.heads, self.dim_head)).unbind(-3)
        scores = torch.einsum("blxyimd,blxyjmd->blxymij", q, k) / math.sqrt(self.dim_head)
        scores = scores + self.position_bias[self.offsets[..., 0], self.offsets[..., 1]]
        key_real = self.partition(real[None, None, :, :, None])[..., 0]    # (1, 1, nH, nW, w*w)
        attention = masked_softmax(scores, key_real[:, :, :, :, None, None, :])
        out = torch.einsum("blxymij,blxyjmd->blxyimd", attention, v).flatten(-2)
        out = self.merge(out, *padded.shape[2:4])[:, :, :height, :width]
        return self.to_out(out)


class SplitAttention(nn.Module):
    """Merges branch outputs by a per-agent softmax over branches (ResNeSt-style), computed from
    the mean feature of the summed branches. [(B, L, H, W, C)] * n -> (B, L, H, W, C)."""

    def __init__(self, dim: int, branches: int):
        super().__init__()
        self.branches = branches
        self.squeeze = nn.Sequential(nn.Linear(dim, dim, bias=False), nn.LayerNorm(dim),
                                     nn.ReLU())
        self.excite = nn.Linear(dim, dim * branches, bias=False)

    def forward(self, outputs: Sequence[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(list(outputs), dim=-2)                      # (B, L, H, W, n, C)
        summary = stacked.sum(dim=-2).mean(dim=(2, 3))                    # (B, L, C)
        logits = self.excite(self.squeeze(summary)).unflatten(-1, (self.branches, -1))
        weights = torch.softmax(logits, dim=-2)[:, :, None, None]         # (B, L, 1, 1, n, C)
        return (stacked * weights).sum(dim=-2)


class MultiScaleWindowAttention(nn.Module):
    """MSwin: one WindowAttention per (heads, dim_head, window) triple, merged by split
    attention (or their mean with ``merge="mean"``). (B, L, H, W, C) -> same shape."""

    def __init__(self, dim: int, heads: Sequence[int], dim_heads: Sequence[int],
                 windows: Sequence[int], dropout: float = 0.0, merge: str = "split_attn"):
        super().__init__()
        if not len(heads) == len(dim_heads) == len(windows):
            raise ValueError("v2xvit window_heads, window_dim_heads and window_sizes must have "
                             "one entry per scale")
        if merge not in ("split_attn", "mean"):
            raise ValueError(f"v2xvit window_merge must be 'split_attn' or 'mean', got {merge!r}")
        self.scales = nn.ModuleList(WindowAttention(dim, h, d, w, dropout)
                                    for h, d, w in zip(heads, dim_heads, windows))
        self.split = SplitAttention(dim, len(windows)) if merge == "split_attn" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = [scale(x) for scale in self.scales]
        if self.split is None:
            return torch.stack(outputs).mean(dim=0)
        return self.split(outputs)


class FeedForward(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout),
                         nn.Linear(hidden, dim), nn.Dropout(dropout))


class V2XFusionBlock(nn.Module):
    """Pre-norm residual HMSA then pre-norm residual MSwin."""

    def __init__(self, dim: int, agent_attention: HeteroAgentAttention,
                 window_attention: MultiScaleWindowAttention):
        super().__init__()
        self.agent_norm, self.agent_attention = nn.LayerNorm(dim), agent_attention
        self.window_norm, self.window_attention = nn.LayerNorm(dim), window_attention

    def forward(self, x, types, senders):
        x = x + self.agent_attention(self.agent_norm(x), types, senders)
        return x + self.window_attention(self.window_norm(x))


@section
class V2XViTArgs:
    depth: int = spec(3, check=positive)            # encoder layers
    num_blocks: int = spec(1, check=positive)       # fusion blocks per layer
    heads: int = spec(8, check=positive)            # HMSA heads
    dim_head: int = spec(32, check=positive)        # and their width
    # one entry per MSwin scale
    window_sizes: Tuple[int, ...] = (4, 8, 16)
    window_heads: Tuple[int, ...] = (16, 8, 4)
    window_dim_heads: Tuple[int, ...] = (16, 32, 64)
    window_merge: Literal["split_attn", "mean"] = "split_attn"     # split_attn: V2X-ViT's
    mlp_dim: int = spec(256, check=positive)        # feed-forward width
    dropout: float = spec(0.0, check=non_negative)  # everywhere
    rte_ratio: int = spec(2, check=positive)        # delay-encoding steps per latency frame
    use_delay_encoding: bool = True                 # off for ablation
    # delay table: fixed sinusoids (ours) or a trained parameter initialised to them (the
    # authors': their nn.Embedding trains and is saved)
    delay_table: Literal["fixed", "learned"] = "fixed"
    # STTF: metres per fused-map cell (voxel x stride), the warp's discretisation (module doc)
    # and whether warped-in empty cells are masked as senders
    cell_size: float = spec(1.6, check=positive)
    warp: Literal["centred", "reference"] = "centred"
    roi_mask: bool = True
    # the authors' Linear(C + 3, C) "prior_feed", never called in their forward: kept only so
    # their checkpoints import and export strictly
    prior_feed: bool = False
    bytes_per_value: int = spec(FP32_BYTES, check=positive)


@FUSIONS.register("v2xvit", args=V2XViTArgs)
class V2XViTFusion(FusionModule):
    """V2X-ViT encoder at the backbone output (after the optional shrink header), on
    (N, in_channels, H, W) maps (in_channels: the transformer width)."""

    supported_stages = ("backbone",)
    extra_inputs = ("agent_types", "agent_latency", "spatial_correction_matrix")

    def __init__(self, args: V2XViTArgs, in_channels: int, num_anchors: int):
        super().__init__(args.bytes_per_value)
        self.delay_encoding = DelayEncoding(
            in_channels, args.rte_ratio, learned_table=args.delay_table == "learned") \
            if args.use_delay_encoding else None
        self.cell_size, self.warp, self.roi_mask = args.cell_size, args.warp, args.roi_mask
        if args.prior_feed:
            # Frozen: it never sees a gradient (DDP without unused-parameter search would stop)
            self.prior_feed = nn.Linear(in_channels + 3, in_channels).requires_grad_(False)
        self.blocks = nn.ModuleList()
        self.feed_forwards = nn.ModuleList()
        for _ in range(args.depth):
            self.blocks.append(nn.ModuleList(
                V2XFusionBlock(in_channels,
                               HeteroAgentAttention(in_channels, args.heads, args.dim_head,
                                                    args.dropout),
                               MultiScaleWindowAttention(in_channels, args.window_heads,
                                                         args.window_dim_heads,
                                                         args.window_sizes, args.dropout,
                                                         args.window_merge))
                for _ in range(args.num_blocks)))
            self.feed_forwards.append(nn.Sequential(
                nn.LayerNorm(in_channels), FeedForward(in_channels, args.mlp_dim, args.dropout)))

    def forward(self, features: torch.Tensor, record_len: torch.Tensor,
                agent_types: Optional[torch.Tensor] = None,
                agent_latency: Optional[torch.Tensor] = None,
                spatial_correction_matrix: Optional[torch.Tensor] = None) -> FusionResult:
        """features (N, C, H, W), record_len (B,), agent_types / agent_latency (N,) int or None
        (all vehicles / no delay), spatial_correction_matrix (B, L' >= L, 4, 4) per sample
        slot, padded with anything, or None (identity) -> FusionResult with the ego's map
        (B, C, H, W)."""
        padded, is_real = pad_by_sample(features, record_len)
        x = padded.permute(0, 1, 3, 4, 2)                                  # (B, L, H, W, C)
        no_values = torch.zeros(features.shape[0], dtype=torch.long, device=features.device)
        types = pad_by_sample(agent_types if agent_types is not None else no_values,
                              record_len)[0].long()
        if self.delay_encoding is not None:
            delay = agent_latency if agent_latency is not None else no_values
            x = self.delay_encoding(x, pad_by_sample(delay, record_len)[0])
        senders = is_real[:, None, None, :]                                # (B, 1, 1, L)
        if spatial_correction_matrix is not None and x.shape[1] > 1:
            if spatial_correction_matrix.shape[1] < x.shape[1]:
                raise ValueError(f"v2xvit: spatial_correction_matrix has "
                                 f"{spatial_correction_matrix.shape[1]} agent slots, the batch "
                                 f"{x.shape[1]}")
            x, roi = apply_sttf(x, spatial_correction_matrix, self.cell_size, self.warp)
            if self.roi_mask:
                senders = senders & roi
        for blocks, feed_forward in zip(self.blocks, self.feed_forwards):
            for block in blocks:
                x = block(x, types, senders)
            x = x + feed_forward(x)
        fused = x[:, 0].permute(0, 3, 1, 2).contiguous()
        return FusionResult(fused, dense_comm_bytes(features, record_len, self.bytes_per_value),
                            {})
