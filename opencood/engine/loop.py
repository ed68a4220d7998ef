"""The pieces of one training step, independent of the detection pipeline (so tests can drive
them with toy models): gradient accumulation with ``no_sync``, collective non-finite checks,
clipping, AMP scaling, and exact distributed validation loss.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch.nn.parallel import DistributedDataParallel

from opencood.errors import OpencoodError
from opencood.utils import dist as dist_utils

# loss_fn(model, micro_batch) -> (loss scalar tensor, {term name: float}, samples in micro-batch)
LossFn = Callable[[torch.nn.Module, object], Tuple[torch.Tensor, Dict[str, float], int]]


class NonFiniteLossError(OpencoodError, FloatingPointError):
    """A loss became NaN/inf; raised on every rank at the same step (decided collectively)."""


def autocast_context(device: torch.device, amp_dtype: torch.dtype | None):
    """``torch.autocast`` for the device when AMP is on, else a no-op context."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def optimizer_step(model: torch.nn.Module, micro_batches: Sequence, loss_fn: LossFn,
                   optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   device: torch.device, amp_dtype: torch.dtype | None = None,
                   grad_clip: float | None = None, where: str = "",
                   skip_nonfinite: bool = False) -> Dict[str, float]:
    """One optimiser step over ``len(micro_batches)`` accumulated micro-batches.

    Each micro-batch loss is divided by the number of micro-batches, and DDP averages over ranks,
    so the step equals one step on the whole global batch (for losses that are means over their
    micro-batch). Gradient all-reduce runs only on the last micro-batch (``no_sync`` before).
    A non-finite loss on ANY rank raises NonFiniteLossError on every rank (a rank-local
    ``continue`` would leave the others waiting in the all-reduce), and so do non-finite
    gradients without a GradScaler (with one, fp16 overflow is the scaler's to handle). With
    ``skip_nonfinite`` the step is skipped instead, on every rank alike: the backward passes
    still run (DDP's all-reduce must see every rank), then the gradients are dropped and the
    optimizer does not move.
    Returns {"loss", term means..., "grad_norm", "samples", "skipped" (0 or 1)} for this rank.
    """
    accum_steps = len(micro_batches)
    totals: Dict[str, float] = {}
    samples, nonfinite = 0, None
    for position, micro_batch in enumerate(micro_batches):
        is_last = position == accum_steps - 1
        sync_context = (model.no_sync() if isinstance(model, DistributedDataParallel)
                        and not is_last else contextlib.nullcontext())
        with sync_context:
            with autocast_context(device, amp_dtype):
                loss, terms, count = loss_fn(model, micro_batch)
            bad = not bool(torch.isfinite(loss.detach()).item())
            if dist_utils.any_across_ranks(bad) and nonfinite is None:
                nonfinite = (f"non-finite loss ({loss.item() if bad else 'on another rank'}) "
                             f"at {where} micro-batch {position}")
                if not skip_nonfinite:
                    raise NonFiniteLossError(f"{nonfinite}; lower the lr, enable grad_clip, or "
                                             f"check the data (train_params.skip_nonfinite_steps "
                                             f"skips such steps); the last checkpoint is intact")
            scaler.scale(loss / accum_steps).backward()
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) / accum_steps
        for name, value in terms.items():
            totals[name] = totals.get(name, 0.0) + float(value) / accum_steps
        samples += int(count)
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    max_norm = float(grad_clip) if grad_clip else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())
    # Gradients are all-reduced by now: every rank sees the same norm and decides alike.
    if nonfinite is None and not scaler.is_enabled() and not math.isfinite(float(grad_norm)):
        nonfinite = f"non-finite gradients (norm {float(grad_norm)}) at {where}"
        if not skip_nonfinite:
            raise NonFiniteLossError(f"{nonfinite}; lower the lr or enable grad_clip "
                                     f"(train_params.skip_nonfinite_steps skips such steps); "
                                     f"the last checkpoint is intact")
    if nonfinite is None:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    totals["grad_norm"] = float(grad_norm)
    totals["samples"] = samples
    totals["skipped"] = int(nonfinite is not None)
    totals["nonfinite"] = nonfinite
    return totals


def group_micro_batches(loader, accum_steps: int):
    """Yield lists of ``accum_steps`` consecutive micro-batches; an incomplete tail is dropped
    (the same on every rank: all ranks get the same number of micro-batches)."""
    group: List = []
    for micro_batch in loader:
        group.append(micro_batch)
        if len(group) == accum_steps:
            yield group
            group = []


def validation_loss(model: torch.nn.Module, loader, loss_fn: LossFn, device: torch.device,
                    amp_dtype: torch.dtype | None = None) -> Tuple[float, int]:
    """Mean loss over the whole (sharded) split, exact across ranks.

    Each rank sums loss x n over its unpadded shard; the sums and counts are all-reduced once
    at the end and divided, so the result equals the single-process mean whatever the shard
    sizes. A failure on one rank's shard (a corrupt file) raises on every rank. Returns
    (mean loss, total samples).
    """
    loss_sum, count = dist_utils.run_together(
        lambda: shard_loss_sum(model, loader, loss_fn, device, amp_dtype), "validation loss")
    total_loss, total_count = dist_utils.sum_across_ranks(loss_sum, count)
    return (total_loss / total_count if total_count else float("nan")), int(total_count)


@torch.no_grad()
def shard_loss_sum(model: torch.nn.Module, loader, loss_fn: LossFn, device: torch.device,
                   amp_dtype: torch.dtype | None = None) -> Tuple[float, int]:
    """(sum of loss x n, n) over this rank's loader, in eval mode (the mode is restored)."""
    was_training = model.training
    model.eval()
    loss_sum, count = 0.0, 0
    try:
        for batch in loader:
            with autocast_context(device, amp_dtype):
                loss, _, batch_count = loss_fn(model, batch)
            loss_sum += float(loss) * batch_count
            count += int(batch_count)
    finally:
        model.train(was_training)
    return loss_sum, count
