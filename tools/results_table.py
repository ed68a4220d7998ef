#!/usr/bin/env python
"""Reproduce the docs/results.md table in one command: train, evaluate, tabulate.

    python tools/results_table.py [--configs A.yaml B.yaml ... | --preset_dir hypes_yaml/opv2v]
        [--runs_root runs/table] [--steps N | --epochs N] [--nproc N] [--data DIR]
        [--split test] [--protocol ours] [--set KEY=VALUE ...] [--seeds N] [--skip_existing]
        [--dry_run]

For each config (default: the six models of ``hypes_yaml/synthetic``) it runs
``torchrun tools/train.py`` into ``RUNS_ROOT/<yaml stem>`` and then ``tools/eval.py`` on it, each
logged to ``RUNS_ROOT/<stem>.train.log`` / ``.eval.log``. It then reads every run's evaluation
record (``RUN/evals/``, ``opencood/eval/records.py``) of exactly the table's setting (the split's
data folder, the run's fusion, the AP protocol of ``--protocol``, default ours, no pose noise or
latency) and writes
``RUNS_ROOT/results.md`` (the table, each row with the checkpoint step and data folder its record
names, and the commands). A run without such a record is refused in one line, not mixed in.

* ``--steps N`` gives every model the same number of optimizer steps (late fusion trains on one
  example per (sample, CAV), so its epochs are longer): epochs = ceil(N / steps per epoch).
* ``--epochs N`` gives every model N epochs; with neither, each config's own ``epoches``.
* ``--seeds N`` trains every model N times, with training seeds base, base + 1, ... (base: the
  config's ``seed``), seed base + k into ``RUNS_ROOT/<stem>_seed<k>`` (the first seed keeps
  ``RUNS_ROOT/<stem>``); each AP cell is then mean ± std (sample std) over the seeds, and
  results.md gets a per-seed table too.
* ``--skip_existing`` does not retrain a run (one seed of a model) whose folder already holds a
  record of the table's setting.
* ``--protocol NAME`` evaluates (and tabulates) under that AP protocol (tools/eval.py's); with
  ``--skip_existing`` a run trained for another protocol's table is evaluated again, not
  retrained, when its folder holds a record of the same split, data and fusion.
* ``--dry_run`` prints the plan and the commands and trains nothing.
* Multi-class runs (``postprocess.classes``): AP@0.3/0.5/0.7 are class means, and
  "AP@0.3/0.5/0.7 <class>" columns per class follow.
* A run folder that holds ``last.pth`` but no such record is resumed by tools/train.py.
* A failing run (a model, or one seed of it) is reported on one line (with its log file); the
  others go on; the exit status is then 1. A row says how many seeds it averages ("2 of 3").

Per-run bookkeeping (epochs, steps, seed, minutes, commands) goes to ``RUNS_ROOT/<run>.run.yaml``.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from opencood.config import get_key, load_config  # noqa: E402
from opencood.data.datasets import SPLIT_KEYS  # noqa: E402
from opencood.errors import ConfigError, OpencoodError, one_line  # noqa: E402
from opencood.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS  # noqa: E402
from opencood.eval.records import describe, list_records, matching_records  # noqa: E402
from opencood.eval.report import (AP_KEYS, AP_NAMES, UNKNOWN, count_cell, markdown_table,  # noqa: E402
                                  mean_of_known, number_cell, seeds_spread_cell)
from opencood.utils.batching import epochs_for_steps, steps_per_epoch  # noqa: E402

DEFAULT_PRESET_DIR = REPO_ROOT / "hypes_yaml" / "synthetic"
# docs/results.md's row order.
DEFAULT_MODELS = ("point_pillar_no_fusion", "point_pillar_late_fusion",
                  "point_pillar_early_fusion", "point_pillar_attfuse", "point_pillar_fcooper",
                  "point_pillar_where2comm")
OCCLUDED_GROUP = "ego-occluded"


class TableError(OpencoodError):
    """Bad input for this tool; the message is one line."""


# -- plain computations (unit-tested; the cells and the arithmetic: opencood/eval/report.py) ---

def table_record(run_dir: Path, split: str, fusion: str, folder: str,
                 protocol: str = DEFAULT_PROTOCOL) -> Tuple[Optional[Dict], Optional[str]]:
    """(the newest evaluation record of exactly the table's setting, None), or (None, why there
    is none: one line). The setting: ``split`` of data ``folder`` (absolute), ``fusion``, AP
    ``protocol``, no pose noise and no latency."""
    records = list_records(run_dir) if Path(run_dir).is_dir() else []
    same_kind = matching_records(records, split=split, fusion=fusion,
                                 protocol=protocol, clean=True)
    matching = [record for _, record in same_kind if record["data"]["folder"] == folder]
    if matching:
        return max(matching, key=lambda record: record["date"] or ""), None
    if not records:
        return None, f"no evaluation record in {run_dir}"
    found = sorted({f"{describe(r['data']['split'])} of {describe(r['data']['folder'])}, "
                    f"{describe(r['settings']['fusion'])}, protocol "
                    f"{describe(r['settings']['protocol'])}" for _, r in records})
    return None, (f"no evaluation record of the table's setting ({split} of {folder}, {fusion}, "
                  f"protocol {protocol}, no noise or latency) in {run_dir}; it has: "
                  f"{'; '.join(found)}")


def record_metrics(record: Dict) -> Dict:
    """A table row's view of a record: its results plus the checkpoint step and data folder."""
    return {**record["results"], "checkpoint_step": record["checkpoint"]["step"],
            "data_folder": record["data"]["folder"]}


def distinct_cell(values: Sequence) -> str:
    """The values of a row's seeds, once each ("n/a" when unknown)."""
    known = [value for value in dict.fromkeys(values) if value is not None]
    return ", ".join(str(value) for value in known) if known else UNKNOWN


def occluded_ap50(metrics: Dict) -> Optional[float]:
    """``visibility["ego-occluded"]["ap_50"]`` of an eval result, or None when absent."""
    visibility = metrics.get("visibility")
    if not isinstance(visibility, dict):
        return None
    group = visibility.get(OCCLUDED_GROUP)
    if not isinstance(group, dict) or group.get("ap_50") is None:
        return None
    return float(group["ap_50"])


def class_ap(metrics: Dict, name: str, key: str) -> Optional[float]:
    """``per_class[name][key]`` (``key`` one of AP_KEYS) of a multi-class eval result, None
    when absent."""
    row = (metrics.get("per_class") or {}).get(name) or {}
    return None if row.get(key) is None else float(row[key])


def seeds_cell(finished: int, planned: int) -> str:
    """How many seeds a row averages: "3", or "2 of 3" when some failed."""
    return str(finished) if finished == planned else f"{finished} of {planned}"


def format_table(rows: Sequence[Dict]) -> str:
    """Markdown table of result rows.

    A row has ``model``, ``fusion``, ``epochs``, ``steps``, ``train_minutes`` (None: unknown),
    ``metrics`` (its finished seeds' results, ``record_metrics`` of their evaluation records:
    one per seed, [] for a model that failed) and optionally ``resumed`` (training went on from an earlier last.pth: its
    minutes are this session's), ``seeds`` (the planned training seeds: above 1 a "seeds" column
    counts the finished ones, and AP cells are mean ± std) and ``seed`` (the training seed of a
    single run: a "training seed" column, for the per-seed table).
    The column "AP@0.5 ego-occluded" appears when at least one row's metrics have that group;
    multi-class results add "AP@0.3/0.5/0.7 <class>" per class (their AP@0.3/0.5/0.7 are class
    means).
    """
    occluded = any(occluded_ap50(m) is not None for row in rows for m in row["metrics"])
    classes = list(dict.fromkeys(name for row in rows for m in row["metrics"]
                                 for name in (m.get("per_class") or {})))
    several_seeds = any(row.get("seeds", 1) > 1 for row in rows)
    per_seed = any("seed" in row for row in rows)
    header = ["model", "fusion", "epochs", "optimizer steps"]
    header += ["seeds"] if several_seeds else []
    header += ["training seed"] if per_seed else []
    header += ["AP@0.3", "AP@0.5", "AP@0.7"]
    header += ["AP@0.5 ego-occluded"] if occluded else []
    header += [f"{AP_NAMES[key]} {name}" for name in classes for key in AP_KEYS]
    header += ["bytes per agent", "train minutes per seed" if several_seeds else "train minutes"]
    header += ["checkpoint step", "data folder"]
    table = []
    for row in rows:
        metrics = row["metrics"]
        cells = [f"`{row['model']}`", str(row.get("fusion") or UNKNOWN),
                 count_cell(row.get("epochs")), count_cell(row.get("steps"))]
        if several_seeds:
            cells.append(seeds_cell(len(metrics), row.get("seeds", 1)))
        if per_seed:
            cells.append(str(row.get("seed", UNKNOWN)))
        first_ap = len(cells)
        cells += [seeds_spread_cell([m.get(key) for m in metrics]) for key in AP_KEYS]
        if occluded:
            cells.append(seeds_spread_cell([occluded_ap50(m) for m in metrics]))
        cells += [seeds_spread_cell([class_ap(m, name, key) for m in metrics])
                  for name in classes for key in AP_KEYS]
        minutes = number_cell(row.get("train_minutes"), 1)
        minutes += " (resumed)" if row.get("resumed") else ""
        cells += [count_cell(mean_of_known([m.get("bytes_per_agent") for m in metrics])), minutes,
                  distinct_cell([m.get("checkpoint_step") for m in metrics]),
                  distinct_cell([_rel(m["data_folder"]) if m.get("data_folder") else None
                                 for m in metrics])]
        if not metrics:
            cells[first_ap] = "failed"
        table.append(cells)
    return "\n".join(markdown_table(header, table))


def format_results_md(rows: Sequence[Dict], commands: Sequence[str], title: str, seeds: int = 1,
                      seed_rows: Sequence[Dict] = ()) -> str:
    """results.md: a title line, the table, the per-seed table (``seed_rows``, when given), then
    the exact commands in a code block."""
    heading = "# Results" if seeds == 1 else f"# Results: mean ± std over {seeds} training seeds"
    body = [f"{heading}\n\n{title}\n", format_table(rows), ""]
    if seed_rows:
        body += ["## Per seed", "", format_table(seed_rows), ""]
    body += ["## Commands", "", "```bash"] + list(commands) + ["```", ""]
    return "\n".join(body)


# -- configs and data ------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", help="model yamls (default: the six models of "
                        "--preset_dir)")
    parser.add_argument("--preset_dir", default=None,
                        help=f"folder of the six model yamls (default {_rel(DEFAULT_PRESET_DIR)})")
    parser.add_argument("--runs_root", default="runs/table", help="run folders, logs, results.md")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="the same optimizer steps for every model")
    length.add_argument("--epochs", type=int, help="the same epochs for every model")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes per model (default: CUDA devices, else 2)")
    parser.add_argument("--data", help="data folder holding train/, validate/ and test/")
    parser.add_argument("--split", default="test", choices=["validate", "test"])
    parser.add_argument("--protocol", default=DEFAULT_PROTOCOL, choices=sorted(PROTOCOLS),
                        help=f"AP protocol of the evaluation and the table (default "
                        f"{DEFAULT_PROTOCOL}; tools/eval.py --protocol)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="config override for every model")
    parser.add_argument("--seeds", type=int, default=1,
                        help="train every model N times (training seeds base, base+1, ...; base: "
                        "the config's seed); AP cells are then mean ± std")
    parser.add_argument("--skip_existing", action="store_true",
                        help="do not retrain a run (one seed of a model) whose folder holds an "
                        "evaluation record of the table's setting")
    parser.add_argument("--dry_run", action="store_true",
                        help="print the plan and the commands; train nothing")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args


def _rel(path) -> str:
    """``path`` relative to the working directory when it lies below it (for shown commands)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def config_paths(args) -> List[Path]:
    """The yamls to run: --configs, else the six default models of --preset_dir."""
    if args.configs and args.preset_dir:
        raise TableError("give --configs or --preset_dir, not both")
    if args.configs:
        paths = [Path(p) for p in args.configs]
    else:
        folder = Path(args.preset_dir) if args.preset_dir else Path(_rel(DEFAULT_PRESET_DIR))
        if not folder.is_dir():
            raise TableError(f"--preset_dir {folder}: folder not found")
        paths = [folder / f"{name}.yaml" for name in DEFAULT_MODELS]
    for path in paths:
        if not path.is_file():
            raise TableError(f"{path}: config file not found")
    stems = [path.stem for path in paths]
    duplicated = sorted({stem for stem in stems if stems.count(stem) > 1})
    if duplicated:
        raise TableError(f"two configs share the run name {duplicated[0]!r} (the yaml stem)")
    return paths


def data_overrides(data: Optional[str]) -> List[str]:
    """--set overrides pointing the three splits at ``data``/{train,validate,test}."""
    if not data:
        return []
    root = Path(data)
    if not root.is_dir():
        raise TableError(f"--data {data}: folder not found")
    missing = [split for split in ("train", "validate", "test") if not (root / split).is_dir()]
    if missing:
        raise TableError(f"--data {data}: no {', '.join(missing)} folder in it")
    return [f"root_dir={root / 'train'}", f"validate_dir={root / 'validate'}",
            f"test_dir={root / 'test'}"]


def count_train_examples(cfg: Dict, source: str) -> int:
    """Training examples of one epoch (late fusion: one per (sample, CAV)), no model built."""
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    from opencood.data.opv2v import OPV2VFormatError
    from opencood.data.pcd import PcdError
    from opencood.registry import RegistryError
    train_dir = cfg["root_dir"]
    if not train_dir or not Path(train_dir).is_dir():
        raise TableError(f"{source}: training folder {train_dir} (root_dir) not found; "
                         f"generate it or pass --data DIR")
    try:
        return len(build_dataset(cfg, "train", train=True, strategy=choose_strategy(cfg)))
    except (ValueError, OSError, OPV2VFormatError, PcdError, RegistryError) as error:
        raise TableError(f"{source}: {str(error).splitlines()[0]}") from None


def plan_model(path: Path, overrides: List[str], args, nproc: int) -> Dict:
    """Name, fusion, examples, steps per epoch and epochs of one config (one-line errors)."""
    from opencood.engine.recipe import check_registered_names
    try:
        cfg = load_config(path, overrides)
        check_registered_names(cfg, str(path))
    except ConfigError as error:
        raise TableError(str(error)) from None
    params = cfg["train_params"]
    examples = count_train_examples(cfg, str(path))
    try:
        epoch_steps = steps_per_epoch(examples, params["batch_size"], nproc,
                                      params["max_micro_batch"])
    except ValueError as error:
        raise TableError(f"{path}: train_params.batch_size: {error}") from None
    if epoch_steps < 1:
        raise TableError(f"{path}: {examples} training examples give no full global batch of "
                         f"{params['batch_size']} over {nproc} processes")
    max_steps = args.steps   # tools/train.py stops there (train_params.max_steps)
    if max_steps is not None:
        epochs = epochs_for_steps(max_steps, epoch_steps)
    else:
        epochs = args.epochs if args.epochs is not None else int(params["epoches"])
    split_folder = cfg[SPLIT_KEYS[args.split]]
    if not split_folder:
        raise TableError(f"{path}: {SPLIT_KEYS[args.split]} (the {args.split} folder) is not set; "
                         f"pass --data DIR")
    return {"model": path.stem, "config": path, "fusion": cfg["fusion"]["core_method"],
            "folder": str(Path(split_folder).resolve()),
            "examples": examples, "steps_per_epoch": epoch_steps, "epochs": epochs,
            "steps": max_steps if max_steps is not None else epochs * epoch_steps,
            "max_steps": max_steps, "base_seed": int(cfg["seed"])}


def seed_runs(plan: Dict, seeds: int) -> List[Dict]:
    """The runs of one model: ``plan`` plus ``run`` (its folder name), ``seed`` (its training
    seed) and ``seed_overrides`` (the --set giving that seed).

    Seed base + k trains into ``<model>_seed<k>``, except the first, which keeps ``<model>``: the
    folder of a one-seed table, so --skip_existing reuses it. One seed adds no override: the
    commands stay those of a table without --seeds.
    """
    runs = []
    for k in range(seeds):
        seed = plan["base_seed"] + k
        runs.append({**plan, "run": plan["model"] + (f"_seed{k}" if k else ""), "seed": seed,
                     "seed_overrides": [f"seed={seed}"] if seeds > 1 else []})
    return runs


# -- running ----------------------------------------------------------------------------------

def resolve_program(command: List[str]) -> List[str]:
    """``command`` with "torchrun"/"python" replaced by this interpreter's own (shown commands
    keep the short names: they are what one types in this environment)."""
    if command[0] == "python":
        return [sys.executable] + command[1:]
    if command[0] == "torchrun":
        beside = Path(sys.executable).with_name("torchrun")
        prefix = [str(beside)] if beside.exists() else [sys.executable, "-m",
                                                          "torch.distributed.run"]
        return prefix + command[1:]
    return command


def train_command(plan: Dict, run_dir: Path, nproc: int, overrides: List[str]) -> List[str]:
    """The torchrun command training one model for ``plan["epochs"]`` epochs (the last one cut
    at ``plan["max_steps"]`` optimizer steps when the table gives every model the same steps)."""
    epochs = plan["epochs"]
    command = ["torchrun", "--standalone", f"--nproc_per_node={nproc}",
                            _rel(REPO_ROOT / "tools" / "train.py"),
                            "--hypes_yaml", str(plan["config"]), "--model_dir", str(run_dir),
                            "--set", f"train_params.epoches={epochs}",
                            "--set", f"train_params.eval_freq={epochs}",
                            "--set", f"train_params.save_freq={epochs}"]
    if plan.get("max_steps") is not None:
        command += ["--set", f"train_params.max_steps={plan['max_steps']}"]
    for override in overrides:
        command += ["--set", override]
    return command


def eval_command(run_dir: Path, split: str, protocol: str = DEFAULT_PROTOCOL) -> List[str]:
    """The command evaluating one run on ``split`` under AP ``protocol`` (the default one adds
    no flag)."""
    command = ["python", _rel(REPO_ROOT / "tools" / "eval.py"), "--model_dir", str(run_dir),
               "--split", split]
    return command + (["--protocol", protocol] if protocol != DEFAULT_PROTOCOL else [])


def run_commands(run: Dict, args, nproc: int, overrides: List[str]) -> List[List[str]]:
    """[train, eval] commands of one run (one seed of one model)."""
    run_dir = Path(args.runs_root) / run["run"]
    return [train_command(run, run_dir, nproc, overrides + run["seed_overrides"]),
            eval_command(run_dir, args.split, args.protocol)]


def run_logged(command: List[str], log_path: Path) -> tuple:
    """Run ``command`` with stdout and stderr into ``log_path``; (return code, seconds)."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        code = subprocess.call(resolve_program(command), stdout=log, stderr=subprocess.STDOUT)
    return code, time.perf_counter() - start


def read_yaml(path: Path) -> Optional[Dict]:
    """A yaml mapping, or None when the file is absent or not a mapping."""
    if not path.is_file():
        return None
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


_START = time.perf_counter()


def _elapsed() -> str:
    """Minutes since this tool started, for the progress lines."""
    return f"{(time.perf_counter() - _START) / 60:.1f} min"


def train_and_eval(run: Dict, args, nproc: int, overrides: List[str], tag: str) -> Dict:
    """Train then evaluate one run; returns its bookkeeping record (``error`` on failure)."""
    root = Path(args.runs_root)
    run_dir = root / run["run"]
    commands = run_commands(run, args, nproc, overrides)
    record = {"model": run["model"], "run": run["run"], "seed": run["seed"],
              "config": str(run["config"]), "fusion": run["fusion"], "folder": run["folder"],
              "epochs": run["epochs"], "steps": run["steps"],
              "train_examples": run["examples"], "steps_per_epoch": run["steps_per_epoch"],
              "nproc": nproc, "commands": [shlex.join(c) for c in commands]}
    if (run_dir / "last.pth").exists():
        record["resumed"] = True
        print(f"{tag} note: {run_dir} holds last.pth: tools/train.py resumes it (its train "
              f"minutes count this session only)", flush=True)
    print(f"{tag} training {run['run']}: {run['epochs']} epochs, {run['steps']:,} steps",
          flush=True)
    for kind, command in zip(("train", "eval"), commands):
        log_path = root / f"{run['run']}.{kind}.log"
        code, seconds = run_logged(command, log_path)
        record[f"{kind}_minutes"] = seconds / 60
        print(f"{tag} {run['run']}: {kind} {'done' if code == 0 else 'FAILED'} in "
              f"{seconds / 60:.1f} min ({_elapsed()} since the start)", flush=True)
        if code != 0:
            record["error"] = (f"error: {run['run']}: {kind} exited with status {code}; "
                               f"see {log_path}")
            break
    (root / f"{run['run']}.run.yaml").write_text(yaml.safe_dump(record, sort_keys=False))
    return record


def existing_record(run: Dict, args) -> Optional[Dict]:
    """The record of a finished run under --skip_existing (None: it must be trained)."""
    run_dir = Path(args.runs_root) / run["run"]
    evaluated, _ = table_record(run_dir, args.split, run["fusion"], run["folder"], args.protocol)
    if evaluated is None:
        return None
    saved = read_yaml(Path(args.runs_root) / f"{run['run']}.run.yaml") or {}
    saved.pop("error", None)              # the record is there: whatever failed, it is done
    config = read_yaml(run_dir / "config.yaml") or {}
    epochs = saved.get("epochs", get_key(config, "train_params.epoches", None))
    steps = saved.get("steps")
    if steps is None and epochs is not None:
        steps = int(epochs) * run["steps_per_epoch"]
    # The seed the folder was trained with (its saved config), which an earlier table with
    # another --set seed may have made differ from the planned one.
    seed = config.get("seed", run["seed"])
    return {**saved, "model": run["model"], "run": run["run"], "seed": seed,
            "fusion": run["fusion"], "folder": run["folder"], "epochs": epochs, "steps": steps,
            "skipped": True, "eval_record": evaluated["name"],
            "commands": saved.get("commands", [])}


def evaluated_otherwise(run: Dict, args) -> bool:
    """Whether the run's folder holds a clean record of the table's split, data and fusion under
    another AP protocol: trained, so --skip_existing only evaluates it again."""
    run_dir = Path(args.runs_root) / run["run"]
    records = list_records(run_dir) if run_dir.is_dir() else []
    return any(record["data"]["folder"] == run["folder"] for _, record in
               matching_records(records, split=args.split, fusion=run["fusion"], clean=True))


def evaluate_again(run: Dict, args, tag: str) -> Dict:
    """Evaluate a trained run under --protocol (no training); its record as existing_record
    gives it, or one with ``error`` when the evaluation failed."""
    root = Path(args.runs_root)
    command = eval_command(root / run["run"], args.split, args.protocol)
    log_path = root / f"{run['run']}.eval_{args.protocol}.log"
    code, seconds = run_logged(command, log_path)
    print(f"{tag} {run['run']}: trained; eval ({args.protocol}) "
          f"{'done' if code == 0 else 'FAILED'} in {seconds / 60:.1f} min", flush=True)
    record = existing_record(run, args) if code == 0 else None
    if record is None:
        return {"model": run["model"], "run": run["run"], "seed": run["seed"],
                "fusion": run["fusion"], "folder": run["folder"],
                "error": f"error: {run['run']}: eval exited with status {code}; see {log_path}"}
    record["commands"] = record.get("commands", []) + [shlex.join(command)]
    return record


def run_metrics(record: Dict, args) -> Tuple[Optional[Dict], Optional[str]]:
    """(a run's row metrics from its evaluation record of the table's setting, None), or (None,
    why not) when its training or evaluation failed or no such record exists."""
    if "error" in record:
        return None, record["error"]
    evaluated, reason = table_record(Path(args.runs_root) / record["run"], args.split,
                                     record["fusion"], record["folder"], args.protocol)
    return (record_metrics(evaluated), None) if evaluated is not None else (None, reason)


def seed_row(record: Dict, metrics: Optional[Dict]) -> Dict:
    """A per-seed format_table row: one run, named by its folder, with its training seed."""
    return {"model": record["run"], "seed": record["seed"], "fusion": record["fusion"],
            "epochs": record.get("epochs"), "steps": record.get("steps"),
            "train_minutes": record.get("train_minutes"), "resumed": bool(record.get("resumed")),
            "metrics": [metrics] if metrics is not None else []}


def model_rows(records: Sequence[Dict], metrics: Sequence[Optional[Dict]],
               seeds: int) -> List[Dict]:
    """One format_table row per model (in first-seen order) over its runs: the finished runs'
    metrics, the mean train minutes, epochs and steps of its first seed."""
    runs_by_model: Dict[str, List[tuple]] = {}
    for record, run_result in zip(records, metrics):
        runs_by_model.setdefault(record["model"], []).append((record, run_result))
    rows = []
    for model, runs in runs_by_model.items():
        first = runs[0][0]
        rows.append({"model": model, "fusion": first["fusion"], "epochs": first.get("epochs"),
                     "steps": first.get("steps"), "seeds": seeds,
                     "train_minutes": mean_of_known([r.get("train_minutes") for r, _ in runs]),
                     "resumed": any(r.get("resumed") for r, _ in runs),
                     "metrics": [m for _, m in runs if m is not None]})
    return rows


# -- main -------------------------------------------------------------------------------------

def plan_all(args) -> tuple:
    """(plans, nproc, overrides) for every config, all checked before anything trains."""
    if args.steps is not None and args.steps < 1 or args.epochs is not None and args.epochs < 1:
        raise TableError("--steps and --epochs must be positive")
    if args.seeds < 1:
        raise TableError(f"--seeds must be at least 1, got {args.seeds}")
    nproc = args.nproc or _default_nproc()
    if nproc < 1:
        raise TableError("--nproc must be positive")
    overrides = data_overrides(args.data) + list(args.overrides)
    plans = [plan_model(path, overrides, args, nproc) for path in config_paths(args)]
    return plans, nproc, overrides


def _default_nproc() -> int:
    import torch
    return torch.cuda.device_count() or 2


def describe_plans(plans: List[Dict], args) -> str:
    """One line per model: examples, steps per epoch, the chosen epochs and steps."""
    how = (f"{args.steps:,} steps each" if args.steps is not None else
           f"{args.epochs} epochs each" if args.epochs is not None else "each config's epochs")
    lines = [f"plan ({how}):"]
    for plan in plans:
        seeds = (f", training seeds {plan['base_seed']}..{plan['base_seed'] + args.seeds - 1}"
                 if args.seeds > 1 else "")
        lines.append(f"  {plan['model']}: {plan['examples']} train examples, "
                     f"{plan['steps_per_epoch']} steps/epoch -> {plan['epochs']} epochs, "
                     f"{plan['steps']:,} steps{seeds}")
    return "\n".join(lines)


def run_all(args) -> int:
    """Plan, train/evaluate (or reuse) every run, write results.md; the exit status."""
    plans, nproc, overrides = plan_all(args)
    print(describe_plans(plans, args), flush=True)
    runs = [run for plan in plans for run in seed_runs(plan, args.seeds)]
    if args.dry_run:
        for run in runs:
            for command in run_commands(run, args, nproc, overrides):
                print(shlex.join(command))
        return 0
    root = Path(args.runs_root)
    root.mkdir(parents=True, exist_ok=True)
    records = [train_or_reuse(run, args, nproc, overrides, f"[{index}/{len(runs)}]")
               for index, run in enumerate(runs, 1)]
    outcomes = [run_metrics(record, args) for record in records]
    metrics = [run_result for run_result, _ in outcomes]
    rows = model_rows(records, metrics, args.seeds)
    write_results(rows, records, metrics, args, nproc)
    print(format_table(rows))
    print(f"written to {root / 'results.md'} ({_elapsed()} in all)")
    failed = [record for record in records if "error" in record]
    missing = [(record, reason) for record, (run_result, reason) in zip(records, outcomes)
               if run_result is None and "error" not in record]
    for record, reason in missing:
        print(f"error: {record['run']}: {reason}", file=sys.stderr)
    return 1 if failed or missing else 0


def train_or_reuse(run: Dict, args, nproc: int, overrides: List[str], tag: str) -> Dict:
    """The record of one run: reused under --skip_existing when it holds an evaluation record of
    the table's setting, else trained and evaluated now; a failure is reported on stderr."""
    record = existing_record(run, args) if args.skip_existing else None
    if record is None and args.skip_existing and evaluated_otherwise(run, args):
        record = evaluate_again(run, args, tag)
    if record is None:
        record = train_and_eval(run, args, nproc, overrides, tag)
    elif "error" not in record:
        other_seed = (f" (its config.yaml has seed {record['seed']}, not {run['seed']})"
                      if record["seed"] != run["seed"] else "")
        print(f"{tag} {run['run']}: evaluated (evals/{record['eval_record']}.yaml), "
              f"not retrained{other_seed}", flush=True)
    if "error" in record:
        print(record["error"], file=sys.stderr, flush=True)
    return record


def write_results(rows: List[Dict], records: List[Dict], metrics: List[Optional[Dict]], args,
                  nproc: int) -> None:
    """RUNS_ROOT/results.md: the table, with a per-seed table when --seeds > 1."""
    title = (f"Split `{args.split}`, {nproc} process(es) per model; written by "
             f"`{shlex.join(['python', _rel(__file__)] + args.argv)}` (`python` and `torchrun` "
             f"are those of {sys.executable}).")
    seed_rows = []
    if args.seeds > 1:
        title += (f" Each AP cell is the mean ± std (sample std, n - 1) over the {args.seeds} "
                  f"training seeds of its model (the config's `seed` + 0..{args.seeds - 1}), "
                  f"of those that finished (column seeds); train minutes are the mean per seed.")
        seed_rows = [seed_row(record, run_result)
                     for record, run_result in zip(records, metrics)]
    commands = [c for record in records for c in record.get("commands", [])]
    (Path(args.runs_root) / "results.md").write_text(
        format_results_md(rows, commands, title, args.seeds, seed_rows))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run_all(args)
    except OpencoodError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
