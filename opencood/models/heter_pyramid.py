"""HEAL's heterogeneous models (Lu et al., ICLR 2024): agents of different modalities (a 64-beam
LiDAR, a 32-beam LiDAR, cameras...), each modality with its own encoder, ResNet BEV backbone and
aligner, meeting in one pyramid fusion (``opencood.models.pyramid_fusion``) and one shared head.

* ``heter_pyramid_collab`` (:class:`HeterPyramidCollab`, HEAL's ``HeterPyramidCollab``): the
  agents of a sample fused at the ego (intermediate fusion, maps in their own frames warped with
  ``transforms_to_ego``);
* ``heter_pyramid_single`` (:class:`HeterPyramidSingle`, HEAL's ``HeterPyramidSingle``): every
  agent alone (record_len all ones): the same modules, the pyramid without the weighting. Under
  the late strategy it is HEAL's late heterogeneous fusion: each CAV detects with its own
  modality's encoder, the boxes are merged at the ego.

Per agent (``model.args.modalities.<name>``, HEAL's ``m1``..``mN``): encoder (the encoder slot,
``opencood.models.encoders``: ``pillar`` for a LiDAR, ``lss`` for cameras) -> backbone
(:class:`ModalityBackboneArgs`, HEAL's ``ResNetBEVBackbone`` without up blocks) -> aligner
(:class:`AlignerArgs`: identity or ConvNeXt blocks) -> for cameras the crop: the camera map
(its own ``xbound`` / ``ybound``, usually half the LiDAR range) padded or cropped about its centre
to cover the model's BEV range (torchvision's ``CenterCrop``, HEAL's). Every modality must end
with the same width and map size.

Inputs (model-input keys, ``opencood.batch_keys``): record_len (B,), transforms_to_ego (N_agents,
4, 4) with points_in_agent_frame, agent_modality (each agent's type, ``m1``...) and, per type,
its encoder's inputs for its agents in batch order (HEAL's ``inputs_<m>``): a LiDAR type's
pillars in ``modality_pillars[m]`` (the agent index counted within the type), a camera type's
tensors in ``modality_cameras[m]`` (one row per agent of the type).

Outputs: cls_preds (B, K*A, H, W) (K classes), reg_preds (B, 7A, H, W), dir_preds (B, 2A, H, W),
fused_features (B, C, H, W) (the map the head reads), occupancy_maps (list of (N_agents, 1, H_l,
W_l) logits, one per pyramid scale; the pyramid loss's input), comm_bytes (B,), and with a camera
encoder's depth supervision depth_outputs {modality: the encoder's ``depth_outputs``}.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Literal, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import (FrozenDict, Problems, all_positive, box_range, positive,
                                     section, spec)
from opencood.models.backbone import BackboneArgs, BaseBEVBackbone
from opencood.models.detectors import (ShrinkHeader, ShrinkHeaderArgs, bev_grid, is_own_frame,
                                       set_bn_momentum)
from opencood.models.encoders import EncoderGeometry, ModelEncoder
from opencood.models.heads import AnchorHead
from opencood.models.pyramid_fusion import PyramidFusion, PyramidFusionArgs
from opencood.registry import ENCODERS, MODELS


@section
class ModalityBackboneArgs(BackboneArgs):
    """A modality's ``backbone`` (HEAL's ``backbone_args``): residual stages, no up blocks unless
    given (then the scales' maps, which must share a size, are concatenated)."""

    upsample_strides: Tuple[int, ...] = ()
    num_upsample_filter: Tuple[int, ...] = ()
    resnet: bool = True


@section
class AlignerArgs:
    """A modality's ``aligner`` (HEAL's ``aligner_args``): ``identity`` or ``convnext`` blocks
    (the two HEAL's configs use) on the backbone's output width."""

    core_method: Literal["identity", "convnext"] = "identity"
    num_of_blocks: int = spec(3, check=positive)         # convnext
    kernel_size: int = spec(7, check=positive)           # convnext's depthwise conv, odd

    def problems(self) -> Problems:
        if self.kernel_size % 2 == 0:
            yield "kernel_size", "must be odd (the map keeps its size)"


@section
class ModalityArgs:
    """``model.args.modalities.<name>``: one agent type. A LiDAR type's pillar grid
    (``lidar_range``, ``voxel_size``) is derived from its ``heter.modality_setting.<name>
    .preprocess`` (else the top-level one), the grid the data side pillarises it on."""

    sensor_type: Literal["lidar", "camera"]
    encoder: ModelEncoder
    backbone: ModalityBackboneArgs
    aligner: AlignerArgs
    lidar_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    voxel_size: Optional[Tuple[float, float, float]] = spec(None, check=all_positive)

    def problems(self) -> Problems:
        expected = "lss" if self.sensor_type == "camera" else "pillar"
        if self.encoder.core_method != expected:
            yield "encoder.core_method", (f"must be {expected!r} for sensor_type "
                                          f"{self.sensor_type!r}")


@section
class HeterGridArgs:
    """The keys that HEAL's heterogeneous models share (``heter_pyramid_*``, ``heter_model_late``):
    the first six derived from the data sections unless given (as the detectors'), and each
    LiDAR type's pillar grid (:meth:`derived_from`). Subclasses add ``modalities``."""

    lidar_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    voxel_size: Optional[Tuple[float, float, float]] = spec(None, check=all_positive)
    anchor_number: Optional[int] = spec(None, check=positive)     # yaws x classes
    num_class: Optional[int] = spec(None, check=positive)         # class logits per anchor
    bev_range: Optional[Tuple[float, ...]] = spec(None, check=box_range)
    bev_cell_size: Optional[Tuple[float, float]] = spec(None, check=all_positive)
    bn_momentum: Optional[float] = None

    def derived_from(self, config):
        """Each LiDAR type's pillar grid left unset: its ``heter`` preprocess's, else the
        top-level ``preprocess`` (``config_schema.derive`` calls this)."""
        settings = config.heter.modality_setting if config.heter is not None else {}
        modalities = {}
        for name, modality in self.modalities.items():
            setting = settings.get(name)
            pre = (setting.preprocess if setting is not None else None) or config.preprocess
            if modality.sensor_type == "lidar":
                modality = dataclasses.replace(
                    modality, lidar_range=modality.lidar_range or pre.cav_lidar_range,
                    voxel_size=modality.voxel_size or pre.args.voxel_size)
            modalities[name] = modality
        return dataclasses.replace(self, modalities=FrozenDict(modalities))   # read-only


@section
class HeterPyramidArgs(HeterGridArgs):
    """``model.args`` of ``heter_pyramid_collab`` / ``heter_pyramid_single``: the shared keys
    (:class:`HeterGridArgs`), the agent types, the pyramid and its shrink header."""

    modalities: Dict[str, ModalityArgs]
    fusion_backbone: PyramidFusionArgs
    shrink_header: Optional[ShrinkHeaderArgs] = None

    def problems(self) -> Problems:
        if not self.modalities:
            yield "modalities", "needs at least one agent type ({m1: {sensor_type, ...}})"


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block as HEAL's aligner has it: depthwise k x k conv, LayerNorm over channels,
    1x1 expansion to 4C, GELU, 1x1 back, per-channel scale ``gamma``, plus the input:
    (N, C, H, W) -> (N, C, H, W)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, kernel_size, padding=kernel_size // 2,
                                groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.pwconv1 = nn.Linear(channels, 4 * channels)
        self.pwconv2 = nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 1e-6))    # ConvNeXt's layer scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(F.gelu(self.pwconv1(self.norm(y))))
        return x + (self.gamma * y).permute(0, 3, 1, 2)


def build_aligner(args: AlignerArgs, channels: int) -> nn.Module:
    if args.core_method == "identity":
        return nn.Identity()
    return nn.Sequential(*(ConvNeXtBlock(channels, args.kernel_size)
                           for _ in range(args.num_of_blocks)))


def center_crop(features: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(N, C, h, w) -> (N, C, height, width) about the centre, zero padded where larger:
    torchvision's ``CenterCrop`` (pad (d // 2, (d + 1) // 2), then crop from round(excess / 2),
    Python's rounding), which HEAL applies to camera maps."""
    h, w = features.shape[-2:]
    if height > h or width > w:
        pad_h, pad_w = max(height - h, 0), max(width - w, 0)
        features = F.pad(features, (pad_w // 2, (pad_w + 1) // 2, pad_h // 2, (pad_h + 1) // 2))
        h, w = features.shape[-2:]
    top, left = int(round((h - height) / 2.0)), int(round((w - width) / 2.0))
    return features[..., top:top + height, left:left + width]


class ModalityBranch(nn.Module):
    """One agent type's encoder -> backbone -> aligner (-> camera crop):
    encoder inputs of its M agents -> (M, C, H, W)."""

    def __init__(self, name: str, args: ModalityArgs, model_args: HeterGridArgs):
        super().__init__()
        self.name, self.sensor_type = name, args.sensor_type
        grid = bev_grid(model_args)
        encoder_cls = ENCODERS.get(args.encoder.core_method)
        if args.sensor_type == "camera":       # its own grid (xbound / ybound), cropped after
            self.encoder = encoder_cls(args.encoder.args, geometry=None)
            bounds = (args.encoder.args.xbound, args.encoder.args.ybound)
            # HEAL's lidar_range[4] / ybound[1], lidar_range[3] / xbound[1] (ranges centred)
            self.crop_ratio = (grid.lidar_range[4] / bounds[1][1],
                               grid.lidar_range[3] / bounds[0][1])
        else:       # its own pillar grid (the data side pillarises it there), as its BEV grid
            lidar_range = args.lidar_range or model_args.lidar_range
            voxel_size = args.voxel_size or model_args.voxel_size
            own = bev_grid(dataclasses.replace(model_args, lidar_range=lidar_range,
                                               voxel_size=voxel_size, bev_range=None,
                                               bev_cell_size=None))
            geometry = EncoderGeometry(own, lidar_range, voxel_size)
            self.encoder = encoder_cls(args.encoder.args, geometry=geometry)
            self.crop_ratio = None
        self.backbone = BaseBEVBackbone(args.backbone, self.encoder.out_channels)
        self.aligner = build_aligner(args.aligner, self.backbone.out_channels)
        self.out_channels = self.backbone.out_channels
        self.map_size = self.output_size(args.backbone.layer_strides)

    def output_size(self, strides: Sequence[int]) -> Tuple[int, int]:
        """(H, W) of this branch's maps: its encoder's grid through the backbone's strides
        (ceil), then the camera crop."""
        if self.crop_ratio is not None:
            height, width = self.encoder.cells[1], self.encoder.cells[0]
        else:
            height, width = self.encoder.scatter.ny, self.encoder.scatter.nx
        for stride in strides:
            height, width = -(-height // stride), -(-width // stride)
        if self.crop_ratio is not None:
            height, width = int(height * self.crop_ratio[0]), int(width * self.crop_ratio[1])
        return height, width

    def forward(self, inputs: dict) -> torch.Tensor:
        features = self.aligner(self.backbone(self.encoder(inputs)))
        if self.crop_ratio is not None:
            height, width = features.shape[-2:]
            features = center_crop(features, int(height * self.crop_ratio[0]),
                                   int(width * self.crop_ratio[1]))
        return features


def modality_batch(inputs: dict, count: int) -> dict:
    """A modality's encoder inputs with the ``record_len`` its encoder counts agents by (one
    sample holding the modality's ``count`` agents) unless given."""
    if "record_len" in inputs:
        return inputs
    device = next((v.device for v in inputs.values() if isinstance(v, torch.Tensor)), None)
    return {**inputs, "record_len": torch.tensor([count], device=device)}


class HeterPyramidBase(nn.Module):
    """The modules of both models (module doc); ``collaborative`` picks the pyramid's pass."""

    collaborative = True

    def __init__(self, args: HeterPyramidArgs):
        super().__init__()
        self.grid = bev_grid(args)
        self.branches = nn.ModuleDict({name: ModalityBranch(name, setting, args)
                                       for name, setting in args.modalities.items()})
        widths = {name: branch.out_channels for name, branch in self.branches.items()}
        if len(set(widths.values())) > 1:
            raise ValueError(f"every modality must end with one width for the fusion: {widths} "
                             "(model.args.modalities.*.backbone.num_filters)")
        sizes = {name: branch.map_size for name, branch in self.branches.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"every modality must end with one map size (H, W) for the fusion: "
                             f"{sizes} (their grids, backbone strides and camera ranges)")
        self.pyramid = PyramidFusion(args.fusion_backbone, next(iter(widths.values())))
        self.shrink = nn.Identity()
        head_width = self.pyramid.out_channels
        if args.shrink_header is not None:
            self.shrink = ShrinkHeader(args.shrink_header, head_width)
            head_width = self.shrink.out_channels
        self.head = AnchorHead(head_width, num_anchors=args.anchor_number, use_dir=True,
                               num_classes=args.num_class)
        self.crop_ratios = {name: branch.crop_ratio for name, branch in self.branches.items()
                            if branch.crop_ratio is not None}
        set_bn_momentum(self, args.bn_momentum)

    def agent_features(self, batch: dict, agent_modalities: Sequence[str]):
        """Every agent's aligned map in batch order: (N_agents, C, H, W), and the encoders'
        depth outputs by modality."""
        unknown = sorted(set(agent_modalities) - set(self.branches))
        if unknown:
            raise ValueError(f"agents of modality {unknown[0]!r}, which the model has no branch "
                             f"for (model.args.modalities: {', '.join(self.branches)})")
        maps, rows, depth = [], {}, {}
        for name, branch in self.branches.items():
            agents = [i for i, modality in enumerate(agent_modalities) if modality == name]
            if not agents:
                continue
            group = "modality_cameras" if branch.sensor_type == "camera" else "modality_pillars"
            if name not in batch.get(group, {}):
                raise ValueError(f"{len(agents)} agents of modality {name}, but the batch has "
                                 f"no {group}[{name!r}]")
            features = branch(modality_batch(batch[group][name], len(agents)))
            if features.shape[0] != len(agents):
                raise ValueError(f"modality {name}: {features.shape[0]} maps from its inputs, "
                                 f"{len(agents)} agents of it in agent_modality")
            for k, agent in enumerate(agents):
                rows[agent] = sum(m.shape[0] for m in maps) + k
            maps.append(features)
            if getattr(branch.encoder, "depth_outputs", None) is not None:
                depth[name] = branch.encoder.depth_outputs
        shapes = {tuple(m.shape[1:]) for m in maps}
        if len(shapes) > 1:
            raise ValueError(f"the modalities' maps differ in shape {sorted(shapes)}: their "
                             "ranges, cells and strides must give one BEV map")
        order = torch.tensor([rows[i] for i in range(len(agent_modalities))],
                             device=maps[0].device)
        return torch.cat(maps).index_select(0, order), depth

    def forward(self, batch: dict) -> dict:
        agent_modalities = list(batch["agent_modality"])
        record_len = batch["record_len"]
        features, depth = self.agent_features(batch, agent_modalities)
        if self.collaborative:
            to_ego = batch["transforms_to_ego"] if is_own_frame(batch) else None
            fused, occupancy = self.pyramid.forward_collab(
                features, record_len, to_ego, self.grid, agent_modalities, self.crop_ratios)
            comm_bytes = self.pyramid.comm_bytes(occupancy, record_len)
        else:
            if features.shape[0] != record_len.shape[0]:
                raise ValueError("heter_pyramid_single is single-agent: every record_len entry "
                                 "must be 1 (one sample per CAV, the late strategy)")
            fused, occupancy = self.pyramid.forward_single(features)
            comm_bytes = torch.zeros(record_len.shape[0], device=fused.device)
        fused = self.shrink(fused)
        outputs = self.head(fused)
        outputs.update(fused_features=fused, occupancy_maps=occupancy, comm_bytes=comm_bytes)
        if depth:
            outputs["depth_outputs"] = depth
        return outputs


@MODELS.register("heter_pyramid_collab", args=HeterPyramidArgs)
class HeterPyramidCollab(HeterPyramidBase):
    """HEAL's ``HeterPyramidCollab`` (module doc): the intermediate strategy's model."""

    collaborative = True

    @property
    def fusion(self) -> PyramidFusion:
        """What makes the strategies see a fusing model (``strategies.fuses_agents``)."""
        return self.pyramid


@MODELS.register("heter_pyramid_single", args=HeterPyramidArgs)
class HeterPyramidSingle(HeterPyramidBase):
    """HEAL's ``HeterPyramidSingle`` (module doc): every agent alone; late fusion's model."""

    collaborative = False
