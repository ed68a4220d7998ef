"""``tools/train.py``: distributed training, top to bottom (DESIGN §6).

    torchrun --nproc_per_node=N tools/train.py --hypes_yaml X.yaml [--model_dir RUN] [--set k=v]

The same command runs with plain ``python`` (one process), under SLURM (``srun``), on CPU (gloo)
and on GPU (nccl).
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from datetime import datetime
from pathlib import Path
from typing import Dict, Mapping

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from opencood.config import ConfigError, load_config, save_config
from opencood.data.collate import collate_samples, seed_worker
from opencood.data.datasets import build_dataset
from opencood.data.pipeline import BatchPreparer
from opencood.engine.loop import group_micro_batches, optimizer_step, validation_loss
from opencood.engine.optim import build_optimizer, build_scheduler
from opencood.engine.recipe import check_registered_names
from opencood.errors import run_cli
from opencood.eval.inference import evaluate_loader
from opencood.losses import build_loss
from opencood.models.build import build_model
from opencood.utils import dist as dist_utils
from opencood.utils.batching import describe_batch, split_global_batch
from opencood.utils.checkpoint import (capture_rng_state, check_state_dict_compatible,
                                       newest_readable_checkpoint, restore_rng_state,
                                       rng_state_for_rank, save_checkpoint, save_with_history)
from opencood.utils.ema import ModelEMA
from opencood.utils.init import init_weights
from opencood.utils.samplers import InferenceSampler, build_train_sampler

logger = logging.getLogger("opencood")

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}


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


# -- configuration and run folder ------------------------------------------------------------

def resolve_config(args) -> Dict:
    """Config from --hypes_yaml, else the run folder's saved config.yaml (resume)."""
    if args.hypes_yaml:
        return load_config(args.hypes_yaml, args.overrides)
    saved = Path(args.model_dir) / "config.yaml"
    if not saved.exists():
        raise ConfigError(f"{saved}: not found; --model_dir without --hypes_yaml must be a run "
                          f"folder written by tools/train.py")
    return load_config(saved, args.overrides)


def new_run_folder_name(name: str, env: Mapping[str, str], now: datetime) -> str:
    """The folder of a run started without --model_dir.

    A restarted job must find its own folder again, so where the launcher can restart workers
    the name comes from the job, not the clock: SLURM's job id (stable across requeues), or
    torchrun's rendezvous run id under ``--max-restarts`` (stable across restarts). A torchrun
    job that may restart but has no run id (``--rdzv-id`` left at "none") must name its folder.
    """
    if env.get("SLURM_JOB_ID"):
        return f"{name}_slurm{env['SLURM_JOB_ID']}"
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        if run_id in ("", "none"):
            raise ConfigError("torchrun --max-restarts needs --model_dir RUN (or --rdzv-id): a "
                              "restarted worker must find the run folder to resume from")
        return f"{name}_{run_id}"
    return f"{name}_{now.strftime('%Y_%m_%d_%H_%M_%S')}"


def make_run_dir(cfg: Dict, args) -> Path:
    """Rank 0 picks (and creates) the run folder; every rank gets the same path."""
    # Named on every rank (the environment is the same): a refusal stops them all alike.
    run_dir = Path(args.model_dir) if args.model_dir else Path(args.runs_root) / \
        new_run_folder_name(cfg["name"], os.environ, datetime.now())
    if dist_utils.is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
    return Path(dist_utils.broadcast_object(str(run_dir) if dist_utils.is_main_process()
                                            else None))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def configure_cuda(cfg: Dict) -> None:
    perf = cfg.get("performance", {})
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = bool(perf.get("tf32", True))
        torch.backends.cudnn.allow_tf32 = bool(perf.get("tf32", True))
        torch.backends.cudnn.benchmark = bool(perf.get("cudnn_benchmark", True))


def amp_settings(cfg: Dict, device: torch.device):
    """(autocast dtype or None, GradScaler). fp16 needs a scaler; bf16 does not."""
    amp_cfg = cfg.get("amp", {}) or {}
    if amp_cfg.get("enabled", False) and device.type != "cuda":
        # CPU autocast runs slower than fp32 for these convolutions: mixed precision is for GPUs.
        logger.info("amp.enabled ignored on %s: mixed precision is used on CUDA only", device)
        return None, torch.amp.GradScaler(device.type, enabled=False)
    if not amp_cfg.get("enabled", False):
        return None, torch.amp.GradScaler(device.type, enabled=False)
    name = str(amp_cfg.get("dtype", "bf16"))
    if name not in AMP_DTYPES:
        raise ConfigError(f"amp.dtype {name!r} is unknown; use bf16 or fp16")
    dtype = AMP_DTYPES[name]
    use_scaler = dtype == torch.float16 and device.type == "cuda"
    return dtype, torch.amp.GradScaler(device.type, enabled=use_scaler)


# -- data ------------------------------------------------------------------------------------

def build_loaders(cfg: Dict, info: dist_utils.DistInfo, micro_batch: int, seed: int):
    train_set = build_dataset(cfg, "train", train=True)
    val_set = build_dataset(cfg, "validate", train=False) if cfg.get("validate_dir") else None
    loss_set = None
    if val_set is not None:
        # The loss needs no visibility counts (AP does). Late fusion trains per CAV: its
        # validation loss is per CAV too (AP uses whole samples).
        per_cav = {"per_cav": True} if cfg["fusion"]["core_method"] == "late" else {}
        loss_set = build_dataset(cfg, "validate", train=False, count_ego_points=False, **per_cav)
    try:  # same length on every rank, so every rank fails alike
        batch_sampler, train_sampler = build_train_sampler(
            len(train_set), micro_batch, info.rank, info.world_size, seed=seed)
    except ValueError as error:
        raise ConfigError(f"train_params.batch_size: {error}") from None
    workers = int(cfg.get("train_params", {}).get("num_workers", 2))
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_sampler=batch_sampler, num_workers=workers,
        collate_fn=collate_samples, worker_init_fn=seed_worker,
        pin_memory=info.device.type == "cuda", generator=torch.Generator())
    val_loaders = None
    if val_set is not None:
        val_loaders = tuple(
            torch.utils.data.DataLoader(
                dataset, batch_size=micro_batch,
                sampler=InferenceSampler(len(dataset), info.rank, info.world_size),
                num_workers=workers, collate_fn=collate_samples, worker_init_fn=seed_worker)
            for dataset in (loss_set, val_set))
    return train_set, train_loader, train_sampler, val_loaders


# -- model -----------------------------------------------------------------------------------

def use_sync_batchnorm(info: dist_utils.DistInfo) -> bool:
    """SyncBN where its all_gather of batch statistics can run: CUDA with world > 1 (on CPU,
    torch's SyncBatchNorm refuses to run; BatchNorm stays plain, per rank)."""
    return info.device.type == "cuda" and info.world_size > 1


def prepare_model(cfg: Dict, info: dist_utils.DistInfo, checkpoint: Dict | None, ckpt_path):
    """build -> init -> SyncBN (CUDA, world > 1) -> device -> load -> EMA -> DDP (DESIGN §6.4)."""
    model = build_model(cfg["model"])
    init_cfg = cfg.get("init", {}) or {}
    init_weights(model, method=init_cfg.get("method", "xavier_uniform"),
                 cls_prior=float(init_cfg.get("cls_prior", 0.01)))
    if use_sync_batchnorm(info):
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(info.device)
    if checkpoint is not None:
        check_state_dict_compatible(model, checkpoint["model"], ckpt_path)
        model.load_state_dict(checkpoint["model"])
    ema = None
    ema_cfg = cfg.get("ema", {}) or {}
    if ema_cfg.get("enabled", False):
        ema = ModelEMA(model, decay=float(ema_cfg.get("decay", 0.999)),
                       tau=float(ema_cfg.get("tau", 200)))
        if checkpoint is not None and checkpoint.get("ema") is not None:
            ema.load_state_dict(checkpoint["ema"])
    model_without_ddp = model
    if info.distributed:
        dist_cfg = cfg.get("distributed", {}) or {}
        model = DistributedDataParallel(
            model, device_ids=[info.device.index] if info.device.type == "cuda" else None,
            find_unused_parameters=bool(dist_cfg.get("find_unused_parameters", False)),
            gradient_as_bucket_view=True)
    return model, model_without_ddp, ema


def make_loss_fn(preparer: BatchPreparer, criterion):
    """loss_fn(model, batch) -> (loss, per-term floats, samples): the detection step."""

    def loss_fn(model, batch):
        inputs, targets = preparer(batch)
        outputs = model(inputs)
        loss, terms = criterion(outputs, targets)
        terms = {name: float(value) for name, value in terms.items()}
        return loss, terms, len(batch["record_len"])

    return loss_fn


def make_validation_loss_fn(preparer: BatchPreparer, criterion):
    """loss_fn(model, batch) -> (mean per-sample loss, {}, samples), for validation_loss.

    The training loss is normalised per micro-batch; validation takes each sample's own
    normalisation (``per_sample_losses``, float64), so validation_loss's sum of loss x samples
    is the sum of per-sample losses and the split's mean does not depend on the micro-batch
    size or the number of ranks (``best.pth`` neither).
    """

    def loss_fn(model, batch):
        inputs, targets = preparer(batch)
        per_sample = criterion.per_sample_losses(model(inputs), targets)
        return per_sample.mean(), {}, per_sample.numel()

    return loss_fn


# -- checkpoints -----------------------------------------------------------------------------

def training_state(model_without_ddp, ema, optimizer, scheduler, scaler, epoch: int, step: int,
                   best_val: float, cfg: Dict, seed: int) -> Dict:
    """What a checkpoint holds (complete on rank 0). All ranks call it: every rank's generator
    states are gathered (``rng_per_rank``; ``rng`` is this rank's own)."""
    own_rng = capture_rng_state()
    return {
        "model": model_without_ddp.state_dict(),
        "ema": ema.state_dict() if ema is not None else None,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "epoch": epoch, "step": step, "best_val_loss": best_val,
        "sampler": {"seed": seed, "epoch": epoch},
        "rng": own_rng,
        "rng_per_rank": dist_utils.gather_object_to_main(own_rng),
        "config": cfg,
    }


def save_run_checkpoints(run_dir: Path, state: Dict, epoch: int, save_freq: int,
                         is_best: bool, keep: int = 3) -> None:
    """Rank 0 only: last.pth and checkpoints/step_N.pth (the ``keep`` newest) always,
    epoch_N.pth every save_freq epochs, best.pth when best."""
    if not dist_utils.is_main_process():
        return
    save_with_history(run_dir, state, int(state["step"]), keep)
    if save_freq and epoch % save_freq == 0:
        save_checkpoint(run_dir / f"epoch_{epoch}.pth", state)
    if is_best:
        save_checkpoint(run_dir / "best.pth", state)


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


def find_resume_checkpoint(run_dir: Path):
    """(path, checkpoint) of the newest readable checkpoint of the run, or (None, None).

    A damaged last.pth (truncated copy, disk error) falls back to the newest readable history
    file, said in one line per file skipped."""
    path, checkpoint, unreadable = newest_readable_checkpoint(run_dir)
    for bad_path, reason in unreadable:
        logger.warning("skipping %s (%s); resuming from %s", bad_path, reason, path)
    return path, checkpoint


# -- logging ---------------------------------------------------------------------------------

class ScalarLogger:
    """TensorBoard scalars on rank 0 (no-op elsewhere)."""

    def __init__(self, run_dir: Path):
        self.writer = None
        if dist_utils.is_main_process():
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(log_dir=str(run_dir))

    def scalars(self, values: Dict[str, float], step: int, prefix: str) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None and math.isfinite(float(value)):
                self.writer.add_scalar(f"{prefix}/{name}", float(value), step)

    def image(self, tag: str, image_bgr, step: int) -> None:
        """A (H, W, 3) uint8 BGR picture (OpenCV order) as an RGB TensorBoard image."""
        if self.writer is not None:
            self.writer.add_image(tag, image_bgr[..., ::-1].copy(), step, dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()


def progress_bar(total: int, epoch: int):
    if not dist_utils.is_main_process():
        return None
    from tqdm import tqdm
    return tqdm(total=total, desc=f"epoch {epoch}", unit="step", dynamic_ncols=True, leave=False)


def log_model_summary(model, preparer, loader) -> None:
    """Parameters and forward FLOPs of one real batch, at training start (rank 0).

    The forward runs in eval mode, on rank 0 alone: in training mode a SyncBatchNorm layer
    all_gathers its batch statistics, a collective the other ranks would never join (a hang on
    GPUs), and BatchNorm would move its running statistics. In eval mode neither happens, and the
    FLOP count is the same (convolutions and matmuls only).
    """
    if not dist_utils.is_main_process():
        return
    from opencood.utils.model_stats import format_model_summary
    was_training = model.training
    model.eval()
    try:
        batch = next(iter(loader))
        inputs, _ = preparer(batch, with_targets=False)
        logger.info("model: %s", format_model_summary(model, inputs))
    except StopIteration:
        logger.warning("model summary skipped: the training loader is empty")
    finally:
        model.train(was_training)


# -- the run ---------------------------------------------------------------------------------

def first_sample_picture(cfg: Dict, pictures: list):
    """on_sample hook: rank 0 renders its first validation sample (points, GT, detections)."""
    if not dist_utils.is_main_process():
        return None
    from opencood.eval.vis import render_detection_sample

    def on_sample(key, batch, row, boxes, scores):
        if not pictures:
            pictures.append(render_detection_sample(batch, row, boxes,
                                                    cfg["preprocess"]["cav_lidar_range"]))

    return on_sample


def validate(model_for_eval, val_loaders, loss_fn, info, amp_dtype, cfg, epoch, preparer):
    """Validation loss (exact over ranks) every epoch; AP every ``eval_freq`` epochs.

    Returns ({"loss", and "ap_30/50/70", "ap_50_ego_occluded" on rank 0 when computed},
    samples in the loss,
    [a BEV picture (H, W, 3) BGR of the first sample when AP was computed, on rank 0]).
    """
    loss_loader, ap_loader = val_loaders
    loss, count = validation_loss(model_for_eval, loss_loader, loss_fn, info.device, amp_dtype)
    results, pictures = {"loss": loss}, []
    eval_freq = int(cfg["train_params"].get("eval_freq", 1))
    if epoch % eval_freq == 0:
        metrics = evaluate_loader(model_for_eval, ap_loader, preparer, cfg, info.device,
                                  on_sample=first_sample_picture(cfg, pictures))
        if metrics is not None:
            results.update({k: metrics[k] for k in ("ap_30", "ap_50", "ap_70")})
            if "visibility" in metrics:
                # The cars only other agents see: the curve that shows cooperation working.
                results["ap_50_ego_occluded"] = metrics["visibility"]["ego-occluded"]["ap_50"]
    return results, count, pictures


def train(cfg: Dict, args, info: dist_utils.DistInfo) -> Dict:
    train_params = cfg["train_params"]
    try:  # before any file is written; every rank fails alike, so none waits in a collective
        micro, accum = split_global_batch(int(train_params["batch_size"]), info.world_size,
                                          train_params.get("max_micro_batch"))
    except ValueError as error:
        raise ConfigError(f"train_params.batch_size: {error}") from None
    check_registered_names(cfg, args.hypes_yaml or str(Path(args.model_dir) / "config.yaml"))
    run_dir = make_run_dir(cfg, args)
    dist_utils.setup_logging(run_dir, info.rank)
    seed = int(cfg.get("seed", 0))
    seed_everything(seed)
    configure_cuda(cfg)
    ckpt_path, checkpoint = find_resume_checkpoint(run_dir)
    if dist_utils.is_main_process() and checkpoint is None:
        save_config(cfg, run_dir / "config.yaml")

    logger.info("run folder %s | %s | device %s, backend %s", run_dir,
                describe_batch(micro, info.world_size, accum), info.device, info.backend)

    train_set, train_loader, train_sampler, val_loaders = build_loaders(cfg, info, micro, seed)
    steps_per_epoch = len(train_loader) // accum
    if steps_per_epoch == 0:
        raise ConfigError(f"train_params.batch_size {train_params['batch_size']} is larger than "
                          f"the training split ({len(train_set)} samples over "
                          f"{info.world_size} ranks)")
    epochs = int(train_params["epoches"])

    model, model_without_ddp, ema = prepare_model(cfg, info, checkpoint, ckpt_path)
    preparer = BatchPreparer.from_config(cfg, info.device)
    criterion = build_loss(cfg["loss"]).to(info.device)
    loss_fn = make_loss_fn(preparer, criterion)
    val_loss_fn = make_validation_loss_fn(
        BatchPreparer.from_config(cfg, info.device, training=False), criterion)
    optimizer = build_optimizer(model_without_ddp.parameters(), cfg["optimizer"])
    scheduler = build_scheduler(optimizer, cfg.get("lr_scheduler", {}),
                                epochs * steps_per_epoch, steps_per_epoch)
    amp_dtype, scaler = amp_settings(cfg, info.device)

    start_epoch, step, best_val = 1, 0, math.inf
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        restore_grad_scaler(scaler, checkpoint.get("scaler"))
        start_epoch, step = int(checkpoint["epoch"]) + 1, int(checkpoint["step"])
        best_val = float(checkpoint.get("best_val_loss", math.inf))
        restore_rank_rng_state(checkpoint, info)
        logger.info("resumed from %s at epoch %d (step %d)", ckpt_path, start_epoch - 1, step)
    else:
        log_model_summary(model_without_ddp, preparer, train_loader)

    scalars = ScalarLogger(run_dir)
    save_freq = int(train_params.get("save_freq", 1))
    keep_checkpoints = int(train_params.get("keep_checkpoints", 3))
    # Steps with a non-finite loss or gradients to skip before stopping (0: stop at the first).
    skip_budget = int(train_params.get("skip_nonfinite_steps", 0))
    barrier_timeout_s = 60.0 * float((cfg.get("distributed") or {}).get("timeout_minutes", 30))
    skipped_steps = int(checkpoint.get("skipped_steps", 0)) if checkpoint is not None else 0
    grad_clip = train_params.get("grad_clip")
    history = {}
    try:
        for epoch in range(start_epoch, epochs + 1):
            train_sampler.set_epoch(epoch)
            train_set.set_epoch(epoch)
            # The loader's generator seeds its workers: a function of (seed, epoch) only, so a
            # resumed run draws exactly what an uninterrupted one would.
            train_loader.generator.manual_seed(seed * 100003 + epoch)
            model.train()
            bar = progress_bar(steps_per_epoch, epoch)
            epoch_start, epoch_samples = time.perf_counter(), 0
            for micro_batches in group_micro_batches(train_loader, accum):
                step_start = time.perf_counter()
                stats = optimizer_step(model, micro_batches, loss_fn, optimizer, scaler,
                                       info.device, amp_dtype, grad_clip,
                                       where=f"epoch {epoch} step {step + 1}",
                                       skip_nonfinite=skipped_steps < skip_budget)
                # A skipped step still counts (lr schedule and step numbers stay aligned with
                # an uninterrupted run); only the weights and their EMA stay where they were.
                scheduler.step()
                if ema is not None and not stats["skipped"]:
                    ema.update(model_without_ddp)
                step += 1
                skipped_steps += stats.pop("skipped")
                nonfinite = stats.pop("nonfinite")
                if nonfinite is not None:
                    logger.warning("skipped step %d: %s (%d of %d allowed skips used)", step,
                                   nonfinite, skipped_steps, skip_budget)
                stats["skipped_steps"] = skipped_steps
                global_samples = stats["samples"] * info.world_size
                epoch_samples += global_samples
                stats["samples_per_s"] = global_samples / max(1e-9, time.perf_counter() - step_start)
                stats["lr"] = optimizer.param_groups[0]["lr"]
                stats.pop("samples")
                scalars.scalars(stats, step, "train")
                if bar is not None:
                    bar.set_postfix(loss=f"{stats['loss']:.3f}", lr=f"{stats['lr']:.2e}",
                                    sps=f"{stats['samples_per_s']:.1f}")
                    bar.update(1)
            if bar is not None:
                bar.close()
            # A rank stuck in its data or dead is named here, instead of leaving the others
            # in the next collective until the process-group timeout with no name.
            dist_utils.monitored_barrier(f"the end of epoch {epoch}", barrier_timeout_s)
            elapsed = time.perf_counter() - epoch_start
            logger.info("epoch %d/%d: loss %.4f, lr %.2e, %.1f samples/s", epoch, epochs,
                        stats["loss"], stats["lr"], epoch_samples / max(elapsed, 1e-9))

            is_best = False
            if val_loaders is not None:
                # Every rank validates rank 0's model (the one saved): the same weights, and
                # the same BatchNorm statistics, which each rank's last forward moved its way.
                if ema is not None:
                    ema.broadcast_from(0)
                else:
                    dist_utils.broadcast_buffers(model_without_ddp, src=0)
                eval_model = ema.module if ema is not None else model_without_ddp
                results, count, pictures = validate(eval_model, val_loaders, val_loss_fn, info,
                                                    amp_dtype, cfg, epoch, preparer)
                scalars.scalars(results, step, "val")
                for picture in pictures:
                    scalars.image("val/bev", picture, step)
                is_best = results["loss"] < best_val
                best_val = min(best_val, results["loss"])
                history[epoch] = results
                logger.info("epoch %d validation (%d samples): %s", epoch, count,
                            ", ".join(f"{k} {v:.4f}" for k, v in results.items()
                                      if v is not None))
            state = training_state(model_without_ddp, ema, optimizer, scheduler, scaler, epoch,
                                   step, best_val, cfg, seed)
            state["skipped_steps"] = skipped_steps      # the skip budget spans resumes
            # Rank 0 writes alone: should that fail (disk full), the others stop too, not wait.
            dist_utils.run_together(
                lambda: save_run_checkpoints(run_dir, state, epoch, save_freq, is_best,
                                             keep_checkpoints),
                "saving checkpoints")
    finally:
        scalars.close()
    return {"run_dir": str(run_dir), "history": history, "step": step,
            "skipped_steps": skipped_steps}


def main(argv=None) -> Dict:
    return run_cli(_main, argv)


def _main(argv=None) -> Dict:
    args = parse_args(argv)
    cfg = resolve_config(args)
    dist_cfg = cfg.get("distributed", {}) or {}
    with dist_utils.distributed_session(backend=dist_cfg.get("backend"),
                                        timeout_minutes=float(dist_cfg.get("timeout_minutes",
                                                                           30))) as info:
        return train(cfg, args, info)
