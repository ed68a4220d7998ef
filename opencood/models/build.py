"""yaml ``model`` section -> detector (OpenPCDet-style config-driven build)."""
from __future__ import annotations

from torch import nn

import opencood.models  # noqa: F401  (registers every model and fusion module)
from opencood.registry import MODELS


def set_bn_momentum(model: nn.Module, momentum: float) -> None:
    """Momentum of every BatchNorm running-statistics update.

    The OpenCOOD default (0.01) needs thousands of steps before eval-mode statistics match the
    training batches; short CPU runs of a few hundred steps validate badly with it.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.momentum = float(momentum)


def build_model(model_cfg: dict) -> nn.Module:
    """``{"core_method": name, "args": {...}}`` -> ``MODELS.get(name).from_config(args)``.

    ``model_cfg`` is the resolved ``model`` section (opencood.config.resolve_section). An
    unknown name raises the registry's error, which lists every registered model. An
    ``args.bn_momentum`` that is not None overrides every BatchNorm's momentum.
    """
    model_cls = MODELS.get(model_cfg["core_method"])
    args = model_cfg["args"]
    model = model_cls.from_config(args)
    if args.get("bn_momentum") is not None:   # model-specific: not every model has the key
        set_bn_momentum(model, args["bn_momentum"])
    return model
