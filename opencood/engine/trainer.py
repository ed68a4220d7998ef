"""The training flow, top to bottom in docs/DESIGN.md §6's order; ``tools/train.py`` runs it.

    torchrun --nproc_per_node=N tools/train.py --hypes_yaml X.yaml [--model_dir RUN] [--set k=v]

The same command runs with plain ``python`` (one process), under SLURM (``srun``), on CPU (gloo)
and on GPU (nccl). Under ``torchrun --max-restarts`` restarted workers resume on their own from
the run's newest readable checkpoint. The pieces live next to this file (recipe: config,
loaders, the training parts, AMP, validation; state: TrainState, checkpoints; loop: one
optimizer step); this file is the order they run in.
"""
from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import torch
import yaml

from opencood.config import ConfigError, save_config
from opencood.data.collate import DevicePrefetcher, build_loader
from opencood.data.datasets import build_dataset
from opencood.engine.cuda_graph import build_graph_step
from opencood.engine.freeze import train_keeping_frozen
from opencood.engine.hooks import NO_HOOKS, TrainHooks
from opencood.engine.loop import group_micro_batches, optimizer_step
from opencood.engine.recipe import (ScalarLogger, build_teacher, build_training_parts,
                                    build_validation_loaders, check_registered_names,
                                    configure_cuda, distillation_dataset_args,
                                    log_model_summary, make_run_dir, progress_bar,
                                    resolve_config, seed_everything, seed_model_randomness,
                                    split_batch_or_refuse, step_budget, validate)
from opencood.engine.run_folder import say_if_finished
from opencood.engine.state import (TRAIN_COST_FILE, MidEpochCheckpoints, TrainingParts,
                                   TrainState, find_resume_checkpoint, restore_training,
                                   save_mid_epoch_checkpoint, save_run_checkpoints, train_cost,
                                   training_state)
from opencood.errors import run_cli
from opencood.strategies import choose_strategy
from opencood.utils import dist as dist_utils
from opencood.utils.atomic import atomic_write
from opencood.utils.batching import describe_batch
from opencood.utils.samplers import build_train_sampler

logger = logging.getLogger("opencood")


def main(argv=None, hooks: TrainHooks = NO_HOOKS) -> Dict:
    """Parse, load the config, start the process group, train; errors end in one line.
    ``hooks``: callbacks at fixed points of the run (opencood.engine.hooks; tests watch it)."""
    return run_cli(lambda arguments: _main(arguments, hooks), argv)


def _main(argv, hooks: TrainHooks) -> Dict:
    args = parse_args(argv)
    cfg = resolve_config(args.hypes_yaml, args.model_dir, args.overrides)
    dist_cfg = cfg["distributed"]
    # init_distributed_mode: torchrun / SLURM / one process; the timeout bounds every collective.
    with dist_utils.distributed_session(
            backend=dist_cfg["backend"], timeout_minutes=dist_cfg["timeout_minutes"]) as info:
        return train(cfg, args, info, hooks)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a cooperative detector (OPV2V format).")
    parser.add_argument("--hypes_yaml", "-y", help="experiment config (yaml)")
    parser.add_argument("--model_dir", help="run folder to resume (or to create)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key, e.g. optimizer.lr=1e-3")
    parser.add_argument("--runs_root", default="runs", help="where new run folders are made")
    args = parser.parse_args(argv)
    if not args.hypes_yaml and not args.model_dir:
        parser.error("give --hypes_yaml (new run) or --model_dir (resume)")
    return args


def train(cfg: Dict, args, info: dist_utils.DistInfo, hooks: TrainHooks = NO_HOOKS) -> Dict:
    """The run: returns {"run_dir", "history" {epoch: validation results}, "step",
    "skipped_steps"}."""
    train_params = cfg["train_params"]
    # Checked before any file is written; every rank fails alike, so none waits in a collective.
    micro, accum = split_batch_or_refuse(train_params, info.world_size)
    check_registered_names(cfg, args.hypes_yaml or str(Path(args.model_dir) / "config.yaml"))
    # The fusion strategy, chosen once here and handed to the data and the evaluation.
    strategy = choose_strategy(cfg)
    # Distillation (yaml kd, DiscoNet): a frozen early-fusion teacher, None without kd; never in
    # DDP, the optimizer, the EMA or a checkpoint.
    teacher = build_teacher(cfg, info.device)
    seed = cfg["seed"]
    # Data, indexed before the run folder exists (a data error leaves no folder behind): every
    # rank the same number of shuffled micro-batches (DistributedSampler pads its shard,
    # BatchSampler drops the incomplete tail); the validation split unpadded.
    train_set = hooks.wrap_train_set(
        build_dataset(cfg, "train", train=True, strategy=strategy,
                      **distillation_dataset_args(teacher)))
    try:   # same length on every rank, so every rank fails alike
        batch_sampler, train_sampler = build_train_sampler(   # BatchSampler(DistributedSampler)
            len(train_set), micro, info.rank, info.world_size, seed=seed, shuffle=True)
    except ValueError as error:
        raise ConfigError(f"train_params.batch_size: {error}") from None
    workers = train_params["num_workers"]
    train_loader = build_loader(train_set, info.device, workers, batch_sampler=batch_sampler,
                                generator=torch.Generator())
    val_loaders = build_validation_loaders(cfg, info, micro, strategy)
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise ConfigError(f"train_params.batch_size {train_params['batch_size']} is larger than "
                          f"the training split ({len(train_set)} samples over "
                          f"{info.world_size} ranks)")
    epochs, total_steps = step_budget(train_params, steps_per_epoch)
    run_dir = make_run_dir(cfg["name"], args.model_dir, args.runs_root)
    dist_utils.setup_logging(run_dir, info.rank)
    seed_everything(seed)
    configure_cuda(cfg["performance"])
    ckpt_path, checkpoint = find_resume_checkpoint(run_dir)
    if dist_utils.is_main_process() and checkpoint is None:
        save_config(cfg, run_dir / "config.yaml")
    logger.info("run folder %s | %s | device %s, backend %s", run_dir,
                describe_batch(micro, info.world_size, accum), info.device, info.backend)

    # Model: build -> Xavier init -> SyncBN (CUDA, world > 1) -> device -> resume's weights ->
    # EMA -> DDP (-> torch.compile); checkpoints are saved from model_without_ddp. Then
    # forward + loss: batches -> model inputs and targets (pillars capped by max_voxel_train in
    # training steps, by max_voxel_test in validation), the criterion, the teacher; the
    # optimizer, the lr schedule, AMP.
    parts = build_training_parts(cfg, info, checkpoint, ckpt_path, teacher,
                                 schedule=(total_steps, steps_per_epoch), strategy=strategy)
    # Initialised alike on every rank above; from here each rank draws its own dropout masks.
    seed_model_randomness(seed, info.rank)
    hooks.on_parts(parts, info)
    progress = TrainState()
    if checkpoint is not None:
        progress = restore_training(checkpoint, parts, info)
        logger.info("resumed from %s at epoch %d (step %d)", ckpt_path, progress.epoch,
                    progress.step)
        say_if_finished(run_dir, progress.epoch, progress.step, epochs, total_steps)
        if progress.epoch_steps_done:
            logger.info("epoch %d continues after its first %d of %d steps", progress.epoch + 1,
                        progress.epoch_steps_done, steps_per_epoch)
    else:
        log_model_summary(parts.model_without_ddp, parts.task.preparer, train_loader)

    run = EpochRunner(cfg, info, run_dir, progress, parts,
                      StepPlan(seed, total_steps, steps_per_epoch, accum), hooks)
    history = {}
    try:
        for epoch in range(progress.epoch + 1, epochs + 1):
            train_sampler.set_epoch(epoch)        # a new shuffle every epoch, the same on all ranks
            run.train_one_epoch(epoch, train_set, train_loader)
            # Rank 0's weights (the EMA's when enabled) are validated and saved, exactly.
            results = run.validate(epoch, val_loaders)
            if results is not None:
                history[epoch] = results
            run.save_epoch_end(epoch, results)
    finally:
        run.scalars.close()
    return {"run_dir": str(run_dir), "history": history, "step": progress.step,
            "skipped_steps": progress.skipped_steps}


@dataclass(frozen=True)
class StepPlan:
    """The run's step budget: ``seed`` (the loader's worker seeds per epoch), ``total_steps``
    optimizer steps, ``steps_per_epoch`` of ``accum`` micro-batches each."""
    seed: int
    total_steps: int
    steps_per_epoch: int
    accum: int


class EpochRunner:
    """One epoch of steps, its validation and its checkpoints, for ``train`` above. Holds the
    run's objects so that each stage reads as one call there."""

    def __init__(self, cfg: Dict, info: dist_utils.DistInfo, run_dir: Path,
                 progress: TrainState, parts: TrainingParts, plan: StepPlan, hooks: TrainHooks):
        self.cfg, self.info, self.run_dir = cfg, info, run_dir
        self.progress, self.parts, self.plan, self.hooks = progress, parts, plan, hooks
        train_params = cfg["train_params"]
        self.grad_clip = train_params["grad_clip"]
        # Steps with a non-finite loss or gradients to skip before stopping (0: stop at once).
        self.skip_budget = train_params["skip_nonfinite_steps"]
        self.keep_checkpoints = train_params["keep_checkpoints"]
        self.save_freq = train_params["save_freq"]
        self.mid_epoch = MidEpochCheckpoints(train_params["checkpoint_every_steps"],
                                             train_params["checkpoint_every_minutes"])
        self.barrier_timeout_s = 60.0 * cfg["distributed"]["timeout_minutes"]
        self.scalars = ScalarLogger(run_dir, resume_step=progress.step if progress.step else None)
        self.last_stats: Dict = {}
        # performance.cuda_graph: steps replayed from one captured graph (None: eager steps).
        self.graph_step = build_graph_step(cfg, parts, info.device, info.world_size, plan.accum)

    def train_one_epoch(self, epoch: int, train_set, train_loader) -> None:
        progress = self.progress
        train_set.set_epoch(epoch)                # augmentation draws: f(seed, epoch, index)
        # The loader's generator seeds its workers: a function of (seed, epoch) only, so a
        # resumed run draws exactly what an uninterrupted one would.
        train_loader.generator.manual_seed(self.plan.seed * 100003 + epoch)
        # Resumed inside this epoch: the same shuffled order without the steps already done.
        train_loader.batch_sampler.resume_in_epoch(epoch, progress.epoch_steps_done * self.plan.accum)
        # train(), the frozen parts' BatchNorm back in eval (also after the last validation).
        train_keeping_frozen(self.parts.model, self.parts.model_without_ddp,
                             self.cfg["train_params"]["fix_modules"])
        bar = progress_bar(self.plan.steps_per_epoch, epoch, progress.epoch_steps_done)
        epoch_start, epoch_samples = time.perf_counter(), 0
        # On CUDA the next batch's copy to the device overlaps this step (a pass-through on CPU).
        batches = DevicePrefetcher(train_loader, self.info.device)
        for micro_batches in group_micro_batches(batches, self.plan.accum):
            if progress.step >= self.plan.total_steps:
                break                              # train_params.max_steps ends inside an epoch
            self.hooks.before_step(progress.step + 1)
            stats = self.train_step(epoch, micro_batches)
            self.hooks.after_step(progress.step, stats)
            epoch_samples += stats["samples"] * self.info.world_size
            if bar is not None:
                bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}",
                                sps=f"{stats['samples_per_s']:.1f}")
                bar.update(1)
            progress.epoch_steps_done += 1
            if progress.epoch_steps_done < self.plan.steps_per_epoch and \
                    self.mid_epoch.due(progress.step):
                self.save_mid_epoch()
        if bar is not None:
            bar.close()
        # A rank stuck in its data or dead is named here, instead of leaving the others in the
        # next collective until the process-group timeout with no name.
        dist_utils.monitored_barrier(f"the end of epoch {epoch}", self.barrier_timeout_s)
        elapsed = time.perf_counter() - epoch_start
        progress.train_seconds += elapsed
        if self.last_stats:
            logger.info("epoch %d: loss %.4f, lr %.2e, %.1f samples/s (step %d of %d)", epoch,
                        self.last_stats["loss"], self.last_stats["lr"],
                        epoch_samples / max(elapsed, 1e-9), progress.step, self.plan.total_steps)

    def train_step(self, epoch: int, micro_batches) -> Dict:
        """One optimizer step (accumulated micro-batches, DDP all-reduce), schedule, EMA, log."""
        progress, parts, step_start = self.progress, self.parts, time.perf_counter()
        where = f"epoch {epoch} step {progress.step + 1}"
        skip_nonfinite = progress.skipped_steps < self.skip_budget
        if self.graph_step is not None:
            stats = self.graph_step.step(micro_batches, where, skip_nonfinite)
        else:
            stats = optimizer_step(parts.model, micro_batches, parts.task.training_loss,
                                   parts.optimizer, parts.scaler, self.info.device,
                                   parts.amp_dtype, self.grad_clip, where=where,
                                   skip_nonfinite=skip_nonfinite,
                                   sync_free=self.cfg["performance"]["sync_free_step"],
                                   ema=parts.ema)
        # A skipped step still counts (lr schedule and step numbers stay aligned with an
        # uninterrupted run); only the weights, buffers and EMA stay where they were.
        parts.scheduler.step()
        progress.step += 1
        progress.skipped_steps += stats.pop("skipped")
        nonfinite = stats.pop("nonfinite")
        if nonfinite is not None:
            logger.warning("skipped step %d: %s (%d of %d allowed skips used)", progress.step,
                           nonfinite, progress.skipped_steps, self.skip_budget)
        stats["skipped_steps"] = progress.skipped_steps
        global_samples = stats["samples"] * self.info.world_size
        stats["samples_per_s"] = global_samples / max(1e-9, time.perf_counter() - step_start)
        stats["lr"] = float(parts.optimizer.param_groups[0]["lr"])   # a tensor under cuda_graph
        self.scalars.scalars({k: v for k, v in stats.items() if k != "samples"}, progress.step,
                             "train")
        self.last_stats = stats
        return stats

    def validate(self, epoch: int, val_loaders) -> Dict | None:
        """Validation results of this epoch on every rank's copy of rank 0's model (the EMA's
        weights when enabled); None without a validation split."""
        if val_loaders is None:
            return None
        # Every rank validates rank 0's model (the one saved): the same weights, and the same
        # BatchNorm statistics, which each rank's last forward moved its way.
        parts = self.parts
        if parts.ema is not None:
            parts.ema.broadcast_from(0)
        else:
            dist_utils.broadcast_buffers(parts.model_without_ddp, src=0)
        eval_model = parts.ema.module if parts.ema is not None else parts.model_without_ddp
        results, count, pictures = validate(eval_model, val_loaders, parts.task, self.info,
                                            parts.amp_dtype, self.cfg, epoch)
        self.scalars.scalars(results, self.progress.step, "val")
        for picture in pictures:
            self.scalars.image("val/bev", picture, self.progress.step)
        logger.info("epoch %d validation (%d samples): %s", epoch, count,
                    ", ".join(f"{k} {v:.4f}" for k, v in results.items() if v is not None))
        return results

    def save_epoch_end(self, epoch: int, results: Dict | None) -> None:
        """last.pth + history (+ epoch_N.pth, best.pth); a run that ran out of ``max_steps``
        inside this epoch saves as from inside it."""
        progress = self.progress
        is_best = results is not None and results["loss"] < progress.best_val_loss
        if results is not None:
            progress.best_val_loss = min(progress.best_val_loss, results["loss"])
        whole = progress.epoch_steps_done >= self.plan.steps_per_epoch
        if whole:
            progress.epoch, progress.epoch_steps_done = epoch, 0
        state = training_state(self.parts, progress, self.cfg, self.plan.seed)
        # Rank 0 writes alone: should that fail (disk full), the others stop too, not wait.
        dist_utils.run_together(
            lambda: save_run_checkpoints(self.run_dir, state, epoch, self.save_freq if whole
                                         else 0, is_best and whole, self.keep_checkpoints),
            "saving checkpoints")
        dist_utils.run_together(lambda: self.write_train_cost() if whole else None,
                                "writing the training cost")
        self.mid_epoch.saved()

    def write_train_cost(self) -> None:
        """Rank 0: RUN/train_cost.yaml (opencood.engine.state.train_cost)."""
        if not dist_utils.is_main_process():
            return
        cost = train_cost(self.progress, self.parts.model_without_ddp, self.cfg,
                          self.info.world_size, self.info.device)
        with atomic_write(self.run_dir / TRAIN_COST_FILE) as stream:
            yaml.safe_dump(cost, stream, sort_keys=False)

    def save_mid_epoch(self) -> None:
        state = training_state(self.parts, self.progress, self.cfg, self.plan.seed)
        dist_utils.run_together(
            lambda: save_mid_epoch_checkpoint(self.run_dir, state, self.keep_checkpoints),
            "saving a mid-epoch checkpoint")
        self.mid_epoch.saved()

