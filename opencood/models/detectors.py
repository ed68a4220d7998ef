"""PointPillars detectors: single-agent (no / early / late fusion) and intermediate fusion.

Input ``batch`` (tensors on the model's device):
  voxel_features (P, M, 4), voxel_num_points (P,), voxel_coords (P, 4) [agent, z, y, x] with the
  agents of a sample consecutive and the ego first; record_len (B,) agents per sample;
  optional shared_points (B,) and num_agents_sent (B,) for early fusion's byte count.
  optional agent_types (N_agents,) int64 (0 vehicle, 1 infrastructure) and agent_latency
  (N_agents,) int64 (frames each agent's data is late), passed to fusion modules that ask for
  them (``FusionModule.extra_inputs``; V2X-ViT).
Output dict: cls_preds (B, A, H, W), reg_preds (B, 7A, H, W), dir_preds (B, 2A, H, W),
  comm_bytes (B,) float, and for where2comm conf_preds (N_agents, A, H, W) with
  conf_sample_index (N_agents,) (the sample each confidence map belongs to); intermediate
  fusion also fused_features (B, C, H, W), the map the head reads, and the fusion module's
  auxiliary outputs (DiscoNet: edge_weights (B, L, H, W)).
H, W = (ny, nx) / backbone output stride (2 for layer_strides [2, 2, 2], upsample [1, 2, 4]).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from opencood.models.backbone import BaseBEVBackbone
from opencood.models.fusion import FusionModule, agent_slots
from opencood.models.heads import AnchorHead
from opencood.models.pillar_vfe import PillarVFE
from opencood.models.scatter import PointPillarScatter
from opencood.registry import FUSIONS, MODELS

POINT_BYTES = 16  # x, y, z, intensity as fp32: what early fusion sends per point


def build_pillar_parts(args: dict):
    """Resolved model args (opencood.config_schema.PillarArgs) -> (vfe, scatter, backbone,
    head), widths chained from one to the next."""
    from opencood.ops.voxelize import grid_size

    nx, ny, _ = grid_size(args["lidar_range"], args["voxel_size"])
    vfe = PillarVFE.from_config(args["pillar_vfe"], args["voxel_size"],
                                args["lidar_range"])
    scatter = PointPillarScatter.from_config(args["point_pillar_scatter"], nx=nx, ny=ny)
    if scatter.num_features != vfe.out_channels:
        raise ValueError(f"point_pillar_scatter.num_features ({scatter.num_features}) must equal "
                         f"the last pillar_vfe filter ({vfe.out_channels})")
    backbone = BaseBEVBackbone.from_config(args["base_bev_backbone"], scatter.num_features)
    head = AnchorHead.from_config(args, backbone.out_channels)
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


@MODELS.register("point_pillar")
class PointPillar(nn.Module):
    """Single-agent PointPillars, used for no fusion (ego points), early fusion (all agents'
    points merged at the ego) and late fusion (each CAV run as its own sample): every
    ``record_len`` entry must be 1. comm_bytes: early fusion's shared points x 16 B when the
    batch has ``shared_points``, else 0 (late fusion's boxes are counted by the post-processor).
    """

    def __init__(self, vfe: PillarVFE, scatter: PointPillarScatter, backbone: BaseBEVBackbone,
                 head: AnchorHead):
        super().__init__()
        self.vfe, self.scatter, self.backbone, self.head = vfe, scatter, backbone, head

    @classmethod
    def from_config(cls, args: dict) -> "PointPillar":
        return cls(*build_pillar_parts(args))

    def bev_features(self, batch: dict) -> torch.Tensor:
        """The BEV map the head reads: (B, C, H, W). An early-fusion model's map is DiscoNet's
        distillation target (``opencood.engine.teacher``)."""
        canvas = encode_agents(self.vfe, self.scatter, batch)
        if canvas.shape[0] != batch["record_len"].shape[0]:
            raise ValueError("point_pillar is single-agent: every record_len entry must be 1 "
                             "(merge points for early fusion, one sample per CAV for late)")
        return self.backbone(canvas)

    def forward(self, batch: dict) -> dict:
        features = self.bev_features(batch)
        outputs = self.head(features)
        outputs["comm_bytes"] = early_fusion_bytes(batch, features.shape[0], features.device)
        return outputs


class ShrinkHeader(nn.Module):
    """OpenCOOD's ``shrink_header`` (V2VNet, V2X-ViT, CoBEVT): two 3x3 convs with ReLU, the
    first strided, narrowing the backbone output before fusion so attention over agents and
    windows stays affordable: (N, C_in, H, W) -> (N, dim, ceil(H / stride), ceil(W / stride)).
    With stride 2 the head runs at feature stride 4 (``anchor_args.feature_stride: 4``)."""

    def __init__(self, in_channels: int, dim: int, stride: int = 2):
        super().__init__()
        self.out_channels = dim
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, dim, 3, stride=stride, padding=1), nn.ReLU(),
            nn.Conv2d(dim, dim, 3, padding=1), nn.ReLU())

    @classmethod
    def from_config(cls, args: dict, in_channels: int) -> "ShrinkHeader":
        dim, stride = args["dim"], args["stride"]
        # OpenCOOD writes one-entry lists (dim: [256], stride: [2]); accept both spellings.
        dim = dim[0] if isinstance(dim, (list, tuple)) else dim
        stride = stride[0] if isinstance(stride, (list, tuple)) else stride
        return cls(in_channels, int(dim), int(stride))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features)


@MODELS.register("point_pillar_intermediate")
class PointPillarIntermediate(nn.Module):
    """PointPillars with per-agent BEV features fused at the ego by a FUSIONS module.

    ``stage`` is where fusion happens: "scatter" (on the pillar canvas, before the backbone),
    "multiscale" (on every backbone scale before its up block) or "backbone" (on the backbone
    output, before the head); the bytes reported are those of the maps fused there, summed over
    scales for "multiscale". An optional ``shrink`` (``ShrinkHeader``) narrows the backbone
    output: per agent before fusion at the "backbone" stage, on the fused map otherwise.
    """

    def __init__(self, vfe: PillarVFE, scatter: PointPillarScatter, backbone: BaseBEVBackbone,
                 head: AnchorHead, fusion: FusionModule, stage: Optional[str] = None,
                 shrink: Optional[ShrinkHeader] = None):
        super().__init__()
        stage = stage or fusion.default_stage
        if stage not in fusion.supported_stages:
            raise ValueError(f"{type(fusion).__name__} cannot fuse at stage {stage!r}; "
                             f"supported: {', '.join(fusion.supported_stages)}")
        self.vfe, self.scatter, self.backbone, self.head = vfe, scatter, backbone, head
        self.fusion = fusion
        self.stage = stage
        self.shrink = shrink if shrink is not None else nn.Identity()

    @classmethod
    def from_config(cls, args: dict) -> "PointPillarIntermediate":
        vfe, scatter, backbone, head = build_pillar_parts(args)
        shrink = None
        if args.get("shrink_header"):
            shrink = ShrinkHeader.from_config(args["shrink_header"], backbone.out_channels)
            head = AnchorHead.from_config(args, shrink.out_channels)
        fusion_cfg = args["fusion"]
        fusion_cls = FUSIONS.get(fusion_cfg["core_method"])
        fusion = fusion_cls.from_config(
            fusion_cfg["args"],
            in_channels=shrink.out_channels if shrink is not None else backbone.out_channels,
            num_anchors=head.num_anchors)
        return cls(vfe, scatter, backbone, head, fusion, stage=fusion_cfg["stage"],
                   shrink=shrink)

    def fuse_features(self, canvas: torch.Tensor, record_len: torch.Tensor,
                      extra: Optional[dict] = None):
        """(N_agents, C, ny, nx) -> (B, C_out, H, W), list of FusionResult (one per fusion).

        ``extra``: the per-agent inputs the fusion module asked for (``extra_inputs``)."""
        results = []
        extra = extra or {}

        def fuse(features, lengths):
            results.append(self.fusion(features, lengths, **extra))
            return results[-1].features

        if self.stage == "scatter":
            return self.shrink(self.backbone(fuse(canvas, record_len))), results
        if self.stage == "multiscale":
            fused = self.backbone(canvas, fuse_fn=fuse, record_len=record_len)
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
        fused, results = self.fuse_features(canvas, record_len, extra)
        outputs = self.head(fused)
        # The map the head reads, for feature distillation (DiscoNet's teacher matches it).
        outputs["fused_features"] = fused
        outputs["comm_bytes"] = torch.stack([r.comm_bytes for r in results]).sum(dim=0)
        for result in results:
            outputs.update(result.aux)
        if "conf_preds" in outputs:
            outputs["conf_sample_index"] = agent_slots(record_len, canvas.shape[0])[0]
        return outputs
