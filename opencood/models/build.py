"""yaml ``model`` section -> detector (OpenPCDet-style config-driven build)."""
from __future__ import annotations

from torch import nn

import opencood.models  # noqa: F401  (registers every model and fusion module)
from opencood.registry import MODELS


def build_model(model_cfg: dict) -> nn.Module:
    """``{"core_method": name, "args": {...}}`` -> ``MODELS.get(name).from_config(args)``.

    An unknown name raises the registry's error, which lists every registered model.
    """
    model_cls = MODELS.get(model_cfg["core_method"])
    return model_cls.from_config(model_cfg.get("args") or {})
