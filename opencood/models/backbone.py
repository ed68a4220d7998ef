"""Multi-scale 2-D BEV backbone (PointPillars / OpenCOOD ``BaseBEVBackbone``), with plain conv
down blocks or, with ``resnet: true``, residual stages of basic blocks (HEAL / CoAlign's
``ResNetBEVBackbone``; ResNeXt stages with ``resnext: true``, HEAL's pyramid fusion)."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Tuple

import torch
from torch import nn

from opencood.config_schema import Problems, section

# fuse_fn(features (N_agents, C, H, W), record_len (B,)) -> (B, C, H, W)
FuseFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# scale_fn(features (N_agents, C, H, W), scale index) -> (N_agents, C, H, W)
ScaleFn = Callable[[torch.Tensor, int], torch.Tensor]


def conv_bn_relu(in_channels: int, out_channels: int, stride: int = 1) -> list:
    # eps/momentum as OpenPCDet/OpenCOOD, so checkpoints and training dynamics carry over.
    return [nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels, eps=1e-3, momentum=0.01), nn.ReLU()]


def make_down_block(in_channels: int, out_channels: int, stride: int, num_convs: int):
    """One strided conv, then ``num_convs`` stride-1 convs; output size ceil(in / stride)."""
    layers = conv_bn_relu(in_channels, out_channels, stride)
    for _ in range(num_convs):
        layers += conv_bn_relu(out_channels, out_channels)
    return nn.Sequential(*layers)


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv + BN, the first strided, a ReLU between them and after
    the sum with the shortcut (a 1x1 strided conv + BN when the shape changes):
    (N, C_in, H, W) -> (N, C_out, ceil(H / stride), ceil(W / stride))."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        # torchvision's BatchNorm defaults, as the authors' ResNetBEVBackbone.
        self.residual = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.residual(x) + self.shortcut(x))


class ResNeXtBlock(nn.Module):
    """HEAL's pyramid-fusion block (``resnext: true``): a torchvision ResNeXt bottleneck with
    32 groups of 4 channels per 64 output channels and no expansion: 1x1 conv to the group
    width, grouped 3x3 conv (strided), 1x1 conv back to ``out_channels``, BatchNorm after each,
    ReLU between them and after the sum with the shortcut (as :class:`BasicBlock`'s):
    (N, C_in, H, W) -> (N, C_out, ceil(H / stride), ceil(W / stride))."""

    GROUPS, WIDTH_PER_GROUP = 32, 4

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        width = int(out_channels * self.WIDTH_PER_GROUP / 64) * self.GROUPS
        self.residual = nn.Sequential(
            nn.Conv2d(in_channels, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=stride, padding=1, groups=self.GROUPS, bias=False),
            nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.residual(x) + self.shortcut(x))


def make_residual_stage(in_channels: int, out_channels: int, stride: int, num_blocks: int,
                        block: type = BasicBlock):
    """``num_blocks`` residual blocks, the first strided (output size ceil(in / stride))."""
    blocks = [block(in_channels, out_channels, stride)]
    blocks += [block(out_channels, out_channels) for _ in range(num_blocks - 1)]
    return nn.Sequential(*blocks)


def make_up_block(in_channels: int, out_channels: int, stride: float) -> nn.Sequential:
    """Brings one scale to the common output stride: transposed conv up, or strided conv down."""
    if stride >= 1:
        stride = int(round(stride))
        conv = nn.ConvTranspose2d(in_channels, out_channels, stride, stride=stride, bias=False)
    else:
        down = int(round(1 / stride))
        conv = nn.Conv2d(in_channels, out_channels, down, stride=down, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(out_channels, eps=1e-3, momentum=0.01), nn.ReLU())


@section
class BackboneArgs:
    """``model.args.base_bev_backbone``: one entry per scale in every list."""

    ALIASES = {"num_upsample_filters": "num_upsample_filter"}    # OpenPCDet's spelling
    # stride-1 convs after each down block's first; with ``resnet``: basic blocks per stage
    layer_nums: Tuple[int, ...]
    layer_strides: Tuple[int, ...]
    num_filters: Tuple[int, ...]
    # both empty: no up blocks, the scales' own maps concatenated (HEAL's per-modality
    # ResNetBEVBackbone, one scale)
    upsample_strides: Tuple[int, ...]
    num_upsample_filter: Tuple[int, ...]    # OpenCOOD's singular spelling
    # True: residual down stages (HEAL's ``resnet`` key; its multiscale models default to it)
    resnet: bool = False
    # True: ResNeXt bottleneck stages (HEAL's pyramid fusion ``resnext``; implies residual)
    resnext: bool = False

    def problems(self) -> Problems:
        for name in ("layer_strides", "num_filters"):
            if len(getattr(self, name)) != len(self.layer_nums):
                yield name, f"needs one entry per layer_nums entry ({len(self.layer_nums)})"
        for name in ("upsample_strides", "num_upsample_filter"):
            if len(getattr(self, name)) not in (0, len(self.layer_nums)):
                yield name, (f"needs one entry per layer_nums entry ({len(self.layer_nums)}), "
                             "or none (no up blocks)")
        if len(self.upsample_strides) != len(self.num_upsample_filter):
            yield "num_upsample_filter", "needs one entry per upsample_strides entry"
        if (self.resnet or self.resnext) and min(self.layer_nums, default=1) < 1:
            yield "layer_nums", "must be >= 1 with residual stages (blocks per stage)"
        if self.resnext and min(self.num_filters, default=16) < 16:
            yield "num_filters", "must be >= 16 with resnext (32 groups of width // 16 x 4)"


class BaseBEVBackbone(nn.Module):
    """Down blocks at strides s0, s0*s1, ...; each scale is brought back to a common stride by an
    up block and the results are concatenated along channels.

    With layer_strides [2, 2, 2] and upsample_strides [1, 2, 4] the output stride is 2:
    (N, C_in, ny, nx) -> (N, sum(num_upsample_filter), ny/2, nx/2) (ny, nx divisible by 8).
    """

    def __init__(self, args: BackboneArgs, in_channels: int):
        super().__init__()
        channels_in = [in_channels, *args.num_filters[:-1]]
        if args.resnext:
            make_block = functools.partial(make_residual_stage, block=ResNeXtBlock)
        else:
            make_block = make_residual_stage if args.resnet else make_down_block
        self.blocks = nn.ModuleList(
            make_block(c_in, c_out, stride, n)
            for c_in, c_out, stride, n in zip(channels_in, args.num_filters, args.layer_strides,
                                              args.layer_nums))
        self.deblocks = nn.ModuleList(
            make_up_block(c_in, c_out, stride)
            for c_in, c_out, stride in zip(args.num_filters, args.num_upsample_filter,
                                           args.upsample_strides))
        self.scale_channels = tuple(args.num_filters)
        self.out_channels = int(sum(args.num_upsample_filter or args.num_filters))

    def forward(self, spatial_features: torch.Tensor, fuse_fn: Optional[FuseFn] = None,
                record_len: Optional[torch.Tensor] = None,
                scale_fn: Optional[ScaleFn] = None) -> torch.Tensor:
        """(N_agents, C_in, ny, nx) -> (N_agents, C_out, H, W), or (B, C_out, H, W) with fuse_fn.

        ``fuse_fn`` (multi-scale fusion, as OpenCOOD's AttFuse) merges each scale's per-agent
        features into one map per sample before its up block; the unfused per-agent features
        continue to the next down block, so every agent's backbone stays independent.
        ``scale_fn`` edits each scale's per-agent maps before both (Where2comm's mask).
        """
        x = spatial_features
        upsampled = []
        deblocks = self.deblocks if len(self.deblocks) else [None] * len(self.blocks)
        for index, (block, deblock) in enumerate(zip(self.blocks, deblocks)):
            x = block(x)
            if scale_fn is not None:
                x = scale_fn(x, index)
            scale_features = fuse_fn(x, record_len) if fuse_fn is not None else x
            upsampled.append(deblock(scale_features) if deblock is not None else scale_features)
        return torch.cat(upsampled, dim=1)
