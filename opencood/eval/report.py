"""Evaluation reports: the arithmetic and the text of what summarises evaluation results
(docs/DESIGN.md §7), shared by tools/eval.py (``opencood.engine.evaluator``),
tools/results_table.py and tools/robustness_table.py.

* Arithmetic: ``mean_std`` (sample std, the one every spread and seed table uses),
  ``mean_of_known``, a sweep's ``spread_by_group`` and its ``pose_error_spread``.
* Cells: ``number_cell``, ``count_cell``, ``mean_std_cell``, ``seeds_spread_cell``, ``ap_cell``;
  ``markdown_table`` for the tables the tools write.
* The evaluator's printed tables: ``format_metrics`` (one setting), ``format_spread`` (a sweep
  over noise seeds).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np

from opencood.eval.protocols import DEFAULT_PROTOCOL

AP_KEYS = ("ap_30", "ap_50", "ap_70")
AP_NAMES = {"ap_30": "AP@0.3", "ap_50": "AP@0.5", "ap_70": "AP@0.7"}
POSE_ERROR_STATS = ("median_translation_m", "median_yaw_deg", "mean_translation_m",
                    "mean_yaw_deg")
UNKNOWN = "n/a"


# -- arithmetic ------------------------------------------------------------------------------

def mean_std(values: Sequence[float]) -> Dict[str, float]:
    """{"mean", "std"} of ``values``; std is the sample std (n - 1), 0 for a single value."""
    values = np.asarray(values, dtype=np.float64)
    std = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    return {"mean": float(values.mean()), "std": std}


def known(values: Sequence[Optional[float]]) -> List[float]:
    """The values that are known (None: a group or field absent), as floats."""
    return [float(value) for value in values if value is not None]


def mean_of_known(values: Sequence[Optional[float]]) -> Optional[float]:
    """Mean of the known values (None: none known)."""
    present = known(values)
    return sum(present) / len(present) if present else None


def spread_by_group(settings: List[Dict], results: List[Dict]) -> Dict[str, Dict]:
    """{group: {"runs": n, "ap_30": {"mean", "std"}, ...}} of evaluated ``settings`` (each with
    its "group") and their ``results``; std is the sample std (n - 1), 0 for a group of one run
    (a setting that draws nothing)."""
    groups: Dict[str, List[Dict]] = {}
    for setting, metrics in zip(settings, results):
        groups.setdefault(setting["group"], []).append(metrics)
    spread = {}
    for group, members in groups.items():
        row = {"runs": len(members)}
        for key in AP_KEYS:
            row[key] = mean_std([m[key] for m in members])
        pose = pose_error_spread([m.get("pose_error", {}) for m in members])
        if pose:
            row["pose_error"] = pose
        spread[group] = row
    return spread


def pose_error_spread(summaries: List[Dict]) -> Dict[str, Dict]:
    """Per-run pose-error summaries ({"before": {...}, "after": {...}}) -> {stage: {stat:
    {"mean", "std"}}} for the stages every run has ({} when runs have no agent pairs)."""
    stages = [stage for stage in ("before", "after")
              if summaries and all(stage in s and s[stage]["pairs"] for s in summaries)]
    return {stage: {stat: mean_std([s[stage][stat] for s in summaries])
                    for stat in POSE_ERROR_STATS} for stage in stages}


# -- cells -----------------------------------------------------------------------------------

def number_cell(value, digits: int = 3) -> str:
    return UNKNOWN if value is None else f"{float(value):.{digits}f}"


def count_cell(value) -> str:
    """A whole number with thousands separators ("n/a" when unknown)."""
    return UNKNOWN if value is None else f"{int(round(float(value))):,}"


def mean_std_cell(spread: Dict[str, float], digits: int = 3) -> str:
    """"0.600 ± 0.010" of a ``mean_std`` result."""
    return f"{spread['mean']:.{digits}f} ± {spread['std']:.{digits}f}"


def seeds_spread_cell(values: Sequence[Optional[float]]) -> str:
    """A cell over seeds: one known value as is, several as "mean ± std" (the sample std of
    ``mean_std``), none as "n/a"; None entries (a group absent) are left out."""
    present = known(values)
    if len(present) < 2:
        return number_cell(present[0] if present else None)
    return mean_std_cell(mean_std(present))


def ap_cell(value) -> str:
    """An AP cell of the printed table: 8 characters, "–" where the row has no GT (AP
    undefined)."""
    return f"{'–':>8}" if value is None else f"{value:8.4f}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    """The lines of a markdown table: the header, its rule, one line per row."""
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + \
        ["| " + " | ".join(row) + " |" for row in rows]


# -- the evaluator's printed tables ----------------------------------------------------------

def format_metrics(name: str, metrics: Dict) -> str:
    """One evaluated setting: AP overall, by distance and by visibility, GT counts, bandwidth,
    speed and the pose error; the GT range it was scored in where the metrics say. A run of
    several classes: the class mean first, then one row per class ("–": no GT of it), and the
    breakdowns as class means."""
    protocol = metrics.get("protocol", {})
    lines = [f"{name} (AP protocol: {protocol.get('name', DEFAULT_PROTOCOL)})"]
    if protocol.get("gt_range") is not None:       # records before issue 39 have none
        lines.append(f"GT scored in {format_range(protocol['gt_range'])} "
                     f"({protocol['gt_range_of']})")
    if metrics.get("labels"):                   # label_type camera only
        lines.append(f"GT labels: {metrics['labels']}")
    per_class = metrics.get("per_class", {})
    width = max([12] + [len(name) for name in per_class])
    # several classes: the first row and the breakdowns are class means (opencood.eval.ap)
    lines += [f"{'':>{width}} {'AP@0.3':>8} {'AP@0.5':>8} {'AP@0.7':>8} {'#GT':>6}",
              f"{'class mean' if per_class else 'overall':>{width}} {metrics['ap_30']:8.4f} "
              f"{metrics['ap_50']:8.4f} {metrics['ap_70']:8.4f} {metrics['num_gt']:6d}"]
    rows = list(per_class.items())
    rows += [(f"{bin_name} m", row) for bin_name, row in metrics["distance"].items()]
    rows += list(metrics.get("visibility", {}).items())
    for row_name, row in rows:
        aps = " ".join(ap_cell(row[key]) for key in AP_KEYS)
        lines.append(f"{row_name:>{width}} {aps} {row['num_gt']:6d}")
    if metrics.get("visibility_rule"):          # records before issue 36 have none
        lines.append(f"ego-visible by {metrics['visibility_rule']}")
    lines.append(f"bytes per agent per frame {metrics['bytes_per_agent']:.0f}, "
                 f"{metrics['frames_per_s']:.2f} frames/s, {metrics['num_frames']} frames")
    lines += format_pose_errors(metrics.get("pose_error", {}))
    return "\n".join(lines)


def format_range(box_range) -> str:
    """[xmin, ymin, zmin, xmax, ymax, zmax] -> 'x -140..140 y -40..40 z -3..1 m'."""
    return " ".join(f"{axis} {box_range[i]:g}..{box_range[i + 3]:g}"
                    for i, axis in enumerate("xyz")) + " m"


def format_pose_errors(pose_error: Dict) -> List[str]:
    """Table lines of the relative pose error (median / mean, metres and degrees), before and
    after correction; none where no sample has two agents."""
    lines = []
    for stage, label in (("before", "reported poses"), ("after", "corrected poses")):
        stats = pose_error.get(stage)
        if stats and stats["pairs"]:
            lines.append(f"pose error, {label}: median {stats['median_translation_m']:.3f} m "
                         f"{stats['median_yaw_deg']:.2f} deg, mean "
                         f"{stats['mean_translation_m']:.3f} m {stats['mean_yaw_deg']:.2f} deg "
                         f"({stats['pairs']} agent pairs)")
    boxes = pose_error.get("stage1_boxes")
    if boxes:
        lines.append(f"stage-1 boxes of the ego and another agent, true poses: median "
                     f"{boxes['median_offset_m']:.3f} m {boxes['median_heading_deg']:.1f} deg "
                     f"apart ({boxes['pairs']} matched pairs: the scatter that bounds the "
                     f"correction)")
    return lines


def format_spread(title: str, spread: Dict[str, Dict]) -> str:
    """A sweep's ``spread_by_group``: per group its runs, AP mean ± std and pose error."""
    lines = [title, f"{'':>20} {'runs':>4} " + " ".join(f"{AP_NAMES[key]:>16}" for key in AP_KEYS)
             + f" {'median pose error':>34}"]
    for group, row in spread.items():
        cells = " ".join(f"{row[k]['mean']:7.4f} ± {row[k]['std']:6.4f}" for k in AP_KEYS)
        lines.append(f"{group:>20} {row['runs']:4d} {cells} {format_pose_spread(row)}")
    return "\n".join(lines)


def format_pose_spread(row: Dict) -> str:
    """The median relative pose error of a spread row, of the stage the row's runs used (after
    correction where they corrected): "0.512 ± 0.010 m  0.49 ± 0.02 deg", or "" without."""
    pose = row.get("pose_error", {})
    stage = pose.get("after") or pose.get("before")
    if stage is None:
        return ""
    return (f"{mean_std_cell(stage['median_translation_m'])} m  "
            f"{mean_std_cell(stage['median_yaw_deg'], 2)} deg")
