#!/usr/bin/env python
"""The benchmark suite: every timing figure of opencood, one JSON line each.

    python tools/bench.py [--list] [--figures NAME[,NAME...]] [--preset quick|lite|opv2v]
                          [--device cuda|cpu] [--hypes_yaml X.yaml] [--set KEY=VALUE]
                          [--data DIR] [--num_workers N] [--steps N] [--warmup N] [--threads N]
                          [--static_pillars N] [--sync_free] [--compile] [--cuda_graph]

``--list`` names every figure and what it measures; ``--figures`` picks some (default: all).
Stdout holds nothing but JSON, one line per figure; the plan and the logs go to stderr.

Presets: the config and the sizes of a run (single flags override them).
    opv2v   the OPV2V geometry: 704 x 200 grid, batch 2 x 3 agents, 16,000 pillars per agent.
            The default on CUDA (about 7 minutes on a 2-core CPU).
    lite    the synthetic lite model and geometry (128 x 64 grid, 2,000 pillars per agent):
            the default on CPU, about 20 s on 2 cores.
    quick   the smoke config, a few hundred pillars, 2 steps (``--quick`` for short): checks the
            script in seconds; its numbers mean nothing.
Before measuring, the plan (figures, preset, sizes and roughly how long) goes to stderr.

How to read a line
    ``ms`` is the MEDIAN over ``steps`` timed repetitions after ``warmup`` untimed ones
    (``ms_min``/``ms_max`` show the spread); on CUDA every timed region is bracketed by
    ``torch.cuda.synchronize``. ``amp`` is the autocast dtype the figure ran under: the
    training-step figures follow the yaml's ``amp`` section on CUDA (as training does) and run
    fp32 on CPU; the other figures are fp32 (``amp_yaml`` says what the yaml asks for).
    A speed ratio compares ours with a reference ON THE SAME INPUT IN THE SAME RUN:
    ``reference_ms`` is one run of the reference the line names (``reference``), ``speedup`` is
    reference_ms / ms. The plain-Python references are those of
    opencood/testing/reference_impls.py, the definitions the tests prove our code equal to on
    random inputs (imported from there, so the ratio is against checked code, not an unchecked
    copy here).
    A figure that cannot run here is ``{"figure": ..., "skipped": "reason"}``; one that failed is
    ``{"figure": ..., "error": ...}`` (and the exit status is 1). Bad input (a missing file, an
    unknown model or figure) is one ``error: ...`` line on stderr and exit status 1.

The fast step path (docs/gpu_and_speed.md "Fast step path"): ``--static_pillars N``, ``--sync_free`` and
``--compile`` set ``performance.static_pillars``, ``sync_free_step`` and ``compile`` (as
``--set`` would; ``--cuda_graph``: ``performance.cuda_graph``, the step figures replay one
captured CUDA graph), and every model figure's line states them; compare a run with them against
one without on the same device. ``host_syncs_per_step`` counts what makes the host wait in one
eager training step (opencood.utils.host_syncs); ``operators_per_step`` the operators it
dispatches, by phase (opencood.utils.op_counts): a launch-bound GPU step costs host time per
operator, so this CPU count judges a change's launch cost without a GPU (the optimizer phase
runs torch's per-tensor loop on CPU, a fused kernel on CUDA).

CPU figures on a machine shared with other jobs are noisy: torch's OpenMP threads then wait for
each other on every op, which can make short ops (the EMA update) 10-50x slower than with
``--threads 1``. Compare figures only between lines with the same ``device_name``.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from opencood.errors import OpencoodError, run_cli

REPO_ROOT = Path(__file__).resolve().parents[1]
STEP_PARTS = ["pillarise", "targets", "forward", "loss", "backward", "grad_clip",
              "optimizer_step"]
AP_THRESHOLDS = (0.3, 0.5, 0.7)

logger = logging.getLogger("opencood.bench")


class BenchError(OpencoodError):
    """A bad command line or input: printed as one ``error: ...`` line."""


class Preset(NamedTuple):
    """The config and sizes of one kind of run; ``cpu_seconds``: how long each figure (and the
    start-up, "setup") took in it on a 2-core CPU, for the estimate printed before a run."""
    hypes_yaml: str
    steps: int
    warmup: int
    pillars: int              # non-empty pillars per agent of the fake batch
    gt_boxes: int             # GT boxes per sample of the fake batch
    loader_batches: int
    eval_frames: int          # frames per AP accumulation of eval_postprocess_per_frame
    ap_frames: int            # random frames of the ap figure (30 GT, 50 detections each)
    iou_pairs: int
    visibility_points: int
    pcd_points: int
    cpu_seconds: Dict[str, float]
    camera_yaml: str = "hypes_yaml/synthetic/camera_base.yaml"   # the camera figures' config
    camera_frames: int = 3    # frames of the tiny split the camera_loader_ms figure writes


PRESETS = {
    "quick": Preset("hypes_yaml/synthetic/smoke.yaml", steps=2, warmup=1, pillars=300,
                    gt_boxes=5, loader_batches=2, eval_frames=4, ap_frames=4, iou_pairs=200,
                    visibility_points=2_000, pcd_points=2_000,
                    cpu_seconds={"setup": 4, "pillarise": 0.2, "train_step_model_only": 0.1,
                                 "host_syncs_per_step": 0.2, "operators_per_step": 0.2,
                                 "train_step_no_pillarise": 0.1, "ap": 0.1, "pcd": 1,
                                 "loader_by_format": 3, "camera_loader_ms": 3,
                                 "lss_forward_backward_ms": 2},
                    camera_yaml="hypes_yaml/synthetic/camera_small.yaml", camera_frames=1),
    "lite": Preset("hypes_yaml/synthetic/point_pillar_attfuse.yaml", steps=10, warmup=3,
                   pillars=2_000, gt_boxes=10, loader_batches=20, eval_frames=64, ap_frames=100,
                   iou_pairs=20_000, visibility_points=105_000, pcd_points=120_000,
                   cpu_seconds={"setup": 5, "pillarise": 0.6, "targets": 0.2, "profile": 0.1,
                                "eval_postprocess_per_frame": 0.4,
                                "eval_inference_per_frame": 1.2, "train_step_model_only": 2.6,
                                "host_syncs_per_step": 0.6, "operators_per_step": 0.6,
                                "train_step_no_pillarise": 2.5, "bev_iou": 1.3, "ap": 2.0,
                                "visibility_count": 0.6, "pcd": 4.5, "loader_by_format": 6,
                                "camera_loader_ms": 15, "lss_forward_backward_ms": 10}),
    "opv2v": Preset("hypes_yaml/opv2v/point_pillar_attfuse.yaml", steps=10, warmup=3,
                    pillars=16_000, gt_boxes=20, loader_batches=30, eval_frames=64,
                    ap_frames=200, iou_pairs=100_000, visibility_points=105_000,
                    pcd_points=120_000,
                    cpu_seconds={"setup": 5, "pillarise": 4.7, "targets": 8.2, "profile": 5.0,
                                 "eval_postprocess_per_frame": 1.1,
                                 "eval_inference_per_frame": 59, "train_step_model_only": 173,
                                 "host_syncs_per_step": 30, "operators_per_step": 30,
                                 "train_step_no_pillarise": 158, "bev_iou": 5.1, "ap": 4.2,
                                 "visibility_count": 0.4, "pcd": 4.5, "loader_by_format": 6,
                                 "camera_loader_ms": 20, "lss_forward_backward_ms": 60},
                    camera_yaml="hypes_yaml/opv2v/camera_base.yaml"),
}

# What --list prints, in the order the figures are measured.
FIGURES = {
    "pillarise": "ms per batch: the batch on the device -> pillars (BatchPreparer.model_inputs); "
                 "vs the per-point Python reference on the same points",
    "targets": "ms per batch: anchor target assignment (BatchPreparer.targets); vs the "
               "per-anchor Python reference on the same anchors and GT",
    "profile": "parameters and forward FLOPs of the model on the fake batch (training is ~3x)",
    "eval_postprocess_per_frame": "ms per frame: decode + rotated NMS (device) + AP matching "
                                  "and AP (CPU) on synthetic head maps firing around the GT",
    "eval_inference_per_frame": "ms per frame of what tools/eval.py times: pillarise + forward "
                                "(eval, fp32) + decode + NMS",
    "train_step_model_only": "ms per optimiser step, inputs on the device: pillarise + targets "
                             "+ forward + loss + backward + clip + step (no EMA)",
    "peak_gpu_memory": "torch.cuda.max_memory_allocated over train_step_model_only (MiB)",
    "train_step_no_pillarise": "the same step with pillars and targets computed beforehand",
    "host_syncs_per_step": "host syncs in one eager train_step_model_only step, by kind (.item(), "
                           "tolist, nonzero, unique, boolean masks, ...): 1 with --static_pillars "
                           "and --sync_free",
    "operators_per_step": "operators one eager train_step_model_only step + EMA dispatches "
                          "(opencood.utils.op_counts: kernels = those doing device work), by "
                          "phase and by operator: the CPU proxy of a GPU step's launch cost",
    "ema_update": "ms per ModelEMA.update; share_of_step_pct: ema / (train step + ema)",
    "dataloader": "samples/s of the training DataLoader over --data (workers, augmentation, "
                  "collate), timed over whole waves of num_workers batches",
    "dataloader_by_fusion": "samples/s of that DataLoader for each fusion strategy "
                            "(no, early, late, intermediate)",
    "loader_cpu_ms": "CPU ms per sample from files to a collated batch on one thread, per fusion "
                     "strategy (warm point cache; first_epoch_ms: the cold first pass), vs the "
                     "pre-issue-28 path of tests/reference_pipeline.py on the same batches",
    "train_step_end_to_end": "ms per step from files: wait for the batch + the step + EMA if "
                             "the yaml enables it, with data_wait_ms",
    "bev_iou": "ms for N overlapping box pairs, rotated BEV IoU (boxes_bev_iou_aligned) vs "
               "polygon clipping one pair at a time",
    "ap": "ms per frame of APAccumulator (matching + AP at 0.3/0.5/0.7) vs the plain-Python "
          "loop AP on the same random frames",
    "visibility_count": "ms to count ego points per GT box (count_points_in_boxes) vs the "
                        "dense (boxes x points) mask",
    "pose_graph_solve_ms": "ms per sample of CoAlign's pose correction (opencood.ops.pose_graph."
                           "align_poses: clustering, graph, LM) for 5 agents x 60 boxes, on one "
                           "CPU thread",
    "loader_by_format": "samples/s per data set format (each the world writes) on the tiny "
                        "synthetic folders written in it: our reader (files -> agents' clouds, "
                        "transforms and ego-frame GT, no point cache) and our intermediate "
                        "fusion dataset (warm point cache); tools/reference/"
                        "bench_reference_readers.py times the reference readers on such files",
    "pcd": "ms per cloud: np.loadtxt, read_pcd (ascii, general ascii, binary), point-cache "
           "miss and hit",
    "camera_loader_ms": "CPU ms of the camera inputs on one thread, on a tiny synthetic split "
                        "with cameras (800 x 600): per agent frame, its 4 PNGs read and their "
                        "calibration (read_opv2v_cameras) and HEAL's image augmentation + "
                        "normalisation (camera_inputs, training draws); per sample, the "
                        "camera-only intermediate dataset's __getitem__ (all agents)",
    "lss_forward_backward_ms": "ms per batch of the lift-splat encoder (the preset's camera "
                               "config) on batch x agents x 4 cameras of fake images: forward "
                               "+ backward of the BEV map's sum, and forward alone (no grad)",
}


# -- command line ------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="The benchmark suite; one JSON line per figure (--list names them).")
    parser.add_argument("--list", action="store_true", help="print the figures and exit")
    parser.add_argument("--figures", default=None,
                        help="comma-separated figures to measure (default: all)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="config and sizes (default: opv2v on CUDA, lite on CPU)")
    parser.add_argument("--quick", dest="preset", action="store_const", const="quick",
                        help="same as --preset quick: checks the script in seconds")
    parser.add_argument("--hypes_yaml", "-y", default=None, help="config (default: the preset's)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config key")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when available, else cpu")
    parser.add_argument("--steps", type=int, default=None, help="timed repetitions")
    parser.add_argument("--warmup", type=int, default=None, help="untimed repetitions")
    parser.add_argument("--batch_size", type=int, default=2, help="samples per GPU")
    parser.add_argument("--agents", type=int, default=3, help="agents per sample")
    parser.add_argument("--pillars", type=int, default=None, help="non-empty pillars per agent")
    parser.add_argument("--points_per_pillar", type=int, default=6)
    parser.add_argument("--gt_boxes", type=int, default=None,
                        help="GT boxes per sample of the fake batch")
    parser.add_argument("--data", default=None,
                        help="OPV2V-format folder (a root with train/, or a split folder) for "
                             "the data-loader and end-to-end figures")
    parser.add_argument("--num_workers", type=int, default=None,
                        help="DataLoader workers (default: the yaml's train_params.num_workers)")
    parser.add_argument("--loader_batches", type=int, default=None,
                        help="batches timed for the data-loader figures")
    parser.add_argument("--eval_frames", type=int, default=None,
                        help="frames per AP accumulation of eval_postprocess_per_frame")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--static_pillars", type=int, default=None, metavar="N",
                        help="performance.static_pillars=N: N pillar slots per agent (fixed "
                             "shapes); at least the fake batch's --pillars keeps results equal")
    parser.add_argument("--sync_free", action="store_true",
                        help="performance.sync_free_step=true: one host read per step")
    parser.add_argument("--compile", action="store_true",
                        help="performance.compile=true: torch.compile the training model")
    parser.add_argument("--cuda_graph", action="store_true",
                        help="performance.cuda_graph=true: the step figures replay one captured "
                             "CUDA graph (needs --static_pillars and --sync_free)")
    args = parser.parse_args(argv)
    check_counts(args)
    args.overrides = [*args.overrides, *fast_step_overrides(args)]
    return args


def fast_step_overrides(args: argparse.Namespace) -> List[str]:
    """The fast-step flags as the ``--set`` overrides they stand for."""
    overrides = []
    if args.static_pillars is not None:
        overrides.append(f"performance.static_pillars={args.static_pillars}")
    if args.sync_free:
        overrides.append("performance.sync_free_step=true")
    if args.compile:
        overrides.append("performance.compile=true")
    if args.cuda_graph:
        overrides.append("performance.cuda_graph=true")
    return overrides


def check_counts(args: argparse.Namespace) -> None:
    """Refuse counts that cannot be measured, before anything is built."""
    at_least_one = ("steps", "batch_size", "agents", "pillars", "points_per_pillar",
                    "gt_boxes", "loader_batches", "eval_frames", "threads", "static_pillars")
    for name in at_least_one:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise BenchError(f"--{name} must be at least 1, got {value}")
    for name in ("warmup", "num_workers"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise BenchError(f"--{name} must be >= 0, got {value}")


def selected_figures(figures_arg: Optional[str]) -> List[str]:
    """--figures "a,b" -> the named figures in measuring order; all of them when not given."""
    if figures_arg is None:
        return list(FIGURES)
    names = [name.strip() for name in figures_arg.split(",") if name.strip()]
    unknown = [name for name in names if name not in FIGURES]
    if unknown or not names:
        raise BenchError(f"--figures: unknown figure {', '.join(unknown) or repr(figures_arg)}; "
                         f"known: {', '.join(FIGURES)}")
    return [name for name in FIGURES if name in names]


def resolve_device(name: Optional[str]) -> torch.device:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise BenchError("--device cuda: CUDA is not available (use --device cpu)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_preset(device: torch.device) -> str:
    """The OPV2V geometry on a GPU; on a CPU it takes minutes, so the lite one."""
    return "opv2v" if device.type == "cuda" else "lite"


def apply_preset(args: argparse.Namespace, preset: Preset) -> None:
    """Fill the sizes the command line left unset from ``preset``."""
    for name in ("steps", "warmup", "pillars", "gt_boxes", "loader_batches", "eval_frames"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    if args.hypes_yaml is None:
        args.hypes_yaml = str(REPO_ROOT / preset.hypes_yaml)


def resolve_split_dir(data: str) -> Path:
    """--data is an OPV2V root (with train/) or one split folder; either must hold frames.
    DAIR-V2X-C (a config with fusion.dataset: dairv2x): its root or a split json."""
    path = Path(data).expanduser()
    if path.suffix == ".json" and path.is_file():
        return path
    if (path / "cooperative" / "data_info.json").is_file() and (path / "train.json").is_file():
        return path / "train.json"
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


def versus(ours_ms: float, reference: str, reference_fn: Callable[[], object],
           scale: float = 1.0) -> Dict:
    """``reference_ms`` (one run of ``reference_fn``, divided by ``scale``) and the ``speedup``
    of ours over it."""
    # One run: the references are slow Python loops whose run-to-run spread is far smaller
    # than the ratio they are compared by.
    start = time.perf_counter()
    reference_fn()
    reference_ms = (time.perf_counter() - start) * 1e3 / scale
    return {"reference": reference, "reference_ms": round(reference_ms, 3),
            "speedup": round(reference_ms / max(ours_ms, 1e-6), 1)}


def display_path(path) -> str:
    """``path`` relative to the repository when inside it (shorter lines), else as given."""
    try:
        return str(Path(path).resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def emit(record: Dict) -> None:
    print(json.dumps(record), flush=True)


# -- set-up ------------------------------------------------------------------------------------

class Suite:
    """What every figure may use: the arguments, the preset, the device, the config, the
    results so far; the model set-up (``ModelBench``) is built on first use."""

    def __init__(self, args, preset_name: str, cfg: Dict, device: torch.device,
                 split_dir: Optional[Path]):
        self.args, self.cfg, self.device, self.split_dir = args, cfg, device, split_dir
        self.preset_name, self.preset = preset_name, PRESETS[preset_name]
        self.workers = (args.num_workers if args.num_workers is not None
                        else int(cfg["train_params"]["num_workers"]))
        self.results: Dict[str, float] = {}
        self.common = {
            "device": device.type,
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else f"cpu ({torch.get_num_threads()} threads)"),
            "preset": preset_name,
            "steps": args.steps,
            "warmup": args.warmup,
        }

    @functools.cached_property
    def model_bench(self) -> "ModelBench":
        return ModelBench(self)

    def record(self, figure: str, **values) -> Dict:
        return {"figure": figure, **values, **self.common}

    def time(self, fn: Callable[[], object], device: Optional[torch.device] = None) -> List[float]:
        return time_calls(fn, self.args.steps, self.args.warmup, device or self.device)


class ModelBench:
    """The training objects of the trainer in one process (``parts``, a TrainingParts) and a
    fake batch on the device."""

    def __init__(self, suite: Suite):
        from opencood.strategies import fuses_agents

        args, cfg, device = suite.args, suite.cfg, suite.device
        self.suite, self.args, self.cfg, self.device = suite, args, cfg, device
        self.batch_size = args.batch_size
        self.parts = training_parts(cfg, device)
        self.single_agent = not fuses_agents(self.parts.model_without_ddp)
        self.preparer = self.parts.task.preparer      # the training steps' pillar cap
        self.sync_free = cfg["performance"]["sync_free_step"]
        self.grad_clip = cfg["train_params"]["grad_clip"]
        self.batch = self._fake_batch()
        amp_cfg = cfg["amp"]
        self.common = self._config_fields(str(amp_cfg["dtype"]) if amp_cfg["enabled"] else "off")

    def _fake_batch(self) -> Dict:
        from opencood.utils.fake_batch import fake_collated_batch
        args = self.args
        cpu_batch = fake_collated_batch(self.cfg["preprocess"], self.batch_size, args.agents,
                                        args.pillars,
                                        points_per_pillar=args.points_per_pillar,
                                        max_gt=args.gt_boxes, single_agent=self.single_agent,
                                        seed=int(self.cfg["seed"]))
        batch = {key: value.to(self.device) if torch.is_tensor(value) else value
                 for key, value in cpu_batch.items()}
        synchronize(self.device)
        return batch

    def _config_fields(self, amp_yaml: str) -> Dict:
        nx, ny, _ = self.preparer.pillarize.grid_size
        perf = self.cfg["performance"]
        return {
            "config": display_path(self.args.hypes_yaml),
            "grid": f"{nx}x{ny}",
            "batch_per_gpu": self.batch_size,
            "agents": 1 if self.single_agent else self.args.agents,
            "pillars_per_agent": min(self.args.pillars, nx * ny),
            "amp_yaml": amp_yaml,
            "tf32": bool(perf["tf32"]) if self.device.type == "cuda" else None,
            "static_pillars": perf["static_pillars"],
            "sync_free_step": perf["sync_free_step"],
            "compile": perf["compile"],
            "cuda_graph": perf["cuda_graph"],
        }

    def record(self, figure: str, autocast: bool = False, **values) -> Dict:
        """One figure's line; ``autocast``: the figure ran under the training AMP setting
        (``amp`` is then that dtype, else "off": pillarisation, EMA and evaluation run fp32)."""
        amp = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.parts.amp_dtype, "off")
        shared = {**self.common, "amp": amp if autocast else "off"}
        # A value measured on real batches (their agents per sample) overrides the fake batch's.
        return self.suite.record(figure, **values,
                                 **{key: value for key, value in shared.items()
                                    if key not in values})

    def time(self, fn: Callable[[], object]) -> List[float]:
        return self.suite.time(fn)

    def train_step(self, batch, loss_fn, eager: bool = False, ema=None) -> Dict:
        """One optimizer step as the trainer takes it (``ema``: updated after it). The step
        figures run the compiled model (performance.compile); ``eager`` the uncompiled one
        (the sync count is a dispatch mode)."""
        from opencood.engine.loop import optimizer_step
        parts = self.parts
        model = parts.model_without_ddp if eager else parts.model
        graph_step = None if eager else self.graph_step(loss_fn, ema)
        if graph_step is not None:
            return graph_step.step([batch], "bench")
        return optimizer_step(model, [batch], loss_fn, parts.optimizer, parts.scaler,
                              self.device, parts.amp_dtype, self.grad_clip, where="bench",
                              sync_free=self.sync_free, ema=ema)

    def graph_step(self, loss_fn, ema):
        """performance.cuda_graph: the captured step of ``loss_fn``'s task (one graph per
        task, built on first use, its first steps eager warm-ups), else None."""
        if not self.cfg["performance"]["cuda_graph"]:
            return None
        from opencood.engine.cuda_graph import build_graph_step
        key = (id(getattr(loss_fn, "__self__", loss_fn)), id(ema))
        steps = self.__dict__.setdefault("graph_steps", {})
        if key not in steps:
            steps[key] = build_graph_step(self.cfg, self.parts, self.device, 1, 1, loss_fn=loss_fn)
            steps[key].ema = ema
        return steps[key]

    def make_ema(self):
        """The yaml's EMA, or one with its decay and warm-up when the yaml leaves it off."""
        from opencood.engine.recipe import make_ema
        if self.parts.ema is not None:
            return self.parts.ema
        return make_ema(self.parts.model_without_ddp, self.cfg["ema"])


def training_parts(cfg: Dict, device: torch.device):
    """The training parts as the trainer builds them (recipe.build_training_parts), for one
    process from the config's seed, without an lr schedule (the timed steps run at the
    optimizer's lr). AMP is a GPU setting: on CPU the bench runs fp32 (amp_yaml still says
    the yaml's)."""
    from opencood.engine.recipe import build_training_parts, configure_cuda
    from opencood.utils.dist import DistInfo
    torch.manual_seed(int(cfg["seed"]))
    configure_cuda(cfg["performance"])
    parts = build_training_parts(cfg, DistInfo(0, 1, 0, False, None, device))
    train_mode(parts, cfg)
    return parts


def train_mode(parts, cfg: Dict) -> None:
    """The trainer's ``model.train()``: the ``train_params.fix_modules`` parts' BatchNorm layers
    stay in eval (running statistics used, not updated), so timed steps run what training runs."""
    from opencood.engine.freeze import train_keeping_frozen
    train_keeping_frozen(parts.model, parts.model_without_ddp, cfg["train_params"]["fix_modules"])


# -- figures on the model and the fake batch ---------------------------------------------------

def bench_pillarise(suite: Suite) -> List[Dict]:
    bench = suite.model_bench
    preparer, batch = bench.preparer, bench.batch
    inputs = preparer.model_inputs(batch)
    # Real pillars: static pillars (--static_pillars) add padded slots, counted apart.
    valid = inputs.get("voxel_valid")
    pillars = int(inputs["voxel_coords"].shape[0] if valid is None else valid.sum())
    times = bench.time(lambda: preparer.model_inputs(batch))
    summary = summarise(times)
    from opencood.testing.reference_impls import reference_pillarize
    points, agent_index = batch["points"].cpu(), batch["agent_index"].cpu()
    grid = preparer.pillarize
    return [bench.record("pillarise", **summary, points=int(points.shape[0]), pillars=pillars,
                         **versus(summary["ms"], "per-point Python dict (CPU)",
                                  lambda: reference_pillarize(
                                      points, agent_index, grid.lidar_range, grid.voxel_size,
                                      grid.max_points_per_pillar)))]


def bench_targets(suite: Suite) -> List[Dict]:
    bench = suite.model_bench
    preparer, batch = bench.preparer, bench.batch
    times = bench.time(lambda: preparer.targets(batch))
    summary = summarise(times)
    from opencood.testing.reference_impls import reference_assign_targets
    post = preparer.postprocessor
    anchors = post.anchors.reshape(-1, 7).tolist()
    gt_per_sample = [boxes[mask].tolist() for boxes, mask in
                     zip(batch["gt_boxes"].cpu(), batch["gt_mask"].cpu())]

    def reference():
        for gt_boxes in gt_per_sample:
            reference_assign_targets(anchors, gt_boxes, post.pos_iou, post.neg_iou)

    return [bench.record("targets", **summary, anchors_per_sample=len(anchors),
                         gt_boxes=int(batch["gt_mask"].sum()),
                         **versus(summary["ms"], "per anchor-GT pair Python loops (CPU)",
                                  reference))]


def bench_profile(suite: Suite) -> List[Dict]:
    from opencood.utils.model_stats import count_flops, count_parameters
    bench = suite.model_bench
    model = bench.parts.model_without_ddp
    total, trainable = count_parameters(model)
    model.eval()
    try:
        flops = count_flops(model, bench.preparer.model_inputs(bench.batch))
    finally:
        train_mode(bench.parts, bench.cfg)
    return [bench.record("profile", parameters=total, trainable_parameters=trainable,
                         forward_flops=flops, forward_gflops=round(flops / 1e9, 3),
                         train_step_tflops_approx=round(3 * flops / 1e12, 4),
                         points_per_pillar=bench.args.points_per_pillar)]


def bench_train_step(suite: Suite) -> List[Dict]:
    bench, device = suite.model_bench, suite.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses = []

    def full_step():
        losses.append(bench.train_step(bench.batch, bench.parts.task.training_loss)["loss"])

    times = bench.time(full_step)
    suite.results["train_step_model_only"] = statistics.median(times)
    records = [bench.record("train_step_model_only", autocast=True, **summarise(times),
                            includes=STEP_PARTS, last_loss=round(losses[-1], 5),
                            cudnn_benchmark=(torch.backends.cudnn.benchmark
                                             if device.type == "cuda" else None))]
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.max_memory_reserved(device)
        records.append(bench.record("peak_gpu_memory", mib=round(peak / 2**20, 1),
                                    reserved_mib=round(reserved / 2**20, 1),
                                    during="train_step_model_only"))
    else:
        records.append({"figure": "peak_gpu_memory", "skipped": "not on CUDA",
                        "device": device.type})
    return records


def bench_train_step_no_pillarise(suite: Suite) -> List[Dict]:
    from opencood.engine.task import DetectionTask
    bench, task = suite.model_bench, suite.model_bench.parts.task
    with torch.no_grad():
        inputs, targets = bench.preparer(bench.batch)

    def prepared_beforehand(_batch):   # a copy: the model may add entries to its inputs
        return dict(inputs), targets

    prepared = DetectionTask(prepared_beforehand, task.criterion, host_terms=task.host_terms)
    times = bench.time(lambda: bench.train_step(bench.batch, prepared.training_loss))
    return [bench.record("train_step_no_pillarise", autocast=True, **summarise(times),
                         includes=[p for p in STEP_PARTS if p not in ("pillarise", "targets")])]


def bench_host_syncs(suite: Suite) -> List[Dict]:
    from opencood.utils.host_syncs import HostSyncCounter, optimizer_host_tensors
    bench = suite.model_bench
    loss_fn = bench.parts.task.training_loss
    bench.train_step(bench.batch, loss_fn, eager=True)     # creates the optimizer state
    with HostSyncCounter(optimizer_host_tensors(bench.parts.optimizer)) as syncs:
        bench.train_step(bench.batch, loss_fn, eager=True)
    return [bench.record("host_syncs_per_step", autocast=True, syncs=syncs.total,
                         by_kind=dict(sorted(syncs.counts.items())), includes=STEP_PARTS)]


def bench_operators(suite: Suite) -> List[Dict]:
    """One eager step + EMA update under an OpCounter, split by phase: the batch's pillars and
    targets, forward + loss, backward + clip, the optimizer step, the EMA update."""
    from opencood.engine.task import DetectionTask
    from opencood.utils.op_counts import OpCounter
    bench, task, optimizer = suite.model_bench, suite.model_bench.parts.task, \
        suite.model_bench.parts.optimizer
    ema = bench.make_ema()
    ops = OpCounter()

    def prepare(batch):
        ops.set_phase("pillarise_targets")
        prepared = task.preparer(batch)
        ops.set_phase("forward_loss")
        return prepared

    def counted_loss(model, batch):
        result = DetectionTask(prepare, task.criterion, host_terms=task.host_terms) \
            .training_loss(model, batch)
        ops.set_phase("backward_clip")
        return result

    bench.train_step(bench.batch, task.training_loss, eager=True, ema=ema)   # optimizer state
    hooks = [optimizer.register_step_pre_hook(lambda *_: ops.set_phase("optimizer")),
             optimizer.register_step_post_hook(lambda *_: ops.set_phase("after_step_ema"))]
    try:
        with ops:
            bench.train_step(bench.batch, counted_loss, eager=True, ema=ema)
    finally:
        for hook in hooks:
            hook.remove()
    defaults = optimizer.defaults
    implementation = ("fused" if defaults.get("fused") else
                      "foreach" if defaults.get("foreach") or
                      (defaults.get("foreach") is None and bench.device.type == "cuda")
                      else "for-loop")
    fused_kernels = fused_optimizer_kernels(optimizer)
    as_on_cuda = (None if fused_kernels is None
                  else ops.kernels - ops.by_phase["optimizer"] + fused_kernels)
    return [bench.record("operators_per_step", autocast=True, kernels=ops.kernels,
                         operators=ops.total, by_phase=ops.by_phase,
                         top_kernels=dict(ops.by_op.most_common(12)),
                         optimizer=f"{type(optimizer).__name__} ({implementation})",
                         kernels_with_fused_optimizer=as_on_cuda,
                         includes=STEP_PARTS + ["ema"])]


def fused_optimizer_kernels(optimizer: torch.optim.Optimizer) -> Optional[int]:
    """Kernels of one step of ``optimizer``'s class with ``fused=True`` (what build_optimizer
    gives on CUDA), on copies of its parameters, so a CPU count compares with a CUDA one
    (CPU runs torch's per-tensor loop, ~9 kernels per parameter); None where this torch has
    no fused kernel for the device."""
    import inspect
    params = [torch.nn.Parameter(param.detach().clone())
              for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        param.grad = torch.zeros_like(param)
    accepted = set(inspect.signature(type(optimizer)).parameters)
    settings = {key: value for key, value in optimizer.defaults.items()
                if key in accepted and key not in ("foreach", "fused", "params")}
    try:
        fused = type(optimizer)(params, **settings, fused=True)
        fused.step()                                  # creates the state
    except (RuntimeError, ValueError) as error:
        logger.info("no fused %s here: %s", type(optimizer).__name__, error)
        return None
    from opencood.utils.op_counts import OpCounter
    with OpCounter() as ops:
        fused.step()
    return ops.kernels


def bench_ema(suite: Suite) -> List[Dict]:
    bench = suite.model_bench
    ema = bench.make_ema()
    times = bench.time(lambda: ema.update(bench.parts.model_without_ddp))
    ema_ms = statistics.median(times)
    step_ms = suite.results.get("train_step_model_only")
    share = round(100.0 * ema_ms / (step_ms + ema_ms), 2) if step_ms else None
    tensors = sum(1 for t in ema.module.state_dict().values() if t.dtype.is_floating_point)
    return [bench.record("ema_update", **summarise(times), share_of_step_pct=share,
                         float_tensors=tensors, enabled_in_yaml=bench.parts.ema is not None)]


def fake_head_outputs(bench: ModelBench, seed: int = 0) -> Dict:
    """Head maps as a trained detector would give: in the 3x3 feature cells around every GT
    centre, every anchor is confident and regresses (with a little noise) to that GT; plus a
    sprinkle of false positives elsewhere. Decoding and NMS then face realistic candidates."""
    anchors = bench.preparer.postprocessor.anchors.cpu()     # (H, W, A, 7)
    coder = bench.preparer.postprocessor.box_coder
    height, width, num_anchors, _ = anchors.shape
    lidar_range = bench.preparer.pillarize.lidar_range
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


def bench_eval_postprocess(suite: Suite) -> List[Dict]:
    """Decode + NMS on the device, then AP matching on the CPU, of synthetic head outputs."""
    from opencood.eval.ap import APAccumulator
    bench = suite.model_bench
    postprocessor = bench.preparer.postprocessor
    outputs = fake_head_outputs(bench, seed=int(bench.cfg["seed"]))
    detections = []

    def decode_nms():
        # The synthetic maps are per sample, in the ego frame: no per-agent (late) step here.
        detections[:] = postprocessor.detections(outputs, bench.batch["record_len"],
                                                 bench.batch["transforms_to_ego"], late=False)

    decode_ms = statistics.median(bench.time(decode_nms)) / bench.batch_size
    per_frame = [(frame.boxes.float().cpu(), frame.scores.float().cpu()) for frame in detections]
    gts = [bench.batch["gt_boxes"][row][bench.batch["gt_mask"][row]].cpu()
           for row in range(bench.batch_size)]
    frames = suite.args.eval_frames
    last_metrics = {}

    def accumulate_ap():
        accumulator = APAccumulator(order=postprocessor.order)
        for frame in range(frames):
            boxes, scores = per_frame[frame % len(per_frame)]
            accumulator.add_frame(boxes, scores, gts[frame % len(gts)],
                                  sample_key=("bench", f"{frame:06d}"))
        last_metrics.update(accumulator.compute())

    ap_ms = statistics.median(suite.time(accumulate_ap, torch.device("cpu"))) / frames
    return [bench.record(
        "eval_postprocess_per_frame", ms=round(decode_ms + ap_ms, 3),
        decode_nms_ms=round(decode_ms, 3), ap_ms=round(ap_ms, 3), eval_frames=frames,
        detections_per_frame=round(sum(len(s) for _, s in per_frame) / len(per_frame), 1),
        gt_per_frame=round(sum(len(g) for g in gts) / len(gts), 1),
        ap_50=round(float(last_metrics.get("ap_50", float("nan"))), 4),
        includes=["decode", "rotated_nms", "ap_matching", "ap_compute"],
        outputs="synthetic head maps (detections near the GT)")]


def bench_eval_inference(suite: Suite) -> List[Dict]:
    """What tools/eval.py times per batch (opencood.eval.inference.detect, with the evaluation
    pillar cap): pillarise + forward + decode + NMS (fp32, eval)."""
    from opencood.eval.inference import detect
    bench = suite.model_bench
    strategy = bench.parts.task.strategy
    model, preparer = bench.parts.model_without_ddp, bench.parts.task.eval_preparer
    counts = []

    @torch.no_grad()
    def inference():
        results, _ = detect(model, bench.batch, preparer, strategy)
        counts.append(sum(int(frame.scores.shape[0]) for frame in results))

    model.eval()
    try:
        times = bench.time(inference)
    finally:
        train_mode(bench.parts, bench.cfg)
    return [bench.record("eval_inference_per_frame", **summarise(times, bench.batch_size),
                         includes=["pillarise", "forward", "decode", "rotated_nms"],
                         detections_per_frame=round(counts[-1] / bench.batch_size, 1),
                         note="untrained weights: few or no detections, NMS is nearly free")]


# -- figures on the data (--data) --------------------------------------------------------------

def build_bench_loader(bench: ModelBench, split_dir: Path, batches: int, workers: int,
                       fusion: Optional[str] = None):
    """The training DataLoader of the trainer over ``split_dir`` (``fusion``: another
    strategy than the yaml's), drawing ``batches`` batches (several epochs' worth if the split
    is small) without restarting its workers."""
    from opencood.data.collate import build_loader
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    cfg = dict(bench.cfg, root_dir=str(split_dir))
    dataset = build_dataset(cfg, "train", train=True, strategy=choose_strategy(cfg, fusion))
    if len(dataset) == 0:
        raise BenchError(f"--data: no samples in {split_dir}")
    generator = torch.Generator().manual_seed(int(cfg["seed"]))
    sampler = torch.utils.data.RandomSampler(dataset, num_samples=batches * bench.batch_size,
                                             generator=generator)
    batch_sampler = torch.utils.data.BatchSampler(sampler, bench.batch_size, drop_last=True)
    loader = build_loader(dataset, bench.device, workers, batch_sampler=batch_sampler)
    return dataset, loader


def measure_loader(suite: Suite, fusion: Optional[str] = None) -> Dict:
    """Steady-state throughput of a loader that is never kept waiting.

    ``W`` workers start together and deliver their batches in waves of ``W``; the clock runs
    from the end of one wave to the end of a later one (the first wave, with worker start-up,
    is ``first_wave_s``), so a partial wave or prefetched batches do not bias the rate."""
    bench, workers = suite.model_bench, suite.workers
    wave = max(workers, 1)
    warm = -(-max(suite.args.warmup, 1) // wave) * wave   # whole waves, at least the first
    timed = -(-suite.args.loader_batches // wave) * wave
    dataset, loader = build_bench_loader(bench, suite.split_dir, warm + timed, workers, fusion)
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
    return {"samples_per_s": round(timed * bench.batch_size / elapsed, 2),
            "ms": round(elapsed * 1e3 / timed, 3),
            "ms_per_batch_median": summarise(per_batch)["ms"], "num_workers": workers,
            "timed_batches": timed, "warmup_batches": warm,
            "first_wave_s": round(first_wave_s, 3), "dataset_samples": len(dataset),
            # Measured on the real samples (the fake batch's pillar count means nothing here).
            "agents": round(agents / (timed * bench.batch_size), 2),
            "points_per_agent": round(points / max(agents, 1), 1)}


def bench_loader(suite: Suite) -> List[Dict]:
    record = suite.model_bench.record("dataloader", **measure_loader(suite),
                                        data=str(suite.split_dir))
    record.pop("pillars_per_agent")
    return [record]


def bench_loader_by_fusion(suite: Suite) -> List[Dict]:
    """Samples/s per fusion strategy; workers read, project, augment and crop (pillarisation
    runs on the training device). After the dataloader figure the point cache is warm."""
    from opencood.strategies import strategy_names
    rates = {fusion: measure_loader(suite, fusion)["samples_per_s"] for fusion in strategy_names()}
    record = suite.model_bench.record("dataloader_by_fusion", samples_per_s=rates,
                                        num_workers=suite.workers, data=str(suite.split_dir))
    record.pop("pillars_per_agent")
    return [record]


# -- loader_cpu_ms (issue 28) ------------------------------------------------------------------

def dataset_strategies() -> List[str]:
    """One strategy per dataset class: a strategy sharing another's samples (late_box_align:
    late's) would time the same pipeline twice."""
    from opencood.strategies import get_strategy, strategy_names
    return [name for name in strategy_names() if get_strategy(name).dataset_name == name]


def bench_loader_cpu(suite: Suite) -> List[Dict]:
    """CPU cost of the input pipeline's CPU part (files -> dataset samples -> collated batch;
    pillars and targets are made on the device), per fusion strategy, in this process on one
    thread (OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=1 in the environment keeps BLAS on one too).

    Clock: ``time.process_time`` (every thread of the process), so a machine shared with other
    jobs inflates the figures less than wall time would. Per strategy, in a fresh cache folder:
    one cold pass of ours (empty point cache: PCD parsing and cache writes, ``first_epoch_ms``,
    the mean), one warm-up pass of the reference (tests/reference_pipeline.py, the path before
    issue 28), then passes alternating ours / reference over the same batches and epochs until
    each has at least 12 samples; ``ms`` and ``reference_ms`` are medians per sample (batch / its
    size), each a dict by strategy (one per dataset class: dataset_strategies). Late fusion's
    samples are its training examples, one per (sample, CAV).
    """
    from opencood.data.collate import collate_samples
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    reference_file = REPO_ROOT / "tests" / "reference_pipeline.py"
    reference = None
    if reference_file.is_file():
        spec = importlib.util.spec_from_file_location("opencood_reference_pipeline",
                                                      reference_file)
        reference = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(reference)
    cfg = dict(suite.cfg, root_dir=str(suite.split_dir))
    batch_size = suite.args.batch_size
    figures = {key: {} for key in ("ms", "reference_ms", "speedup", "first_epoch_ms", "samples",
                                   "agents_per_sample", "points_per_agent")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="loader_cpu_") as cache_root:
            for fusion in dataset_strategies():
                dataset = build_dataset(cfg, "train", train=True,
                                        strategy=choose_strategy(cfg, fusion),
                                        cache_dir=Path(cache_root) / fusion)
                batches = [list(range(start, start + batch_size))
                           for start in range(0, len(dataset) - batch_size + 1, batch_size)]
                if not batches:
                    raise BenchError(f"--data: fewer than {batch_size} samples in "
                                     f"{suite.split_dir}")
                seen = {"samples": 0, "agents": 0, "points": 0}

                def cpu_ms_per_sample(make_sample, count_into=None) -> List[float]:
                    """One pass over ``batches``: process-CPU ms per sample of each batch."""
                    times = []
                    for indices in batches:
                        start = time.process_time()
                        batch = collate_samples([make_sample(index) for index in indices])
                        times.append((time.process_time() - start) * 1e3 / len(indices))
                        if count_into is not None:
                            count_into["samples"] += len(indices)
                            count_into["agents"] += int(batch["record_len"].sum())
                            count_into["points"] += int(batch["points"].shape[0])
                    return times

                ours = dataset.__getitem__
                first_epoch = cpu_ms_per_sample(ours, seen)
                theirs = ((lambda index: reference.reference_sample(dataset, index))
                          if reference is not None else None)
                if theirs is not None:
                    cpu_ms_per_sample(theirs)                 # warm its raw point cache
                ours_ms, theirs_ms, epoch = [], [], 0
                while len(ours_ms) * batch_size < 12 or epoch < 2:
                    epoch += 1
                    dataset.set_epoch(epoch)               # new augmentation draws, both paths
                    ours_ms += cpu_ms_per_sample(ours)
                    if theirs is not None:
                        theirs_ms += cpu_ms_per_sample(theirs)
                figures["ms"][fusion] = round(statistics.median(ours_ms), 3)
                figures["first_epoch_ms"][fusion] = round(statistics.mean(first_epoch), 3)
                figures["samples"][fusion] = len(ours_ms) * batch_size
                figures["agents_per_sample"][fusion] = round(seen["agents"] / seen["samples"], 2)
                figures["points_per_agent"][fusion] = round(seen["points"]
                                                            / max(seen["agents"], 1), 1)
                if theirs_ms:
                    figures["reference_ms"][fusion] = round(statistics.median(theirs_ms), 3)
                    figures["speedup"][fusion] = round(statistics.median(theirs_ms)
                                                       / max(statistics.median(ours_ms), 1e-6), 1)
    finally:
        torch.set_num_threads(threads)
    if reference is None:
        del figures["reference_ms"], figures["speedup"]
        about = f"not available ({display_path(reference_file)} not found)"
    else:
        about = f"{display_path(reference_file)} (the path before issue 28)"
    return [suite.record("loader_cpu_ms", **figures, reference=about, batch_size=batch_size,
                         threads=1, clock="process_time", data=str(suite.split_dir))]


def bench_end_to_end(suite: Suite) -> List[Dict]:
    from opencood.engine.task import DetectionTask
    bench, args, device = suite.model_bench, suite.args, suite.device
    _, loader = build_bench_loader(bench, suite.split_dir, args.warmup + args.steps,
                                   suite.workers)
    ema, task = bench.parts.ema, bench.parts.task
    seen = {"agents": 0, "pillars": 0}

    def counting_preparer(batch):      # the training preparer, counting what it prepares
        inputs, targets = task.preparer(batch)
        seen["agents"] += int(batch["record_len"].sum())
        seen["pillars"] += int(inputs["voxel_coords"].shape[0])
        return inputs, targets

    counting = DetectionTask(counting_preparer, task.criterion, host_terms=task.host_terms)
    iterator = iter(loader)
    step_ms, wait_ms = [], []
    for index in range(args.warmup + args.steps):
        if index == args.warmup:
            seen.update(agents=0, pillars=0)
        synchronize(device)
        start = time.perf_counter()
        batch = next(iterator)
        waited = time.perf_counter() - start
        bench.train_step(batch, counting.training_loss, ema=ema)
        synchronize(device)
        if index >= args.warmup:
            step_ms.append((time.perf_counter() - start) * 1e3)
            wait_ms.append(waited * 1e3)
    del iterator
    includes = ["data_wait", "host_to_device"] + STEP_PARTS + (["ema"] if ema else [])
    return [bench.record("train_step_end_to_end", autocast=True, **summarise(step_ms),
                         data_wait_ms=round(statistics.median(wait_ms), 3),
                         num_workers=suite.workers, includes=includes, data=str(suite.split_dir),
                         agents=round(seen["agents"] / args.steps / bench.batch_size, 2),
                         pillars_per_agent=round(seen["pillars"] / max(seen["agents"], 1), 1))]


# -- figures on kernels (no model, no config) --------------------------------------------------

def bench_bev_iou(suite: Suite) -> List[Dict]:
    """Overlapping pairs (centres within 1 m, any headings): every pair takes the full polygon
    clipping path, none is skipped by the bounding-circle pre-filter."""
    from opencood.ops.iou import boxes_bev_iou_aligned
    from opencood.utils.fake_batch import random_vehicle_boxes
    count = suite.preset.iou_pairs
    generator = torch.Generator().manual_seed(0)
    boxes_a, boxes_b = (random_vehicle_boxes(count, generator, (-1, 1), (-1, 1))
                        for _ in range(2))
    on_device = [boxes.float().to(suite.device) for boxes in (boxes_a, boxes_b)]
    summary = summarise(suite.time(lambda: boxes_bev_iou_aligned(*on_device)))
    from opencood.testing.reference_impls import reference_bev_iou
    rows_a, rows_b = boxes_a.tolist(), boxes_b.tolist()
    return [suite.record("bev_iou", **summary, pairs=count, dtype="float32",
                         pairs_per_s=round(count / summary["ms"] * 1e3),
                         **versus(summary["ms"], "Sutherland-Hodgman clipping per pair, "
                                                 "Python (CPU)",
                                  lambda: [reference_bev_iou(a, b)
                                           for a, b in zip(rows_a, rows_b)]))]


def bench_pose_graph(suite: Suite) -> List[Dict]:
    """5 agents seeing the same 60 objects (boxes 5 cm off, poses up to 0.5 m / 0.5 deg off),
    solved on the CPU with one thread, as a single-core deployment would run it."""
    from opencood.ops.pose_graph import align_poses
    from opencood.testing.pose_graph_scene import make_pose_graph_scene
    true, noisy, boxes = make_pose_graph_scene(5, 60, pose_noise=0.5, box_noise=0.05)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = summarise(suite.time(lambda: align_poses(boxes, None, noisy, [5]),
                                       torch.device("cpu")))
    finally:
        torch.set_num_threads(threads)
    result = align_poses(boxes, None, noisy, [5])
    error_before = (noisy - true)[:, :2].norm(dim=1).max().item()
    error_after = (result.poses - true)[:, :2].norm(dim=1).max().item()
    return [suite.record("pose_graph_solve_ms", **summary, agents=5, boxes_per_agent=60,
                         threads=1, landmarks=result.num_landmarks[0],
                         lm_iterations=result.iterations[0],
                         max_translation_error_m_before=round(error_before, 3),
                         max_translation_error_m_after=round(error_after, 4))]


def bench_ap(suite: Suite) -> List[Dict]:
    """APAccumulator (CPU, as tools/eval.py runs it) against the loop AP, same random frames."""
    from opencood.eval.ap import APAccumulator
    from opencood.utils.fake_batch import fake_detection_frames
    frames = fake_detection_frames(suite.preset.ap_frames, seed=0)

    def ours():
        accumulator = APAccumulator(AP_THRESHOLDS)
        for index, (pred, scores, gt) in enumerate(frames):
            accumulator.add_frame(pred, scores, gt, sample_key=index)
        return accumulator.compute()

    count = len(frames)
    summary = summarise(suite.time(ours, torch.device("cpu")), scale=count)
    from opencood.testing.reference_impls import reference_ap
    frame_lists = [tuple(t.tolist() for t in frame) for frame in frames]
    pairs = sum(len(pred) * len(gt) for pred, _, gt in frames)
    return [suite.record("ap", **summary, frames=count, detection_gt_pairs=pairs,
                         thresholds=list(AP_THRESHOLDS), unit="ms per frame",
                         **versus(summary["ms"], "greedy matching and VOC AP in Python loops, "
                                                 "IoU by polygon clipping",
                                  lambda: reference_ap(frame_lists, AP_THRESHOLDS),
                                  scale=count))]


def bench_visibility_count(suite: Suite) -> List[Dict]:
    """Ego points per GT box behind the ego-visible / occluded split of AP, at ``--preset``
    size (OPV2V: 105,000 points, 60 boxes): BEV buckets against the dense (M, N) mask."""
    from opencood.ops.transforms import count_points_in_boxes, points_in_boxes_mask
    from opencood.utils.fake_batch import random_vehicle_boxes
    count = suite.preset.visibility_points
    generator = torch.Generator().manual_seed(0)
    points = torch.stack([torch.empty(count).uniform_(low, high, generator=generator)
                          for low, high in ((-140, 140), (-40, 40), (-3, 1), (0, 1))], dim=1)
    points = points.numpy()
    boxes = random_vehicle_boxes(60, generator, (-140, 140), (-40, 40)).numpy()
    cpu = torch.device("cpu")
    summary = summarise(suite.time(lambda: count_points_in_boxes(points, boxes, margin=0.1), cpu))
    dense = versus(summary["ms"], "dense points_in_boxes_mask(...).sum(1)",
                   lambda: points_in_boxes_mask(points, boxes, margin=0.1).sum(axis=1))
    return [suite.record("visibility_count", **summary, points=count, boxes=len(boxes),
                         **dense)]


REFERENCE_HEADER_LINES = 11   # lines np.loadtxt must skip in a reference-layout PCD file


def write_general_ascii(path: Path, points: np.ndarray) -> None:
    """Reference layout but values printed with "%.9g" (exponents, varying decimals), as
    other tools do; read_pcd's fast path declines it, so this times the general parser."""
    red = np.rint(points[:, 3].astype(np.float64) * 255).astype(np.int64) << 16
    lines = ["%.9g %.9g %.9g %d" % (x, y, z, r)
             for (x, y, z), r in zip(points[:, :3].tolist(), red.tolist())]
    header = ("# .PCD v0.7 - Point Cloud Data file format\nVERSION 0.7\nFIELDS x y z rgb\n"
              "SIZE 4 4 4 4\nTYPE F F F U\nCOUNT 1 1 1 1\n"
              f"WIDTH {len(points)}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\n"
              f"POINTS {len(points)}\nDATA ascii\n")
    path.write_text(header + "\n".join(lines) + "\n")


def random_cloud(count: int, seed: int = 0) -> np.ndarray:
    """(count, 4) float32 lidar-like points: xyz within 80 m, intensity on the 1/255 grid."""
    generator = torch.Generator().manual_seed(seed)
    xyz = torch.empty(count, 3).uniform_(-80.0, 80.0, generator=generator)
    intensity = torch.randint(0, 256, (count, 1), generator=generator) / 255.0
    return torch.cat([xyz, intensity], dim=1).numpy().astype(np.float32)


def bench_pcd(suite: Suite) -> List[Dict]:
    """ms per cloud of each way to read one, against np.loadtxt (the fastest plain-numpy parse,
    docs/DESIGN.md §2) on the same file."""
    from opencood.data.pcd import PointCloudCache, read_pcd, write_pcd
    points = random_cloud(suite.preset.pcd_points)
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory(prefix="bench_pcd_") as folder:
        folder = Path(folder)
        ascii_path, binary_path = folder / "ascii.pcd", folder / "binary.pcd"
        general_path = folder / "general_ascii.pcd"
        write_pcd(ascii_path, points)
        write_pcd(binary_path, points, data="binary")
        write_general_ascii(general_path, points)
        cache = PointCloudCache(folder / "cache")

        def cache_miss():
            cache.entry_path(ascii_path).unlink(missing_ok=True)
            return cache.load(ascii_path)

        methods = {
            "loadtxt": lambda: np.loadtxt(ascii_path, skiprows=REFERENCE_HEADER_LINES),
            "read_pcd_ascii": lambda: read_pcd(ascii_path),
            "read_pcd_general_ascii": lambda: read_pcd(general_path),
            "read_pcd_binary": lambda: read_pcd(binary_path),
            "cache_miss": cache_miss,
            "cache_hit": lambda: cache.load(ascii_path),
        }
        timings = {name: summarise(suite.time(fn, cpu)) for name, fn in methods.items()}
        megabytes = {path.name: round(path.stat().st_size / 1e6, 2)
                     for path in (ascii_path, general_path, binary_path)}
    baseline = timings["loadtxt"]["ms"]
    for summary in timings.values():
        summary["speedup_vs_loadtxt"] = round(baseline / max(summary["ms"], 1e-6), 1)
    return [suite.record("pcd", points=len(points), file_mb=megabytes, methods=timings)]


# -- loader_by_format (issue 25) ---------------------------------------------------------------

# Every agent of a sample is read (tiny OPV2V has up to 4 CAVs), as the references' base data do.
FORMAT_MAX_CAV = 5


def samples_per_s(suite: Suite, load_all: Callable[[], int]) -> Dict:
    """Median samples/s over ``steps`` timed passes of ``load_all`` (it returns the samples it
    loaded), after ``warmup`` untimed ones."""
    count = load_all()
    times = suite.time(load_all, torch.device("cpu"))
    median = statistics.median(times)
    return {"samples_per_s": round(count / (median / 1e3), 1),
            "ms_per_sample": round(median / count, 3), "samples": count}


def bench_loader_by_format(suite: Suite) -> List[Dict]:
    """Per format: the tiny synthetic data set written in it (seed 0, a temporary folder), then
    the samples/s of our reader (``load_sample``: every agent's cloud parsed from its file, its
    transform to the ego, the ego-frame GT; the index is built beforehand, as the references
    build theirs) and of IntermediateFusionDataset.__getitem__ (the training path: point cache
    warm after the first pass, no augmentation), over every sample of the three splits."""
    from opencood.data.datasets import IntermediateFusionDataset
    from opencood.data.formats import get_format, open_split, writer_formats
    from opencood.data.synthetic import generate_dataset
    formats = {}
    with tempfile.TemporaryDirectory(prefix="loader_by_format_") as folder:
        # Each reader filters its GT with its format's published range, as the references do.
        for data_format in writer_formats():
            root = Path(folder) / data_format
            generate_dataset(root, preset="tiny", seed=0, progress=False, data_format=data_format)
            gt_range = list(get_format(data_format).gt_range)
            splits = get_format(data_format).split_paths(root)
            readers = [open_split(data_format, split, com_range=1e6, max_cav=FORMAT_MAX_CAV,
                                  use_point_cache=False, cache_dir=Path(folder) / "cache")
                       for split in splits]
            datasets = [IntermediateFusionDataset(split, gt_range=gt_range,
                                                  max_cav=FORMAT_MAX_CAV,
                                                  com_range=1e6, dataset=data_format,
                                                  cache_dir=Path(folder) / "cache")
                        for split in splits]

            def read_all(readers=readers, gt_range=gt_range) -> int:
                for reader in readers:
                    for index in range(len(reader)):
                        reader.load_sample(index, gt_range)
                return sum(len(reader) for reader in readers)

            def dataset_all(datasets=datasets) -> int:
                for dataset in datasets:
                    for index in range(len(dataset)):
                        dataset[index]
                return sum(len(dataset) for dataset in datasets)

            formats[data_format] = {"reader": samples_per_s(suite, read_all),
                                    "dataset": samples_per_s(suite, dataset_all)}
    return [suite.record("loader_by_format", formats=formats, data="tiny synthetic, seed 0",
                         reference="tools/reference/bench_reference_readers.py (side "
                                   "environment): the reference readers on the same files")]


# -- the camera path (issue 36) ----------------------------------------------------------------

def camera_config(suite: Suite) -> Dict:
    """The preset's camera config, resolved (without depth supervision: its loss input, the
    depth maps, is not part of these figures, so neither are the depth images read)."""
    from opencood.config import load_config
    return load_config(REPO_ROOT / suite.preset.camera_yaml,
                       ["model.args.encoder.args.depth_supervision=false",
                        "input_source=[camera]", "loss.args.depth=null"])


def bench_camera_loader(suite: Suite) -> List[Dict]:
    """The tiny preset's test split written with OPV2V's cameras (seed 0, ``camera_frames``
    frames, a temporary folder); then, on one thread, the ms of reading one agent frame's
    cameras, of augmenting them (the training draws of the config's data_aug_conf), and of one
    training sample of the camera-only intermediate dataset (every agent: both, plus the
    extrinsics composed), each the median over timed passes over all frames."""
    import dataclasses
    from opencood.data.cameras import camera_inputs
    from opencood.data.datasets import IntermediateFusionDataset
    from opencood.data.synthetic import generate_dataset
    from opencood.data.synthetic.camera import CameraConfig
    from opencood.data.synthetic.presets import get_preset
    cfg = camera_config(suite)
    conf = cfg["camera"]["data_aug_conf"]
    preset = dataclasses.replace(get_preset("tiny"), frames=suite.preset.camera_frames,
                                 cameras=CameraConfig(width=conf["W"], height=conf["H"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="camera_loader_") as folder:
            generate_dataset(folder, preset=preset, seed=0, progress=False, splits=("test",))
            dataset = IntermediateFusionDataset.from_config(
                cfg, Path(folder) / "test", train=True, cache_dir=Path(folder) / "cache")
            frames = [agent["frame"] for index in range(len(dataset))
                      for agent in dataset._agents(index)[1]]
            read = [dataset.split.load_cameras(*frame) for frame in frames]
            rng = np.random.default_rng(0)
            timings = {
                "read_ms": suite.time(lambda: [dataset.split.load_cameras(*frame)
                                               for frame in frames], torch.device("cpu")),
                "augment_ms": suite.time(lambda: [camera_inputs(frame, conf, rng)
                                                  for frame in read], torch.device("cpu")),
                "sample_ms": suite.time(lambda: [dataset[index] for index in
                                                 range(len(dataset))], torch.device("cpu"))}
            samples = len(dataset)
    finally:
        torch.set_num_threads(threads)
    per_frame = {name: round(statistics.median(times) / len(frames), 3)
                 for name, times in timings.items() if name != "sample_ms"}
    sample_ms = round(statistics.median(timings["sample_ms"]) / samples, 3)
    return [suite.record("camera_loader_ms", ms=sample_ms, **per_frame,
                         agent_frames=len(frames), samples=samples,
                         agents_per_sample=round(len(frames) / samples, 2),
                         cameras_per_agent=len(read[0].images),
                         image_size=[conf["W"], conf["H"]],
                         final_dim=list(conf["final_dim"]),
                         config=display_path(REPO_ROOT / suite.preset.camera_yaml),
                         threads=1, data="tiny synthetic test split with cameras, seed 0")]


def bench_lift_splat(suite: Suite) -> List[Dict]:
    """The lift-splat encoder of the preset's camera config on ``--batch_size`` x ``--agents``
    agents of 4 fake cameras (``fake_camera_batch`` at the encoder's image size) on the
    device: forward, sum of the BEV map, backward (weights' gradients cleared first), and the
    forward alone under no_grad."""
    from opencood.models import build_model
    from opencood.utils.fake_batch import fake_camera_batch
    cfg = camera_config(suite)
    device = suite.device
    torch.manual_seed(int(cfg["seed"]))
    encoder = build_model(cfg["model"]).encoder.to(device).train()
    args = encoder.args
    agents = suite.args.batch_size * suite.args.agents
    batch = {key: value.to(device) for key, value in
             fake_camera_batch(agents, image_size=tuple(args.image_size)).items()}

    def forward_backward():
        encoder.zero_grad(set_to_none=True)
        encoder(batch).sum().backward()

    def forward():
        with torch.no_grad():
            encoder(batch)

    step = summarise(suite.time(forward_backward))
    nx, ny, nz = encoder.cells
    return [suite.record("lss_forward_backward_ms", **step,
                         forward_ms=summarise(suite.time(forward))["ms"],
                         agents=agents, cameras=batch["images"].shape[1],
                         image_size=list(args.image_size), depth_bins=encoder.num_bins,
                         camera_encoder=args.camera_encoder, grid=f"{nx}x{ny}x{nz}",
                         out_channels=encoder.out_channels,
                         parameters=sum(p.numel() for p in encoder.parameters()),
                         config=display_path(REPO_ROOT / suite.preset.camera_yaml))]


# -- the suite ---------------------------------------------------------------------------------

class Group(NamedTuple):
    """Figures measured by one call; ``needs``: "model" (config, model, fake batch), "data"
    (that and --data) or "" (neither)."""
    figures: Tuple[str, ...]
    needs: str
    measure: Callable[[Suite], List[Dict]]


# In measuring order: evaluation before any training step, since a few steps on random data can
# make the model fire on thousands of anchors, and the NMS time of eval_inference with it.
GROUPS = (
    Group(("pillarise",), "model", bench_pillarise),
    Group(("targets",), "model", bench_targets),
    Group(("profile",), "model", bench_profile),
    Group(("eval_postprocess_per_frame",), "model", bench_eval_postprocess),
    Group(("eval_inference_per_frame",), "model", bench_eval_inference),
    Group(("train_step_model_only", "peak_gpu_memory"), "model", bench_train_step),
    Group(("train_step_no_pillarise",), "model", bench_train_step_no_pillarise),
    Group(("host_syncs_per_step",), "model", bench_host_syncs),
    Group(("operators_per_step",), "model", bench_operators),
    Group(("ema_update",), "model", bench_ema),
    Group(("dataloader",), "data", bench_loader),
    Group(("dataloader_by_fusion",), "data", bench_loader_by_fusion),
    Group(("loader_cpu_ms",), "data", bench_loader_cpu),
    Group(("train_step_end_to_end",), "data", bench_end_to_end),
    Group(("bev_iou",), "", bench_bev_iou),
    Group(("ap",), "", bench_ap),
    Group(("visibility_count",), "", bench_visibility_count),
    Group(("pose_graph_solve_ms",), "", bench_pose_graph),
    Group(("loader_by_format",), "", bench_loader_by_format),
    Group(("pcd",), "", bench_pcd),
    Group(("camera_loader_ms",), "", bench_camera_loader),
    Group(("lss_forward_backward_ms",), "", bench_lift_splat),
)


def plan_line(suite: Suite, figures: List[str]) -> str:
    """What the run will measure and roughly how long it takes, said before it starts."""
    args, preset = suite.args, suite.preset
    sizes = (f"batch {args.batch_size} x {args.agents} agents, {args.pillars} pillars per agent, "
             f"{args.steps} timed + {args.warmup} warm-up steps")
    seconds = preset.cpu_seconds
    total = seconds.get("setup", 0) + sum(seconds.get(name, 0) for name in figures)
    estimate = f"about {max(round(total), 1)} s on a 2-core CPU"
    if suite.device.type == "cuda":
        estimate += " (not yet timed on a GPU)"
    if suite.split_dir is not None and set(figures) & data_figures():
        estimate += ", plus the --data figures (their time depends on the data)"
    other = "--preset opv2v for the OPV2V geometry" if suite.preset_name != "opv2v" else ""
    names = "all" if len(figures) == len(FIGURES) else ", ".join(figures)
    return (f"bench plan: {len(figures)} of {len(FIGURES)} figures ({names}) on "
            f"{suite.device.type}, preset {suite.preset_name} ({display_path(args.hypes_yaml)}, "
            f"{sizes}); {estimate}" + (f"; {other}" if other else ""))


def measure_group(suite: Suite, group: Group, wanted: List[str]) -> List[Dict]:
    """The records of ``group`` that were asked for; a figure that fails becomes an error line
    (one broken figure must not hide the others), one lacking --data a skipped line."""
    if group.needs == "data" and suite.split_dir is None:
        return [{"figure": name, "skipped": "no --data folder given"} for name in wanted]
    logger.info("measuring %s", ", ".join(wanted))
    try:
        produced = group.measure(suite)
    except OpencoodError:
        raise
    except Exception as error:
        logger.exception("%s failed", group.figures[0])
        return [{"figure": name, "error": f"{type(error).__name__}: {error}"} for name in wanted]
    return [record for record in produced if record["figure"] in wanted]


def data_figures() -> set:
    return {name for group in GROUPS if group.needs == "data" for name in group.figures}


def list_figures() -> List[Dict]:
    width = max(len(name) for name in FIGURES)
    for name, about in FIGURES.items():
        needs = " (needs --data)" if name in data_figures() else ""
        print(f"{name:<{width}}  {about}{needs}")
    return []


def run(args) -> List[Dict]:
    from opencood.config import load_config
    from opencood.engine.recipe import check_registered_names
    if args.list:
        return list_figures()
    figures = selected_figures(args.figures)
    device = resolve_device(args.device)
    preset_name = args.preset or default_preset(device)
    apply_preset(args, PRESETS[preset_name])
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cfg = load_config(args.hypes_yaml, args.overrides)
    check_registered_names(cfg, str(args.hypes_yaml))
    split_dir = resolve_split_dir(args.data) if args.data is not None else None
    suite = Suite(args, preset_name, cfg, device, split_dir)
    groups = [group for group in GROUPS if set(group.figures) & set(figures)]
    if any(group.needs == "model" or (group.needs == "data" and split_dir) for group in groups):
        suite.model_bench             # an unknown model is an input error: before the plan
    logger.info("%s", plan_line(suite, figures))
    records: List[Dict] = []
    for group in groups:
        for record in measure_group(suite, group, [n for n in group.figures if n in figures]):
            emit(record)
            records.append(record)
    return records


def main(argv=None) -> List[Dict]:
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(message)s")
    records = run_cli(lambda arguments: run(parse_args(arguments)), argv)
    if any("error" in record for record in records):
        raise SystemExit(1)
    return records


if __name__ == "__main__":
    main()
