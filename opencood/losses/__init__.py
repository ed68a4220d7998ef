"""Detection losses. Importing this package registers them in ``LOSSES``."""
from __future__ import annotations

from torch import nn

from opencood.losses import detection_loss  # noqa: F401  (registration)
from opencood.losses.detection_loss import DetectionLoss  # noqa: F401
from opencood.registry import LOSSES


def build_loss(loss_cfg: dict) -> nn.Module:
    """yaml ``loss: {core_method, args}`` -> loss module; unknown names list the registered ones."""
    return LOSSES.get(loss_cfg["core_method"]).from_config(loss_cfg.get("args") or {})
