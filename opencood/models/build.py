"""yaml ``model`` section -> detector (OpenPCDet-style config-driven build)."""
from __future__ import annotations

import torch
from torch import nn

from opencood.registry import MODELS


def build_model(model_cfg: dict) -> nn.Module:
    """``{"core_method": name, "args": {...}}`` -> ``MODELS.get(name)(parsed args)``.

    ``model_cfg`` is the resolved ``model`` section (opencood.config.resolve_section); its
    ``args`` are parsed with the schema the model registered (a missing key takes its default).
    An unknown name raises the registry's error, which lists every registered model.
    """
    return MODELS.build(model_cfg["core_method"], model_cfg["args"], "model.args")


def use_channels_last(model: nn.Module) -> nn.Module:
    """``model`` with its 4-D weights and its BEV maps channels-last (NHWC), in place
    (``performance.channels_last``).

    cudnn runs convolutions in NHWC; NCHW tensors are transposed to it and back around each
    convolution (2.1 ms of an H100 step in issue 40's profile). With the weights channels-last,
    every convolution's output is too, so the layout flows through the backbone, the fusion and
    the heads; the pillar scatter writes its canvas in that layout from the start (it is laid
    out (agent, y, x, channel) already), so no transpose is left. The arithmetic is the same,
    its order inside the convolutions is not: fp32 results change by float rounding (~1e-6 of
    the outputs, up to a few percent of a small gradient after BatchNorm), hence an option,
    off by default."""
    from opencood.models.scatter import PointPillarScatter
    model.to(memory_format=torch.channels_last)
    for module in model.modules():
        if isinstance(module, PointPillarScatter):
            module.memory_format = torch.channels_last
    return model
