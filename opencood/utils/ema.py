"""Exponential moving average (EMA) of a model's weights, for validation and checkpoints."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
from torch import nn

from opencood.utils import dist as dist_utils


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / DataParallel / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


class ModelEMA:
    """EMA of every floating-point tensor of ``model.state_dict()`` (parameters and buffers).

    After update ``t`` (counted from 1) each EMA tensor becomes
    ``ema = d_t * ema + (1 - d_t) * model`` with ``d_t = decay * (1 - exp(-t / tau))``: the ramp
    lets early, fast-changing weights through instead of averaging in the random init for
    thousands of steps. ``tau <= 0`` turns the ramp off. Non-float buffers (BatchNorm's
    ``num_batches_tracked``) are copied, not averaged.

    ``decay`` and ``tau`` have no defaults here: the config's ``ema`` section holds them.

    ``module`` (alias ``ema_model``) is a deep copy of the model holding the EMA weights, in eval
    mode with ``requires_grad`` off; validate with it. The update has no collectives, so it is
    identical on every rank when the inputs are: DDP keeps parameters equal, but plain BatchNorm
    running statistics are rank-local between forwards (no SyncBN, e.g. on CPU); call
    :meth:`broadcast_from` before validating or saving to make those equal too.
    """

    def __init__(self, model: nn.Module, decay: float, tau: float,
                 device: torch.device | str | None = None):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.tau = tau
        self.device = device
        self.updates = 0
        self.module = copy.deepcopy(unwrap_model(model)).eval()
        self.module.requires_grad_(False)
        if device is not None:
            self.module.to(device)

    @property
    def ema_model(self) -> nn.Module:
        return self.module

    def current_decay(self) -> float:
        """Decay used by the most recent update (``updates`` counted from 1)."""
        if self.tau is None or self.tau <= 0:
            return self.decay
        return self.decay * (1.0 - math.exp(-self.updates / self.tau))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """Move the EMA one step towards ``model``'s current weights (call after optimizer.step)."""
        self.updates += 1
        decay = self.current_decay()
        model_state = unwrap_model(model).state_dict()
        ema_floats, model_floats = [], []
        for key, ema_tensor in self.module.state_dict().items():
            if key not in model_state:
                raise KeyError(f"ModelEMA.update: the model has no {key!r}, which the EMA tracks "
                               "(a different model than the one the EMA was built from?)")
            model_tensor = model_state[key].detach()
            if ema_tensor.dtype.is_floating_point:
                ema_floats.append(ema_tensor)
                model_floats.append(model_tensor.to(ema_tensor.device, non_blocking=True))
            else:
                ema_tensor.copy_(model_tensor)
        if ema_floats:
            # lerp: ema + (1 - d) * (model - ema) == d * ema + (1 - d) * model, one fused call.
            torch._foreach_lerp_(ema_floats, model_floats, 1.0 - decay)

    @torch.no_grad()
    def broadcast_from(self, src: int = 0) -> None:
        """Copy rank ``src``'s EMA tensors to every rank (no-op without a process group).

        All ranks must call it. EMA parameters already agree across DDP ranks; this also aligns the
        averaged BatchNorm statistics, which are rank-local without SyncBN.
        """
        if dist_utils.get_world_size() == 1:
            return
        device = dist_utils.collective_device()
        for tensor in self.module.state_dict().values():
            staged = tensor.to(device)
            dist.broadcast(staged, src=src)
            tensor.copy_(staged)

    def state_dict(self) -> dict:
        """EMA weights plus the update count (the ramp depends on it) for checkpoints."""
        return {"module": self.module.state_dict(), "updates": self.updates,
                "decay": self.decay, "tau": self.tau}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; keeps this object's ``decay``/``tau`` settings."""
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])
