"""PointPillars detectors: single-agent (no / early / late fusion) and intermediate fusion.

Input ``batch`` (tensors on the model's device):
  voxel_features (P, M, 4), voxel_num_points (P,), voxel_coords (P, 4) [agent, z, y, x] with the
  agents of a sample consecutive and the ego first; record_len (B,) agents per sample;
  optional shared_points (B,) and num_agents_sent (B,) for early fusion's byte count.
  optional agent_types (N_agents,) int64 (0 vehicle, 1 infrastructure) and agent_latency
  (N_agents,) int64 (frames each agent's data is late), and spatial_correction_matrix
  (B, L >= max agents, 4, 4) per sample slot (V2X-ViT's STTF; absent: identity), passed to
  fusion modules that ask for them (``FusionModule.extra_inputs``; V2X-ViT).
  Own-frame data (``points_in_agent_frame`` True, from ``fusion.args.proj_first: false``): each
  agent's pillars are in its own frame and ``transforms_to_ego`` (N_agents, 4, 4) maps it into
  the ego frame; the intermediate detector warps every agent's map with exactly that key (pose
  correction replaces it before the model runs) before fusing.
Output dict: cls_preds (B, A, H, W), reg_preds (B, 7A, H, W), dir_preds (B, 2A, H, W) (not with
  ``use_dir: false``),
  comm_bytes (B,) float, and for where2comm conf_preds (N_agents, A, H, W) with
  conf_sample_index (N_agents,) (the sample each confidence map belongs to); intermediate
  fusion also fused_features (B, C, H, W), the map the head reads, and the fusion module's
  auxiliary outputs (DiscoNet: edge_weights (B, L, H, W)).
H, W = (ny, nx) / backbone output stride (2 for layer_strides [2, 2, 2], upsample [1, 2, 4]).

Both detectors are built from their parsed ``model.args`` (:class:`PillarArgs`).
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Tuple

import torch
from torch import nn

from opencood.config_schema import Problems, all_positive, box_range, positive, section, spec
from opencood.models.backbone import BackboneArgs, BaseBEVBackbone
from opencood.models.fusion import FusionModule, agent_slots, pad_by_sample
from opencood.models.heads import AnchorHead
from opencood.models.pillar_vfe import PillarVFE, PillarVFEArgs
from opencood.models.scatter import PointPillarScatter, ScatterArgs
from opencood.models.warp import BevGrid, warp_to_ego
from opencood.registry import FUSIONS, MODELS

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
    """PointPillars arguments. The first four are derived from the data sections unless given."""

    lidar_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    voxel_size: Optional[Tuple[float, float, float]] = spec(None, check=all_positive)
    max_points_per_voxel: Optional[int] = spec(None, check=positive)
    anchor_number: Optional[int] = spec(None, check=positive)
    bn_momentum: Optional[float] = None             # None: PyTorch's BatchNorm momentum
    pillar_vfe: PillarVFEArgs
    point_pillar_scatter: ScatterArgs
    base_bev_backbone: BackboneArgs
    fusion: Optional[ModelFusion] = None
    # intermediate fusion: before (stage "backbone") or after fusion; point_pillar: before the
    # head (V2V4Real's single-agent PointPillars narrow 384 -> 256 at stride 2 there)
    shrink_header: Optional[ShrinkHeaderArgs] = None
    # False: no direction classifier in the head (OpenCOOD's models; AnchorHead)
    use_dir: bool = True
    uncertainty_dim: Literal[0, 2, 3] = 0   # CoAlign's head: log variances of x, y (, yaw)


@section
class PointPillarArgs(PillarArgs):
    def problems(self) -> Problems:
        if self.fusion is not None:
            yield "fusion", ("must be null: point_pillar is single-agent (point_pillar_intermediate "
                             "fuses features)")


@section
class PointPillarIntermediateArgs(PillarArgs):
    def problems(self) -> Problems:
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


def build_pillar_parts(args: PillarArgs):
    """Parsed model args -> (vfe, scatter, backbone, head), widths chained from one to the
    next."""
    from opencood.ops.voxelize import grid_size

    nx, ny, _ = grid_size(args.lidar_range, args.voxel_size)
    vfe = PillarVFE(args.pillar_vfe, args.voxel_size, args.lidar_range)
    scatter = PointPillarScatter(args.point_pillar_scatter.num_features, nx=nx, ny=ny)
    if scatter.num_features != vfe.out_channels:
        raise ValueError(f"point_pillar_scatter.num_features ({scatter.num_features}) must equal "
                         f"the last pillar_vfe filter ({vfe.out_channels})")
    backbone = BaseBEVBackbone(args.base_bev_backbone, scatter.num_features)
    head = AnchorHead(backbone.out_channels, num_anchors=args.anchor_number,
                      use_dir=args.use_dir, uncertainty_dim=args.uncertainty_dim)
    return vfe, scatter, backbone, head


def has_static_pillars(batch: dict) -> bool:
    """The batch comes from ``pillarize_static`` (``voxel_valid`` (A, K)): the model then runs
    without data-dependent sizes or host syncs where it can (``performance.static_pillars``)."""
    return batch.get("voxel_valid") is not None


def encode_agents(vfe: PillarVFE, scatter: PointPillarScatter, batch: dict) -> torch.Tensor:
    """Pillars of every agent -> (N_agents, C, ny, nx) BEV canvases."""
    static = has_static_pillars(batch)
    pillar_features = vfe(batch["voxel_features"], batch["voxel_num_points"],
                          batch["voxel_coords"], static_shapes=static)
    return scatter(pillar_features, batch["voxel_coords"], batch["record_len"],
                   batch["voxel_valid"] if static else None)


def bev_grid(args: PillarArgs) -> BevGrid:
    """The model's BEV geometry (range, pillar size and grid), for warping maps of any stage."""
    from opencood.ops.voxelize import grid_size

    nx, ny, _ = grid_size(args.lidar_range, args.voxel_size)
    return BevGrid(tuple(args.lidar_range), tuple(args.voxel_size[:2]), int(nx), int(ny))


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
class PointPillar(nn.Module):
    """Single-agent PointPillars, used for no fusion (ego points), early fusion (all agents'
    points merged at the ego) and late fusion (each CAV run as its own sample): every
    ``record_len`` entry must be 1. comm_bytes: early fusion's shared points x 16 B when the
    batch has ``shared_points``, else 0 (late fusion's boxes are counted by the post-processor).
    An optional ``shrink_header`` narrows the backbone output before the head (V2V4Real's
    early and late fusion models).
    """

    def __init__(self, args: PointPillarArgs):
        super().__init__()
        self.vfe, self.scatter, self.backbone, self.head = build_pillar_parts(args)
        self.shrink = nn.Identity()
        if args.shrink_header is not None:
            self.shrink = ShrinkHeader(args.shrink_header, self.backbone.out_channels)
            self.head = AnchorHead(self.shrink.out_channels, num_anchors=args.anchor_number,
                                   use_dir=args.use_dir, uncertainty_dim=args.uncertainty_dim)
        set_bn_momentum(self, args.bn_momentum)

    def bev_features(self, batch: dict) -> torch.Tensor:
        """The BEV map the head reads: (B, C, H, W). An early-fusion model's map is DiscoNet's
        distillation target (``opencood.engine.teacher``)."""
        canvas = encode_agents(self.vfe, self.scatter, batch)
        if canvas.shape[0] != batch["record_len"].shape[0]:
            raise ValueError("point_pillar is single-agent: every record_len entry must be 1 "
                             "(merge points for early fusion, one sample per CAV for late)")
        return self.shrink(self.backbone(canvas))

    def forward(self, batch: dict) -> dict:
        features = self.bev_features(batch)
        outputs = self.head(features)
        outputs["comm_bytes"] = early_fusion_bytes(batch, features.shape[0], features.device)
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
class PointPillarIntermediate(nn.Module):
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
        vfe, scatter, backbone, head = build_pillar_parts(args)
        shrink = None
        if args.shrink_header is not None:
            shrink = ShrinkHeader(args.shrink_header, backbone.out_channels)
            # A second head, on the narrower map (the first one's draws from the RNG are kept:
            # initial weights stay what they were for a seed).
            head = AnchorHead(shrink.out_channels, num_anchors=args.anchor_number,
                              use_dir=args.use_dir, uncertainty_dim=args.uncertainty_dim)
        fusion = build_fusion(args.fusion, shrink.out_channels if shrink is not None
                              else backbone.out_channels, head.num_anchors)
        self.vfe, self.scatter, self.backbone, self.head = vfe, scatter, backbone, head
        self.fusion = fusion
        self.stage = fusion_stage(fusion, args.fusion.stage)
        fusion.stage = self.stage
        self.shrink = shrink if shrink is not None else nn.Identity()
        self.grid = bev_grid(args)
        set_bn_momentum(self, args.bn_momentum)

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
        canvas = encode_agents(self.vfe, self.scatter, batch)
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
        return outputs
