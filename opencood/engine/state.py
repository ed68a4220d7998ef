"""What a run saves and resumes: the progress counters (``TrainState``), the checkpoint contents,
when to save (epoch ends, and inside epochs on a schedule), and restoring on resume.

A checkpoint is complete on rank 0: it holds every rank's generator states (gathered), so that
each rank resumes its own random stream (docs/DESIGN.md §6.7).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from opencood.config import ConfigError
from opencood.config_schema import to_plain
from opencood.engine.run_folder import record_schedule
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import (capture_rng_state, newest_readable_checkpoint,
                                       restore_rng_state, rng_state_for_rank, save_checkpoint,
                                       save_with_history)

logger = logging.getLogger("opencood")


@dataclass
class TrainState:
    """Where a run stands: enough, with the module/optimizer states, to continue it exactly.

    ``epoch`` is the last whole epoch; ``epoch_steps_done`` the optimizer steps already done in
    the next one (non-zero only in a checkpoint saved inside an epoch); ``step`` counts every
    optimizer step, skipped ones included (the lr schedule counts them too).
    """
    epoch: int = 0
    epoch_steps_done: int = 0
    step: int = 0
    best_val_loss: float = math.inf
    skipped_steps: int = 0
    # Wall seconds of the training steps of every epoch so far, across resumes (validation and
    # checkpoints excluded): what a run cost to train (RUN/train_cost.yaml).
    train_seconds: float = 0.0

    @classmethod
    def from_checkpoint(cls, checkpoint: Dict | None) -> "TrainState":
        if checkpoint is None:
            return cls()
        return cls(epoch=int(checkpoint["epoch"]),
                   epoch_steps_done=int(checkpoint.get("epoch_steps_done", 0)),
                   step=int(checkpoint["step"]),
                   best_val_loss=float(checkpoint.get("best_val_loss", math.inf)),
                   skipped_steps=int(checkpoint.get("skipped_steps", 0)),
                   train_seconds=float(checkpoint.get("train_seconds", 0.0)))


@dataclass
class TrainingParts:
    """The objects a run trains with, travelling together.

    ``model`` is what steps run (DDP-wrapped when distributed, compiled with
    ``performance.compile``); ``model_without_ddp`` the bare module that checkpoints save (no
    ``module.`` prefix) and the optimizer and EMA follow; ``amp_dtype`` the autocast dtype or
    None; ``task`` the forward + loss (``opencood.engine.task.DetectionTask``).
    """
    model: torch.nn.Module
    model_without_ddp: torch.nn.Module
    ema: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    amp_dtype: Optional[torch.dtype]
    task: Any


def training_state(parts: TrainingParts, progress: TrainState, cfg: Dict, seed: int) -> Dict:
    """What a checkpoint holds (complete on rank 0). All ranks call it: every rank's generator
    states are gathered (``rng_per_rank``; ``rng`` is this rank's own)."""
    own_rng = capture_rng_state()
    return {
        "model": parts.model_without_ddp.state_dict(),
        "ema": parts.ema.state_dict() if parts.ema is not None else None,
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "scaler": parts.scaler.state_dict(),
        "epoch": progress.epoch, "step": progress.step,
        "best_val_loss": progress.best_val_loss,
        "skipped_steps": progress.skipped_steps,       # the skip budget spans resumes
        "train_seconds": progress.train_seconds,
        **({"epoch_steps_done": progress.epoch_steps_done} if progress.epoch_steps_done else {}),
        "sampler": {"seed": seed, "epoch": progress.epoch},
        "rng": own_rng,
        "rng_per_rank": dist_utils.gather_object_to_main(own_rng),
        "config": to_plain(cfg),        # plain data: checkpoints load with weights_only
    }


def save_run_checkpoints(run_dir: Path, state: Dict, epoch: int, save_freq: int,
                         is_best: bool, keep: int = 3) -> None:
    """Rank 0 only: last.pth and checkpoints/step_N.pth (the ``keep`` newest) always,
    epoch_N.pth every save_freq epochs, best.pth when best; config.yaml takes the schedule
    keys a resume changed."""
    if not dist_utils.is_main_process():
        return
    save_with_history(run_dir, state, int(state["step"]), keep)
    if save_freq and epoch % save_freq == 0:
        save_checkpoint(run_dir / f"epoch_{epoch}.pth", state)
    if is_best:
        save_checkpoint(run_dir / "best.pth", state)
    record_schedule(run_dir, state["config"])


TRAIN_COST_FILE = "train_cost.yaml"


def train_cost(progress: TrainState, model: torch.nn.Module, cfg: Dict, world_size: int,
               device) -> Dict:
    """What the run has cost so far: optimizer steps, whole epochs, wall seconds of training
    (summed over resumes), trainable and frozen parameters, the frozen parts and the base it
    started from (``train_params.fix_modules``, ``init.checkpoint``: HEAL's stage two), the
    processes and device. Written by rank 0 at every epoch end to ``RUN/train_cost.yaml``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return {"steps": progress.step, "epochs": progress.epoch,
            "train_seconds": round(progress.train_seconds, 1),
            "trainable_parameters": trainable, "frozen_parameters": frozen,
            "fix_modules": list(cfg["train_params"]["fix_modules"] or []),
            "init_checkpoint": cfg["init"]["checkpoint"],
            "world_size": world_size, "device": str(device)}


def save_mid_epoch_checkpoint(run_dir: Path, state: Dict, keep: int) -> None:
    """Rank 0 only: last.pth and its history file, from inside an epoch."""
    if dist_utils.is_main_process():
        save_with_history(run_dir, state, int(state["step"]), keep)
        record_schedule(run_dir, state["config"])


class MidEpochCheckpoints:
    """When to save inside an epoch, so that a killed job loses at most that much work.

    ``every_steps`` (optimizer steps) is the same decision on every rank by construction;
    ``every_minutes`` is decided collectively (any rank's clock), because saving gathers every
    rank's generator states and all ranks must join it. 0 turns either off.
    """

    def __init__(self, every_steps: int, every_minutes: float):
        if every_steps < 0 or every_minutes < 0:
            raise ConfigError("train_params.checkpoint_every_steps and checkpoint_every_minutes "
                              "must be >= 0 (0 turns them off)")
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.last_save = time.monotonic()

    def due(self, step: int) -> bool:
        by_steps = self.every_steps > 0 and step % self.every_steps == 0
        if self.every_minutes <= 0:
            return by_steps
        late = time.monotonic() - self.last_save >= 60.0 * self.every_minutes
        return dist_utils.any_across_ranks(by_steps or late)

    def saved(self) -> None:
        self.last_save = time.monotonic()


def find_resume_checkpoint(run_dir: Path):
    """(path, checkpoint) of the newest readable checkpoint of the run, or (None, None).

    A damaged last.pth (truncated copy, disk error) falls back to the newest readable history
    file, said in one line per file skipped."""
    path, checkpoint, unreadable = newest_readable_checkpoint(run_dir)
    for bad_path, reason in unreadable:
        logger.warning("skipping %s (%s); resuming from %s", bad_path, reason, path)
    return path, checkpoint


def restore_grad_scaler(scaler: torch.amp.GradScaler, state: Dict | None) -> None:
    """Load a checkpoint's GradScaler state into ``scaler``.

    A run saved without fp16 (fp32 or bf16) holds an empty state, which an enabled scaler
    refuses: an fp16 resume of such a run starts loss scaling afresh. A disabled scaler ignores
    any state (an fp16 run resumed in fp32 or bf16).
    """
    if scaler.is_enabled() and not state:
        logger.info("fp16 loss scaling starts afresh: the checkpoint was saved without it")
        return
    scaler.load_state_dict(state or {})


def restore_rank_rng_state(checkpoint: Dict, info: dist_utils.DistInfo) -> None:
    """Each rank resumes its own generators; rank 0's where the world size changed."""
    saved_ranks = len(checkpoint.get("rng_per_rank") or [])
    if saved_ranks and saved_ranks != info.world_size:
        logger.warning("the checkpoint was saved by %d ranks, this run has %d: every rank "
                       "resumes rank 0's random generators", saved_ranks, info.world_size)
    restore_rng_state(rng_state_for_rank(checkpoint, info.rank, info.world_size))


# How an optimizer's step runs, not where training stands: this run's own, whatever a checkpoint
# saved (a CUDA-graph run saves capturable groups, which step only on a GPU).
STEP_IMPLEMENTATION_KEYS = ("capturable", "foreach", "fused", "differentiable")


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: Dict) -> None:
    """``optimizer.load_state_dict(saved)`` keeping the groups' :data:`STEP_IMPLEMENTATION_KEYS`
    as this run built them, and the lr a float: a CUDA-graph run saves 0-d tensor lrs and
    capturable groups (``cuda_graph.tensor_lrs``), which a CPU run cannot step and foreach
    refuses uncapturable; a graph run turns them back into tensors after the resume."""
    own = [{key: group[key] for key in STEP_IMPLEMENTATION_KEYS if key in group}
           for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, implementation in zip(optimizer.param_groups, own):
        group.update(implementation)
        if torch.is_tensor(group["lr"]):
            group["lr"] = float(group["lr"])


def restore_training(checkpoint: Dict, parts: TrainingParts,
                     info: dist_utils.DistInfo) -> TrainState:
    """Optimizer, lr schedule, loss scaler and this rank's generators from ``checkpoint``;
    returns where the run stands. (The model and EMA are loaded before DDP wraps the model.)"""
    load_optimizer_state(parts.optimizer, checkpoint["optimizer"])
    parts.scheduler.load_state_dict(checkpoint["scheduler"])
    restore_grad_scaler(parts.scaler, checkpoint.get("scaler"))
    restore_rank_rng_state(checkpoint, info)
    return TrainState.from_checkpoint(checkpoint)
