"""yaml ``model`` section -> detector (OpenPCDet-style config-driven build)."""
from __future__ import annotations

from torch import nn

from opencood.registry import MODELS


def build_model(model_cfg: dict) -> nn.Module:
    """``{"core_method": name, "args": {...}}`` -> ``MODELS.get(name)(parsed args)``.

    ``model_cfg`` is the resolved ``model`` section (opencood.config.resolve_section); its
    ``args`` are parsed with the schema the model registered (a missing key takes its default).
    An unknown name raises the registry's error, which lists every registered model.
    """
    return MODELS.build(model_cfg["core_method"], model_cfg["args"], "model.args")
