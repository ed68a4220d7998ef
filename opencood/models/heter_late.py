"""HEAL's late heterogeneous model (``heter_model_late.py``, ``HeterModelLate``): every agent type
a complete single-agent detector of its own, for late fusion (each CAV detects alone, the boxes
are merged at the ego by the late strategy).

Per type (``model.args.modalities.<m>``, :class:`LateModalityArgs`): the branch of the pyramid
models (encoder, ResNet backbone, camera crop; ``opencood.models.heter_pyramid``) gives the first
scale; ``layers`` (HEAL's ``layers_args``, a ResNetBEVBackbone whose first stage HEAL builds but
never runs, so ours has none) adds the further scales from it, the up blocks bring every scale to
the first one's stride; then the type's shrink header and its own cls / reg / dir heads.

Input and output keys as ``heter_pyramid_single`` (every record_len entry 1), without the
occupancy maps: cls_preds, reg_preds, dir_preds, comm_bytes (0: the late strategy counts the
boxes).
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from opencood.config_schema import section
from opencood.models.backbone import BackboneArgs, make_residual_stage, make_up_block
from opencood.models.detectors import ShrinkHeader, ShrinkHeaderArgs, bev_grid, set_bn_momentum
from opencood.models.heads import AnchorHead
from opencood.models.heter_pyramid import (HeterGridArgs, ModalityArgs, ModalityBranch,
                                           modality_batch)
from opencood.registry import MODELS


@section
class LateModalityArgs(ModalityArgs):
    """One agent type's detector: the branch's keys, ``layers`` (its scales after the first:
    HEAL's ``layers_args``; entry 0 describes the branch's output scale) and its shrink
    header."""

    layers: BackboneArgs
    shrink_header: ShrinkHeaderArgs


@section
class HeterLateArgs(HeterGridArgs):
    """``model.args`` of ``heter_model_late``: the shared keys (:class:`HeterGridArgs`) and one
    detector per agent type."""

    modalities: Dict[str, LateModalityArgs]


class LateDetector(nn.Module):
    """One agent type's detector: (M agents' inputs) -> head maps (M, ...)."""

    def __init__(self, name: str, args: LateModalityArgs, model_args: HeterLateArgs,
                 anchors: int):
        super().__init__()
        self.branch = ModalityBranch(name, args, model_args)
        layers = args.layers
        if layers.num_filters[0] != self.branch.out_channels:
            raise ValueError(f"model.args.modalities.{name}.layers.num_filters[0] "
                             f"({layers.num_filters[0]}) must be the backbone's width "
                             f"({self.branch.out_channels}): it is the first scale")
        self.stages = nn.ModuleList(
            make_residual_stage(c_in, c_out, stride, n) for c_in, c_out, stride, n in
            zip(layers.num_filters[:-1], layers.num_filters[1:], layers.layer_strides[1:],
                layers.layer_nums[1:]))
        self.deblocks = nn.ModuleList(
            make_up_block(c_in, c_out, stride) for c_in, c_out, stride in
            zip(layers.num_filters, layers.num_upsample_filter, layers.upsample_strides))
        self.shrink = ShrinkHeader(args.shrink_header, sum(layers.num_upsample_filter))
        self.head = AnchorHead(self.shrink.out_channels, num_anchors=anchors, use_dir=True,
                               num_classes=model_args.num_class)

    def forward(self, inputs: dict) -> dict:
        scales = [self.branch(inputs)]
        for stage in self.stages:
            scales.append(stage(scales[-1]))
        return self.head(self.shrink(torch.cat([up(x) for up, x in zip(self.deblocks, scales)],
                                               1)))


@MODELS.register("heter_model_late", args=HeterLateArgs)
class HeterModelLate(nn.Module):
    """HEAL's ``HeterModelLate`` (module doc): the late strategy's model."""

    def __init__(self, args: HeterLateArgs):
        super().__init__()
        self.grid = bev_grid(args)
        self.detectors = nn.ModuleDict({name: LateDetector(name, setting, args,
                                                           args.anchor_number)
                                        for name, setting in args.modalities.items()})
        set_bn_momentum(self, args.bn_momentum)

    def forward(self, batch: dict) -> dict:
        modalities = list(batch["agent_modality"])
        record_len = batch["record_len"]
        if len(modalities) != record_len.shape[0]:
            raise ValueError("heter_model_late is single-agent: every record_len entry must be "
                             "1 (one sample per CAV, the late strategy)")
        parts, order = [], []
        for name, detector in self.detectors.items():
            agents = [i for i, modality in enumerate(modalities) if modality == name]
            if not agents:
                continue
            sensor = detector.branch.sensor_type
            group = batch["modality_cameras" if sensor == "camera" else "modality_pillars"]
            parts.append(detector(modality_batch(group[name], len(agents))))
            order += agents
        unknown = sorted(set(modalities) - set(self.detectors))
        if unknown:
            raise ValueError(f"agents of modality {unknown[0]!r}, which the model has no "
                             f"detector for (model.args.modalities: {', '.join(self.detectors)})")
        rows = torch.empty(len(order), dtype=torch.long)
        rows[torch.tensor(order)] = torch.arange(len(order))
        rows = rows.to(parts[0]["cls_preds"].device)
        outputs = {key: torch.cat([p[key] for p in parts]).index_select(0, rows)
                   for key in parts[0]}
        outputs["comm_bytes"] = torch.zeros(len(modalities), device=rows.device)
        return outputs

