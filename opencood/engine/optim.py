"""Optimisers and learning-rate schedules from yaml.

    optimizer:
      core_method: AdamW          # Adam | AdamW | SGD
      lr: 0.002
      args: {weight_decay: 0.01}  # passed to the torch optimiser (betas, eps, momentum, ...)
    lr_scheduler:
      core_method: cosine         # cosine | multistep | constant
      warmup_epochs: 1            # linear warm-up from warmup_start_ratio * lr (cosine/multistep)
      warmup_start_ratio: 0.01
      min_lr_ratio: 0.01          # cosine floor, as a fraction of lr
      step_size: [10, 15]         # multistep milestones, in epochs
      gamma: 0.1                  # multistep factor

Schedules are stepped once per optimiser step (not per epoch), so they are independent of the
world size once the global batch is fixed. Defaults and validation live in the config schema
(opencood.config_schema): these functions take resolved sections.
"""
from __future__ import annotations

import math

import torch

OPTIMIZERS = {"Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}
SCHEDULES = ("cosine", "multistep", "constant")


def build_optimizer(params, cfg: dict) -> torch.optim.Optimizer:
    """``cfg``: the resolved ``optimizer`` section (opencood.config.resolve_section)."""
    name = cfg["core_method"]
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer.core_method {name!r} is unknown; "
                         f"known: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name](params, lr=float(cfg["lr"]), **cfg["args"])


def lr_factor(step: int, total_steps: int, steps_per_epoch: int, cfg: dict) -> float:
    """Multiplier of the base lr at optimiser step ``step`` (0-based); ``cfg``: the resolved
    ``lr_scheduler`` section."""
    name = cfg["core_method"]
    warmup_steps = int(round(float(cfg["warmup_epochs"]) * steps_per_epoch))
    start = float(cfg["warmup_start_ratio"])
    if step < warmup_steps:
        return start + (1.0 - start) * step / warmup_steps
    if name == "constant":
        return 1.0
    if name == "cosine":
        floor = float(cfg["min_lr_ratio"])
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if name == "multistep":
        milestones = [int(m) * steps_per_epoch for m in cfg["step_size"]]
        return float(cfg["gamma"]) ** sum(step >= m for m in milestones)
    raise ValueError(f"lr_scheduler.core_method {name!r} is unknown; known: {', '.join(SCHEDULES)}")


def build_scheduler(optimizer, cfg: dict, total_steps: int, steps_per_epoch: int):
    """A LambdaLR over optimiser steps (``cfg``: the resolved ``lr_scheduler`` section);
    validates the schedule name eagerly."""
    cfg = dict(cfg)
    lr_factor(0, total_steps, steps_per_epoch, cfg)
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, steps_per_epoch, cfg))
