#!/usr/bin/env python
"""HEAL's table from run folders: AP as agent types join, and what each type cost to train.

    python tools/heal_table.py --chain runs/heal/base runs/heal/align_m2 runs/heal/align_m3 \\
        runs/heal/align_m4 [--chain ...another seed's runs...] [--split test] [--out FILE.md]

A chain is the base run followed by the run aligning each new type, in the order the types
join (docs/heterogeneous.md "HEAL's table"). The AP rows come from the last run of the chain
(the one holding every type): its newest ``tools/eval.py --heter_in_order`` rows of the split
(``RUN/evals/heter/<split>_*_in_order_*.yaml``), which must have one step per run of the chain.
Row k's cost is run k's ``train_cost.yaml`` (optimizer steps, training wall seconds), and its
fraction of the base's: HEAL's point that a new type costs a fraction of retraining. Several
chains (one per training seed) give mean ± std cells (sample std) and per-chain columns.
A missing file is refused in one line.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Sequence

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from opencood.engine.state import TRAIN_COST_FILE  # noqa: E402
from opencood.errors import OpencoodError, one_line  # noqa: E402
from opencood.eval.heter_order import HETER_DIR  # noqa: E402
from opencood.eval.records import RECORDS_DIR  # noqa: E402
from opencood.eval.report import markdown_table, mean_of_known, number_cell, \
    seeds_spread_cell  # noqa: E402


class HealTableError(OpencoodError):
    """Bad input for this tool; the message is one line naming the file."""


def read_yaml_file(path: Path) -> Dict:
    """A yaml mapping; HealTableError naming the file when absent or not a mapping."""
    if not path.is_file():
        raise HealTableError(f"{path}: not found")
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise HealTableError(f"{path}: not a yaml mapping")
    return data


def in_order_rows(run_dir: Path, split: str) -> List[Dict]:
    """The rows of the newest ``--heter_in_order`` evaluation of ``split`` in ``run_dir``."""
    folder = Path(run_dir) / RECORDS_DIR / HETER_DIR
    found = sorted(folder.glob(f"{split}_*_in_order_*.yaml"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise HealTableError(f"{folder}: no {split} rows of tools/eval.py --heter_in_order "
                             f"(evaluate {run_dir} with it first)")
    return read_yaml_file(found[-1])["rows"]


def chain_rows(chain: Sequence[Path], split: str) -> List[Dict]:
    """One row per run of the chain: the in-order step's AP and the run's training cost, with
    its fractions of the base's (run 0's) steps and seconds."""
    rows = in_order_rows(chain[-1], split)
    if len(rows) != len(chain):
        raise HealTableError(f"{chain[-1]}: its in-order rows have {len(rows)} steps, the chain "
                             f"{len(chain)} runs (one per type joining)")
    costs = [read_yaml_file(Path(run) / TRAIN_COST_FILE) for run in chain]
    base = costs[0]
    return [{"agents": row["agents"], "ap_50": row["ap_50"], "ap_70": row["ap_70"],
             "num_gt": row["num_gt"], "run": str(run), "steps": cost["steps"],
             "minutes": cost["train_seconds"] / 60.0,
             "trainable": cost["trainable_parameters"],
             "step_fraction": cost["steps"] / base["steps"],
             "time_fraction": cost["train_seconds"] / base["train_seconds"]}
            for row, run, cost in zip(rows, chain, costs)]


def format_table(chains_rows: Sequence[List[Dict]]) -> str:
    """The markdown table over one or several chains (seeds): AP mean ± std, cost means."""
    header = ["agents", "AP@0.5", "AP@0.7", "trained for this row", "optimizer steps",
              "train minutes", "trainable parameters", "steps / base's", "time / base's"]
    table = []
    for k, first in enumerate(chains_rows[0]):
        rows = [chain[k] for chain in chains_rows]
        table.append([
            first["agents"] + (" (base)" if k == 0 else ""),
            seeds_spread_cell([row["ap_50"] for row in rows]),
            seeds_spread_cell([row["ap_70"] for row in rows]),
            ", ".join(f"`{row['run']}`" for row in rows),
            number_cell(mean_of_known([row["steps"] for row in rows]), 0),
            number_cell(mean_of_known([row["minutes"] for row in rows]), 1),
            f"{first['trainable']:,}",
            number_cell(mean_of_known([row["step_fraction"] for row in rows]), 2),
            number_cell(mean_of_known([row["time_fraction"] for row in rows]), 2)])
    return "\n".join(markdown_table(header, table))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", nargs="+", action="append", required=True, metavar="RUN",
                        help="the base run, then each aligned type's run, in joining order "
                             "(repeat for another seed)")
    parser.add_argument("--split", default="test")
    parser.add_argument("--out", help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    try:
        lengths = {len(chain) for chain in args.chain}
        if len(lengths) != 1:
            raise HealTableError(f"every --chain needs the same number of runs, got "
                                 f"{sorted(lengths)}")
        text = format_table([chain_rows([Path(r) for r in chain], args.split)
                             for chain in args.chain])
    except OpencoodError as error:
        print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
