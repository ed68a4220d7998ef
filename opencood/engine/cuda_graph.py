"""The whole training step as one CUDA graph (``performance.cuda_graph``, docs/DESIGN.md §6.12).

Pillarisation + targets + forward + loss + backward + gradient clipping + optimizer step + EMA
update are captured once, after a few eager warm-up steps on a side stream, and replayed for
every later batch: one launch per step instead of ~700 kernels. A graph replays fixed shapes
and fixed memory, so each batch is padded to fixed maxima and copied into static input
buffers:

* points to ``performance.cuda_graph_max_points`` rows: the padding rows lie outside the lidar
  range, which pillarisation drops (``pillarize_static`` sorts them last and never keeps them);
* GT boxes to ``performance.cuda_graph_max_gt`` per sample, with ``gt_mask`` False on the
  padding (the targets ignore masked boxes);
* agents are not padded (a padded agent would join the fusion): a batch with another agent
  count, like any batch whose padded shapes differ from the captured ones, runs eagerly.

A batch or run the graph cannot take runs the eager step (``engine.loop.optimizer_step``),
with its reason logged once: results are never those of another batch's shapes. So does a
model whose loss runs an op a capture refuses (a value read back, a host-to-device copy): the
second warm-up's loss runs under ``utils.host_syncs.CaptureHazards``, and the reason names
the first such op's ``opencood/file.py:line`` (``hazard_refusal``), before any capture. The
step's values (loss, terms, finite flags, gradient norm) are read once after each replay, as
``sync_free_step`` does. The learning rate is a device tensor in the optimizer's groups, so
schedules (which ``fill_`` it in place) reach the captured step; the EMA's decay likewise.
"""
from __future__ import annotations

import contextlib
import logging
import re
import traceback
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import torch

from opencood.engine.loop import (nonfinite_error, nonfinite_reason, optimizer_step,
                                  unscale_and_clip)
from opencood.utils.host_syncs import CaptureHazards, project_site

logger = logging.getLogger("opencood")

# (boxes key, mask key) pairs padded to ``max_gt`` along dim 1.
GT_KEYS = (("gt_boxes", "gt_mask"), ("agent_gt_boxes", "agent_gt_mask"))
# Optimizers whose step can be captured with a tensor lr (``capturable`` / fused).
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW)


@dataclass(frozen=True)
class GraphLimits:
    """Fixed maxima a batch is padded to (0: the batch's own size, no padding).

    ``max_points``: point rows of the whole batch; ``max_gt``: GT boxes per sample;
    ``lidar_range``: ``[x0, y0, z0, x1, y1, z1]``, padding points go below ``x0``."""
    max_points: int
    max_gt: int
    lidar_range: Tuple[float, ...]


def pad_batch(batch: Dict, limits: GraphLimits):
    """-> (padded batch, None), or (None, reason) when the batch exceeds a limit.

    ``points`` (N, C) -> (max_points, C), the new rows at ``x = x0 - 1`` (outside the range)
    with ``agent_index`` 0; ``gt_boxes`` (B, G, 7) -> (B, max_gt, 7) zeros with ``gt_mask``
    False (and ``agent_gt_*`` alike). Every other key is kept as it is."""
    padded = dict(batch)
    if limits.max_points and "points" in batch:
        points, count = batch["points"], batch["points"].shape[0]
        if count > limits.max_points:
            return None, (f"{count} points > performance.cuda_graph_max_points "
                          f"{limits.max_points}")
        filler = points.new_zeros((limits.max_points - count, points.shape[1]))
        filler[:, 0] = float(limits.lidar_range[0]) - 1.0
        padded["points"] = torch.cat([points, filler])
        index = batch["agent_index"]
        padded["agent_index"] = torch.cat([index, index.new_zeros(limits.max_points - count)])
    for boxes_key, mask_key in GT_KEYS:
        if not limits.max_gt or boxes_key not in batch:
            continue
        boxes, mask = batch[boxes_key], batch[mask_key]
        extra = limits.max_gt - boxes.shape[1]
        if extra < 0:
            return None, (f"{boxes.shape[1]} {boxes_key} per sample > "
                          f"performance.cuda_graph_max_gt {limits.max_gt}")
        padded[boxes_key] = torch.cat([boxes, boxes.new_zeros(
            (*boxes.shape[:1], extra, *boxes.shape[2:]))], dim=1)
        padded[mask_key] = torch.cat([mask, mask.new_zeros((*mask.shape[:1], extra))], dim=1)
    return padded, None


def batch_signature(batch: Dict):
    """What a captured graph is valid for: every tensor's key, shape, dtype and device, and the
    plain values (flags, lists of names). Lists of arrays (sample keys, GT ids) are metadata
    the step does not read. -> (signature, None), or (None, reason) for a nested dict."""
    items = []
    for key in sorted(batch):
        value = batch[key]
        if torch.is_tensor(value):
            items.append((key, tuple(value.shape), value.dtype, value.device))
        elif isinstance(value, dict):
            return None, f"batch key '{key}' is nested (not captured)"
        elif isinstance(value, (bool, int, float, str)):
            items.append((key, value))
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (str, int))
                                                          for v in value):
            items.append((key, tuple(value)))
    return tuple(items), None


def run_refusal(cfg: Dict, device: torch.device, world_size: int, accum_steps: int,
                optimizer: torch.optim.Optimizer, scaler) -> str | None:
    """Why the run's steps cannot be captured (logged once; the run steps eagerly), or None."""
    perf = cfg["performance"]
    if device.type != "cuda":
        return "performance.cuda_graph needs CUDA"
    checks = [
        (not perf["static_pillars"], "it needs performance.static_pillars > 0"),
        (not perf["sync_free_step"], "it needs performance.sync_free_step: true"),
        (world_size > 1, "several ranks (DDP) are not captured"),
        (accum_steps > 1, "gradient accumulation is not captured"),
        (scaler.is_enabled(), "fp16's GradScaler is not captured (use bf16 or fp32)"),
        (not isinstance(optimizer, CAPTURABLE), "the optimizer must be Adam or AdamW"),
        (cfg["train_params"]["skip_nonfinite_steps"] > 0,
         "train_params.skip_nonfinite_steps > 0: a replayed step cannot be undone"),
    ]
    return next((reason for refused, reason in checks if refused), None)


class CudaGraphStep:
    """Takes optimizer steps by replaying one captured graph (see the module docstring).

    ``step(micro_batches, where, skip_nonfinite)`` returns ``optimizer_step``'s stats dict,
    from the graph or, for a batch or run it refuses, from the eager step."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, optimizer, scaler, ema,
                 device: torch.device, amp_dtype, grad_clip, limits: GraphLimits,
                 run_refused: str | None = None, warmup_steps: int = 2,
                 check_hazards: bool = True):
        self.model, self.loss_fn, self.optimizer, self.scaler = model, loss_fn, optimizer, scaler
        self.ema, self.device, self.amp_dtype, self.grad_clip = ema, device, amp_dtype, grad_clip
        self.limits, self.run_refused, self.warmup_steps = limits, run_refused, warmup_steps
        self.check_hazards = check_hazards
        self.eager_warmups = 0
        self.graph = None
        self.signature = None
        self.static_batch: Dict = {}
        self.values: torch.Tensor | None = None
        self.term_names: List[str] = []
        self.samples = 0
        self.said: set = {run_refused} if run_refused else set()   # logged already
        if run_refused is None:
            self.lrs = tensor_lrs(optimizer, device)
            self.ema_weight = torch.zeros((), device=device)

    def step(self, micro_batches: List, where: str, skip_nonfinite: bool = False) -> Dict:
        reason, padded = self.refusal(micro_batches, skip_nonfinite)
        if reason is not None:
            self.say_once(reason)
            return self.eager(micro_batches, where, skip_nonfinite)
        signature, _ = batch_signature(padded)
        # Capture only shapes the last warm-up ran (cudnn's algorithm search for new shapes
        # must not happen inside the capture).
        if self.graph is None and (self.eager_warmups < self.warmup_steps
                                   or signature != self.signature):
            self.signature = signature
            return self.warm_up(padded, where)
        if self.graph is None:
            if not self.capture(padded, signature):
                return self.eager(micro_batches, where, skip_nonfinite)
        elif signature != self.signature:
            self.say_once("the batch's padded shapes differ from the captured step's "
                          "(another agent count or batch size)")
            return self.eager(micro_batches, where, skip_nonfinite)
        else:
            copy_batch(self.static_batch, padded)
        return self.replay(where)

    def refusal(self, micro_batches: List, skip_nonfinite: bool):
        """(reason, None) for a step that runs eagerly, else (None, the padded batch)."""
        if self.run_refused is not None:
            return self.run_refused, None
        if len(micro_batches) != 1:
            return "gradient accumulation is not captured", None
        if skip_nonfinite:
            return "a step that may be skipped as non-finite is not captured", None
        padded, reason = pad_batch(micro_batches[0], self.limits)
        if reason is None:
            _, reason = batch_signature(padded)
        return reason, padded

    def say_once(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            logger.warning("cuda_graph: running this step eagerly: %s", reason)

    def eager(self, micro_batches: List, where: str, skip_nonfinite: bool,
              loss_fn: Callable | None = None) -> Dict:
        # After a capture every parameter's .grad is the graph's buffer, which a backward would
        # add to: the eager step starts from no gradients, as optimizer_step leaves them.
        self.optimizer.zero_grad(set_to_none=True)
        return optimizer_step(self.model, micro_batches, loss_fn or self.loss_fn, self.optimizer,
                              self.scaler, self.device, self.amp_dtype, self.grad_clip, where=where,
                              skip_nonfinite=skip_nonfinite, sync_free=True, ema=self.ema)

    def warm_up(self, padded: Dict, where: str) -> Dict:
        """An eager step on a side stream (torch's recipe before capture: lazy initialisation,
        cudnn's algorithm choice and the optimizer's state happen outside the graph). From the
        second one on (the first builds caches, which may copy from the host: voxelize's grid
        constants), an op in its loss that a capture refuses makes the run eager, named in one
        line, before any capture fails on it (``checked_eager``; not under torch.compile,
        ``check_hazards`` False: a mode would change what it traces)."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            if self.check_hazards and self.eager_warmups > 0:
                stats, sites = self.checked_eager(padded, where)
            else:
                stats, sites = self.eager([padded], where, skip_nonfinite=False), []
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.eager_warmups += 1
        if sites:
            self.run_refused = hazard_refusal(sites)
            self.say_once(self.run_refused)
        return stats

    def checked_eager(self, padded: Dict, where: str):
        """The eager step on ``padded``, its loss (pillarisation, targets, forward, loss: the
        model's code) run under ``CaptureHazards``: -> (stats, the sites found). Backward,
        clipping, the optimizer and the EMA are this module's own calls, checked by the tests."""
        found = CaptureHazards(device=self.device)

        def checked_loss(model, batch):
            with found:
                return self.loss_fn(model, batch)

        return self.eager([padded], where, skip_nonfinite=False, loss_fn=checked_loss), found.sites

    def capture(self, padded: Dict, signature) -> bool:
        """Record the step on ``padded`` (nothing runs yet); False, with the reason logged
        and every later step eager, when the capture fails (a host read inside the step:
        a model that reads ``record_len`` back, ...)."""
        # The input buffers live on the device whatever the batch's tensors (a CPU tensor read
        # inside the step would be a host-to-device copy the graph cannot hold).
        self.static_batch = {key: value.to(self.device, copy=True) if torch.is_tensor(value)
                             else value for key, value in padded.items()}
        self.signature = signature
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the loader's pin-memory thread may allocate while this captures.
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.values = self.captured_step()
        except RuntimeError as error:
            self.run_refused = capture_failure(error)
            self.say_once(self.run_refused)
            self.optimizer.zero_grad(set_to_none=True)
            return False
        self.graph = graph
        logger.info("cuda_graph: the training step is captured (%d warm-up steps)",
                    self.eager_warmups)
        return True

    def captured_step(self) -> torch.Tensor:
        """The step's work, recorded: -> (3 + terms,) float32 [finite, loss, grad_norm, terms]."""
        # No autocast weight-cast cache in a capture (torch's advice for graphed autocast).
        autocast = (torch.autocast(self.device.type, self.amp_dtype, cache_enabled=False)
                    if self.amp_dtype is not None else contextlib.nullcontext())
        with autocast:
            loss, terms, count = self.loss_fn(self.model, self.static_batch)
        loss.backward()
        grad_norm = unscale_and_clip(self.optimizer, self.scaler, self.grad_clip)
        self.optimizer.step()
        if self.ema is not None:
            self.ema.lerp_towards(self.model, self.ema_weight)
        self.term_names, self.samples = list(terms), int(count)
        loss = loss.detach().float().reshape(1)
        return torch.cat([torch.isfinite(loss).float(), loss, grad_norm.detach().float().reshape(1),
                          *[torch.as_tensor(terms[name], device=self.device).float().reshape(1)
                            for name in self.term_names]])

    def replay(self, where: str) -> Dict:
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            if group["lr"] is not lr:           # a float set by hand or a loaded state
                lr.fill_(float(group["lr"]))
                group["lr"] = lr
        if self.ema is not None:
            self.ema.updates += 1
            self.ema_weight.fill_(1.0 - self.ema.current_decay())
        self.graph.replay()
        values = self.values.tolist()                 # the step's one host read
        finite, loss, grad_norm, terms = values[0], values[1], values[2], values[3:]
        nonfinite = nonfinite_reason([finite], [loss], grad_norm, self.scaler, where)
        if nonfinite is not None:
            raise nonfinite_error(nonfinite)
        return {"loss": loss, **dict(zip(self.term_names, terms)), "grad_norm": grad_norm,
                "samples": self.samples, "skipped": 0, "overflow": 0, "nonfinite": None}


def hazard_refusal(sites: List[str]) -> str:
    """The one-line reason for not capturing a step whose loss runs ``sites`` (CaptureHazards'
    ``"opencood/file.py:line kind (op)"``): the first one and how many in all."""
    return (f"the step runs {len(sites)} op(s) a CUDA graph capture refuses, the first at "
            f"{sites[0]}")


def capture_failure(error: BaseException) -> str:
    """The one-line reason of a failed capture, with where it failed: the innermost
    ``opencood/`` frame of the error's traceback (``at opencood/models/x.py:12``), or, for an
    error of torch.compile's tracing, the innermost one its message's user-code stack names;
    and the first line of the error's cause, if it has one. A GPU run's log is often all there
    is to go on. An op refused inside the capture raises there, and then the end of
    ``torch.cuda.graph`` raises over it ("operation failed due to a previous error during
    capture", at the ``with`` line): the first error of that chain is the one reported, with
    the last one after it."""
    first, seen = error, {id(error)}
    # Implicit chaining only (raised while handling the earlier error); ``raise ... from``
    # names its cause below.
    while (first.__cause__ is None and not first.__suppress_context__
           and first.__context__ is not None and id(first.__context__) not in seen):
        first = first.__context__
        seen.add(id(first))
    message = str(first).strip()
    traced = re.findall(r'File "[^"]*/(opencood/[^"]+)", line (\d+)', message)
    site = (f"{traced[-1][0]}:{traced[-1][1]}" if traced
            else project_site(traceback.extract_tb(first.__traceback__)))
    reason = (message.splitlines() or [type(first).__name__])[0]
    cause = str(first.__cause__ or "").strip().splitlines()
    if cause and cause[0] not in reason:
        reason += f" (cause: {cause[0]})"
    if first is not error:
        reason += f" (then: {(str(error).strip().splitlines() or [type(error).__name__])[0]})"
    return f"the capture failed{' at ' + site if site else ''}: {reason}"


def copy_batch(static: Dict, padded: Dict) -> None:
    """Copy a batch's tensors into the captured step's input buffers (same shapes)."""
    for key, value in padded.items():
        if torch.is_tensor(value):
            static[key].copy_(value, non_blocking=True)


def tensor_lrs(optimizer: torch.optim.Optimizer, device: torch.device) -> List[torch.Tensor]:
    """Make every group capturable with its lr a 0-d device tensor (which lr schedules
    ``fill_`` in place, so the replayed step sees every change); -> those tensors."""
    lrs = []
    for group in optimizer.param_groups:
        lr = group["lr"]
        if not (torch.is_tensor(lr) and lr.device == device):
            lr = torch.tensor(float(lr), dtype=torch.float32, device=device)
        group["lr"], group["capturable"] = lr, True
        lrs.append(lr)
        for param in group["params"]:       # a resumed state's step counters, to the device
            state = optimizer.state.get(param, {})
            if torch.is_tensor(state.get("step")) and state["step"].device != device:
                state["step"] = state["step"].to(device, torch.float32)
    return lrs


def build_graph_step(cfg: Dict, parts, device: torch.device, world_size: int,
                     accum_steps: int, loss_fn: Callable | None = None,
                     model: torch.nn.Module | None = None) -> CudaGraphStep | None:
    """The run's graph step when ``performance.cuda_graph`` is on (None when off); a run it
    cannot capture gets one logged line and eager steps."""
    perf = cfg["performance"]
    if not perf["cuda_graph"]:
        return None
    refused = run_refusal(cfg, device, world_size, accum_steps, parts.optimizer, parts.scaler)
    if refused is not None:
        logger.warning("cuda_graph: running eagerly: %s", refused)
    limits = GraphLimits(perf["cuda_graph_max_points"], perf["cuda_graph_max_gt"],
                         tuple(cfg["preprocess"]["cav_lidar_range"]))
    return CudaGraphStep(model if model is not None else parts.model,
                         loss_fn or parts.task.training_loss, parts.optimizer, parts.scaler,
                         parts.ema, device, parts.amp_dtype, cfg["train_params"]["grad_clip"],
                         limits, run_refused=refused, check_hazards=not perf["compile"])
