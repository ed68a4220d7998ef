"""``tools/eval.py``: evaluate a checkpoint of a run (docs/DESIGN.md §7).

    python tools/eval.py --model_dir RUN [--checkpoint FILE] [--fusion_method no|early|late|intermediate]
                         [--split validate|test] [--save_vis] [--no-ema]
                         [--pose_noise STD ...] [--latency FRAMES ...]

and the same under torchrun: each rank evaluates an unpadded shard, detections are gathered to
rank 0, and AP is computed once. Results go to ``RUN/eval_<split>_<fusion>[_<setting>].yaml``, a
printed table and TensorBoard.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch
import yaml

from opencood.config import ConfigError, apply_overrides, load_config, resolve
from opencood.data.collate import build_loader
from opencood.data.datasets import build_dataset
from opencood.data.pipeline import BatchPreparer
from opencood.engine.recipe import check_registered_names, configure_cuda
from opencood.errors import alike_on_every_rank, run_cli
from opencood.eval.inference import evaluate_loader
from opencood.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS
from opencood.models.build import build_model
from opencood.strategies import get_strategy, strategy_names
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import CheckpointError, check_state_dict_compatible, load_checkpoint
from opencood.utils.atomic import atomic_write
from opencood.utils.samplers import InferenceSampler

logger = logging.getLogger("opencood")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Evaluate a trained run (AP in BEV).")
    parser.add_argument("--model_dir", required=True, help="run folder written by tools/train.py")
    parser.add_argument("--checkpoint", help="checkpoint file (default RUN/best.pth, else last.pth)")
    parser.add_argument("--fusion_method", choices=strategy_names(),
                        help="fusion strategy at test time (default: the run's)")
    parser.add_argument("--split", default="test", choices=["validate", "test"])
    parser.add_argument("--save_vis", action="store_true", help="BEV pictures in RUN/vis/")
    parser.add_argument("--vis_count", type=int, default=10, help="pictures with --save_vis")
    parser.add_argument("--no-ema", dest="use_ema", action="store_false",
                        help="evaluate the raw weights even if the checkpoint has EMA weights")
    parser.add_argument("--pose_noise", type=float, nargs="*", default=[],
                        help="sweep: pose noise std (m for x/y, deg for yaw) of non-ego agents")
    parser.add_argument("--latency", type=int, nargs="*", default=[],
                        help="sweep: latency in frames of non-ego agents")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default=DEFAULT_PROTOCOL,
                        help="AP protocol: ours (global sort, the config's gt range), opencood "
                             "(per-frame sort, +-140 x +-40 m) or coalign (global sort, "
                             "+-102.4 m); see opencood/eval/protocols.py")
    parser.add_argument("--seeds", type=int, default=1,
                        help="noise seeds per --pose_noise level; > 1 prints mean ± std")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a key of the run's config")
    args = parser.parse_args(argv)
    # Refused here, before the clean evaluation runs: the sweep would fail (or mean nothing)
    # only after it.
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.seeds > 1 and not args.pose_noise:
        parser.error(f"--seeds {args.seeds} repeats each --pose_noise level with another noise "
                     f"seed; give --pose_noise STD ... (the clean and --latency settings draw "
                     f"no noise, so their spread would be of one run)")
    for flag, values in (("--pose_noise", args.pose_noise), ("--latency", args.latency)):
        negative = [value for value in values if value < 0]
        if negative:
            parser.error(f"{flag} must be >= 0, got {negative[0]:g}")
    return args


def pick_checkpoint(run_dir: Path, explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    for name in ("best.pth", "last.pth"):
        if (run_dir / name).exists():
            return run_dir / name
    raise CheckpointError(f"{run_dir}: no best.pth or last.pth in the run folder "
                          f"(give --checkpoint FILE)")


def load_eval_model(cfg: Dict, checkpoint_path: Path, use_ema: bool, device) -> torch.nn.Module:
    """Model with the checkpoint's EMA weights (if present and wanted) or raw weights."""
    checkpoint = load_checkpoint(checkpoint_path)
    if "model" not in checkpoint:
        raise CheckpointError(f"{checkpoint_path}: not a training checkpoint (no 'model' entry)")
    model = build_model(cfg["model"])
    state = checkpoint["model"]
    if use_ema and checkpoint.get("ema"):
        state = checkpoint["ema"]["module"]
    check_state_dict_compatible(model, state, checkpoint_path)
    model.load_state_dict(state)
    return model.to(device).eval()


def settings_to_run(pose_noise: List[float], latency: List[int], seeds: int = 1,
                    base_seed: int = 25) -> List[Dict]:
    """[{"tag", "group", "overrides"}, ...]: the clean setting, then each sweep value.

    Pose noise is random: with ``seeds`` > 1 each noise level runs once per noise seed
    (``base_seed + k``), tagged ``noise0.2_seed1`` and grouped under ``noise0.2`` for the
    mean and std. Clean and latency settings draw nothing and run once.
    """
    runs = [{"tag": "", "group": "clean", "overrides": []}]
    for std in pose_noise:
        noise = ["wild_setting.loc_err=true", f"wild_setting.xyz_std={std}",
                 f"wild_setting.yaw_std={std}"]
        for k in range(seeds):
            suffix = f"_seed{k}" if seeds > 1 else ""
            runs.append({"tag": f"noise{std:g}{suffix}", "group": f"noise{std:g}",
                         "overrides": noise + [f"wild_setting.seed={base_seed + k}"]})
    for frames in latency:
        runs.append({"tag": f"latency{frames}", "group": f"latency{frames}", "overrides": [
            f"wild_setting.latency_frames={frames}"]})
    return runs


def spread_by_group(settings: List[Dict], results: List[Dict]) -> Dict[str, Dict]:
    """{group: {"runs": n, "ap_30": {"mean", "std"}, ...}}; std is the sample std (n - 1),
    0 for a group of one run (a setting that draws nothing)."""
    groups: Dict[str, List[Dict]] = {}
    for setting, metrics in zip(settings, results):
        groups.setdefault(setting["group"], []).append(metrics)
    spread = {}
    for group, members in groups.items():
        row = {"runs": len(members)}
        for key in ("ap_30", "ap_50", "ap_70"):
            row[key] = mean_std([m[key] for m in members])
        spread[group] = row
    return spread


def mean_std(values: List[float]) -> Dict[str, float]:
    """{"mean", "std"} of ``values``; std is the sample std (n - 1), 0 for a single value."""
    values = np.asarray(values, dtype=np.float64)
    std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return {"mean": float(values.mean()), "std": std}


def format_spread(title: str, spread: Dict[str, Dict]) -> str:
    lines = [title, f"{'':>12} {'runs':>4} " + " ".join(f"{name:>16}" for name in
                                                          ("AP@0.3", "AP@0.5", "AP@0.7"))]
    for group, row in spread.items():
        cells = " ".join(f"{row[k]['mean']:7.4f} ± {row[k]['std']:6.4f}"
                         for k in ("ap_30", "ap_50", "ap_70"))
        lines.append(f"{group:>12} {row['runs']:4d} {cells}")
    return "\n".join(lines)


def format_ap(value) -> str:
    """An AP cell: 8 characters, "–" where the row has no GT (AP undefined)."""
    return f"{'–':>8}" if value is None else f"{value:8.4f}"


def format_table(name: str, metrics: Dict) -> str:
    protocol = metrics.get("protocol", {}).get("name", DEFAULT_PROTOCOL)
    lines = [f"{name} (AP protocol: {protocol})",
             f"{'':>12} {'AP@0.3':>8} {'AP@0.5':>8} {'AP@0.7':>8} {'#GT':>6}",
             f"{'overall':>12} {metrics['ap_30']:8.4f} {metrics['ap_50']:8.4f} "
             f"{metrics['ap_70']:8.4f} {metrics['num_gt']:6d}"]
    rows = [(f"{bin_name} m", row) for bin_name, row in metrics["distance"].items()]
    rows += list(metrics.get("visibility", {}).items())
    for row_name, row in rows:
        aps = " ".join(format_ap(row[key]) for key in ("ap_30", "ap_50", "ap_70"))
        lines.append(f"{row_name:>12} {aps} {row['num_gt']:6d}")
    lines.append(f"bytes per agent per frame {metrics['bytes_per_agent']:.0f}, "
                 f"{metrics['frames_per_s']:.2f} frames/s, {metrics['num_frames']} frames")
    return "\n".join(lines)


def vis_callback(run_dir: Path, tag: str, count: int, bev_range):
    """on_sample hook drawing the first ``count`` samples of this rank to RUN/vis/."""
    from opencood.eval.vis import draw_detection_sample, frame_title
    out_dir = run_dir / "vis"
    out_dir.mkdir(exist_ok=True)
    drawn = {"n": 0}

    def on_sample(key, batch, row, boxes, scores):
        if drawn["n"] >= count:
            return
        name = "_".join(str(k) for k in key) + (f"_{tag}" if tag else "") + ".png"
        title = frame_title(key) + (f" ({tag})" if tag else "")
        draw_detection_sample(out_dir / name, batch, row, boxes, scores, bev_range, title)
        drawn["n"] += 1

    return on_sample


def evaluate_setting(cfg, args, run_dir, model, device, setting) -> Dict | None:
    protocol = PROTOCOLS[args.protocol]
    cfg_run = resolve(apply_overrides(cfg, setting["overrides"] + protocol.config_overrides(),
                                      source="eval sweep"), "eval sweep")
    fusion = args.fusion_method or cfg_run["fusion"]["core_method"]
    dataset = build_dataset(cfg_run, args.split, train=False, fusion_method=fusion)
    loader = build_loader(dataset, device, args.num_workers, batch_size=args.batch_size,
                          sampler=InferenceSampler(len(dataset)))
    preparer = BatchPreparer.from_config(cfg_run, device, training=False)
    on_sample = None
    if args.save_vis:
        on_sample = vis_callback(run_dir, setting["tag"], args.vis_count,
                                 cfg_run["preprocess"]["cav_lidar_range"])
    metrics = evaluate_loader(model, loader, preparer, cfg_run, device, fusion, on_sample,
                              protocol)
    if metrics is None:
        return None
    name = f"eval_{args.split}_{fusion}" + (f"_{setting['tag']}" if setting["tag"] else "")
    name += "" if protocol.name == DEFAULT_PROTOCOL else f"_{protocol.name}"
    metrics["name"] = name
    metrics["protocol"] = {"name": protocol.name, "description": protocol.description}
    return metrics


def report_results(metrics: Dict, run_dir: Path, writer) -> None:
    """Rank 0: RUN/<name>.yaml, the printed table and the TensorBoard scalars."""
    name = metrics["name"]
    with atomic_write(run_dir / f"{name}.yaml") as stream:
        yaml.safe_dump(_plain(metrics), stream, sort_keys=False)
    print(format_table(name, metrics), flush=True)
    for key in ("ap_30", "ap_50", "ap_70"):
        writer.add_scalar(f"{name}/{key}", metrics[key], 0)
    for group, row in metrics.get("visibility", {}).items():
        if row["ap_50"] is not None:        # a group without GT has no AP
            writer.add_scalar(f"{name}/ap_50_{group.replace('-', '_')}", row["ap_50"], 0)


def _plain(value):
    """Numpy/tensor scalars -> python numbers, for yaml.safe_dump."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value


def evaluate(args) -> List[Dict]:
    run_dir = Path(args.model_dir)
    config_path = run_dir / "config.yaml"
    # Every rank reads the same config and checkpoint: their errors are printed by rank 0 alone.
    with alike_on_every_rank(dist_utils.launcher_rank()):
        if not config_path.exists():
            raise ConfigError(f"{config_path}: not found; --model_dir must be a run folder "
                              f"written by tools/train.py")
        cfg = load_config(config_path, args.overrides)
        check_registered_names(cfg, str(config_path))
    dist_cfg = cfg["distributed"]
    with dist_utils.distributed_session(
            backend=dist_cfg["backend"],
            timeout_minutes=float(dist_cfg["timeout_minutes"])) as info:
        dist_utils.setup_logging(None, info.rank)
        configure_cuda(cfg)      # the TF32 switches training validated with
        with alike_on_every_rank(info.rank):
            checkpoint_path = pick_checkpoint(run_dir, args.checkpoint)
            model = load_eval_model(cfg, checkpoint_path, args.use_ema, info.device)
            get_strategy(args.fusion_method or cfg["fusion"]["core_method"]).check_model(
                model, cfg["model"]["core_method"])
        logger.info("evaluating %s on %s", checkpoint_path, args.split)
        results = []
        writer = None
        if dist_utils.is_main_process():
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(log_dir=str(run_dir))
        settings = settings_to_run(args.pose_noise, args.latency, args.seeds,
                                   cfg["wild_setting"]["seed"])
        for setting in settings:
            metrics = evaluate_setting(cfg, args, run_dir, model, info.device, setting)
            # Rank 0 writes alone: should that fail, the other ranks stop too, not wait.
            dist_utils.run_together(
                lambda: None if metrics is None else report_results(metrics, run_dir, writer),
                "writing results")
            if metrics is not None:
                results.append(metrics)
        if writer is not None:
            writer.close()
        fusion = args.fusion_method or cfg["fusion"]["core_method"]
        dist_utils.run_together(
            lambda: write_spread(run_dir, args, fusion, settings, results)
            if results and args.seeds > 1 else None, "writing the spread")
        # Rank 0 computes AP after the gather while the others are done: let every rank leave
        # together so no rank tears the group down under another's feet.
        dist_utils.barrier()
        return results


def write_spread(run_dir: Path, args, fusion: str, settings: List[Dict],
                 results: List[Dict]) -> None:
    """Rank 0: mean ± std over noise seeds, printed and written to RUN/eval_..._spread.yaml."""
    name = f"eval_{args.split}_{fusion}_spread" + (
        "" if args.protocol == DEFAULT_PROTOCOL else f"_{args.protocol}")
    spread = spread_by_group(settings, results)
    print(format_spread(f"{name}: mean ± std over {args.seeds} noise seeds "
                        f"(AP protocol: {args.protocol})", spread), flush=True)
    with atomic_write(run_dir / f"{name}.yaml") as stream:
        yaml.safe_dump({"seeds": args.seeds, "protocol": args.protocol, "groups": spread}, stream,
                       sort_keys=False)


def main(argv=None) -> List[Dict]:
    return run_cli(lambda argv: evaluate(parse_args(argv)), argv)
