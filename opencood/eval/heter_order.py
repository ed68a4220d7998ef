"""HEAL's evaluations of heterogeneous runs (``tools/eval.py --heter_in_order`` and
``--modality_ap``; docs/heterogeneous.md "Evaluating as HEAL does").

**In order** (HEAL's ``tools/inference_heter_in_order.py``): the agents of every scenario take
the given modalities in folder order, cycling (HEAL's ``_in_order.json``: the first folder
``-1``, a roadside unit, moved last; :func:`opencood.data.heter.in_order_assignment`), the first
name is the ego's (``heter.ego_modality``), each name maps to itself (``heter.mapping_dict``);
step k of N keeps the first k agents of each sample for the fusion (HEAL's ``use_cav``), the
GT stays every agent's labels at every step. With ``m1 m2 m3 m4`` the steps are m1; m1+m2;
m1+m2+m3; m1+m2+m3+m4: HEAL's main table. A sample with fewer than k agents fuses all it has.

**Per modality** (HEAL's single-modality evaluation, its stage-two yamls mapping every agent
to one modality): for each given modality every agent is mapped to it, and the ego alone
detects (``use_cav`` 1) against the sample's GT of every agent (HEAL's ``--fusion_method no``;
its ``single`` scores the ego's own labels instead). So each modality is scored on the same
frames, egos and GT, through the run's own model: for a collaboration model its branch, the
pyramid with one agent and the shared heads, which is what an aligned type must get right.

Each step or modality is an evaluated setting with its own record (``settings.agents``); the
rows together go to ``RUN/evals/heter/<split>_<fusion>_<kind>_<hash>.yaml`` and a printed
table.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Sequence

import yaml

from opencood.data.heter import in_order_assignment
from opencood.errors import ConfigError
from opencood.eval.records import RECORDS_DIR
from opencood.eval.report import markdown_table, number_cell
from opencood.utils.atomic import atomic_write

HETER_DIR = "heter"
NO_NOISE = "wild_setting.loc_err=false"
# HEAL's post-processing (its VoxelPostprocessor: implausible boxes dropped before NMS, the
# 1000 best-scored enter it, every survivor kept), for both evaluations
HEAL_POSTPROCESS = ["postprocess.filters=reference", "postprocess.pre_nms_max=1000"]
# inference_heter_in_order.py's communication range ("large enough": every agent joins)
HEAL_IN_ORDER_COMM_RANGE = 180


def check_modalities(names: Sequence[str], heter, flag: str) -> List[str]:
    """``names`` as a list, checked: a heter run, names its ``heter.modality_setting`` has,
    each once; a ConfigError naming ``flag`` otherwise."""
    names = list(names)
    if heter is None:
        raise ConfigError(f"{flag}: the run has no heter section (heterogeneous agents, "
                          f"docs/heterogeneous.md)")
    known = list(heter["modality_setting"])
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ConfigError(f"{flag}: {unknown[0]!r} is not a modality of the run "
                          f"(heter.modality_setting has {', '.join(known)})")
    if len(set(names)) != len(names):
        raise ConfigError(f"{flag}: a modality is named twice ({' '.join(names)})")
    return names


def write_in_order_assignment(split_dir, names: Sequence[str], run_dir, split: str) -> Path:
    """The in-order assignment of the split's folders with ``names``, written to
    ``RUN/evals/heter/<split>_in_order_<names>.json`` (what the steps' configs point
    ``heter.assignment_path`` at); returns the path."""
    assignment = in_order_assignment(split_dir, names)
    path = Path(run_dir) / RECORDS_DIR / HETER_DIR / f"{split}_in_order_{'_'.join(names)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as stream:
        json.dump(assignment, stream, indent=4, sort_keys=True)
    return path


def in_order_settings(names: Sequence[str], assignment_path) -> List[Dict]:
    """One setting per step (``tools/eval.py``'s setting dicts plus ``use_cav`` and
    ``agents``): step k keeps the first k agents, ``names[:k]``."""
    mapping = "{" + ", ".join(f"{name}: {name}" for name in names) + "}"
    overrides = [NO_NOISE, *HEAL_POSTPROCESS, f"comm_range={HEAL_IN_ORDER_COMM_RANGE}",
                 f"heter.assignment_path={assignment_path}",
                 f"heter.mapping_dict={mapping}", f"heter.ego_modality={names[0]}"]
    return [{"tag": f"in_order{k}", "group": f"in_order{k}", "overrides": list(overrides),
             "use_cav": k, "label": "+".join(names[:k]),
             "agents": {"in_order": list(names), "use_cav": k}}
            for k in range(1, len(names) + 1)]


def modality_settings(names: Sequence[str], heter) -> List[Dict]:
    """One setting per modality: every assigned name (``heter.mapping_dict``'s keys) mapped to
    it, the ego alone."""
    settings = []
    for name in names:
        mapping = "{" + ", ".join(f"{assigned}: {name}" for assigned in heter["mapping_dict"]) \
            + "}"
        settings.append({"tag": f"modality_{name}", "group": f"modality_{name}",
                         "overrides": [NO_NOISE, *HEAL_POSTPROCESS,
                                       f"heter.mapping_dict={mapping}",
                                       f"heter.ego_modality={name}"],
                         "use_cav": 1, "label": name,
                         "agents": {"modality": name, "use_cav": 1}})
    return settings


def agents_per_frame(cav_counts: Sequence[int], use_cav: int) -> float:
    """Mean agents fused per frame when the first ``use_cav`` of each frame's take part."""
    return sum(min(count, use_cav) for count in cav_counts) / max(1, len(cav_counts))


def summary_rows(settings: Sequence[Dict], results: Sequence[Dict]) -> List[Dict]:
    """One row per setting: its label ("m1+m2", or the modality), the agents kept, AP, #GT,
    mean agents fused per frame and its record's name."""
    rows = []
    for setting, metrics in zip(settings, results):
        rows.append({"agents": setting["label"], "use_cav": setting["use_cav"],
                     **{key: metrics[key] for key in ("ap_30", "ap_50", "ap_70", "num_gt")},
                     "agents_per_frame": metrics.get("agents_per_frame"),
                     "record": metrics["name"]})
    return rows


def format_summary(title: str, rows: Sequence[Dict]) -> str:
    """The printed (markdown) table of the rows."""
    header = ["agents", "AP@0.3", "AP@0.5", "AP@0.7", "#GT", "agents fused per frame"]
    table = [[row["agents"], number_cell(row["ap_30"]), number_cell(row["ap_50"]),
              number_cell(row["ap_70"]), str(row["num_gt"]),
              number_cell(row["agents_per_frame"], 2)] for row in rows]
    return "\n".join([title] + markdown_table(header, table))


def write_summary(run_dir, kind: str, split: str, fusion: str, names: Sequence[str],
                  rows: Sequence[Dict], title: str) -> Path:
    """``RUN/evals/heter/<split>_<fusion>_<kind>_<hash>.yaml`` ({kind, modalities, split,
    fusion, rows}); the hash covers the rows' record names (so another checkpoint or setting
    gets its own file); returns the path."""
    digest = hashlib.sha256("\n".join(row["record"] for row in rows).encode()).hexdigest()[:8]
    path = Path(run_dir) / RECORDS_DIR / HETER_DIR / f"{split}_{fusion}_{kind}_{digest}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as stream:
        yaml.safe_dump({"kind": kind, "title": title, "modalities": list(names),
                        "split": split, "fusion": fusion, "rows": list(rows)},
                       stream, sort_keys=False)
    return path
