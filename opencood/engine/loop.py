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

# loss_fn(model, micro_batch) -> (loss scalar tensor, {term name: float}, samples in micro-batch);
# for ``optimizer_step(sync_free=True)`` the terms may be detached 0-d tensors (no host read).
LossFn = Callable[[torch.nn.Module, object], Tuple[torch.Tensor, Dict[str, float], int]]


class NonFiniteLossError(OpencoodError, FloatingPointError):
    """A loss became NaN/inf; raised on every rank at the same step (decided collectively)."""


def autocast_context(device: torch.device, amp_dtype: torch.dtype | None):
    """``torch.autocast`` for the device when AMP is on, else a no-op context."""
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=amp_dtype)


def nonfinite_error(reason: str) -> NonFiniteLossError:
    """The one-line error of a non-finite step that is not skipped (both step paths)."""
    return NonFiniteLossError(f"{reason}; lower the lr, enable grad_clip, or check the data "
                              f"(train_params.skip_nonfinite_steps skips such steps); the last "
                              f"checkpoint is intact")


def accumulation_context(model: torch.nn.Module, is_last: bool):
    """DDP's ``no_sync`` for every micro-batch but the last (the gradient all-reduce runs once
    per step); also through torch.compile's wrapper (``performance.compile``)."""
    inner = getattr(model, "_orig_mod", model)
    if isinstance(inner, DistributedDataParallel) and not is_last:
        return inner.no_sync()
    return contextlib.nullcontext()


def optimizer_step(model: torch.nn.Module, micro_batches: Sequence, loss_fn: LossFn,
                   optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   device: torch.device, amp_dtype: torch.dtype | None = None,
                   grad_clip: float | None = None, where: str = "",
                   skip_nonfinite: bool = False, sync_free: bool = False,
                   ema=None) -> Dict[str, float]:
    """One optimiser step over ``len(micro_batches)`` accumulated micro-batches (+ the EMA).

    Each micro-batch loss is divided by the number of micro-batches, and DDP averages over ranks,
    so the step equals one step on the whole global batch (for losses that are means over their
    micro-batch). Gradient all-reduce runs only on the last micro-batch (``no_sync`` before).
    A non-finite loss on ANY rank raises NonFiniteLossError on every rank (a rank-local
    ``continue`` would leave the others waiting in the all-reduce), and so do non-finite
    gradients without a GradScaler (with one, fp16 overflow is the scaler's to handle). With
    ``skip_nonfinite`` the step is skipped instead, on every rank alike: the backward passes
    still run (DDP's all-reduce must see every rank), then the gradients are dropped.

    A step not taken (skipped here, or by the fp16 GradScaler on inf gradients) leaves no trace:
    the weights, the buffers the forward moved (BatchNorm running statistics) and ``ema``
    (a ModelEMA, updated after every step taken) stay as they were, and the scaler is still
    updated (its scale backs off).

    When values are read back to the host: ``sync_free`` False checks each micro-batch's loss
    before its backward (an error names the micro-batch at once); ``sync_free`` True
    (``performance.sync_free_step``) reads losses, terms, finite flags, the gradient norm and
    the scaler's overflow flag in ONE read after the clip (plus the collective that makes the
    decision the same on every rank), so a non-finite loss is reported after the backward
    passes of the whole step. Removing that read too needs the decision on the device (a fused
    optimizer given ``found_inf``); on CUDA that is the GPU session's work.

    Returns {"loss", term means..., "grad_norm", "samples", "skipped" (0 or 1: skipped as
    non-finite), "overflow" (0 or 1: skipped by the GradScaler), "nonfinite" (reason or None)}
    for this rank.
    """
    accum_steps = len(micro_batches)
    # Only a step that may be dropped needs its buffers saved (without skipping or a scaler a
    # bad step raises and the run stops at its last checkpoint).
    saved_buffers = snapshot_buffers(model) if skip_nonfinite or scaler.is_enabled() else None
    losses, term_values, samples, early = [], {}, 0, None
    for position, micro_batch in enumerate(micro_batches):
        with accumulation_context(model, is_last=position == accum_steps - 1):
            with autocast_context(device, amp_dtype):
                loss, terms, count = loss_fn(model, micro_batch)
            if not sync_free and early is None:
                early = check_loss_now(loss, where, position, skip_nonfinite)
            scaler.scale(loss / accum_steps).backward()
        losses.append(loss.detach().float())
        for name, value in terms.items():
            term_values.setdefault(name, []).append(
                torch.as_tensor(value, dtype=torch.float32, device=losses[-1].device))
        samples += int(count)
    grad_norm = unscale_and_clip(optimizer, scaler, grad_clip)
    values = read_step_values(losses, term_values, grad_norm, scaler_overflow(scaler, optimizer))
    nonfinite = early if not sync_free else nonfinite_reason(
        values["finite"], values["losses"], values["grad_norm"], scaler, where)
    if nonfinite is None and not sync_free:
        nonfinite = nonfinite_gradients(values["grad_norm"], scaler, where)
    if nonfinite is not None and not skip_nonfinite:
        raise nonfinite_error(nonfinite)
    overflow = nonfinite is None and values["overflow"]
    finish_step(optimizer, scaler, take_step=nonfinite is None)
    if nonfinite is not None or overflow:
        restore_buffers(model, saved_buffers)
    elif ema is not None:
        ema.update(model)
    totals: Dict[str, float] = {"loss": sum(values["losses"]) / accum_steps}
    for name, rows in values["terms"].items():
        totals[name] = sum(rows) / accum_steps
    totals.update(grad_norm=values["grad_norm"], samples=samples,
                  skipped=int(nonfinite is not None), overflow=int(overflow),
                  nonfinite=nonfinite)
    return totals


def check_loss_now(loss: torch.Tensor, where: str, position: int,
                   skip_nonfinite: bool) -> str | None:
    """The reason a micro-batch's loss (on any rank) makes the step non-finite, or None; raises
    at once without ``skip_nonfinite`` (every rank alike: the check is collective)."""
    bad = not bool(torch.isfinite(loss.detach()).item())
    if not dist_utils.any_across_ranks(bad):
        return None
    reason = (f"non-finite loss ({loss.item() if bad else 'on another rank'}) "
              f"at {where} micro-batch {position}")
    if not skip_nonfinite:
        raise nonfinite_error(reason)
    return reason


def read_step_values(losses: List[torch.Tensor], term_values: Dict[str, List[torch.Tensor]],
                     grad_norm: torch.Tensor, overflow: torch.Tensor | None) -> Dict:
    """The step's values in ONE host read: {"finite": [0./1. per micro-batch], "losses",
    "grad_norm", "overflow" (bool), "terms": {name: [per micro-batch]}}.

    ``losses``: 0-d float32 tensors, one per micro-batch; ``overflow``: 0-d, non-zero when the
    GradScaler found inf gradients (None without a scaler)."""
    accum_steps, names = len(losses), list(term_values)
    device = losses[0].device
    stacked = torch.stack(losses)
    overflow = torch.zeros((), device=device) if overflow is None else overflow
    packed = torch.cat([torch.isfinite(stacked).float(), stacked,
                        grad_norm.detach().float().reshape(1).to(device),
                        overflow.float().reshape(1).to(device),
                        *[torch.stack(term_values[name]) for name in names]])
    values = packed.tolist()                                   # the step's one host read
    rows = values[2 * accum_steps + 2:]
    return {"finite": values[:accum_steps], "losses": values[accum_steps:2 * accum_steps],
            "grad_norm": values[2 * accum_steps], "overflow": values[2 * accum_steps + 1] > 0,
            "terms": {name: rows[index * accum_steps:(index + 1) * accum_steps]
                      for index, name in enumerate(names)}}


def unscale_and_clip(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                     grad_clip: float | None) -> torch.Tensor:
    """Unscale (AMP) and clip the gradients; -> the total norm before clipping, a 0-d tensor on
    the device (the foreach norm and scaling read nothing back to the host)."""
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    max_norm = float(grad_clip) if grad_clip else math.inf
    return torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())


def scaler_overflow(scaler: torch.amp.GradScaler,
                    optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
    """0-d tensor, non-zero when the enabled GradScaler's ``unscale_`` found inf/NaN gradients
    (its ``step`` will then not move the weights); None for a disabled scaler."""
    if not scaler.is_enabled():
        return None
    found = list(scaler._found_inf_per_device(optimizer).values())
    return torch.stack([flag.to(found[0].device) for flag in found]).sum()


def finish_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                take_step: bool) -> None:
    """Step (unless skipped), update the scaler and drop the gradients.

    The scaler is updated on EVERY step: ``unscale_`` may run once per ``update()``, so a
    skipped step without one makes the next step's ``unscale_`` raise. A step skipped here is
    marked as an overflow first, so the scale backs off as for one the scaler skipped itself.
    """
    if take_step:
        scaler.step(optimizer)
    elif scaler.is_enabled():
        for flag in scaler._found_inf_per_device(optimizer).values():
            flag.fill_(1.0)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def snapshot_buffers(model: torch.nn.Module) -> List[torch.Tensor]:
    """Copies of every buffer of ``model`` (BatchNorm running statistics and counters), which
    the forward of a step moves before anyone knows whether the step is taken."""
    return [buffer.detach().clone() for buffer in model.buffers()]


@torch.no_grad()
def restore_buffers(model: torch.nn.Module, saved: List[torch.Tensor] | None) -> None:
    """Put back the buffers of :func:`snapshot_buffers` (a step that was not taken)."""
    if saved is None:
        return
    for buffer, value in zip(model.buffers(), saved):
        buffer.copy_(value)


def nonfinite_reason(finite_flags: List[float], micro_losses: List[float], grad_norm: float,
                     scaler: torch.amp.GradScaler, where: str) -> str | None:
    """Why the step must not be taken (the same on every rank), or None.

    A non-finite loss on any rank counts (one collective); then the gradients
    (:func:`nonfinite_gradients`)."""
    bad = [position for position, flag in enumerate(finite_flags) if not flag]
    if dist_utils.any_across_ranks(bool(bad)):
        if not bad:
            return f"non-finite loss (on another rank) at {where}"
        return f"non-finite loss ({micro_losses[bad[0]]}) at {where} micro-batch {bad[0]}"
    return nonfinite_gradients(grad_norm, scaler, where)


def nonfinite_gradients(grad_norm: float, scaler: torch.amp.GradScaler, where: str) -> str | None:
    """Non-finite gradients count without a GradScaler only (with one, fp16 overflow is the
    scaler's to handle); they are all-reduced already, so every rank sees the same norm."""
    if not scaler.is_enabled() and not math.isfinite(grad_norm):
        return f"non-finite gradients (norm {grad_norm}) at {where}"
    return None


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
