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
        self._pairs: _TensorPairs | None = None
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
        """Move the EMA one step towards ``model``'s current weights (call after optimizer.step).

        Two operators whatever the model's size: one ``_foreach_lerp_`` over the float tensors
        and one ``_foreach_copy_`` over the integer ones. The pairs of tensors are found once
        (:class:`_TensorPairs`) and reused while they are still the model's. Walking both state
        dicts on every update (a ``detach`` per tensor, then a ``to`` and a ``copy_`` per
        integer buffer) was host work that grows with the tensor count, not their size: 0.76 ms
        per update for AttFuse's 144 tensors on this project's 2-core CPU, 0.14 ms now (each
        tensor cut to one element, so only the host's work is left; best of 5 x 300 updates,
        runs interleaved). On an H100 the old update took 1.77 ms, 5.4 % of the step, for
        about 30 us of arithmetic (docs/DESIGN.md §6.5)."""
        self.updates += 1
        self.lerp_towards(model, 1.0 - self.current_decay())

    @torch.no_grad()
    def lerp_towards(self, model: nn.Module, weight) -> None:
        """``ema += weight * (model - ema)`` over the float tensors, integer ones copied;
        ``weight``: a float (one lerp), or a 0-d device tensor, never read by the host (a
        captured CUDA graph's step fills it, ``engine.cuda_graph``; sub, mul, add: equal to the
        lerp within float rounding). ``updates`` is the caller's to count."""
        model = unwrap_model(model)
        if self._pairs is None or not self._pairs.still_bound(model):
            self._pairs = _TensorPairs(self.module, model)
        pairs = self._pairs
        model_floats = pairs.model_floats
        if pairs.cross_device:          # an EMA kept on another device (``device=``)
            model_floats = [tensor.to(ema.device, non_blocking=True)
                            for tensor, ema in zip(model_floats, pairs.ema_floats)]
        if pairs.ema_floats and torch.is_tensor(weight):
            # _foreach_lerp_ takes its weight as a Scalar: a tensor's would be read by the host
            # (.item(), a device sync a CUDA graph capture refuses, the failed H200 capture):
            # model - ema, times the weight, added (three foreach calls, none reads it back).
            steps = torch._foreach_sub(model_floats, pairs.ema_floats)
            torch._foreach_mul_(steps, weight)
            torch._foreach_add_(pairs.ema_floats, steps)
        elif pairs.ema_floats:
            # lerp: ema + (1 - d) * (model - ema) == d * ema + (1 - d) * model, one fused call.
            torch._foreach_lerp_(pairs.ema_floats, model_floats, weight)
        if pairs.ema_others:            # BatchNorm's step counters: copied, not averaged
            torch._foreach_copy_(pairs.ema_others, pairs.model_others, non_blocking=True)

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


class _TensorPairs:
    """The EMA's state-dict tensors and the model's of the same key, in two lists each:
    ``ema_floats`` / ``model_floats`` (averaged) and ``ema_others`` / ``model_others`` (integer
    buffers, copied).

    Holds the tensor objects themselves (no ``detach``: the update runs under ``no_grad``), and
    for each the dict it lives in (a module's ``_parameters`` or ``_buffers``), so
    :meth:`still_bound` can tell in one pass of identity checks whether the model or the EMA
    replaced one since (``module.to(...)`` replaces buffers, ``load_state_dict`` does not)."""

    def __init__(self, ema_module: nn.Module, model: nn.Module):
        self.model = model
        self.ema_floats, self.model_floats, self.ema_others, self.model_others = [], [], [], []
        self._slots = []                          # (owning dict, name, tensor) of both sides
        model_slots, seen = _state_slots(model), set()
        for key, (ema_owner, name, ema_tensor) in _state_slots(ema_module).items():
            if key not in model_slots:
                raise KeyError(f"ModelEMA.update: the model has no {key!r}, which the EMA tracks "
                               "(a different model than the one the EMA was built from?)")
            if id(ema_tensor) in seen:            # a tied weight: averaged once
                continue
            seen.add(id(ema_tensor))
            model_owner, model_name, model_tensor = model_slots[key]
            self._slots += [(ema_owner, name, ema_tensor),
                            (model_owner, model_name, model_tensor)]
            floats = ema_tensor.dtype.is_floating_point
            (self.ema_floats if floats else self.ema_others).append(ema_tensor)
            (self.model_floats if floats else self.model_others).append(model_tensor)
        self.cross_device = any(ema.device != tensor.device for ema, tensor in
                                zip(self.ema_floats, self.model_floats))

    def still_bound(self, model: nn.Module) -> bool:
        """Whether ``model`` is the model paired and every paired tensor, the EMA's and the
        model's, is still the one its module holds."""
        return model is self.model and all(owner.get(name) is tensor
                                           for owner, name, tensor in self._slots)


def _state_slots(module: nn.Module) -> dict:
    """``{state-dict key: (owning dict, name, tensor)}`` of the parameters and persistent
    buffers ``module.state_dict()`` would hold (without their ``detach``)."""
    slots = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        prefix = f"{prefix}." if prefix else ""
        for name, tensor in owner._parameters.items():
            if tensor is not None:
                slots.setdefault(prefix + name, (owner._parameters, name, tensor))
        for name, tensor in owner._buffers.items():
            if tensor is not None and name not in owner._non_persistent_buffers_set:
                slots.setdefault(prefix + name, (owner._buffers, name, tensor))
    return slots
