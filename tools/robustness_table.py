#!/usr/bin/env python
"""docs/results.md's pose-noise robustness table from evaluated runs.

    python tools/robustness_table.py --run "No fusion=runs/no_fusion" --run "CoAlign=runs/coalign"
        [--split test] [--protocol ours] [--metric ap_50 ap_70] [--out FILE.md]

Each run must have been evaluated with a pose-noise sweep over several noise seeds, e.g.
``tools/eval.py --model_dir RUN --pose_noise 0.2 0.4 0.6 --seeds 3``, which writes a spread
(``RUN/evals/spreads/<split>_<fusion>[_<protocol>]_<hash>.yaml``: mean ± std over the seeds per
noise level, with and without pose correction where the run has it). The newest spread of the
split and protocol is used. One row per run, and one more ("+ correction") where the spread has
corrected groups; a cell is ``mean ± std`` of the metric; the last columns give the median
relative pose error at the largest noise, before and after correction.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Dict, List, Tuple

import yaml

from opencood.errors import ConfigError, run_cli
from opencood.eval.protocols import DEFAULT_PROTOCOL, PROTOCOLS
from opencood.eval.records import RECORDS_DIR
from opencood.eval.report import AP_NAMES, markdown_table, mean_std_cell

ALIGNED = "_aligned"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Pose-noise robustness table from spreads.")
    parser.add_argument("--run", action="append", required=True, metavar="NAME=RUN_DIR",
                        help="a table row: its name and its run folder (repeatable)")
    parser.add_argument("--split", default="test", choices=["validate", "test"])
    parser.add_argument("--protocol", default=DEFAULT_PROTOCOL, choices=sorted(PROTOCOLS))
    parser.add_argument("--metric", nargs="+", default=["ap_50"], choices=sorted(AP_NAMES))
    parser.add_argument("--out", help="also write the table (markdown) to this file")
    return parser.parse_args(argv)


def named_runs(items: List[str]) -> List[Tuple[str, Path]]:
    runs = []
    for item in items:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            raise ConfigError(f"--run {item!r}: expected NAME=RUN_DIR")
        runs.append((name, Path(folder)))
    return runs


def spread_protocol(path: Path) -> str:
    """The AP protocol a spread file's name says (``<split>_<fusion>[_<protocol>]_<hash>``)."""
    head = path.stem.rsplit("_", 1)[0]
    return next((name for name in PROTOCOLS
                 if name != DEFAULT_PROTOCOL and head.endswith(f"_{name}")), DEFAULT_PROTOCOL)


def newest_spread(run_dir: Path, split: str, protocol: str) -> Dict:
    """The newest spread yaml of ``split`` under ``protocol`` in ``run_dir`` (ConfigError, one
    line, when there is none)."""
    folder = run_dir / RECORDS_DIR / "spreads"
    spreads = sorted((path for path in folder.glob(f"{split}_*.yaml")
                      if spread_protocol(path) == protocol), key=lambda p: p.stat().st_mtime)
    if not spreads:
        raise ConfigError(f"{run_dir}: no {split} spread under protocol {protocol!r} in {folder} "
                          f"(run tools/eval.py --model_dir {run_dir} --split {split} "
                          f"--pose_noise 0.2 0.4 0.6 --seeds 3)")
    with open(spreads[-1]) as stream:
        return yaml.safe_load(stream)


def noise_levels(groups: Dict) -> List[str]:
    """["clean", "noise0.2", ...] in increasing noise, as the spread's groups hold them."""
    levels = [g for g in groups if g.startswith("noise") and not g.endswith(ALIGNED)]
    levels.sort(key=lambda g: float(g[len("noise"):]))
    return ["clean"] + levels


def cell(groups: Dict, group: str, metric: str) -> str:
    row = groups.get(group)
    if row is None:
        return "–"
    return mean_std_cell(row[metric])


def pose_cell(groups: Dict, group: str, stage: str) -> str:
    pose = groups.get(group, {}).get("pose_error", {}).get(stage)
    if pose is None:
        return "–"
    return (f"{pose['median_translation_m']['mean']:.2f} m / "
            f"{pose['median_yaw_deg']['mean']:.2f}°")


def table_rows(name: str, groups: Dict, levels: List[str], metric: str) -> List[List[str]]:
    """The row of a run (and its "+ correction" row where the spread has corrected groups)."""
    worst = levels[-1]
    rows = [[name] + [cell(groups, level, metric) for level in levels]
            + [pose_cell(groups, worst, "before")]]
    if any(g.endswith(ALIGNED) for g in groups):
        rows.append([f"{name} + correction"]
                    + [cell(groups, level + ALIGNED, metric) for level in levels]
                    + [pose_cell(groups, worst + ALIGNED, "after")])
    return rows


def render(runs: List[Tuple[str, Dict]], metric: str) -> str:
    levels = noise_levels(runs[0][1]["groups"])
    header = ["model"] + [level.replace("noise", "σ = ") for level in levels] \
        + [f"median pose error at {levels[-1].replace('noise', 'σ = ')}"]
    rows = [row for name, spread in runs
            for row in table_rows(name, spread["groups"], levels, metric)]
    return "\n".join([f"{AP_NAMES[metric]}, mean ± std over the noise seeds"]
                     + markdown_table(header, rows))


def main(argv=None) -> str:
    def run(argv):
        args = parse_args(argv)
        runs = [(name, newest_spread(folder, args.split, args.protocol))
                for name, folder in named_runs(args.run)]
        text = "\n\n".join(render(runs, metric) for metric in args.metric)
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return text

    return run_cli(run, argv)


if __name__ == "__main__":
    main()
