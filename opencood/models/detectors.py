"""The detectors: single-agent (no / early / late fusion) and intermediate fusion, each an
encoder (``model.args.encoder``, ``opencood.models.encoders``: pillars, lift-splat) writing every
agent's BEV map, a BEV backbone, optional fusion and an anchor head.

Input ``batch`` (tensors on the model's device): the model-input keys of
``opencood.batch_keys.MODEL_INPUT`` (listed at the end of this docstring), of which the encoder
reads its modality's (pillars: voxel_*), the detectors record_len (B,) (agents of a sample
consecutive, the ego first), early fusion's shared_points / num_agents_sent, and the fusion
module the per-agent keys it asks for (``FusionModule.extra_inputs``: V2X-ViT's agent_types,
agent_latency, spatial_correction_matrix). Own-frame data (``points_in_agent_frame`` True, from
``fusion.args.proj_first: false``): each agent's map is in its own frame and
``transforms_to_ego`` (N_agents, 4, 4) maps it into the ego frame; the intermediate detector
warps every agent's map with exactly that key (pose correction replaces it before the model
runs) before fusing.
Output dict: cls_preds (B, K*A, H, W) (K classes, 1 by default), reg_preds (B, 7A, H, W),
  dir_preds (B, 2A, H, W) (not with ``use_dir: false``),
  comm_bytes (B,) float, and for where2comm conf_preds (N_agents, A, H, W) with
  conf_sample_index (N_agents,) (the sample each confidence map belongs to); intermediate
  fusion also fused_features (B, C, H, W), the map the head reads, and the fusion module's
  auxiliary outputs (DiscoNet: edge_weights (B, L, H, W)).
H, W = the BEV grid (``bev_grid``) / backbone output stride (2 for layer_strides [2, 2, 2],
upsample [1, 2, 4]).

Both detectors are built from their parsed ``model.args`` (:class:`PillarArgs`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional, Tuple

import torch
from torch import nn

from opencood.batch_keys import describe
from opencood.config_schema import Problems, all_positive, box_range, positive, section, spec
from opencood.models.backbone import BackboneArgs, BaseBEVBackbone
from opencood.models.encoders import (EncoderGeometry, ModelEncoder, PillarEncoderArgs,
                                      encoder_outputs, has_static_pillars, rename_legacy_keys)
from opencood.models.fusion import FusionModule, agent_slots, pad_by_sample
from opencood.models.heads import AnchorHead
from opencood.models.pillar_vfe import PillarVFEArgs
from opencood.models.scatter import ScatterArgs
from opencood.models.warp import BevGrid, warp_to_ego
from opencood.registry import ENCODERS, FUSIONS, MODELS

POINT_BYTES = 16  # x, y, z, intensity as fp32: what early fusion sends per point


@section
class ShrinkHeaderArgs:
    """OpenCOOD's ``shrink_header`` before fusion (V2VNet, V2X-ViT, CoBEVT configs)."""

    dim: int = spec(check=positive)
    stride: int = spec(2, check=positive)
    # of the first conv (padding kernel_size // 2); OpenCOOD's F-Cooper shrinks with a 1x1
    kernel_size: Literal[1, 3] = 3


@section
class ModelFusion:
    """``model.args.fusion``: a module of FUSIONS and the stage it fuses at."""

    core_method: str
    args: Any = spec(args_of=("core_method", "fusion"))       # the module's own schema
    stage: Optional[Literal["scatter", "multiscale", "backbone"]] = None   # None: the module's


@section
class PillarArgs:
    """Detector arguments. The first seven are derived from the data sections unless given."""

    lidar_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    voxel_size: Optional[Tuple[float, float, float]] = spec(None, check=all_positive)
    max_points_per_voxel: Optional[int] = spec(None, check=positive)
    anchor_number: Optional[int] = spec(None, check=positive)     # yaws x classes
    num_class: Optional[int] = spec(None, check=positive)         # class logits per anchor
    # The BEV map the encoder writes and the heads read (the config's ``bev_grid`` section).
    bev_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    bev_cell_size: Optional[Tuple[float, float]] = spec(None, check=all_positive)
    bn_momentum: Optional[float] = None             # None: PyTorch's BatchNorm momentum
    # The encoder slot (opencood.models.encoders); None: the pillar encoder from the two keys
    # below, OpenCOOD's form.
    encoder: Optional[ModelEncoder] = None
    pillar_vfe: Optional[PillarVFEArgs] = None
    point_pillar_scatter: Optional[ScatterArgs] = None
    base_bev_backbone: BackboneArgs
    fusion: Optional[ModelFusion] = None
    # intermediate fusion: before (stage "backbone") or after fusion; point_pillar: before the
    # head (V2V4Real's single-agent PointPillars narrow 384 -> 256 at stride 2 there)
    shrink_header: Optional[ShrinkHeaderArgs] = None
    # False: no direction classifier in the head (OpenCOOD's models; AnchorHead)
    use_dir: bool = True
    uncertainty_dim: Literal[0, 2, 3] = 0   # CoAlign's head: log variances of x, y (, yaw)

    def problems(self) -> Problems:
        legacy = [key for key in ("pillar_vfe", "point_pillar_scatter")
                  if getattr(self, key) is not None]
        if self.encoder is not None and legacy:
            yield legacy[0], ("belongs in model.args.encoder.args when model.args.encoder is "
                              "given (or drop encoder for OpenCOOD's form)")
        elif self.encoder is None and self.point_pillar_scatter is None:
            yield "point_pillar_scatter", ("is required (or give model.args.encoder: "
                                           "{core_method, args})")

    def completed(self) -> "PillarArgs":
        """OpenCOOD's form (no ``encoder``): ``pillar_vfe`` gets its defaults when absent."""
        if self.encoder is None and self.pillar_vfe is None:
            return dataclasses.replace(self, pillar_vfe=PillarVFEArgs())
        return self


@section
class PointPillarArgs(PillarArgs):
    def problems(self) -> Problems:
        yield from super().problems()
        if self.fusion is not None:
            yield "fusion", ("must be null: point_pillar is single-agent (point_pillar_intermediate "
                             "fuses features)")


@section
class PointPillarIntermediateArgs(PillarArgs):
    def problems(self) -> Problems:
        yield from super().problems()
        if self.fusion is None:
            yield "fusion", "is required by point_pillar_intermediate ({core_method, args})"


def set_bn_momentum(model: nn.Module, momentum: Optional[float]) -> None:
    """Momentum of every BatchNorm running-statistics update (None: leave PyTorch's).

    The OpenCOOD default (0.01) needs thousands of steps before eval-mode statistics match the
    training batches; short CPU runs of a few hundred steps validate badly with it.
    """
    if momentum is None:
        return
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = float(momentum)


def bev_grid(args: PillarArgs) -> BevGrid:
    """The model's BEV geometry (``bev_grid``: range and cell size), for the encoder and for
    warping maps of any stage. A ``model`` section parsed alone (no config to derive from) has
    the pillar grid's."""
    from opencood.ops.voxelize import grid_size

    grid_range = tuple(args.bev_range if args.bev_range is not None else args.lidar_range)
    cell = tuple(args.bev_cell_size if args.bev_cell_size is not None else args.voxel_size[:2])
    nx, ny, _ = grid_size(grid_range, (*cell, grid_range[5] - grid_range[2]))
    return BevGrid(grid_range, cell, int(nx), int(ny))


def build_encoder(args: PillarArgs) -> nn.Module:
    """``model.args.encoder`` (or OpenCOOD's ``pillar_vfe`` + ``point_pillar_scatter``) ->
    the ENCODERS module writing (N_agents, out_channels, ny, nx) maps of the BEV grid."""
    geometry = EncoderGeometry(bev_grid(args), args.lidar_range, args.voxel_size)
    if args.encoder is None:
        legacy = PillarEncoderArgs(pillar_vfe=args.pillar_vfe,
                                   point_pillar_scatter=args.point_pillar_scatter)
        return ENCODERS.get("pillar")(legacy, geometry=geometry)
    return ENCODERS.get(args.encoder.core_method)(args.encoder.args, geometry=geometry)


def build_pillar_parts(args: PillarArgs):
    """Parsed model args -> (encoder, backbone, head), widths chained from one to the next."""
    encoder = build_encoder(args)
    backbone = BaseBEVBackbone(args.base_bev_backbone, encoder.out_channels)
    head = AnchorHead(backbone.out_channels, num_anchors=args.anchor_number,
                      num_classes=args.num_class, use_dir=args.use_dir,
                      uncertainty_dim=args.uncertainty_dim)
    return encoder, backbone, head


class LegacyKeys:
    """Mixin of the detectors: checkpoints saved before the encoder slot load (their ``vfe.`` /
    ``scatter.`` keys are the encoder's, ``opencood.models.encoders.LEGACY_PREFIXES``)."""

    def _register_legacy_hook(self) -> None:
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *_: rename_legacy_keys(state_dict, prefix))


def is_own_frame(batch: dict) -> bool:
    """The agents' pillars are in their own frames (``fusion.args.proj_first: false``): the
    batch says so, so a model cannot disagree with the data it is given."""
    return bool(batch.get("points_in_agent_frame", False))


def pairwise_transforms(to_ego: torch.Tensor, record_len: torch.Tensor) -> torch.Tensor:
    """(N_agents, 4, 4) agent -> ego, (B,) -> (B, L, L, 4, 4), entry [b, i, j] agent j -> agent i
    (inv(T_i) @ T_j); padded slots get the identity."""
    padded, is_real = pad_by_sample(to_ego, record_len)
    eye = torch.eye(4, dtype=to_ego.dtype, device=to_ego.device)
    padded = torch.where(is_real[:, :, None, None], padded, eye)
    return torch.linalg.inv(padded).unsqueeze(2) @ padded.unsqueeze(1)


def early_fusion_bytes(batch: dict, batch_size: int, device) -> torch.Tensor:
    """(B,) bytes per sending agent: shared points x 16 B, split over the senders if known."""
    shared_points = batch.get("shared_points")
    if shared_points is None:
        return torch.zeros(batch_size, dtype=torch.float32, device=device)
    comm_bytes = shared_points.to(device=device, dtype=torch.float32) * POINT_BYTES
    senders = batch.get("num_agents_sent")
    if senders is not None:
        comm_bytes = comm_bytes / senders.to(device=device, dtype=torch.float32).clamp(min=1)
    return comm_bytes


@MODELS.register("point_pillar", args=PointPillarArgs)
class PointPillar(LegacyKeys, nn.Module):
    """Single-agent PointPillars, used for no fusion (ego points), early fusion (all agents'
    points merged at the ego) and late fusion (each CAV run as its own sample): every
    ``record_len`` entry must be 1. comm_bytes: early fusion's shared points x 16 B when the
    batch has ``shared_points``, else 0 (late fusion's boxes are counted by the post-processor).
    An optional ``shrink_header`` narrows the backbone output before the head (V2V4Real's
    early and late fusion models).
    """

    def __init__(self, args: PointPillarArgs):
        super().__init__()
        self.encoder, self.backbone, self.head = build_pillar_parts(args)
        self.shrink = nn.Identity()
        if args.shrink_header is not None:
            self.shrink = ShrinkHeader(args.shrink_header, self.backbone.out_channels)
            self.head = AnchorHead(self.shrink.out_channels, num_anchors=args.anchor_number,
                                   num_classes=args.num_class, use_dir=args.use_dir,
                                   uncertainty_dim=args.uncertainty_dim)
        set_bn_momentum(self, args.bn_momentum)
        self._register_legacy_hook()

    def bev_features(self, batch: dict) -> torch.Tensor:
        """The BEV map the head reads: (B, C, H, W). An early-fusion model's map is DiscoNet's
        distillation target (``opencood.engine.teacher``)."""
        canvas = self.encoder(batch)
        if canvas.shape[0] != batch["record_len"].shape[0]:
            raise ValueError("point_pillar is single-agent: every record_len entry must be 1 "
                             "(merge points for early fusion, one sample per CAV for late)")
        return self.shrink(self.backbone(canvas))

    def forward(self, batch: dict) -> dict:
        features = self.bev_features(batch)
        outputs = self.head(features)
        outputs["comm_bytes"] = early_fusion_bytes(batch, features.shape[0], features.device)
        outputs.update(encoder_outputs(self.encoder))      # depth supervision's inputs
        return outputs


class ShrinkHeader(nn.Module):
    """OpenCOOD's ``shrink_header`` (V2VNet, V2X-ViT, CoBEVT): two 3x3 convs (the first 1x1
    with ``kernel_size: 1``, as in its F-Cooper) with ReLU, the first strided, narrowing the backbone output before fusion so attention over agents and
    windows stays affordable: (N, C_in, H, W) -> (N, dim, ceil(H / stride), ceil(W / stride)).
    With stride 2 the head runs at feature stride 4 (``anchor_args.feature_stride: 4``)."""

    def __init__(self, args: ShrinkHeaderArgs, in_channels: int):
        super().__init__()
        self.out_channels = args.dim
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, args.dim, args.kernel_size, stride=args.stride,
                      padding=args.kernel_size // 2), nn.ReLU(),
            nn.Conv2d(args.dim, args.dim, 3, padding=1), nn.ReLU())

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


def build_fusion(fusion: ModelFusion, in_channels: int, num_anchors: int) -> FusionModule:
    """The FUSIONS module ``fusion.core_method`` from its parsed arguments, on (N, in_channels,
    H, W) maps with ``num_anchors`` anchors per cell."""
    fusion_cls = FUSIONS.get(fusion.core_method)
    return fusion_cls(fusion.args, in_channels=in_channels, num_anchors=num_anchors)


def fusion_stage(fusion: FusionModule, stage: Optional[str]) -> str:
    """``stage`` (None: the module's default), refused when the module cannot fuse there."""
    stage = stage or fusion.default_stage
    if stage not in fusion.supported_stages:
        raise ValueError(f"{type(fusion).__name__} cannot fuse at stage {stage!r}; "
                         f"supported: {', '.join(fusion.supported_stages)}")
    return stage


@MODELS.register("point_pillar_intermediate", args=PointPillarIntermediateArgs)
class PointPillarIntermediate(LegacyKeys, nn.Module):
    """PointPillars with per-agent BEV features fused at the ego by a FUSIONS module.

    ``stage`` is where fusion happens: "scatter" (on the pillar canvas, before the backbone),
    "multiscale" (on every backbone scale before its up block) or "backbone" (on the backbone
    output, before the head); the bytes reported are those of the maps fused there, summed over
    scales for "multiscale". An optional ``shrink`` (``ShrinkHeader``) narrows the backbone
    output: per agent before fusion at the "backbone" stage, on the fused map otherwise.

    Own-frame batches (:func:`is_own_frame`): every agent's map is warped into the ego frame with
    ``transforms_to_ego`` right before the fusion module, at the stage it runs (the canvas,
    each scale with its own cell size, or the backbone output), so each agent's backbone still
    runs in its own frame; a module that warps itself (V2VNet) gets pairwise transforms.
    """

    def __init__(self, args: PointPillarIntermediateArgs):
        super().__init__()
        encoder, backbone, head = build_pillar_parts(args)
        shrink = None
        if args.shrink_header is not None:
            shrink = ShrinkHeader(args.shrink_header, backbone.out_channels)
            # A second head, on the narrower map (the first one's draws from the RNG are kept:
            # initial weights stay what they were for a seed).
            head = AnchorHead(shrink.out_channels, num_anchors=args.anchor_number,
                              num_classes=args.num_class, use_dir=args.use_dir,
                              uncertainty_dim=args.uncertainty_dim)
        fusion = build_fusion(args.fusion, shrink.out_channels if shrink is not None
                              else backbone.out_channels, head.num_anchors)
        self.encoder, self.backbone, self.head = encoder, backbone, head
        self.fusion = fusion
        self.stage = fusion_stage(fusion, args.fusion.stage)
        fusion.stage = self.stage
        self.shrink = shrink if shrink is not None else nn.Identity()
        self.grid = bev_grid(args)
        set_bn_momentum(self, args.bn_momentum)
        self._register_legacy_hook()

    def fuse_features(self, canvas: torch.Tensor, record_len: torch.Tensor,
                      extra: Optional[dict] = None, to_ego: Optional[torch.Tensor] = None):
        """(N_agents, C, ny, nx) -> (B, C_out, H, W), list of FusionResult (one per fusion).

        ``extra``: the per-agent inputs the fusion module asked for (``extra_inputs``).
        ``to_ego``: (N_agents, 4, 4) for maps in their agents' own frames (None: ego frame)."""
        results = []
        extra = dict(extra or {})
        if to_ego is not None and self.fusion.warps_itself:
            extra.update(pairwise=pairwise_transforms(to_ego, record_len), grid=self.grid)

        def fuse(features, lengths):
            if to_ego is not None and not self.fusion.warps_itself:
                features = warp_to_ego(features, to_ego, self.grid)
            results.append(self.fusion(features, lengths, **extra))
            return results[-1].features

        if self.stage == "scatter":
            return self.shrink(self.backbone(fuse(canvas, record_len))), results
        if self.stage == "multiscale":
            def before_scale(features, index):
                return self.fusion.before_scale(features, index, record_len, **extra)

            fused = self.backbone(canvas, fuse_fn=fuse, record_len=record_len,
                                  scale_fn=before_scale)
            return self.shrink(fused), results
        return fuse(self.shrink(self.backbone(canvas)), record_len), results

    def forward(self, batch: dict) -> dict:
        record_len = batch["record_len"]
        canvas = self.encoder(batch)
        # Absent keys reach the module as None (hand-made batches, older loaders).
        extra = {name: batch.get(name) for name in self.fusion.extra_inputs}
        if has_static_pillars(batch) and self.fusion.pads_to_max_agents:
            # The most agents a sample can have, from shapes alone: every other sample has at
            # least one. Padding to it instead of record_len.max() (a host sync) fuses the same.
            extra["max_agents"] = canvas.shape[0] - record_len.shape[0] + 1
        if self.fusion.confidence_from_head:
            # Each agent's own detection confidence decides what it sends (OpenCOOD's
            # Where2comm): its full single-agent pass, the backbone run once more to fuse.
            extra["conf_logits"] = self.head.cls_conv(self.shrink(self.backbone(canvas)))
        to_ego = batch["transforms_to_ego"] if is_own_frame(batch) else None
        fused, results = self.fuse_features(canvas, record_len, extra, to_ego)
        outputs = self.head(fused)
        # The map the head reads, for feature distillation (DiscoNet's teacher matches it).
        outputs["fused_features"] = fused
        outputs["comm_bytes"] = torch.stack([r.comm_bytes for r in results]).sum(dim=0)
        for result in results:
            outputs.update(result.aux)
        if "conf_preds" in outputs:
            outputs["conf_sample_index"] = agent_slots(record_len, canvas.shape[0])[0]
        outputs.update(encoder_outputs(self.encoder))      # depth supervision's inputs
        return outputs


__doc__ += "\nModel-input keys (opencood.batch_keys.MODEL_INPUT):\n" + describe("model input")
