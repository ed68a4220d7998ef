"""Image trunks of HEAL's lift-splat camera encoder, built from torchvision's blocks.

* :class:`EfficientNetB0` is the EfficientNet-b0 of ``efficientnet_pytorch`` (what HEAL's
  ``CamEncode`` runs) on torchvision's ``efficientnet_b0`` structure. The layers, widths, squeeze-
  excitation, SiLU and stochastic depth are the same; three settings differ in torchvision and are
  set here: BatchNorm eps 1e-3 / momentum 0.01 (torchvision: 1e-5 / 0.1), TensorFlow's "same"
  padding of the five stride-2 convs (torchvision pads k // 2 on every side, which moves the
  sampling grid by a pixel), and no classifier head (HEAL reads the stage outputs only).
  :func:`efficientnet_pytorch_to_ours` maps an ``efficientnet_pytorch`` state dict onto it, so that
  package stays out of our requirements.
* :class:`ResNet101Stem`: conv1, bn1, max-pool, layer1 and layer2 of torchvision's ResNet-101
  (HEAL's ``CamEncode_Resnet101`` uses no more: 512 channels at stride 8), with torchvision's key
  names, so HEAL's keys carry over unchanged.
* :class:`ResNetBevEncode`: HEAL's ``BevEncode`` (the first three ResNet-18 stages on the BEV map,
  a skip connection, back to full resolution).
* :class:`LightTrunk` (ours, not HEAL's): plain strided 3x3 conv-BN-ReLU stages, for a camera
  model that must train from scratch on a CPU budget (about 1/30 of the EfficientNet's cost).
"""
from __future__ import annotations

import math
from functools import partial
from typing import Dict, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torchvision.models import efficientnet_b0
from torchvision.models.resnet import BasicBlock, Bottleneck

from opencood.errors import OpencoodError

# efficientnet_pytorch's flat ``_blocks`` list, in torchvision's stages (``features[1..7]``)
EFFICIENTNET_B0_STAGE_DEPTHS = (1, 2, 2, 3, 3, 4, 1)
# efficientnet_pytorch keys HEAL never runs (the 1280-channel head, pooling, classifier)
EFFICIENTNET_UNUSED_PREFIXES = ("_conv_head.", "_bn1.", "_fc.")


class WeightMappingError(OpencoodError, KeyError):
    """A state dict key that a mapping does not know. ``str()`` is the plain message."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class SamePadConv2d(nn.Conv2d):
    """A conv that pads like TensorFlow's "same": ``k - s`` in total per axis for an even input,
    the odd pixel at the bottom / right (``efficientnet_pytorch``'s ``Conv2dStaticSamePadding``,
    whose pads are fixed from b0's 224-pixel input; for a stride-2 conv they are the same for
    every even size). (N, C, H, W) -> (N, C', ceil(H / s), ceil(W / s))."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                         padding=0, groups=conv.groups, bias=conv.bias is not None)
        self.weight = conv.weight
        self.bias = conv.bias
        pads = []
        for kernel, stride in zip(reversed(self.kernel_size), reversed(self.stride)):
            total = max(kernel - stride, 0)
            pads += [total // 2, total - total // 2]       # (left, right, top, bottom)
        self.pads = tuple(pads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, self.pads))


class EfficientNetB0(nn.Module):
    """EfficientNet-b0 without its head: images (N, 3, H, W), H and W multiples of 32 ->
    {stride: the last feature map at that stride}: 2: (N, 16), 4: (N, 24), 8: (N, 40),
    16: (N, 112), 32: (N, 320), each (N, C, H / stride, W / stride) (HEAL's ``reduction_1..5``)."""

    def __init__(self, stochastic_depth_prob: float = 0.2):
        super().__init__()
        norm = partial(nn.BatchNorm2d, eps=1e-3, momentum=0.01)     # efficientnet_pytorch's
        net = efficientnet_b0(weights=None, norm_layer=norm,
                              stochastic_depth_prob=stochastic_depth_prob)
        self.features = net.features[:8]          # stem + 7 stages (features[8]: the head)
        for name, module in list(self.features.named_modules()):
            if isinstance(module, nn.Conv2d) and module.stride != (1, 1):
                parent_name, _, child = name.rpartition(".")
                setattr(self.features.get_submodule(parent_name), child, SamePadConv2d(module))

    def forward(self, images: torch.Tensor) -> Dict[int, torch.Tensor]:
        endpoints = {}
        x = self.features[0](images)
        for stage in self.features[1:]:
            before = x
            x = stage(x)
            if x.shape[-2] < before.shape[-2]:          # the stage downsampled: keep the last
                endpoints[images.shape[-2] // before.shape[-2]] = before
        endpoints[images.shape[-2] // x.shape[-2]] = x
        return endpoints


def _efficientnet_block_names() -> list:
    """efficientnet_pytorch block index -> (stage, index in stage), stages 1..7."""
    names = []
    for stage, depth in enumerate(EFFICIENTNET_B0_STAGE_DEPTHS, start=1):
        names += [(stage, index) for index in range(depth)]
    return names


def _efficientnet_block_key(block: int, rest: str) -> str:
    """``_blocks.{block}.{rest}`` -> our key. Stage 1 has no expansion conv, so torchvision
    numbers its layers one lower."""
    stage, index = _efficientnet_block_names()[block]
    expand = 0 if stage == 1 else 1
    module, _, tail = rest.partition(".")
    layer = {"_expand_conv": "0.0", "_bn0": "0.1",
             "_depthwise_conv": f"{expand}.0", "_bn1": f"{expand}.1",
             "_se_reduce": f"{expand + 1}.fc1", "_se_expand": f"{expand + 1}.fc2",
             "_project_conv": f"{expand + 2}.0", "_bn2": f"{expand + 2}.1"}.get(module)
    if layer is None or (stage == 1 and module in ("_expand_conv", "_bn0")):
        raise WeightMappingError(f"efficientnet_pytorch key _blocks.{block}.{rest}: unknown layer "
                                 f"{module!r}")
    return f"features.{stage}.{index}.block.{layer}.{tail}"


def efficientnet_pytorch_to_ours(state: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """An ``efficientnet_pytorch`` EfficientNet-b0 state dict (``EfficientNet.state_dict()``) ->
    :class:`EfficientNetB0`'s, the same tensors. The head, pooling and classifier
    (``_conv_head``, ``_bn1``, ``_fc``) are dropped: HEAL never runs them. An unknown key raises
    :class:`WeightMappingError` naming it."""
    ours = {}
    for key, tensor in state.items():
        if key.startswith(EFFICIENTNET_UNUSED_PREFIXES):
            continue
        if key.startswith("_conv_stem."):
            ours["features.0.0." + key[len("_conv_stem."):]] = tensor
        elif key.startswith("_bn0."):
            ours["features.0.1." + key[len("_bn0."):]] = tensor
        elif key.startswith("_blocks."):
            block, _, rest = key[len("_blocks."):].partition(".")
            if not block.isdigit() or int(block) >= sum(EFFICIENTNET_B0_STAGE_DEPTHS):
                raise WeightMappingError(f"efficientnet_pytorch key {key}: no block {block} in b0")
            ours[_efficientnet_block_key(int(block), rest)] = tensor
        else:
            raise WeightMappingError(f"efficientnet_pytorch key {key}: not part of EfficientNet-b0")
    return ours


def resnet_stage(block: type, in_channels: int, planes: int, num_blocks: int,
                 stride: int) -> nn.Sequential:
    """torchvision's ``ResNet._make_layer``: ``num_blocks`` blocks, the first strided with a
    1x1 conv + BN shortcut when the shape changes (same keys: ``0.downsample.0``, ...)."""
    out_channels = planes * block.expansion
    shortcut = None
    if stride != 1 or in_channels != out_channels:
        shortcut = nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                                 nn.BatchNorm2d(out_channels))
    blocks = [block(in_channels, planes, stride, shortcut)]
    blocks += [block(out_channels, planes) for _ in range(num_blocks - 1)]
    return nn.Sequential(*blocks)


def init_like_torchvision_resnet(module: nn.Module) -> None:
    """torchvision's ResNet initialisation with ``zero_init_residual=True`` (HEAL's trunks):
    Kaiming-normal convs (fan out), unit BN, the last BN of each residual branch zero."""
    for layer in module.modules():
        if isinstance(layer, nn.Conv2d):
            nn.init.kaiming_normal_(layer.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(layer, nn.BatchNorm2d):
            nn.init.ones_(layer.weight)
            nn.init.zeros_(layer.bias)
    for layer in module.modules():
        if isinstance(layer, Bottleneck):
            nn.init.zeros_(layer.bn3.weight)
        elif isinstance(layer, BasicBlock):
            nn.init.zeros_(layer.bn2.weight)


class ResNet101Stem(nn.Module):
    """The first two stages of ResNet-101 (= ResNet-50's): images (N, 3, H, W) ->
    (N, 512, H / 8, W / 8)."""

    out_channels = 512

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = resnet_stage(Bottleneck, 64, 64, 3, stride=1)
        self.layer2 = resnet_stage(Bottleneck, 256, 128, 4, stride=2)
        init_like_torchvision_resnet(self)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(torch.relu(self.bn1(self.conv1(images))))
        return self.layer2(self.layer1(x))


class UpConcat(nn.Module):
    """HEAL's ``Up``: bilinear upsampling (corners aligned) of the coarse map, concatenated AFTER
    the fine one, then two 3x3 conv-BN-ReLU: coarse (N, C1, h, w), fine (N, C2, h * s, w * s)
    -> (N, out_channels, h * s, w * s)."""

    def __init__(self, in_channels: int, out_channels: int, scale_factor: int = 2):
        super().__init__()
        self.up = nn.Upsample(scale_factor=scale_factor, mode="bilinear", align_corners=True)
        self.conv = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))

    def forward(self, coarse: torch.Tensor, fine: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.cat([fine, self.up(coarse)], dim=1))


class ResNetBevEncode(nn.Module):
    """HEAL's ``BevEncode``: a 7x7 stride-2 conv, ResNet-18's layer1..3, the stride-16 map
    upsampled x4 onto layer1's, then x2 to the input size and a 1x1 conv:
    (N, in_channels, H, W) -> (N, out_channels, H, W), H and W multiples of 8."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.layer1 = resnet_stage(BasicBlock, 64, 64, 2, stride=1)
        self.layer2 = resnet_stage(BasicBlock, 64, 128, 2, stride=2)
        self.layer3 = resnet_stage(BasicBlock, 128, 256, 2, stride=2)
        # HEAL builds conv1 after torchvision's ResNet initialised: it keeps PyTorch's default
        conv1_init = self.conv1.weight.detach().clone()
        init_like_torchvision_resnet(self)
        with torch.no_grad():
            self.conv1.weight.copy_(conv1_init)
        self.up1 = UpConcat(64 + 256, 256, scale_factor=4)
        self.up2 = nn.Sequential(
            nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True),
            nn.Conv2d(256, 128, 3, padding=1, bias=False),
            nn.BatchNorm2d(128), nn.ReLU(inplace=True),
            nn.Conv2d(128, out_channels, 1))

    def forward(self, bev: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(bev)))
        fine = self.layer1(x)
        return self.up2(self.up1(self.layer3(self.layer2(fine)), fine))


class LightTrunk(nn.Module):
    """Ours: images (N, 3, H, W) -> (N, width, H / downsample, W / downsample), H and W
    multiples of ``downsample`` (8 or 16). One stage per halving, each a stride-2 3x3 conv then
    a 3x3 conv (both conv-BN-ReLU); stage widths 16, 32, 64 (, 128 at stride 16), the last
    stage ``width`` wide. A CPU-budget trunk: the synthetic world's cars differ from the road
    by colour and shading, which a few convs see without ImageNet weights."""

    def __init__(self, downsample: int, width: int):
        super().__init__()
        stages = int(math.log2(downsample))
        if 2 ** stages != downsample or stages < 1:
            raise ValueError(f"LightTrunk: downsample {downsample} is not a power of two")
        widths = [16 * 2 ** stage for stage in range(stages - 1)] + [width]
        layers, channels = [], 3
        for out in widths:
            layers += [conv_bn_relu(channels, out, stride=2), conv_bn_relu(out, out, stride=1)]
            channels = out
        self.layers = nn.Sequential(*layers)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


def conv_bn_relu(in_channels: int, out_channels: int, stride: int) -> nn.Sequential:
    """3x3 conv (padding 1, no bias) + BatchNorm + ReLU: (N, C, H, W) -> (N, C', H / s, W / s)."""
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1,
                                   bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))
