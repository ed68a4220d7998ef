"""The training and evaluation recipe: the pieces ``opencood.engine.trainer`` assembles in
docs/DESIGN.md §6's order (and the evaluator and tools/bench.py reuse), so that no tool
re-assembles them: config and run folder, AMP, the step budget, validation loaders, model
preparation, the training parts, exact validation, logging (the loss step is
``opencood.engine.task``).
"""
from __future__ import annotations

import logging
import math
import os
import random
from datetime import datetime
from pathlib import Path
from typing import Dict, Mapping, Tuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from opencood.config import ConfigError, load_config
from opencood.data.collate import build_loader
from opencood.data.datasets import build_dataset
from opencood.engine.freeze import freeze_parameters, load_base_weights
from opencood.engine.loop import validation_loss
from opencood.engine.optim import build_optimizer, build_scheduler
from opencood.engine.run_folder import refuse_another_config, refuse_training_changes
from opencood.engine.state import TrainingParts
from opencood.engine.task import DetectionTask
from opencood.engine.teacher import FrozenTeacher, load_teacher
from opencood.errors import alike_on_every_rank
from opencood.eval.inference import detection_class_names, evaluate_loader
from opencood.models.build import build_model, use_channels_last
from opencood.registry import FUSIONS, LOSSES, MODELS, POSTPROCESSORS, RegistryError
from opencood.utils import dist as dist_utils
from opencood.utils.batching import epochs_for_steps, split_global_batch
from opencood.utils.checkpoint import check_state_dict_compatible
from opencood.utils.ema import ModelEMA
from opencood.utils.init import init_weights
from opencood.utils.samplers import InferenceSampler

logger = logging.getLogger("opencood")

AMP_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
              "fp16": torch.float16, "float16": torch.float16}


def check_registered_names(cfg: Dict, source: str) -> None:
    """Every registry name of the config exists, checked before any file is written (a typo in
    ``model.core_method`` must not leave an empty run folder behind). ``cfg`` is resolved."""
    import opencood.losses  # noqa: F401  (registers losses)
    import opencood.models  # noqa: F401  (registers models and fusion modules)
    import opencood.postprocess  # noqa: F401  (registers postprocessors)
    fusion = cfg["model"]["args"].get("fusion")     # model args are model-specific
    names = [("model.core_method", MODELS, cfg["model"]["core_method"]),
             ("model.args.fusion.core_method", FUSIONS,
              fusion["core_method"] if isinstance(fusion, Mapping) else None),
             ("loss.core_method", LOSSES, cfg["loss"]["core_method"]),
             ("postprocess.core_method", POSTPROCESSORS, cfg["postprocess"]["core_method"])]
    with alike_on_every_rank(dist_utils.get_rank()):
        for dotted, registry, name in names:
            if name is None:
                continue
            try:
                registry.get(name)
            except RegistryError as error:
                raise ConfigError(f"{source}: {dotted}: {error}") from None


# -- configuration and run folder ------------------------------------------------------------

def resolve_config(hypes_yaml: str | None, model_dir: str | None, overrides) -> Dict:
    """Config from ``hypes_yaml``, else the run folder's saved config.yaml (resume). A
    ``hypes_yaml`` whose config is not the one ``model_dir`` already holds is refused
    (:func:`opencood.engine.run_folder.refuse_another_config`), and so is a resume's ``--set``
    of a non-schedule ``train_params`` key (``run_folder.refuse_training_changes``)."""
    # Before any process group: every rank reads the same files, so rank 0 alone prints.
    with alike_on_every_rank(dist_utils.launcher_rank()):
        if hypes_yaml:
            cfg = load_config(hypes_yaml, overrides)
            if model_dir:
                refuse_another_config(cfg, hypes_yaml, model_dir)
            return cfg
        saved = Path(model_dir) / "config.yaml"
        if not saved.exists():
            raise ConfigError(f"{saved}: not found; --model_dir without --hypes_yaml must be a "
                              f"run folder written by tools/train.py")
        cfg = load_config(saved, overrides)
        refuse_training_changes(cfg, model_dir)
        return cfg


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


def make_run_dir(name: str, model_dir: str | None, runs_root: str) -> Path:
    """Rank 0 creates the run folder; every rank gets the same path."""
    # Named on every rank (the environment is the same): a refusal stops them all alike.
    run_dir = Path(model_dir) if model_dir else \
        Path(runs_root) / new_run_folder_name(name, os.environ, datetime.now())
    if dist_utils.is_main_process():
        run_dir.mkdir(parents=True, exist_ok=True)
    return Path(dist_utils.broadcast_object(str(run_dir) if dist_utils.is_main_process()
                                            else None))


def split_batch_or_refuse(train_params: Dict, world_size: int) -> tuple:
    """(micro-batch, accumulation steps) of the global batch, or a one-line ConfigError."""
    with alike_on_every_rank(dist_utils.get_rank()):
        try:
            return split_global_batch(int(train_params["batch_size"]), world_size,
                                      train_params["max_micro_batch"])
        except ValueError as error:
            raise ConfigError(f"train_params.batch_size: {error}") from None


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A seed of its own for each (seed, rank), well apart from other runs' seeds."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def seed_model_randomness(seed: int, rank: int) -> None:
    """Give each rank its own torch stream for the model's randomness (dropout masks), once the
    model is built and initialised alike on every rank: one stream for all would train V2X-ViT
    and CoBEVT with the same masks on every GPU. Data order and augmentation draw from
    (seed, epoch, index) generators of their own, so they stay the same for any rank count; a
    resume then restores each rank's saved stream."""
    torch.manual_seed(rank_seed(seed, rank))


def configure_cuda(perf: Dict) -> None:
    """TF32 and cudnn.benchmark from the resolved ``performance`` section, for training (and its
    validation) and for tools/eval.py alike: the same checkpoint then scores the same in both.
    Set on every machine (the switches are inert without CUDA), so CPU tests can see them."""
    torch.backends.cuda.matmul.allow_tf32 = perf["tf32"]
    torch.backends.cudnn.allow_tf32 = perf["tf32"]
    torch.backends.cudnn.benchmark = perf["cudnn_benchmark"]


def amp_settings(amp: Dict, device: torch.device):
    """(autocast dtype or None, GradScaler) of the resolved ``amp`` section. fp16 needs a
    scaler; bf16 does not."""
    if not amp["enabled"]:
        return None, torch.amp.GradScaler(device.type, enabled=False)
    if device.type != "cuda":
        # CPU autocast runs slower than fp32 for these convolutions: mixed precision is for GPUs.
        logger.info("amp.enabled ignored on %s: mixed precision is used on CUDA only", device)
        return None, torch.amp.GradScaler(device.type, enabled=False)
    dtype = AMP_DTYPES[amp["dtype"]]          # the schema allows exactly these names
    return dtype, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


# -- step budget -----------------------------------------------------------------------------

def step_budget(train_params: Dict, steps_per_epoch: int) -> tuple:
    """(epochs, total optimizer steps) of a run.

    ``train_params.max_steps`` (> 0) fixes the steps, so models whose epochs differ in length
    (late fusion trains per CAV) get the same optimizer steps; the run stops part-way through
    its last epoch when the budget ends there. Otherwise ``epoches`` whole epochs.
    """
    max_steps = train_params["max_steps"]
    if max_steps < 0:
        raise ConfigError(f"train_params.max_steps must be >= 0, got {max_steps}")
    if max_steps:
        return epochs_for_steps(max_steps, steps_per_epoch), max_steps
    epochs = int(train_params["epoches"])
    return epochs, epochs * steps_per_epoch


# -- data ------------------------------------------------------------------------------------

def build_validation_loaders(cfg: Dict, info: dist_utils.DistInfo, micro_batch: int, strategy):
    """(loss loader, AP loader) over the validation split of the run's ``strategy``, each
    sample once across ranks (unpadded shards); None without ``validate_dir``."""
    if not cfg.get("validate_dir"):
        return None
    ap_set = build_dataset(cfg, "validate", train=False, strategy=strategy)
    # The loss needs no visibility counts (AP does); its examples are what the strategy trains on.
    loss_set = build_dataset(cfg, "validate", train=False, strategy=strategy,
                             count_ego_points=False, **strategy.loss_dataset_args())
    workers = cfg["train_params"]["num_workers"]
    return tuple(
        build_loader(dataset, info.device, workers, batch_size=micro_batch,
                     sampler=InferenceSampler(len(dataset), info.rank, info.world_size))
        for dataset in (loss_set, ap_set))


# -- model -----------------------------------------------------------------------------------

def use_sync_batchnorm(info: dist_utils.DistInfo) -> bool:
    """SyncBN where its all_gather of batch statistics can run: CUDA with world > 1 (on CPU,
    torch's SyncBatchNorm refuses to run; BatchNorm stays plain, per rank)."""
    return info.device.type == "cuda" and info.world_size > 1


def init_settings(init: Dict) -> Dict:
    """Keyword arguments of ``init_weights`` from the resolved ``init`` section."""
    return {"method": init["method"], "cls_prior": init["cls_prior"]}


def make_ema(model: torch.nn.Module, ema_cfg: Dict) -> ModelEMA:
    """A fresh EMA of ``model`` with the ``ema`` section's decay and warm-up, enabled or not
    (tools/bench.py times one either way)."""
    return ModelEMA(model, decay=ema_cfg["decay"], tau=ema_cfg["tau"])


def build_ema(model: torch.nn.Module, ema_cfg: Dict, checkpoint: Dict | None) -> ModelEMA | None:
    """The EMA of ``model`` (before DDP wraps it) when the resolved ``ema`` section is
    enabled, resumed if saved."""
    if not ema_cfg["enabled"]:
        return None
    ema = make_ema(model, ema_cfg)
    if checkpoint is not None and checkpoint.get("ema") is not None:
        ema.load_state_dict(checkpoint["ema"])
    return ema


def ddp_settings(dist_cfg: Dict, info: dist_utils.DistInfo) -> Dict:
    """Keyword arguments of ``DistributedDataParallel`` for this run (the resolved
    ``distributed`` section)."""
    return {"device_ids": [info.device.index] if info.device.type == "cuda" else None,
            "find_unused_parameters": dist_cfg["find_unused_parameters"],
            "gradient_as_bucket_view": True}


def load_model_weights(model: torch.nn.Module, checkpoint: Dict | None, path) -> None:
    """Resume's model weights, after a check that lists mismatched keys and shapes."""
    if checkpoint is not None:
        check_state_dict_compatible(model, checkpoint["model"], path)
        model.load_state_dict(checkpoint["model"])


def prepare_model(cfg: Dict, info: dist_utils.DistInfo, checkpoint: Dict | None, ckpt_path):
    """(model to train: DDP-wrapped when distributed, model_without_ddp, EMA or None).

    The order matters: Xavier init before anything copies the weights; SyncBN conversion before
    the move to the device and before DDP; resume's weights before the EMA copies them; the
    ``train_params.fix_modules`` parts frozen before DDP (which then ignores them); DDP last,
    on the device, and the checkpoint saved from ``model_without_ddp`` (no ``module.`` prefix).
    """
    model = build_model(cfg["model"])
    init_weights(model, **init_settings(cfg["init"]))
    if checkpoint is None and cfg["init"]["checkpoint"]:   # a resume has its own weights
        load_base_weights(model, cfg["init"]["checkpoint"], cfg["train_params"]["fix_modules"])
    if use_sync_batchnorm(info):           # CUDA with world > 1
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(info.device)
    if cfg["performance"]["channels_last"]:   # before the EMA copies the weights' layout
        use_channels_last(model)
    load_model_weights(model, checkpoint, ckpt_path)
    # Before DDP wraps it: DDP registers only parameters that require gradients.
    freeze_parameters(model, cfg["train_params"]["fix_modules"])
    ema = build_ema(model, cfg["ema"], checkpoint)
    model_without_ddp = model
    if info.distributed:
        model = DistributedDataParallel(model, **ddp_settings(cfg["distributed"], info))
    return model, model_without_ddp, ema


def compile_for_training(model: torch.nn.Module, perf: Dict) -> torch.nn.Module:
    """``torch.compile(model)`` for training steps when the resolved ``performance`` section's
    ``compile`` is set, else ``model``.

    Compiled lazily, on the first step. Parameters are shared with ``model``, so checkpoints,
    the EMA and evaluation keep using the uncompiled ``model_without_ddp``. Without graph
    breaks only with ``performance.static_pillars`` (tests/test_static_step.py)."""
    if not perf["compile"]:
        return model
    logger.info("performance.compile: the training model is compiled on its first step")
    return torch.compile(model)


def build_training_parts(cfg: Dict, info: dist_utils.DistInfo, checkpoint: Dict | None = None,
                         ckpt_path=None, teacher: FrozenTeacher | None = None,
                         schedule: Tuple[int, int] | None = None,
                         strategy=None) -> TrainingParts:
    """What a training step uses, in §6.4's order: the model (prepare_model: resumed from
    ``checkpoint`` when given; compiled for the steps when ``performance.compile``), the task
    (forward + loss, with ``teacher``), the optimizer, the lr schedule over ``schedule`` =
    (total_steps, steps_per_epoch) (None: no schedule, the steps run at the optimizer's lr) and
    the AMP settings. Draws nothing from the random streams beyond prepare_model's init. The
    trainer and tools/bench.py both build their parts here."""
    model, model_without_ddp, ema = prepare_model(cfg, info, checkpoint, ckpt_path)
    model = compile_for_training(model, cfg["performance"])
    task = DetectionTask.from_config(cfg, info.device, teacher, strategy)
    # Frozen parameters (train_params.fix_modules) are not the optimizer's.
    optimizer = build_optimizer((param for param in model_without_ddp.parameters()
                                 if param.requires_grad), cfg["optimizer"])
    scheduler = (None if schedule is None
                 else build_scheduler(optimizer, cfg["lr_scheduler"], *schedule))
    amp_dtype, scaler = amp_settings(cfg["amp"], info.device)
    return TrainingParts(model, model_without_ddp, ema, optimizer, scheduler, scaler, amp_dtype,
                         task)


# -- knowledge distillation (DiscoNet) -------------------------------------------------------

def build_teacher(cfg: Dict, device: torch.device) -> FrozenTeacher | None:
    """The frozen early-fusion teacher of the resolved config's ``kd`` section, or None without
    one. The section (keys, weight) is checked by the schema, an intermediate-fusion student by
    the strategy (choose_strategy);
    the teacher's file (it exists, holds an early-fusion model of the student's grid) here,
    before any file is written, each a one-line error."""
    kd = cfg["kd"]
    if kd is None:
        return None
    return load_teacher(kd["teacher"], kd["weight"], cfg["preprocess"], device)


def distillation_dataset_args(teacher: FrozenTeacher | None) -> Dict:
    """build_dataset keywords: with a teacher, each training sample also carries the
    early-fusion input of the same index (the teacher's view)."""
    return {"with_early_fusion": True} if teacher is not None else {}


# -- validation ------------------------------------------------------------------------------

def first_sample_picture(bev_range, pictures: list):
    """on_sample hook: rank 0 renders its first validation sample (points, GT, detections)
    over ``bev_range`` [xmin, ymin, zmin, xmax, ymax, zmax]."""
    if not dist_utils.is_main_process():
        return None
    from opencood.eval.vis import frame_title, render_detection_sample

    def on_sample(key, batch, row, boxes, scores, classes=None):
        if not pictures:
            pictures.append(render_detection_sample(batch, row, boxes, bev_range,
                                                    frame_title(key)))

    return on_sample


def validate(model_for_eval, val_loaders, task: DetectionTask, info, amp_dtype, cfg, epoch):
    """Validation loss (exact over ranks) every epoch; AP every ``eval_freq`` epochs, both with
    the task's validation preparer (``max_voxel_test``).

    Returns ({"loss", and "ap_30/50/70", "ap_50_ego_occluded" on rank 0 when computed},
    samples in the loss,
    [a BEV picture (H, W, 3) BGR of the first sample when AP was computed, on rank 0]).
    """
    loss_loader, ap_loader = val_loaders
    loss, count = validation_loss(model_for_eval, loss_loader, task.validation_loss, info.device,
                                  amp_dtype)
    results, pictures = {"loss": loss}, []
    eval_freq = cfg["train_params"]["eval_freq"]
    if epoch % eval_freq == 0:
        picture = first_sample_picture(cfg["preprocess"]["cav_lidar_range"], pictures)
        metrics = evaluate_loader(model_for_eval, ap_loader, task.eval_preparer, info.device,
                                  task.strategy, on_sample=picture,
                                  class_names=detection_class_names(cfg["postprocess"]))
        if metrics is not None:
            results.update({k: metrics[k] for k in ("ap_30", "ap_50", "ap_70")})
            if "visibility" in metrics:
                # The cars only other agents see: the curve that shows cooperation working.
                results["ap_50_ego_occluded"] = metrics["visibility"]["ego-occluded"]["ap_50"]
    return results, count, pictures


# -- logging ---------------------------------------------------------------------------------

class ScalarLogger:
    """TensorBoard scalars on rank 0 (no-op elsewhere)."""

    def __init__(self, run_dir: Path, resume_step: int | None = None):
        self.writer = None
        if dist_utils.is_main_process():
            from torch.utils.tensorboard import SummaryWriter
            # A resumed run drops what the interrupted one logged after its checkpoint: those
            # steps run again, and the curves must not hold them twice.
            purge = resume_step + 1 if resume_step is not None else None
            self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge)

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


def progress_bar(total: int, epoch: int, done: int = 0):
    if not dist_utils.is_main_process():
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=done, desc=f"epoch {epoch}", unit="step",
                dynamic_ncols=True, leave=False)


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
