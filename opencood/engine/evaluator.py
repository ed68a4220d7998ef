"""``tools/eval.py``: evaluate a checkpoint of a run (docs/DESIGN.md §7).

    python tools/eval.py --model_dir RUN [--checkpoint FILE] [--fusion_method no|early|late|intermediate]
                         [--split validate|test] [--save_vis] [--save_detections] [--no-ema]
                         [--pose_noise STD ...] [--latency FRAMES ...]
    python tools/eval.py --list RUN
    python tools/eval.py --model_dir RUN --heter_in_order m1 m2 m3 m4 [--modality_ap m1 m2]

and the same under torchrun: each rank evaluates an unpadded shard, detections are gathered to
rank 0, and AP is computed once. Each evaluated setting writes a self-describing record to
``RUN/evals/<split>_<fusion>[_<setting>]_<hash>.yaml`` (``opencood/eval/records.py``: checkpoint
and its hash, data folder, settings, code, machine, results), prints its table and logs its
TensorBoard scalars under ``eval/<record name>/``; ``--list`` prints a run's records.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
from pathlib import Path
from typing import Dict, List, Tuple

import torch
import yaml

from opencood.config import ConfigError, apply_overrides, load_config, resolve
from opencood.config_schema import BoxAlignArgs, to_plain
from opencood.data.collate import build_loader
from opencood.data.datasets import (CAMERA_LABELS, SPLIT_KEYS, VISIBILITY_CHOICES,
                                    VISIBILITY_RULES, build_dataset)
from opencood.data.pipeline import BatchPreparer
from opencood.engine.recipe import check_registered_names, configure_cuda
from opencood.errors import alike_on_every_rank, run_cli
from opencood.eval.heter_order import (agents_per_frame, check_modalities, format_summary,
                                      in_order_settings, modality_settings, summary_rows,
                                      write_in_order_assignment, write_summary)
from opencood.eval.detections import DetectionCollector, detections_name, write_detections
from opencood.eval.inference import detection_class_names, evaluate_loader
from opencood.eval.pose_correction import load_pose_corrector
from opencood.eval.protocols import DEFAULT_PROTOCOL, HEAL_PROTOCOL, PROTOCOLS
from opencood.eval.records import (RECORDS_DIR, build_record, checkpoint_facts, format_record_line,
                                   list_records, machine_facts, record_name,
                                   uses_validation_as_test, write_record)
from opencood.eval.report import format_metrics, format_spread, spread_by_group
from opencood.models.build import build_model
from opencood.strategies import choose_strategy, strategy_names
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import (CheckpointError, check_state_dict_compatible,
                                       load_checkpoint, run_checkpoint)
from opencood.utils.atomic import atomic_write
from opencood.utils.samplers import InferenceSampler

logger = logging.getLogger("opencood")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Evaluate a trained run (AP in BEV).")
    parser.add_argument("--model_dir", help="run folder written by tools/train.py")
    parser.add_argument("--list", dest="list_run", metavar="RUN",
                        help="print the evaluation records of a run folder, a line each")
    parser.add_argument("--checkpoint", help="checkpoint file (default RUN/best.pth, else last.pth)")
    parser.add_argument("--fusion_method", choices=strategy_names(),
                        help="fusion strategy at test time (default: the run's)")
    parser.add_argument("--split", default="test", choices=["validate", "test"])
    parser.add_argument("--save_vis", action="store_true", help="BEV pictures in RUN/vis/")
    parser.add_argument("--vis_count", type=int, default=10, help="pictures with --save_vis")
    parser.add_argument("--save_detections", action="store_true",
                        help="every frame's boxes, scores and sample key in "
                             "RUN/detections_<split>_<fusion>.npz (opencood/eval/detections.py)")
    parser.add_argument("--no-ema", dest="use_ema", action="store_false",
                        help="evaluate the raw weights even if the checkpoint has EMA weights")
    parser.add_argument("--pose_noise", type=float, nargs="*", default=[],
                        help="sweep: pose noise std (m for x/y, deg for yaw) of non-ego agents")
    parser.add_argument("--latency", type=int, nargs="*", default=[],
                        help="sweep: latency in frames of non-ego agents")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS),
                        help="AP protocol (default ours; heal with --heter_in_order / "
                             "--modality_ap): ours (global sort, the config's gt range), opencood "
                             "(per-frame sort, +-140 x +-40 m), coalign (global sort, "
                             "+-102.4 m), v2v4real, heal_dairv2x, v2xreal (per class, as "
                             "V2X-Real); see opencood/eval/protocols.py")
    parser.add_argument("--visibility", choices=VISIBILITY_CHOICES, default="auto",
                        help="what makes a GT box ego-visible in the AP split: auto (the ego's "
                             "LiDAR returns, or for camera-only inputs its cameras), lidar, or "
                             "camera (the ego's <ts>_bev_visibility.png; docs/evaluation.md)")
    parser.add_argument("--seeds", type=int, default=1,
                        help="noise seeds per --pose_noise level; > 1 prints mean ± std")
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--num_workers", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a key of the run's config")
    parser.add_argument("--heter_in_order", nargs="+", metavar="MODALITY",
                        help="HEAL's inference_heter_in_order: the agents take these modalities "
                             "in folder order (cycling), the first the ego's; one AP row per "
                             "step k, the first k agents fused, every agent's labels the GT")
    parser.add_argument("--modality_ap", nargs="+", metavar="MODALITY",
                        help="per-modality AP: every agent mapped to one modality, the ego "
                             "alone against the sample's GT; one row per modality")
    args = parser.parse_args(argv)
    if args.protocol is None:       # HEAL's own evaluations score as HEAL's scripts do
        args.protocol = HEAL_PROTOCOL if args.heter_in_order or args.modality_ap \
            else DEFAULT_PROTOCOL
    # Refused here, before the clean evaluation runs: the sweep would fail (or mean nothing)
    # only after it.
    if not args.model_dir and not args.list_run:
        parser.error("give --model_dir RUN (evaluate) or --list RUN (show its records)")
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    if args.seeds > 1 and not args.pose_noise:
        parser.error(f"--seeds {args.seeds} repeats each --pose_noise level with another noise "
                     f"seed; give --pose_noise STD ... (the clean and --latency settings draw "
                     f"no noise, so their spread would be of one run)")
    if (args.heter_in_order or args.modality_ap) and (args.pose_noise or args.latency):
        parser.error("--heter_in_order / --modality_ap evaluate clean settings; give "
                     "--pose_noise / --latency in another call")
    for flag, values in (("--pose_noise", args.pose_noise), ("--latency", args.latency)):
        negative = [value for value in values if value < 0]
        if negative:
            parser.error(f"{flag} must be >= 0, got {negative[0]:g}")
    return args


def load_eval_model(model_cfg: Dict, checkpoint_path: Path, use_ema: bool,
                    device) -> Tuple[torch.nn.Module, Dict]:
    """(the resolved ``model`` section's model with the checkpoint's EMA weights (if present and
    wanted) or raw weights, the checkpoint's facts for the record: file, epoch, step, sha256,
    weights)."""
    checkpoint = load_checkpoint(checkpoint_path)
    if "model" not in checkpoint:
        raise CheckpointError(f"{checkpoint_path}: not a training checkpoint (no 'model' entry)")
    model = build_model(model_cfg)
    weights = "ema" if use_ema and checkpoint.get("ema") else "raw"
    state = checkpoint["ema"]["module"] if weights == "ema" else checkpoint["model"]
    check_state_dict_compatible(model, state, checkpoint_path)
    model.load_state_dict(state)
    return model.to(device).eval(), checkpoint_facts(checkpoint_path, checkpoint, weights)


def settings_to_run(pose_noise: List[float], latency: List[int], seeds: int = 1,
                    base_seed: int = 25) -> List[Dict]:
    """[{"tag", "group", "overrides"}, ...]: the clean setting, then each sweep value.

    Pose noise is random: with ``seeds`` > 1 each noise level runs once per noise seed
    (``base_seed + k``), tagged ``noise0.2_seed1`` and grouped under ``noise0.2`` for the
    mean and std. Clean and latency settings draw nothing and run once: they switch pose noise
    off, which a run trained with noise (CoAlign's recipe) has on in its ``wild_setting``.
    """
    no_noise = ["wild_setting.loc_err=false"]
    runs = [{"tag": "", "group": "clean", "overrides": list(no_noise)}]
    for std in pose_noise:
        noise = ["wild_setting.loc_err=true", f"wild_setting.xyz_std={std}",
                 f"wild_setting.yaw_std={std}"]
        for k in range(seeds):
            suffix = f"_seed{k}" if seeds > 1 else ""
            runs.append({"tag": f"noise{std:g}{suffix}", "group": f"noise{std:g}",
                         "overrides": noise + [f"wild_setting.seed={base_seed + k}"]})
    for frames in latency:
        runs.append({"tag": f"latency{frames}", "group": f"latency{frames}", "overrides": [
            *no_noise, f"wild_setting.latency_frames={frames}"]})
    return runs


def vis_callback(run_dir: Path, tag: str, count: int, bev_range):
    """on_sample hook drawing the first ``count`` samples of this rank to RUN/vis/."""
    from opencood.eval.vis import draw_detection_sample, frame_title
    out_dir = run_dir / "vis"
    out_dir.mkdir(exist_ok=True)
    drawn = {"n": 0}

    def on_sample(key, batch, row, boxes, scores, classes=None):
        if drawn["n"] >= count:
            return
        name = "_".join(str(k) for k in key) + (f"_{tag}" if tag else "") + ".png"
        title = frame_title(key) + (f" ({tag})" if tag else "")
        draw_detection_sample(out_dir / name, batch, row, boxes, scores, bev_range, title)
        drawn["n"] += 1

    return on_sample


def correction_modes(box_align: Dict | None, strategy) -> List[Dict]:
    """How each setting is evaluated: [{"suffix", "fusion", "correct"}], once as is and, when
    the run has pose correction (a ``box_align`` section, or fusion ``late_box_align``), once
    more with it (suffix ``_aligned``), so the table shows AP with and without correction.
    Late fusion's correction is the ``late_box_align`` strategy; intermediate fusion's a stage-1
    ``PoseCorrector`` (``opencood.eval.pose_correction``)."""
    fusion = strategy.name
    if strategy.late_variants and (box_align is not None or strategy.corrects_poses):
        plain, aligned = strategy.late_variants
        return [{"suffix": "", "fusion": plain, "correct": False},
                {"suffix": "_aligned", "fusion": aligned, "correct": False}]
    if box_align is None:
        return [{"suffix": "", "fusion": fusion, "correct": False}]
    return [{"suffix": "", "fusion": fusion, "correct": False},
            {"suffix": "_aligned", "fusion": fusion, "correct": True}]


def evaluate_setting(cfg, args, run_dir, model, info, setting, checkpoint: Dict,
                     mode: Dict | None = None, corrector=None) -> Dict | None:
    """Evaluate one setting (clean, a noise level or a latency) in one correction ``mode``
    (:func:`correction_modes`; None: as configured) -> its record on rank 0 (see
    ``opencood/eval/records.py``), None on the other ranks."""
    protocol = PROTOCOLS[args.protocol]
    cfg_run = resolve(apply_overrides(cfg, setting["overrides"] + protocol.config_overrides(),
                                      source="eval sweep"), "eval sweep")
    fusion = args.fusion_method or cfg_run["fusion"]["core_method"]
    tag, correction = setting["tag"], None
    if mode is not None:
        fusion, tag = mode["fusion"], "_".join(filter(None, [tag, mode["suffix"].strip("_")]))
        corrector = corrector if mode["correct"] else None
        if mode["suffix"]:      # what corrected the poses, in the record (and its hash)
            correction = {"box_align": to_plain(cfg_run["box_align"] or {"args": BoxAlignArgs()}),
                          "stage1": "stage1_model_dir" if mode["correct"] else "own"}
    # The engine's one choice for this setting, handed to the data and the evaluation.
    strategy = choose_strategy(cfg_run, fusion)
    dataset = build_dataset(cfg_run, args.split, train=False, strategy=strategy,
                            visibility=args.visibility, use_cav=setting.get("use_cav"))
    loader = build_loader(dataset, info.device, args.num_workers, batch_size=args.batch_size,
                          sampler=InferenceSampler(len(dataset)))
    preparer = BatchPreparer.from_config(cfg_run, info.device, training=False)
    on_sample = None
    if args.save_vis:
        on_sample = vis_callback(run_dir, tag, args.vis_count,
                                 cfg_run["preprocess"]["cav_lidar_range"])
    collector = DetectionCollector(then=on_sample) if args.save_detections else None
    metrics = evaluate_loader(model, loader, preparer, info.device, strategy,
                              collector or on_sample,
                              protocol.at_gt_range(cfg_run["postprocess"]["gt_range"]), corrector,
                              detection_class_names(cfg_run["postprocess"]))
    if collector is not None:
        save_detections(collector, run_dir, args, fusion, tag, cfg_run["postprocess"]["order"],
                        detection_class_names(cfg_run["postprocess"]))
    if metrics is None:
        return None
    if "visibility" in metrics:
        metrics["visibility_rule"] = VISIBILITY_RULES[dataset.visibility_rule]
    if dataset.camera_labels:           # a GT other than the agents' LiDAR labels: said
        metrics["labels"] = CAMERA_LABELS
    if setting.get("use_cav") is not None:
        metrics["agents_per_frame"] = agents_per_frame(
            [len(dataset.split.info(i).cav_ids) for i in range(len(dataset.split))],
            setting["use_cav"])
    metrics["protocol"] = {"name": protocol.name, "description": protocol.description,
                           **scored_gt_range(protocol, cfg_run["postprocess"]["gt_range"])}
    return setting_record(cfg_run, args, tag, fusion, checkpoint, info, metrics, correction,
                          setting.get("agents"))


def scored_gt_range(protocol, gt_range) -> Dict:
    """{"gt_range": the range the GT was scored in, "gt_range_of": whose it is}: the protocol's
    own range where it has one (set as the data set's gt_range: ``gt_range``, the evaluated
    config's ``postprocess.gt_range``), else the config's own (for an imported run: the peer's test range cut to its LiDAR range,
    so another number of GT boxes than the peer's own evaluation counts)."""
    return {"gt_range": [float(v) for v in gt_range],
            "gt_range_of": (f"protocol {protocol.name}" if protocol.box_range is not None
                            else "postprocess.gt_range")}


def save_detections(collector: DetectionCollector, run_dir: Path, args, fusion: str, tag: str,
                    order: str, class_names: List[str] | None = None) -> None:
    """Every rank's frames to rank 0, written there (every rank calls it); ``order``: the box
    size order (``postprocess.order``); ``class_names``: a multi-class detector's."""
    frames = collector.gather()
    protocol = "" if args.protocol == DEFAULT_PROTOCOL else f"_{args.protocol}"
    path = Path(run_dir) / detections_name(args.split, fusion, tag, protocol)
    written = dist_utils.run_together(
        lambda: None if frames is None else write_detections(path, frames, order, class_names),
        "writing detections")
    if written is not None:
        print(f"detections: {written}", flush=True)


def setting_record(cfg_run: Dict, args, tag: str, fusion: str, checkpoint: Dict, info,
                   metrics: Dict, correction: Dict | None = None,
                   agents: Dict | None = None) -> Dict:
    """The record of one evaluated setting; names it (``metrics["name"]`` too).
    ``correction``: how the poses were corrected (``settings.pose_correction``), None: not.
    ``agents``: which agents took part (``settings.agents``: a ``--heter_in_order`` step or a
    ``--modality_ap`` modality, opencood.eval.heter_order), None: all."""
    folder = str(Path(cfg_run[SPLIT_KEYS[args.split]]).resolve())
    settings = {"fusion": fusion, "protocol": args.protocol,
                "wild_setting": dict(cfg_run["wild_setting"]), "overrides": list(args.overrides)}
    if correction is not None:
        settings["pose_correction"] = correction
    if agents is not None:
        settings["agents"] = agents
    if args.visibility != "auto":          # records of the default keep their names
        settings["visibility"] = args.visibility
    name = record_name(args.split, fusion, tag, args.protocol, DEFAULT_PROTOCOL,
                       {**settings, "split": args.split, "folder": folder}, checkpoint)
    metrics["name"] = name
    data = {"split": args.split, "folder": folder, "frames": metrics["num_frames"],
            "test_is_validation": uses_validation_as_test(cfg_run, args.split)}
    return build_record(name, checkpoint, data, settings, cfg_run,
                        machine_facts(info.device, info.world_size), metrics)


def report_results(record: Dict, run_dir: Path, writer) -> Path:
    """Rank 0: the record in RUN/evals/, the printed table (saying where the record went) and
    the TensorBoard scalars under eval/<record name>/ (a multi-class run's per class under
    eval/<record name>/<class>/); returns the record's path."""
    name, metrics = record["name"], record["results"]
    path = write_record(run_dir, record)
    print(format_metrics(name, metrics), flush=True)
    if record["data"]["test_is_validation"]:
        print(f"note: the test split is the validation folder {record['data']['folder']} "
              f"(the config's test_dir is its validate_dir); --set test_dir=PATH evaluates a "
              f"test folder", flush=True)
    print(f"record: {path}", flush=True)
    for key in ("ap_30", "ap_50", "ap_70"):
        writer.add_scalar(f"eval/{name}/{key}", metrics[key], 0)
    for group, row in metrics.get("visibility", {}).items():
        if row["ap_50"] is not None:        # a group without GT has no AP
            writer.add_scalar(f"eval/{name}/ap_50_{group.replace('-', '_')}", row["ap_50"], 0)
    for class_name, row in metrics.get("per_class", {}).items():      # several classes
        for key in ("ap_30", "ap_50", "ap_70"):
            if row[key] is not None:        # a class without GT has no AP
                writer.add_scalar(f"eval/{name}/{class_name}/{key}", row[key], 0)
    return path


def list_run_records(run_dir: Path) -> List[Dict]:
    """``--list RUN``: a line per record of the run; returns the records."""
    if not Path(run_dir).is_dir():
        raise ConfigError(f"{run_dir}: no such run folder")
    records = list_records(Path(run_dir))
    for path, record in records:
        print(format_record_line(path, record), flush=True)
    if not records:
        print(f"{run_dir}: no evaluation records (run tools/eval.py --model_dir {run_dir})",
              flush=True)
    return [record for _, record in records]


def evaluate(args) -> List[Dict]:
    """Evaluate every setting of ``args``; returns each setting's results on rank 0 (with
    ``name``, the record's name, and ``record``, its path)."""
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
        configure_cuda(cfg["performance"])      # the TF32 switches training validated with
        with alike_on_every_rank(info.rank):
            checkpoint_path = run_checkpoint(run_dir, args.checkpoint)
            model, checkpoint = load_eval_model(cfg["model"], checkpoint_path, args.use_ema,
                                                info.device)
            strategy = choose_strategy(cfg, args.fusion_method)
            strategy.check_model(model, cfg["model"]["core_method"])
        logger.info("evaluating %s on %s", checkpoint_path, args.split)
        results = []
        writer = None
        if dist_utils.is_main_process():
            from torch.utils.tensorboard import SummaryWriter
            writer = SummaryWriter(log_dir=str(run_dir))
        fusion = strategy.name
        modes = correction_modes(cfg["box_align"], strategy)
        with alike_on_every_rank(info.rank):
            corrector = load_pose_corrector(
                cfg, strategy, info.device,
                lambda stage1_cfg, path: load_eval_model(stage1_cfg["model"], path, True,
                                                         info.device)[0])
        settings = settings_to_run(args.pose_noise, args.latency, args.seeds,
                                   cfg["wild_setting"]["seed"])
        heter_runs = heter_settings(cfg, args, run_dir)
        if heter_runs and len(modes) > 1:
            raise ConfigError("--heter_in_order / --modality_ap: the run corrects poses "
                              "(box_align); evaluate its rows without the correction "
                              "(--set box_align=null)")
        if heter_runs:
            settings = [setting for _, kind_settings in heter_runs for setting in kind_settings]
        evaluated = []
        for setting in settings:
            for mode in modes:
                record = evaluate_setting(cfg, args, run_dir, model, info, setting, checkpoint,
                                          mode, corrector)
                # Rank 0 writes alone: should that fail, the other ranks stop too, not wait.
                written = dist_utils.run_together(
                    lambda: None if record is None else report_results(record, run_dir, writer),
                    "writing results")
                evaluated.append({**setting, "group": setting["group"] + mode["suffix"]})
                if record is not None:
                    results.append({**record["results"], "record": str(written)})
        if writer is not None:
            writer.close()
        dist_utils.run_together(
            lambda: write_heter_summaries(run_dir, args, fusion, heter_runs, results)
            if results and heter_runs else None, "writing the heterogeneous rows")
        dist_utils.run_together(
            lambda: write_spread(run_dir, args, fusion, evaluated, results)
            if results and args.seeds > 1 else None, "writing the spread")
        # Rank 0 computes AP after the gather while the others are done: let every rank leave
        # together so no rank tears the group down under another's feet.
        dist_utils.barrier()
        return results


def heter_settings(cfg: Dict, args, run_dir: Path) -> List[Tuple[str, List[Dict]]]:
    """[(kind, its settings)] of ``--heter_in_order`` ("in_order") and ``--modality_ap``
    ("modality"), in that order; [] without either (opencood.eval.heter_order)."""
    runs = []
    if args.heter_in_order:
        names = check_modalities(args.heter_in_order, cfg["heter"], "--heter_in_order")
        max_cav = cfg["train_params"]["max_cav"]
        if max_cav < len(names):        # a stage-two run trains its type alone (max_cav 1)
            raise ConfigError(f"--heter_in_order {' '.join(names)}: train_params.max_cav is "
                              f"{max_cav}, so at most {max_cav} agent(s) per sample; give "
                              f"--set train_params.max_cav={max(5, len(names))} (HEAL's "
                              f"final_infer setting)")
        # every rank writes the same file (atomically): each builds its data set from it
        path = write_in_order_assignment(cfg[SPLIT_KEYS[args.split]], names, run_dir,
                                         args.split)
        runs.append(("in_order", in_order_settings(names, path)))
    if args.modality_ap:
        names = check_modalities(args.modality_ap, cfg["heter"], "--modality_ap")
        runs.append(("modality", modality_settings(names, cfg["heter"])))
    return runs


HETER_TITLES = {
    "in_order": "HEAL's in-order evaluation: the first k agents fused (agents in folder order, "
                "ego first), every agent's labels the GT",
    "modality": "per-modality AP: every agent of one modality, the ego alone, every agent's "
                "labels the GT"}


def write_heter_summaries(run_dir: Path, args, fusion: str,
                          heter_runs: List[Tuple[str, List[Dict]]], results: List[Dict]) -> None:
    """Rank 0: each kind's rows (one per setting, ``results`` in the settings' order) printed
    as a table and written to RUN/evals/heter/."""
    start = 0
    for kind, kind_settings in heter_runs:
        rows = summary_rows(kind_settings, results[start:start + len(kind_settings)])
        start += len(kind_settings)
        title = f"{HETER_TITLES[kind]} ({args.split}, {fusion})"
        names = args.heter_in_order if kind == "in_order" else args.modality_ap
        path = write_summary(run_dir, kind, args.split, fusion, names, rows, title)
        print(format_summary(title, rows), flush=True)
        print(f"rows: {path}", flush=True)


def write_spread(run_dir: Path, args, fusion: str, settings: List[Dict],
                 results: List[Dict]) -> None:
    """Rank 0: mean ± std over noise seeds, printed and written to
    RUN/evals/spreads/<split>_<fusion>[_<protocol>]_<hash>.yaml, naming the records it spans."""
    names = [metrics["name"] for metrics in results]
    digest = hashlib.sha256("\n".join(names).encode()).hexdigest()[:8]
    protocol = "" if args.protocol == DEFAULT_PROTOCOL else f"_{args.protocol}"
    name = f"{args.split}_{fusion}{protocol}_{digest}"
    spread = spread_by_group(settings, results)
    print(format_spread(f"spread {name}: mean ± std over {args.seeds} noise seeds "
                        f"(AP protocol: {args.protocol})", spread), flush=True)
    path = Path(run_dir) / RECORDS_DIR / "spreads" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as stream:
        yaml.safe_dump({"seeds": args.seeds, "protocol": args.protocol, "records": names,
                        "groups": spread}, stream, sort_keys=False)
    print(f"spread: {path}", flush=True)


def main(argv=None) -> List[Dict]:
    def run(argv):
        args = parse_args(argv)
        return list_run_records(Path(args.list_run)) if args.list_run else evaluate(args)

    return run_cli(run, argv)
