"""QuantV2X's multi-class runs on V2X-Real -> ours (``--from quantv2x``, issue 38 point 5).

QuantV2X (ucla-mobility/QuantV2X) is HEAL's code base; its V2X-Real LiDAR runs
(``hypes_yaml/v2x_real/LiDAROnly/lidar_attfuse.yaml``, ``lidar_fcooper.yaml``) use
``heter_model_baseline_mc``: HEAL's ``heter_model_baseline`` (the same modules and keys:
``encoder_m1.``, ``backbone_m1.``, ``shrinker_m1.``, its ``fusion_method`` att / max) with
V2X-Real's multi-class heads (``cls_head`` K x K x R channels, ``reg_head`` 7 x K x R, our
layout: ``opencood.interop.v2xreal``) and a direction head of 2 x K x R channels. Read from its
sources and checked by running them (``tools/reference/make_quantv2x_run_fixtures.py``). So the
run is translated as HEAL's (``opencood.interop.heal``: own-frame fusion after the shrinker)
and given V2X-Real's class list; what differs:

* Its multi-class post-processor (``VoxelPostprocessor3Heads``) never reads the direction head:
  yaws are decoded as regressed. The import does the same (``use_dir: false``) and leaves
  ``dir_head`` out (trained, never used at inference; a printed note), so the detections are
  its detections.
* Its post-processing is V2X-Real's (100 m box filters, one class-agnostic NMS):
  ``filters: v2xreal``, as ``--from v2xreal``.
* ``fusion.core_method: intermediateheter3class`` is HEAL's intermediate heterogeneous
  strategy with three classes; its ``fusion.dataset: v2xreal`` is our V2X-Real reader in its
  ``dataset_mode``, and its ``comm_range`` is carried.
"""
from __future__ import annotations

import copy
from typing import List, Tuple

from opencood.interop.heal import PROJ_FIRST_NOTE, heal_rules, translate_heal_config
from opencood.interop.opencood_ckpt import InteropError, Rule
from opencood.interop.v2xreal import (check_head_counts, set_classes, set_v2xreal_data,
                                      translate_classes)

CORE_METHOD = "heter_model_baseline_mc"
STRATEGIES = ("intermediateheter3class", "intermediateheter")
DIRECTION_NOTE = ("QuantV2X's multi-class post-processing never reads its direction head: "
                  "imported with use_dir: false (yaws as regressed, as there) and its dir_head "
                  "left out")


def as_heal_hypes(data: dict, source: str) -> dict:
    """QuantV2X's hypes as those of HEAL's single-class ``heter_model_baseline`` (its
    multi-class names taken out; the classes put back by :func:`translate_quantv2x_config`)."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if model.get("core_method") != CORE_METHOD:
        raise InteropError(f"{source}: model.core_method {model.get('core_method')!r}: only "
                           f"QuantV2X's {CORE_METHOD} has a counterpart here")
    strategy = data.get("fusion", {}).get("core_method")
    if strategy not in STRATEGIES:
        raise InteropError(f"{source}: fusion.core_method {strategy!r} does not go with "
                           f"{CORE_METHOD} ({', '.join(STRATEGIES)})")
    classes, yaws, _ = translate_classes(data, source)
    check_head_counts(data, source, classes, yaws, keys=("anchor_number", "num_class"))
    hypes = copy.deepcopy(data)
    hypes["model"]["core_method"] = "heter_model_baseline"
    hypes["fusion"]["core_method"] = "intermediateheter"
    hypes["postprocess"]["core_method"] = "VoxelPostprocessor"
    return hypes


def translate_quantv2x_config(data: dict, source: str) -> dict:
    """QuantV2X hypes -> our multi-class config (unresolved); InteropError naming the key."""
    cfg = translate_heal_config(as_heal_hypes(data, source), source)
    set_classes(cfg, data, source)
    cfg["model"]["args"]["use_dir"] = False
    del cfg["loss"]["args"]["dir_offset"]
    if cfg["fusion"]["dataset"] == "v2xreal":
        set_v2xreal_data(cfg, data, source)
    if "comm_range" in data:
        cfg["comm_range"] = float(data["comm_range"])
    return cfg


def quantv2x_rules(data: dict, source: str) -> Tuple[Rule, ...]:
    return tuple(rule for rule in heal_rules(as_heal_hypes(data, source), source)
                 if not rule.peer.startswith("dir_head."))


def quantv2x_notes(data: dict) -> List[str]:
    return [PROJ_FIRST_NOTE, DIRECTION_NOTE]


def quantv2x_unused_keys(data: dict) -> Tuple[str, ...]:
    return ("dir_head.",)
