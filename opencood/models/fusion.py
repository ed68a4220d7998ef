"""Intermediate-fusion modules: per-agent BEV maps -> one map per sample, at the ego.

Every module takes ``features`` (N_agents, C, H, W), where the agents of a sample are consecutive
with the ego first, and ``record_len`` (B,) agents per sample, and returns a ``FusionResult``:
the fused (B, C, H, W) map, ``comm_bytes`` (B,) — bytes one non-ego agent transmits for this map,
averaged over the sample's non-ego agents, 0 for a sample with the ego alone — and auxiliary
outputs for the loss. The non-ego maps arrive in the ego frame: either the points were projected
before pillarisation (OpenCOOD's ``proj_first``) or the detector warped each agent's map into the
ego frame (own-frame data, ``opencood.models.warp``), so fusion is per BEV location.

Agents are padded to (B, L, C, H, W) with a validity mask (L = most agents in any sample) so a
whole batch is fused at once, with no Python loop over samples.

Where each module is applied (the detector's ``stage``) decides what is transmitted:
``attfuse`` fuses every backbone scale (OpenCOOD AttFuse), so an agent sends every scale's map;
``fcooper`` max-fuses the scattered pillar canvas (F-Cooper's voxel-feature fusion), so it sends
that canvas; ``where2comm`` fuses the backbone output and sends only its selected cells.

A module is registered with the schema of its yaml arguments (``@FUSIONS.register(name,
args=...)``) and built as ``cls(args, in_channels=C, num_anchors=A)`` from the parsed arguments.
"""
from __future__ import annotations

import math
from typing import Literal, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import non_negative, positive, section, spec
from opencood.models.heads import prior_bias
from opencood.registry import FUSIONS

STAGES = ("scatter", "multiscale", "backbone")
FP32_BYTES = 4


class FusionResult(NamedTuple):
    features: torch.Tensor      # (B, C, H, W)
    comm_bytes: torch.Tensor    # (B,) float
    aux: dict                   # extra outputs for the loss, e.g. where2comm confidence logits


def agent_slots(record_len: torch.Tensor, num_agents: int):
    """-> sample index (N,), slot within the sample (N,), 0 for the ego."""
    samples = torch.arange(record_len.shape[0], device=record_len.device)
    sample_index = torch.repeat_interleave(samples, record_len, output_size=num_agents)
    first_agent = torch.cumsum(record_len, 0) - record_len
    slot = torch.arange(num_agents, device=record_len.device) - first_agent[sample_index]
    return sample_index, slot


def pad_by_sample(features: torch.Tensor, record_len: torch.Tensor,
                  max_agents: Optional[int] = None):
    """(N, C, H, W) -> zero-padded (B, L, C, H, W) and (B, L) bool mask of real agents.

    L = ``max_agents``, or the most agents in a sample (``record_len.max()``, a host sync) when
    None; a larger L only adds padded slots."""
    sample_index, slot = agent_slots(record_len, features.shape[0])
    if max_agents is None:
        max_agents = int(record_len.max())
    shape = (record_len.shape[0], max_agents)
    padded = features.new_zeros(*shape, *features.shape[1:])
    padded = padded.index_put((sample_index, slot), features)
    is_real = torch.zeros(shape, dtype=torch.bool, device=features.device)
    # A device True, not the Python one (which becomes a host tensor copied to the device).
    is_real[sample_index, slot] = torch.ones((), dtype=torch.bool, device=features.device)
    return padded, is_real


def ego_attention(padded: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention per BEV cell with the ego as the only query.

    padded (B, L, C, H, W), attend (B, L, H, W) bool (the ego slot always True) -> (B, C, H, W).
    Equals the ego row of full self-attention across agents (OpenCOOD AttFuse), without
    computing the rows that would be thrown away.
    """
    ego = padded[:, :1]
    scores = (padded * ego).sum(dim=2) / math.sqrt(padded.shape[2])
    weights = torch.softmax(scores.masked_fill(~attend, float("-inf")), dim=1)
    return (weights.unsqueeze(2) * padded).sum(dim=1)


def masked_max(padded: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
    """Element-wise max over the agents allowed by ``attend`` (B, L, H, W) -> (B, C, H, W)."""
    return padded.masked_fill(~attend.unsqueeze(2), float("-inf")).amax(dim=1)


def dense_comm_bytes(features: torch.Tensor, record_len: torch.Tensor,
                     bytes_per_value: int) -> torch.Tensor:
    """Every non-ego agent sends its whole (C, H, W) map: -> (B,) float, 0 when alone."""
    map_bytes = float(features[0].numel() * bytes_per_value)
    return (record_len > 1).to(torch.float32) * map_bytes


def mean_over_non_ego(per_agent: torch.Tensor, record_len: torch.Tensor) -> torch.Tensor:
    """(N,) per-agent values -> (B,) mean over each sample's non-ego agents (0 if none)."""
    sample_index, slot = agent_slots(record_len, per_agent.shape[0])
    totals = torch.zeros(record_len.shape[0], dtype=torch.float32, device=per_agent.device)
    totals = totals.index_add(0, sample_index, per_agent.float() * (slot > 0))
    return totals / (record_len - 1).clamp(min=1).to(torch.float32)


class FusionModule(nn.Module):
    """Base: ``default_stage`` is where the detector applies it unless the yaml says otherwise.
    ``extra_inputs``: model-input keys (per-agent or per-sample tensors) the detector passes to
    ``forward`` as keyword arguments, None when a batch lacks them."""

    default_stage = "backbone"
    supported_stages = STAGES
    extra_inputs: tuple = ()
    # Own-frame data (``fusion.args.proj_first: false``): False, the detector warps every
    # agent's map into the ego frame before calling the module; True, the module warps
    # itself and ``forward`` takes ``pairwise`` (B, L, L, 4, 4) and ``grid`` (V2VNet).
    warps_itself = False
    # forward takes ``max_agents`` (an int >= the most agents of a sample), given by the
    # static-shape step, and pads to it instead of reading record_len.max() (a host sync).
    pads_to_max_agents = False

    # The detector computes each agent's single-agent classification logits (its head's cls
    # conv on the agent's own map) and passes them as ``conf_logits`` (Where2comm, OpenCOOD's).
    confidence_from_head = False

    def __init__(self, bytes_per_value: int = FP32_BYTES):
        super().__init__()
        self.bytes_per_value = bytes_per_value
        self.stage = self.default_stage         # set by the detector to where it applies it

    def before_scale(self, features: torch.Tensor, index: int, record_len: torch.Tensor,
                     **extra) -> torch.Tensor:
        """Multi-scale stage: each agent's map of backbone scale ``index`` before it is fused
        AND before it continues to the next down block (N, C, H, W) -> same. Identity here."""
        return features


@section
class DenseFusionArgs:
    bytes_per_value: int = spec(FP32_BYTES, check=positive)   # fp32 maps


class DenseFusion(FusionModule):
    """Parameter-free fusion of whole maps: every non-ego agent sends its full (C, H, W) map and
    the ego combines the real agents of its sample per location with ``combine``."""

    pads_to_max_agents = True

    def __init__(self, args: DenseFusionArgs, in_channels: int, num_anchors: int):
        super().__init__(args.bytes_per_value)

    @staticmethod
    def combine(padded: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """padded (B, L, C, H, W), attend (B, L, H, W) bool -> (B, C, H, W)."""
        raise NotImplementedError

    def forward(self, features: torch.Tensor, record_len: torch.Tensor,
                max_agents: Optional[int] = None) -> FusionResult:
        """Padded agent slots get -inf (no attention weight, never the max): any
        ``max_agents`` >= the real maximum gives the same result."""
        padded, is_real = pad_by_sample(features, record_len, max_agents)
        attend = is_real[:, :, None, None].expand(-1, -1, *features.shape[2:])
        return FusionResult(self.combine(padded, attend),
                            dense_comm_bytes(features, record_len, self.bytes_per_value), {})


@FUSIONS.register("attfuse", args=DenseFusionArgs)
class AttFusion(DenseFusion):
    """OpenCOOD AttFuse: per-location self-attention across agents, the ego's row kept.
    Parameter-free; by default applied at every backbone scale."""

    default_stage = "multiscale"
    combine = staticmethod(ego_attention)


@FUSIONS.register("fcooper", args=DenseFusionArgs)
class SpatialMaxFusion(DenseFusion):
    """F-Cooper: element-wise max over agents. Parameter-free; by default applied to the
    scattered pillar canvas (voxel-feature fusion), ``stage: backbone`` gives F-Cooper's
    spatial-feature fusion as OpenCOOD implements it."""

    default_stage = "scatter"
    combine = staticmethod(masked_max)


@section
class GaussianSmoothingArgs:
    kernel_size: int = spec(5, check=positive)
    sigma: float = spec(1.0, check=positive)


@section
class Where2commArgs:
    threshold: float = 0.01                 # confidence above which a cell is sent
    max_bytes_per_agent: Optional[int] = spec(None, check=non_negative)   # None: no budget
    fusion_mode: Literal["attention", "max"] = "attention"
    bytes_per_value: int = spec(FP32_BYTES, check=positive)
    # "own_conv": a 1x1 conv of this module scores the cells (ours). "head": the detection
    # head's cls conv on each agent's own map, as OpenCOOD's Where2comm (reference option).
    confidence: Literal["own_conv", "head"] = "own_conv"
    # A Gaussian-initialised 5x5 conv over the confidence before the threshold (OpenCOOD's
    # ``gaussian_smooth``); only with confidence "head".
    smoothing: Optional[GaussianSmoothingArgs] = None


@FUSIONS.register("where2comm", args=Where2commArgs)
class Where2comm(FusionModule):
    """Where2comm: non-ego agents send only the cells where they see something.

    Each agent's confidence map is sigmoid(max over anchors of a 1x1 conv). A non-ego agent sends
    the cells with confidence > ``threshold``, and at most
    k = floor(max_bytes_per_agent / (C * bytes_per_value)) of them, the most confident first
    (``max_bytes_per_agent`` None = no budget, 0 = send nothing). The ego fuses its own map (never
    masked) with what it received, by attention or max over the sent cells only, so with nothing
    sent the output is exactly the ego's map.

    The cell selection is a hard, non-differentiable choice. Sent features are multiplied by a
    straight-through gate (value exactly 1, gradient that of the confidence), and the confidence
    logits are returned as ``conf_preds`` for the loss to supervise with the anchor labels, so the
    confidence conv gets a gradient even when nothing is sent (DDP without unused parameters).
    Applied to the backbone output only (the confidence must be on the anchor grid for that loss).
    """

    supported_stages = ("backbone",)

    def __init__(self, args: Where2commArgs, in_channels: int, num_anchors: int,
                 cls_prior: float = 0.01):
        super().__init__(args.bytes_per_value)
        self.in_channels = in_channels
        self.threshold = args.threshold
        self.max_bytes_per_agent = args.max_bytes_per_agent
        self.fusion_mode = args.fusion_mode
        self.confidence_from_head = args.confidence == "head"
        if self.confidence_from_head:
            # OpenCOOD's: multi-scale as well, the mask applied at the first scale.
            self.supported_stages = ("backbone", "multiscale")
            self.smooth = gaussian_smoothing(args.smoothing) if args.smoothing else None
            if args.max_bytes_per_agent is not None or args.fusion_mode != "attention":
                raise ValueError("where2comm confidence 'head' (OpenCOOD's) takes no "
                                 "max_bytes_per_agent and fusion_mode 'attention' only")
        else:
            if args.smoothing is not None:
                raise ValueError("where2comm smoothing goes with confidence 'head' only")
            self.conf_conv = nn.Conv2d(in_channels, num_anchors, 1)
            self.reset_cls_prior(cls_prior)

    @torch.no_grad()
    def reset_cls_prior(self, prior: float) -> None:
        """The confidence is a classification score: same prior as the head (``init_weights``)."""
        if not self.confidence_from_head:
            self.conf_conv.bias.fill_(prior_bias(prior))

    @property
    def max_cells_per_agent(self) -> Optional[int]:
        if self.max_bytes_per_agent is None:
            return None
        return int(self.max_bytes_per_agent // (self.in_channels * self.bytes_per_value))

    def select_cells(self, confidence: torch.Tensor, is_ego: torch.Tensor) -> torch.Tensor:
        """confidence (N, H, W) in [0, 1], is_ego (N,) -> (N, H, W) bool cells sent/kept."""
        flat = confidence.flatten(1)
        chosen = flat > self.threshold
        max_cells = self.max_cells_per_agent
        if max_cells is not None and max_cells < flat.shape[1]:
            in_top_k = torch.zeros_like(chosen)
            if max_cells > 0:
                # -1 is below every sigmoid value, so cells under the threshold rank last.
                ranked = flat.masked_fill(~chosen, -1.0)
                top_index = ranked.topk(max_cells, dim=1).indices
                in_top_k = in_top_k.scatter(1, top_index, True)
            chosen = chosen & in_top_k
        return (chosen | is_ego.unsqueeze(1)).view_as(confidence)

    def forward(self, features: torch.Tensor, record_len: torch.Tensor,
                conf_logits: Optional[torch.Tensor] = None) -> FusionResult:
        if self.confidence_from_head:
            return self.forward_reference(features, record_len, conf_logits)
        conf_logits = self.conf_conv(features)                      # (N, A, H, W)
        confidence = torch.sigmoid(conf_logits.amax(dim=1))        # (N, H, W)
        _, slot = agent_slots(record_len, features.shape[0])
        is_ego = slot == 0
        sent = self.select_cells(confidence.detach(), is_ego)
        # Straight-through: forward value is exactly the hard mask, gradient is d(confidence).
        gate = sent.to(features.dtype) + (confidence - confidence.detach())
        gate = torch.where(is_ego[:, None, None], torch.ones_like(gate), gate)
        padded, is_real = pad_by_sample(features * gate.unsqueeze(1), record_len)
        padded_sent, _ = pad_by_sample(sent.unsqueeze(1), record_len)
        attend = padded_sent.squeeze(2) & is_real[:, :, None, None]
        fuse = ego_attention if self.fusion_mode == "attention" else masked_max
        fused = fuse(padded, attend)
        cells_sent = sent.flatten(1).sum(dim=1)
        bytes_per_agent = cells_sent * (self.in_channels * self.bytes_per_value)
        comm_bytes = mean_over_non_ego(bytes_per_agent, record_len)
        return FusionResult(fused, comm_bytes, {"conf_preds": conf_logits})

    # ---- OpenCOOD's Where2comm (confidence "head") --------------------------------------

    def communication_mask(self, conf_logits: torch.Tensor,
                           record_len: torch.Tensor) -> torch.Tensor:
        """OpenCOOD's ``Communication`` in eval mode: conf_logits (N, A, h, w), the head's
        single-agent logits -> (N, 1, h, w) mask, 1 where the (smoothed) max-over-anchors
        sigmoid exceeds the threshold (everywhere for threshold 0), and on every ego cell.
        (Its training mode sends a random number of top cells instead; here training keeps
        the threshold.)"""
        confidence = torch.sigmoid(conf_logits).amax(dim=1, keepdim=True)
        if self.smooth is not None:
            confidence = self.smooth(confidence)
        if self.threshold:
            mask = (confidence > self.threshold).to(confidence.dtype)
        else:
            mask = torch.ones_like(confidence)
        _, slot = agent_slots(record_len, conf_logits.shape[0])
        return torch.where((slot == 0)[:, None, None, None], torch.ones_like(mask), mask)

    @staticmethod
    def mask_at(mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The mask at the features' resolution: resized bilinearly (fractional at the edges
        of sent regions) when it differs, as OpenCOOD does for its first backbone scale."""
        if mask.shape[-2:] != features.shape[-2:]:
            mask = F.interpolate(mask, size=features.shape[-2:], mode="bilinear",
                                 align_corners=False)
        return mask

    def before_scale(self, features, index, record_len, conf_logits=None, **extra):
        """Multi-scale: the first scale's maps are masked, and continue masked to the next
        down blocks (OpenCOOD's order)."""
        if not self.confidence_from_head or index != 0:
            return features
        mask = self.communication_mask(conf_logits, record_len)
        return features * self.mask_at(mask, features)

    def forward_reference(self, features, record_len, conf_logits) -> FusionResult:
        """Attention over every agent at every cell (unsent cells hold zeros and still take
        part, as in OpenCOOD); at the backbone stage the mask is applied here, at the
        multi-scale stage ``before_scale`` applied it already. Bytes: cells the mask keeps at
        this map's resolution x C."""
        if conf_logits is None:
            raise ValueError("where2comm confidence 'head' needs the detector's conf_logits")
        sent = self.communication_mask(conf_logits, record_len)       # (N, 1, h, w)
        mask = self.mask_at(sent, features)
        if self.stage != "multiscale":
            features = features * mask
        padded, is_real = pad_by_sample(features, record_len)
        attend = is_real[:, :, None, None].expand(-1, -1, *features.shape[2:])
        cells_sent = (mask > 0).flatten(1).sum(dim=1)
        comm_bytes = mean_over_non_ego(cells_sent * (features.shape[1] * self.bytes_per_value),
                                       record_len)
        return FusionResult(ego_attention(padded, attend), comm_bytes,
                            {"single_cls_preds": conf_logits, "comm_mask": sent})


def gaussian_smoothing(args: GaussianSmoothingArgs) -> nn.Conv2d:
    """A 1 -> 1 channel conv (zero padding, same size) initialised to OpenCOOD's Gaussian:
    exp(-(x^2 + y^2) / (2 sigma^2)) / (2 pi sigma), bias 0. Parameters (frozen), so checkpoints
    carry them as OpenCOOD's do."""
    if args.kernel_size % 2 == 0:
        raise ValueError("where2comm smoothing.kernel_size must be odd")
    conv = nn.Conv2d(1, 1, args.kernel_size, padding=(args.kernel_size - 1) // 2)
    centre = args.kernel_size // 2
    offsets = torch.arange(args.kernel_size, dtype=torch.float64) - centre
    squared = offsets[:, None] ** 2 + offsets[None, :] ** 2
    kernel = torch.exp(-squared / (2 * args.sigma ** 2)) / (2 * math.pi * args.sigma)
    with torch.no_grad():
        conv.weight.copy_(kernel[None, None].float())
        conv.bias.zero_()
    # Frozen (OpenCOOD means it to be): nothing differentiable flows through the threshold, and
    # a parameter without a gradient would trip DDP's unused-parameter check.
    return conv.requires_grad_(False)
