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
                   skip_nonfinite: bool = False, sync_free: bool = False) -> Dict[str, float]:
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

    ``sync_free`` (``performance.sync_free_step``): the same step with one host read instead of
    several per micro-batch (:func:`sync_free_optimizer_step`).
    """
    if sync_free:
        return sync_free_optimizer_step(model, micro_batches, loss_fn, optimizer, scaler, device,
                                        amp_dtype, grad_clip, where, skip_nonfinite)
    accum_steps = len(micro_batches)
    totals: Dict[str, float] = {}
    samples, nonfinite = 0, None
    for position, micro_batch in enumerate(micro_batches):
        with accumulation_context(model, is_last=position == accum_steps - 1):
            with autocast_context(device, amp_dtype):
                loss, terms, count = loss_fn(model, micro_batch)
            bad = not bool(torch.isfinite(loss.detach()).item())
            if dist_utils.any_across_ranks(bad) and nonfinite is None:
                nonfinite = (f"non-finite loss ({loss.item() if bad else 'on another rank'}) "
                             f"at {where} micro-batch {position}")
                if not skip_nonfinite:
                    raise nonfinite_error(nonfinite)
            scaler.scale(loss / accum_steps).backward()
        totals["loss"] = totals.get("loss", 0.0) + float(loss.detach()) / accum_steps
        for name, value in terms.items():
            totals[name] = totals.get(name, 0.0) + float(value) / accum_steps
        samples += int(count)
    grad_norm = unscale_and_clip(optimizer, scaler, grad_clip)
    # Gradients are all-reduced by now: every rank sees the same norm and decides alike.
    if nonfinite is None and not scaler.is_enabled() and not math.isfinite(float(grad_norm)):
        nonfinite = f"non-finite gradients (norm {float(grad_norm)}) at {where}"
        if not skip_nonfinite:
            raise nonfinite_error(nonfinite)
    finish_step(optimizer, scaler, take_step=nonfinite is None)
    totals["grad_norm"] = float(grad_norm)
    totals["samples"] = samples
    totals["skipped"] = int(nonfinite is not None)
    totals["nonfinite"] = nonfinite
    return totals


def unscale_and_clip(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                     grad_clip: float | None) -> torch.Tensor:
    """Unscale (AMP) and clip the gradients; -> the total norm before clipping, a 0-d tensor on
    the device (the foreach norm and scaling read nothing back to the host)."""
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    max_norm = float(grad_clip) if grad_clip else math.inf
    return torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.zeros(())


def finish_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                take_step: bool) -> None:
    """Step (unless skipped) and drop the gradients."""
    if take_step:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def sync_free_optimizer_step(model: torch.nn.Module, micro_batches: Sequence, loss_fn: LossFn,
                             optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                             device: torch.device, amp_dtype: torch.dtype | None = None,
                             grad_clip: float | None = None, where: str = "",
                             skip_nonfinite: bool = False) -> Dict[str, float]:
    """:func:`optimizer_step` with ONE host read per optimizer step (plus, with DDP, the
    collective that makes the non-finite decision the same on every rank).

    Every micro-batch's forward and backward is queued without looking at a value; the losses,
    terms, finite flags and gradient norm stay on the device and are read in one go after the
    clip, before the optimizer steps. That read remains because the host must decide whether to
    step, skip or raise (and the log wants the numbers). Removing it too needs the decision on
    the device (a fused optimizer given ``found_inf``, as GradScaler does for fp16) and a
    deferred error; on CUDA that is the GPU session's work.

    Same updates, returned values and errors as :func:`optimizer_step`, except that a
    non-finite loss is reported after the backward passes of the whole step rather than
    before its own (gradients are dropped either way; DDP's all-reduce runs on every rank).
    Adam/AdamW's own ``.item()`` of their host-side step counters is no device sync.
    """
    accum_steps = len(micro_batches)
    losses, finite, term_values, samples = [], [], {}, 0
    for position, micro_batch in enumerate(micro_batches):
        with accumulation_context(model, is_last=position == accum_steps - 1):
            with autocast_context(device, amp_dtype):
                loss, terms, count = loss_fn(model, micro_batch)
            scaler.scale(loss / accum_steps).backward()
        losses.append(loss.detach().float())
        finite.append(torch.isfinite(losses[-1]))
        for name, value in terms.items():
            term_values.setdefault(name, []).append(torch.as_tensor(value, dtype=torch.float32,
                                                                     device=losses[-1].device))
        samples += int(count)
    grad_norm = unscale_and_clip(optimizer, scaler, grad_clip)
    names = list(term_values)
    packed = torch.cat([torch.stack(finite).float(), torch.stack(losses),
                        grad_norm.detach().float().reshape(1).to(losses[0].device),
                        *[torch.stack(term_values[name]) for name in names]])
    values = packed.tolist()                                   # the step's one host read
    finite_flags = values[:accum_steps]
    micro_losses = values[accum_steps:2 * accum_steps]
    norm = values[2 * accum_steps]
    nonfinite = nonfinite_reason(finite_flags, micro_losses, norm, scaler, where)
    if nonfinite is not None and not skip_nonfinite:
        raise nonfinite_error(nonfinite)
    finish_step(optimizer, scaler, take_step=nonfinite is None)
    totals: Dict[str, float] = {"loss": sum(micro_losses) / accum_steps}
    term_rows = values[2 * accum_steps + 1:]
    for index, name in enumerate(names):
        totals[name] = sum(term_rows[index * accum_steps:(index + 1) * accum_steps]) / accum_steps
    totals.update(grad_norm=norm, samples=samples, skipped=int(nonfinite is not None),
                  nonfinite=nonfinite)
    return totals


def nonfinite_reason(finite_flags: List[float], micro_losses: List[float], grad_norm: float,
                     scaler: torch.amp.GradScaler, where: str) -> str | None:
    """Why the step must not be taken (the same on every rank), or None.

    A non-finite loss on any rank counts (one collective); non-finite gradients count without
    a GradScaler only (with one, fp16 overflow is the scaler's to handle), and they are
    all-reduced already, so every rank sees the same norm."""
    bad = [position for position, flag in enumerate(finite_flags) if not flag]
    if dist_utils.any_across_ranks(bool(bad)):
        if not bad:
            return f"non-finite loss (on another rank) at {where}"
        return f"non-finite loss ({micro_losses[bad[0]]}) at {where} micro-batch {bad[0]}"
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
