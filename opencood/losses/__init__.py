"""Detection losses. Every module of this package is imported on the first lookup in ``LOSSES``
(``opencood.registry``): a file registering a loss needs no import line here."""
from __future__ import annotations

from torch import nn

from opencood.losses.detection_loss import DetectionLoss, PointPillarLossArgs  # noqa: F401
from opencood.registry import LOSSES


def build_loss(loss_cfg: dict) -> nn.Module:
    """yaml ``loss: {core_method, args}`` -> the loss built from its parsed ``args`` (a missing
    key takes its default); an unknown name lists the registered ones."""
    return LOSSES.build(loss_cfg["core_method"], loss_cfg.get("args") or {}, "loss.args")
