#!/usr/bin/env python
"""Training-step, data-loader, pillarisation, EMA and evaluation timings as JSON lines.

    python tools/bench.py [--hypes_yaml hypes_yaml/opv2v/point_pillar_attfuse.yaml]
                          [--device cuda|cpu] [--steps N] [--warmup N] [--data DIR]
                          [--num_workers N] [--threads N] [--quick]

Stdout holds nothing but JSON, one line per figure; logs go to stderr. Default geometry: the
yaml's BEV grid (704 x 200 for the OPV2V configs), batch 2 per GPU, 3 agents (CAVs) per sample,
16,000 non-empty pillars per agent (``opencood.utils.fake_batch``: no data set needed).

How to read a line
    ``ms`` is the MEDIAN over ``--steps`` timed repetitions after ``--warmup`` untimed ones
    (``ms_min``/``ms_max`` show the spread); on CUDA every timed region is bracketed by
    ``torch.cuda.synchronize``. ``amp`` is the autocast dtype the figure ran under: the
    training-step figures follow the yaml's ``amp`` section on CUDA (as tools/train.py) and run
    fp32 on CPU; the other figures are fp32 (``amp_yaml`` says what the yaml asks for).
    ``includes`` lists what a training figure contains. A figure that cannot run here is
    ``{"figure": ..., "skipped": "reason"}``; one that failed is ``{"figure": ..., "error": ...}``
    (and the exit status is 1).

Figures
    pillarise                 ms per batch: the batch already on the device -> pillars
                              (``BatchPreparer.model_inputs``).
    targets                   ms per batch: anchor target assignment (``BatchPreparer.targets``).
    train_step_model_only     ms per optimiser step, inputs already on the device: pillarise +
                              targets + forward + loss + backward + clip + optimiser step
                              (``opencood.engine.loop.optimizer_step``), EMA not included.
    train_step_no_pillarise   the same step with pillars and targets computed once beforehand:
                              forward + loss + backward + clip + optimiser step.
    peak_gpu_memory           torch.cuda.max_memory_allocated over train_step_model_only (MiB).
    ema_update                ms per ``ModelEMA.update``; ``share_of_step_pct`` is its share of a
                              step that includes it: ema / (train_step_model_only + ema).
    eval_postprocess_per_frame  ms per frame of decode + rotated NMS (device) + AP accumulation
                              (matching and AP over ``eval_frames`` frames, CPU), on synthetic
                              head outputs with detections around the GT boxes (a randomly
                              initialised model detects nothing, which would time nothing).
    eval_inference_per_frame  ms per frame of what ``tools/eval.py`` times for frames/s:
                              pillarise + forward (eval mode, fp32) + decode + NMS.
    dataloader                samples/s of the training DataLoader over ``--data`` (workers,
                              augmentation, collate), never kept waiting; ``ms`` is the mean
                              time per batch. Timed over whole waves of ``num_workers`` batches
                              after the first wave (worker start-up: ``first_wave_s``). Clouds
                              are read through opencood's point cache: a cold cache (the first
                              run over a folder) includes PCD parsing.
    train_step_end_to_end     ms per step from files: wait for the next batch + the model step
                              + EMA when the yaml enables it (as tools/train.py), with
                              ``data_wait_ms`` (the loader's share) and the measured agents and
                              pillars per agent of the real batches.

CPU figures on a machine shared with other jobs are noisy: torch's OpenMP threads then wait for
each other on every op, which can make short ops (the EMA update) 10-50x slower than with
``--threads 1``. Compare figures only between lines with the same ``device_name``.

``--quick`` uses ``hypes_yaml/synthetic/smoke.yaml`` (unless ``--hypes_yaml`` is given), a few
hundred pillars, 2 timed steps and 1 warm-up: it checks the script in seconds on a CPU, its
numbers mean nothing.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

from opencood.errors import OpencoodError

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_YAML = REPO_ROOT / "hypes_yaml" / "opv2v" / "point_pillar_attfuse.yaml"
QUICK_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"

FIGURES = ("pillarise", "targets", "train_step_model_only", "train_step_no_pillarise",
           "peak_gpu_memory", "ema_update", "eval_postprocess_per_frame",
           "eval_inference_per_frame", "dataloader", "train_step_end_to_end")

STEP_PARTS = ["pillarise", "targets", "forward", "loss", "backward", "grad_clip",
              "optimizer_step"]

logger = logging.getLogger("opencood.bench")


class BenchError(OpencoodError):
    """A bad command line or input: printed as one ``error: ...`` line."""


# -- command line ------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Benchmark training, data loading and evaluation; one JSON line per figure.")
    parser.add_argument("--hypes_yaml", "-y", default=None,
                        help=f"config (default {DEFAULT_YAML.relative_to(REPO_ROOT)}; "
                             f"with --quick {QUICK_YAML.relative_to(REPO_ROOT)})")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed repetitions (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed repetitions (default 3)")
    parser.add_argument("--batch_size", type=int, default=None, help="samples per GPU (default 2)")
    parser.add_argument("--agents", type=int, default=None, help="agents per sample (default 3)")
    parser.add_argument("--pillars", type=int, default=None,
                        help="non-empty pillars per agent (default 16000)")
    parser.add_argument("--points_per_pillar", type=int, default=6)
    parser.add_argument("--gt_boxes", type=int, default=None,
                        help="GT boxes per sample of the fake batch (default 20)")
    parser.add_argument("--data", default=None,
                        help="OPV2V-format folder (a root with train/, or a split folder) for "
                             "the data-loader and end-to-end figures")
    parser.add_argument("--num_workers", type=int, default=None,
                        help="DataLoader workers (default: the yaml's train_params.num_workers)")
    parser.add_argument("--loader_batches", type=int, default=None,
                        help="batches timed for the data-loader figure (default 30)")
    parser.add_argument("--eval_frames", type=int, default=None,
                        help="frames per AP accumulation (default 64)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke geometry, 2 steps: checks the script in seconds")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {"steps": 2 if quick else 10, "warmup": 1 if quick else 3, "batch_size": 2,
                "agents": 3, "pillars": 300 if quick else 16000, "gt_boxes": 5 if quick else 20,
                "loader_batches": 2 if quick else 30, "eval_frames": 4 if quick else 64}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.hypes_yaml is None:
        args.hypes_yaml = str(QUICK_YAML if quick else DEFAULT_YAML)
    for name in ("steps", "batch_size", "agents", "pillars", "points_per_pillar", "gt_boxes",
                 "loader_batches", "eval_frames"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0, got {args.warmup}")
    if args.threads is not None and args.threads < 1:
        raise BenchError(f"--threads must be at least 1, got {args.threads}")
    if args.num_workers is not None and args.num_workers < 0:
        raise BenchError(f"--num_workers must be >= 0, got {args.num_workers}")
    return args


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise BenchError("--device cuda: CUDA is not available (use --device cpu)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_split_dir(data: str) -> Path:
    """--data is an OPV2V root (with train/) or one split folder; either must hold frames."""
    path = Path(data).expanduser()
    if not path.is_dir():
        raise BenchError(f"--data {data}: no such folder")
    split = path / "train" if (path / "train").is_dir() else path
    if not any(split.glob("*/*/*.pcd")):
        raise BenchError(f"--data {data}: no OPV2V frames (<scenario>/<cav>/<ts>.pcd) in {split}")
    return split


# -- timing ------------------------------------------------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn: Callable[[], object], steps: int, warmup: int,
               device: torch.device) -> List[float]:
    """Milliseconds of each of ``steps`` calls after ``warmup`` untimed ones (device-synced)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summarise(times_ms: List[float], scale: float = 1.0) -> Dict:
    """Median (and spread) of millisecond timings, each divided by ``scale``."""
    values = [t / scale for t in times_ms]
    return {"ms": round(statistics.median(values), 3), "ms_min": round(min(values), 3),
            "ms_max": round(max(values), 3)}


def display_path(path) -> str:
    """``path`` relative to the repository when inside it (shorter lines), else as given."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def emit(record: Dict) -> None:
    print(json.dumps(record), flush=True)


# -- set-up ------------------------------------------------------------------------------------

class Bench:
    """Everything the figures share: config, device, model, optimiser, a fake batch."""

    def __init__(self, args, cfg: Dict, device: torch.device):
        from opencood.data.pipeline import BatchPreparer
        from opencood.engine.optim import build_optimizer
        from opencood.engine.trainer import (amp_settings, configure_cuda, make_loss_fn,
                                             prepare_model)
        from opencood.losses import build_loss
        from opencood.ops.voxelize import grid_size
        from opencood.utils.dist import DistInfo
        from opencood.utils.fake_batch import fake_collated_batch

        self.args, self.cfg, self.device = args, cfg, device
        torch.manual_seed(int(cfg.get("seed", 0)))
        configure_cuda(cfg)
        self.single_agent = cfg["model"]["core_method"] == "point_pillar"
        self.agents = 1 if self.single_agent else args.agents
        self.batch_size = args.batch_size
        info = DistInfo(0, 1, 0, False, None, device)
        self.model, self.model_without_ddp, self.ema = prepare_model(cfg, info, None, None)
        self.model.train()
        self.preparer = BatchPreparer.from_config(cfg, device)
        self.criterion = build_loss(cfg["loss"]).to(device)
        self.loss_fn = make_loss_fn(self.preparer, self.criterion)
        self.optimizer = build_optimizer(self.model_without_ddp.parameters(), cfg["optimizer"])
        amp_cfg = cfg.get("amp", {}) or {}
        self.amp_yaml = str(amp_cfg.get("dtype", "bf16")) if amp_cfg.get("enabled") else "off"
        if device.type == "cuda":
            self.amp_dtype, self.scaler = amp_settings(cfg, device)
        else:  # AMP is a GPU setting; on CPU the bench runs fp32 (amp_yaml still says the yaml)
            self.amp_dtype, self.scaler = None, torch.amp.GradScaler("cpu", enabled=False)
        self.grad_clip = cfg["train_params"].get("grad_clip")
        nx, ny, _ = grid_size(cfg["preprocess"]["cav_lidar_range"],
                              cfg["preprocess"]["args"]["voxel_size"])
        self.grid = f"{nx}x{ny}"
        cpu_batch = fake_collated_batch(cfg, self.batch_size, args.agents, args.pillars,
                                        points_per_pillar=args.points_per_pillar,
                                        max_gt=args.gt_boxes,
                                        single_agent=self.single_agent,
                                        seed=int(cfg.get("seed", 0)))
        self.batch = {key: value.to(device) if torch.is_tensor(value) else value
                      for key, value in cpu_batch.items()}
        synchronize(device)
        perf = cfg.get("performance", {}) or {}
        self.common = {
            "device": device.type,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else f"cpu ({torch.get_num_threads()} threads)"),
            "config": display_path(args.hypes_yaml),
            "grid": self.grid,
            "batch_per_gpu": self.batch_size,
            "agents": self.agents,
            "pillars_per_agent": min(args.pillars, nx * ny),
            "amp_yaml": self.amp_yaml,
            "tf32": bool(perf.get("tf32", True)) if device.type == "cuda" else None,
            "steps": args.steps,
            "warmup": args.warmup,
        }

    def record(self, figure: str, autocast: bool = False, **values) -> Dict:
        """One figure's line; ``autocast``: the figure ran under the training AMP setting
        (``amp`` is then that dtype, else "off": pillarisation, EMA and evaluation run fp32)."""
        amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.amp_dtype, "off")
        return {"figure": figure, **values, **self.common, "amp": amp if autocast else "off"}

    def train_step(self, batch, loss_fn) -> Dict:
        from opencood.engine.loop import optimizer_step
        return optimizer_step(self.model, [batch], loss_fn, self.optimizer, self.scaler,
                              self.device, self.amp_dtype, self.grad_clip, where="bench")

    def make_ema(self):
        if self.ema is not None:
            return self.ema
        from opencood.utils.ema import ModelEMA
        ema_cfg = self.cfg.get("ema", {}) or {}
        return ModelEMA(self.model_without_ddp, decay=float(ema_cfg.get("decay", 0.999)),
                        tau=float(ema_cfg.get("tau", 200)))


# -- figures -----------------------------------------------------------------------------------

def bench_pillarise(bench: Bench) -> List[Dict]:
    args, device = bench.args, bench.device
    inputs = bench.preparer.model_inputs(bench.batch)
    pillars = int(inputs["voxel_coords"].shape[0])
    points = int(bench.batch["points"].shape[0])
    times = time_calls(lambda: bench.preparer.model_inputs(bench.batch), args.steps,
                       args.warmup, device)
    records = [bench.record("pillarise", **summarise(times), points=points, pillars=pillars)]
    gt = int(bench.batch["gt_mask"].sum())
    times = time_calls(lambda: bench.preparer.targets(bench.batch), args.steps, args.warmup,
                       device)
    anchors = int(bench.preparer.anchors[..., 0].numel())
    records.append(bench.record("targets", **summarise(times), anchors_per_sample=anchors,
                                gt_boxes=gt))
    return records


def bench_train_steps(bench: Bench, results: Dict) -> List[Dict]:
    args, device = bench.args, bench.device
    records = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []

    def full_step():
        losses.append(bench.train_step(bench.batch, bench.loss_fn)["loss"])

    times = time_calls(full_step, args.steps, args.warmup, device)
    results["train_step_model_only"] = statistics.median(times)
    records.append(bench.record("train_step_model_only", autocast=True, **summarise(times),
                                includes=STEP_PARTS, last_loss=round(losses[-1], 5),
                                cudnn_benchmark=(torch.backends.cudnn.benchmark
                                                 if device.type == "cuda" else None)))
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        records.append(bench.record("peak_gpu_memory", mib=round(peak / 2**20, 1),
                                    reserved_mib=round(reserved / 2**20, 1),
                                    during="train_step_model_only"))
    else:
        records.append({"figure": "peak_gpu_memory", "skipped": "not on CUDA",
                        "device": device.type})

    with torch.no_grad():
        inputs, targets = bench.preparer(bench.batch)

    def prepared_loss_fn(model, _batch):
        outputs = model(dict(inputs))
        loss, terms = bench.criterion(outputs, targets)
        return loss, {name: float(value) for name, value in terms.items()}, bench.batch_size

    times = time_calls(lambda: bench.train_step(None, prepared_loss_fn), args.steps,
                       args.warmup, device)
    records.append(bench.record("train_step_no_pillarise", autocast=True, **summarise(times),
                                includes=[p for p in STEP_PARTS
                                          if p not in ("pillarise", "targets")]))
    return records


def bench_ema(bench: Bench, results: Dict) -> List[Dict]:
    ema = bench.make_ema()
    times = time_calls(lambda: ema.update(bench.model_without_ddp), bench.args.steps,
                       bench.args.warmup, bench.device)
    ema_ms = statistics.median(times)
    step_ms = results.get("train_step_model_only")
    share = round(100.0 * ema_ms / (step_ms + ema_ms), 2) if step_ms else None
    tensors = sum(1 for t in ema.module.state_dict().values() if t.dtype.is_floating_point)
    return [bench.record("ema_update", **summarise(times), share_of_step_pct=share,
                         float_tensors=tensors, enabled_in_yaml=bench.ema is not None)]


def fake_head_outputs(bench: Bench, seed: int = 0) -> Dict:
    """Head maps as a trained detector would give: in the 3x3 feature cells around every GT
    centre, every anchor is confident and regresses (with a little noise) to that GT; plus a
    sprinkle of false positives elsewhere. Decoding and NMS then face realistic candidates."""
    anchors = bench.preparer.anchors.cpu()               # (H, W, A, 7)
    coder = bench.preparer.box_coder
    height, width, num_anchors, _ = anchors.shape
    lidar_range = bench.preparer.lidar_range
    generator = torch.Generator().manual_seed(seed)
    size = bench.batch_size
    cls = torch.full((size, height, width, num_anchors), -8.0)
    false_positive = torch.rand(cls.shape, generator=generator) < 1e-4
    cls[false_positive] = 0.0
    reg = torch.randn(size, height, width, num_anchors, 7, generator=generator) * 0.05
    direction = torch.zeros(size, height, width, num_anchors, 2)
    step_x = (lidar_range[3] - lidar_range[0]) / width
    step_y = (lidar_range[4] - lidar_range[1]) / height
    gt_boxes, gt_mask = bench.batch["gt_boxes"].cpu(), bench.batch["gt_mask"].cpu()
    for sample in range(size):
        boxes = gt_boxes[sample][gt_mask[sample]]
        cell_x = ((boxes[:, 0] - lidar_range[0]) / step_x).long()
        cell_y = ((boxes[:, 1] - lidar_range[1]) / step_y).long()
        bins = coder.direction_targets(boxes[:, 6])
        for dy in (-1, 0, 1):
            for dx in (-1, 0, 1):
                ys = (cell_y + dy).clamp(0, height - 1)
                xs = (cell_x + dx).clamp(0, width - 1)
                count = ys.shape[0]
                cls[sample, ys, xs] = torch.rand(count, num_anchors, generator=generator) * 3.0
                deltas = coder.encode(boxes[:, None, :], anchors[ys, xs])
                noise = torch.randn(deltas.shape, generator=generator) * 0.02
                reg[sample, ys, xs] = deltas + noise
                direction[sample, ys, xs] = torch.nn.functional.one_hot(
                    bins, 2).float()[:, None, :].expand(-1, num_anchors, -1) * 3.0

    def head_layout(maps):  # (B, H, W, A, k) -> (B, A*k, H, W), channel a * k + j
        return maps.reshape(size, height, width, -1).permute(0, 3, 1, 2).contiguous()

    device = bench.device
    return {"cls_preds": head_layout(cls[..., None]).to(device),
            "reg_preds": head_layout(reg).to(device),
            "dir_preds": head_layout(direction).to(device),
            "comm_bytes": torch.zeros(size, device=device)}


def bench_eval(bench: Bench) -> List[Dict]:
    from opencood.eval.ap import APAccumulator
    from opencood.eval.inference import (detections_per_sample, late_model_inputs,
                                         postprocess_settings)
    args, device, cfg = bench.args, bench.device, bench.cfg
    settings = postprocess_settings(cfg)
    late = cfg["fusion"]["core_method"] == "late"
    records = []

    # Post-processing on synthetic head outputs (decode + NMS on the device, AP on the CPU).
    outputs = fake_head_outputs(bench, seed=int(cfg.get("seed", 0)))
    # The synthetic maps are per sample, in the ego frame: no per-agent (late) step here.
    decode_inputs = {"record_len": bench.batch["record_len"],
                     "transforms_to_ego": bench.batch["transforms_to_ego"]}
    detections = []

    def decode_nms():
        detections[:] = detections_per_sample(outputs, decode_inputs, bench.preparer, settings,
                                              late=False)

    times = time_calls(decode_nms, args.steps, args.warmup, device)
    decode_ms = statistics.median(times) / bench.batch_size
    per_frame = [(boxes.float().cpu(), scores.float().cpu()) for boxes, scores, _ in detections]
    gts = [bench.batch["gt_boxes"][row][bench.batch["gt_mask"][row]].cpu()
           for row in range(bench.batch_size)]
    frames = args.eval_frames
    last_metrics = {}

    def accumulate_ap():
        accumulator = APAccumulator(order=settings["order"])
        for frame in range(frames):
            boxes, scores = per_frame[frame % len(per_frame)]
            accumulator.add_frame(boxes, scores, gts[frame % len(gts)],
                                  sample_key=("bench", f"{frame:06d}"))
        last_metrics.update(accumulator.compute())

    times = time_calls(accumulate_ap, args.steps, args.warmup, torch.device("cpu"))
    ap_ms = statistics.median(times) / frames
    record = bench.record(
        "eval_postprocess_per_frame", ms=round(decode_ms + ap_ms, 3),
        decode_nms_ms=round(decode_ms, 3), ap_ms=round(ap_ms, 3), eval_frames=frames,
        detections_per_frame=round(sum(len(s) for _, s in per_frame) / len(per_frame), 1),
        gt_per_frame=round(sum(len(g) for g in gts) / len(gts), 1),
        ap_50=round(float(last_metrics.get("ap_50", float("nan"))), 4),
        includes=["decode", "rotated_nms", "ap_matching", "ap_compute"],
        outputs="synthetic head maps (detections near the GT)")
    records.append(record)

    # What tools/eval.py times per batch: pillarise + forward + decode + NMS (fp32, eval mode).
    model = bench.model_without_ddp
    model.eval()
    counts = []

    @torch.no_grad()
    def inference():
        inputs, _ = bench.preparer(bench.batch, with_targets=False)
        outputs = model(late_model_inputs(inputs) if late else inputs)
        results = detections_per_sample(outputs, inputs, bench.preparer, settings, late)
        counts.append(sum(int(r[1].shape[0]) for r in results))

    try:
        times = time_calls(inference, args.steps, args.warmup, device)
    finally:
        model.train()
    record = bench.record("eval_inference_per_frame", **summarise(times, bench.batch_size),
                          includes=["pillarise", "forward", "decode", "rotated_nms"],
                          detections_per_frame=round(counts[-1] / bench.batch_size, 1),
                          note="untrained weights: few or no detections, NMS is nearly free")
    records.append(record)
    return records


def build_bench_loader(bench: Bench, split_dir: Path, batches: int, workers: int):
    """The training DataLoader of tools/train.py over ``split_dir``, drawing ``batches``
    batches (several epochs' worth if the split is small) without restarting its workers."""
    from opencood.data.collate import collate_samples, seed_worker
    from opencood.data.datasets import build_dataset
    cfg = dict(bench.cfg, root_dir=str(split_dir))
    dataset = build_dataset(cfg, "train", train=True)
    if len(dataset) == 0:
        raise BenchError(f"--data: no samples in {split_dir}")
    generator = torch.Generator().manual_seed(int(cfg.get("seed", 0)))
    sampler = torch.utils.data.RandomSampler(dataset, num_samples=batches * bench.batch_size,
                                             generator=generator)
    batch_sampler = torch.utils.data.BatchSampler(sampler, bench.batch_size, drop_last=True)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=batch_sampler, num_workers=workers, collate_fn=collate_samples,
        worker_init_fn=seed_worker, pin_memory=bench.device.type == "cuda")
    return dataset, loader


def bench_loader(bench: Bench, split_dir: Path, workers: int) -> List[Dict]:
    """Steady-state throughput of a loader that is never kept waiting.

    ``W`` workers start together and deliver their batches in waves of ``W``; the clock runs
    from the end of one wave to the end of a later one (the first wave, with worker start-up,
    is ``first_wave_s``), so a partial wave or prefetched batches do not bias the rate."""
    args = bench.args
    wave = max(workers, 1)
    warm = max(args.warmup, 1)
    warm = -(-warm // wave) * wave                       # whole waves, at least the first
    timed = -(-args.loader_batches // wave) * wave
    dataset, loader = build_bench_loader(bench, split_dir, warm + timed, workers)
    iterator = iter(loader)
    start = time.perf_counter()
    for _ in range(warm):
        next(iterator)
    first_wave_s = time.perf_counter() - start
    per_batch, agents, points = [], 0, 0
    start = time.perf_counter()
    for _ in range(timed):
        tick = time.perf_counter()
        batch = next(iterator)
        per_batch.append((time.perf_counter() - tick) * 1e3)
        agents += int(batch["record_len"].sum())
        points += int(batch["points"].shape[0])
    elapsed = time.perf_counter() - start
    del iterator
    record = bench.record("dataloader", samples_per_s=round(timed * bench.batch_size / elapsed, 2),
                          ms=round(elapsed * 1e3 / timed, 3),
                          ms_per_batch_median=summarise(per_batch)["ms"], num_workers=workers,
                          timed_batches=timed, warmup_batches=warm,
                          first_wave_s=round(first_wave_s, 3), dataset_samples=len(dataset),
                          data=str(split_dir))
    # Measured on the real samples (the fake batch's pillar count means nothing here).
    record.pop("pillars_per_agent")
    record.update(agents=round(agents / (timed * bench.batch_size), 2),
                  points_per_agent=round(points / max(agents, 1), 1))
    return [record]


def bench_end_to_end(bench: Bench, split_dir: Path, workers: int) -> List[Dict]:
    args, device = bench.args, bench.device
    _, loader = build_bench_loader(bench, split_dir, args.warmup + args.steps, workers)
    ema = bench.ema
    seen = {"agents": 0, "pillars": 0}

    def counting_loss_fn(model, batch):
        inputs, targets = bench.preparer(batch)
        seen["agents"] += int(batch["record_len"].sum())
        seen["pillars"] += int(inputs["voxel_coords"].shape[0])
        outputs = model(inputs)
        loss, terms = bench.criterion(outputs, targets)
        return loss, {name: float(value) for name, value in terms.items()}, len(batch["record_len"])

    iterator = iter(loader)
    step_ms, wait_ms = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            seen.update(agents=0, pillars=0)
        synchronize(device)
        start = time.perf_counter()
        batch = next(iterator)
        waited = time.perf_counter() - start
        bench.train_step(batch, counting_loss_fn)
        if ema is not None:
            ema.update(bench.model_without_ddp)
        synchronize(device)
        if index >= args.warmup:
            step_ms.append((time.perf_counter() - start) * 1e3)
            wait_ms.append(waited * 1e3)
    del iterator
    includes = ["data_wait", "host_to_device"] + STEP_PARTS + (["ema"] if ema else [])
    agents = seen["agents"] / args.steps / bench.batch_size
    pillars = seen["pillars"] / max(seen["agents"], 1)
    record = bench.record("train_step_end_to_end", autocast=True, **summarise(step_ms),
                          data_wait_ms=round(statistics.median(wait_ms), 3),
                          num_workers=workers, includes=includes, data=str(split_dir))
    record.update(agents=round(agents, 2), pillars_per_agent=round(pillars, 1))
    return [record]


# -- main --------------------------------------------------------------------------------------

def run(args) -> List[Dict]:
    from opencood.config import ConfigError, load_config
    try:
        cfg = load_config(args.hypes_yaml, args.overrides)
    except ConfigError as error:
        raise BenchError(str(error)) from None
    device = resolve_device(args.device)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    split_dir = resolve_split_dir(args.data) if args.data is not None else None
    workers = (args.num_workers if args.num_workers is not None
               else int(cfg.get("train_params", {}).get("num_workers", 2)))
    logger.info("bench: %s on %s, steps %d, warm-up %d", args.hypes_yaml, device, args.steps,
                args.warmup)
    bench = Bench(args, cfg, device)
    results: Dict[str, float] = {}
    records: List[Dict] = []
    no_data = "no --data folder given"
    plan = [
        (("pillarise", "targets"), lambda: bench_pillarise(bench)),
        # Before any training step: a few steps on random data can make the model fire on
        # thousands of anchors, and the NMS time of eval_inference_per_frame with it.
        (("eval_postprocess_per_frame", "eval_inference_per_frame"), lambda: bench_eval(bench)),
        (("train_step_model_only", "peak_gpu_memory", "train_step_no_pillarise"),
         lambda: bench_train_steps(bench, results)),
        (("ema_update",), lambda: bench_ema(bench, results)),
        (("dataloader",), lambda: bench_loader(bench, split_dir, workers) if split_dir else None),
        (("train_step_end_to_end",),
         lambda: bench_end_to_end(bench, split_dir, workers) if split_dir else None),
    ]
    for figures, measure in plan:
        logger.info("measuring %s", ", ".join(figures))
        try:
            produced = measure()
        except BenchError:
            raise
        except Exception as error:  # one broken figure must not hide the others
            logger.exception("%s failed", figures[0])
            produced = [{"figure": name, "error": f"{type(error).__name__}: {error}"}
                        for name in figures]
        if produced is None:
            produced = [{"figure": name, "skipped": no_data} for name in figures]
        for record in produced:
            emit(record)
        records.extend(produced)
    return records


def main(argv=None) -> List[Dict]:
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(message)s")
    try:
        args = parse_args(argv)
        records = run(args)
    except BenchError as error:
        raise SystemExit(f"error: {error}") from None
    if any("error" in record for record in records):
        raise SystemExit(1)
    return records


if __name__ == "__main__":
    main()
