"""V2X-Real's multi-class run folders -> ours (issue 38 point 5).

V2X-Real (ucla-mobility/V2X-Real) is OpenCOOD's layout and ``train.py`` (``config.yaml`` =
``yaml.dump`` of the parsed hypes, ``net_epoch<N>.pth`` = bare state dicts; its
``load_saved_model`` takes ``latest.pth``, else the highest ``net_epoch<N>``) with OpenCOOD's model
names and keys, made multi-class. Read from its sources and checked by running them
(``tools/reference/make_v2xreal_run_fixtures.py``); what differs from OpenCOOD and how it is
handled:

* **Classes and anchors**: ``postprocess.anchor_args.anchor_generator_config``, one entry per
  class (``class_name``, ``anchor_sizes`` [[l, w, h]], ``anchor_rotations`` in radians,
  ``anchor_bottom_heights`` used as the centre z, ``align_center``, ``feature_map_stride``,
  ``matched_threshold`` / ``unmatched_threshold``) -> our ``postprocess.classes`` entry for
  entry (docs/DESIGN.md §5.1), the rotations (the same for every class) -> ``anchor_args.r``
  in degrees, ``align_center: true`` -> ``placement: cell_centre`` (its anchors sit at the
  feature cells' centres; without it they span the range edge to edge, refused). One size and
  one height per class: more have no counterpart (refused naming the entry).
* **Heads**: ``cls_head`` has ``anchor_number * K * K`` channels and ``reg_head``
  ``7 * anchor_num * K``, its ``anchor_number`` / ``anchor_num`` being the yaws per class R: per
  cell ``A = K * R`` anchors, class-major, each scoring all K classes (channel ``a * K + c``)
  and regressing 7 codes (``a * 7 + k``) -- our layout, so the head tensors copy unchanged
  (same outputs: ``tests/test_import_v2xreal.py``). Our ``anchor_number`` is A: the yaml's R is
  checked and left for ``derive``.
* **AttFuse** (``point_pillar_intermediate``): V2X-Real's shrinks the backbone output (3x3,
  384 -> 256) and fuses that single map with OpenCOOD's parameter-free AttFusion; OpenCOOD's
  fuses every backbone scale. Ours: ``attfuse`` at stage ``backbone`` after the shrink header,
  the shrink's keys mapped as OpenCOOD's F-Cooper's. Its attention divides by
  sqrt(``base_bev_backbone.num_filters[-1]``), ours by sqrt(the fused width): equal in its yamls
  (256), other runs refused.
* **Post-processing**: its ``remove_large_pred_bbx`` / ``remove_bbx_abnormal_z`` allow 100 m
  (and it asserts nothing is dropped; OpenCOOD's 6 m filter would drop every truck), its NMS
  takes the 1000 best boxes above the score threshold, is class-agnostic and keeps every
  survivor: ``filters: v2xreal`` with ``pre_nms_max: 1000`` (our default NMS is per class).
  Its test GT range is [-100, -40, -15, 100, 40, 15] (its
  ``datasets/__init__.py``), cut to the LiDAR range, and its communication range 50 m.
* **Data**: ``fusion.dataset: v2xreal`` (our reader, ``opencood.data.v2xreal``) in its
  ``dataset_mode`` (vc, ic, v2v, i2i: ``fusion.dataset_mode``).
* **V2X-ViT** (``point_pillar_transformer``): v2x-vit's model (the same keys and forward), so
  OpenCOOD's translation of it serves (``warp: reference``, ``delay_table: learned``,
  ``prior_feed: true``).
* Refused (by the OpenCOOD translation, naming the key): the naive compressor and models
  other than these five.
"""
from __future__ import annotations

import copy
import math
from typing import List, Tuple

from opencood.interop.opencood_ckpt import (PILLAR_RULES, RULES, SHRINK_RULES, InteropError,
                                            Rule)
from opencood.interop.opencood_config import _gt_range, translate_config
from opencood.postprocess.voxel_postprocessor import REFERENCE_PRE_NMS

V2XREAL_GT_RANGE = (-100.0, -40.0, -15.0, 100.0, 40.0, 15.0)
V2XREAL_COM_RANGE = 50.0            # its datasets/__init__.py COM_RANGE (metres)
V2XREAL_DEFAULT_MAX_CAV = 4         # its basedataset's max_cav when train_params has none
ANCHORS = "postprocess.anchor_args.anchor_generator_config"
# V2X-Real model.core_method -> its key rules
V2XREAL_RULES = {
    "point_pillar": RULES["point_pillar"],
    "point_pillar_intermediate": PILLAR_RULES + SHRINK_RULES,     # AttFuse after its shrink
    "point_pillar_fcooper": RULES["point_pillar_fcooper"],
    "point_pillar_v2vnet": RULES["point_pillar_v2vnet"],
    "point_pillar_transformer": RULES["point_pillar_transformer"],   # V2X-ViT, as v2x-vit's
}


def _entry_value(entry: dict, key: str, where: str):
    if key not in entry:
        raise InteropError(f"{where}.{key}: missing (required to translate the run)")
    return entry[key]


def _one(entry: dict, key: str, where: str):
    """A per-class list that must hold one value (V2X-Real allows several sizes / heights)."""
    values = _entry_value(entry, key, where)
    if not isinstance(values, list) or len(values) != 1:
        raise InteropError(f"{where}.{key}: {values!r}: one entry per class has a counterpart "
                           "here (one anchor size and height per class)")
    return values[0]


def translate_classes(data: dict, source: str) -> Tuple[List[dict], List[float], int]:
    """V2X-Real's ``anchor_generator_config`` -> (our ``postprocess.classes``, the shared
    yaws in degrees, the feature stride); InteropError naming the entry otherwise."""
    anchor_range = data.get("postprocess", {}).get("anchor_args", {}).get("cav_lidar_range")
    crop = data.get("preprocess", {}).get("cav_lidar_range")
    if anchor_range is not None and anchor_range != crop:
        raise InteropError(f"{source}: postprocess.anchor_args.cav_lidar_range {anchor_range} "
                           f"is not preprocess.cav_lidar_range {crop}: its anchors span the "
                           "first, ours the crop")
    entries = data.get("postprocess", {}).get("anchor_args", {}).get("anchor_generator_config")
    if not isinstance(entries, list) or not entries:
        raise InteropError(f"{source}: {ANCHORS}: missing or empty (V2X-Real's per-class "
                           "anchors)")
    classes, yaws, strides = [], [], []
    for index, entry in enumerate(entries):
        where = f"{source}: {ANCHORS}[{index}]"
        if not isinstance(entry, dict):
            raise InteropError(f"{where}: not a mapping")
        if _entry_value(entry, "align_center", where) is not True:
            raise InteropError(f"{where}.align_center: only true (anchors at the feature cells' "
                               "centres) has a counterpart here")
        size = _one(entry, "anchor_sizes", where)
        if not isinstance(size, list) or len(size) != 3:
            raise InteropError(f"{where}.anchor_sizes: {size!r} is not [l, w, h]")
        classes.append({"name": str(_entry_value(entry, "class_name", where)),
                        "l": float(size[0]), "w": float(size[1]), "h": float(size[2]),
                        "z": float(_one(entry, "anchor_bottom_heights", where)),
                        "pos_threshold": float(_entry_value(entry, "matched_threshold", where)),
                        "neg_threshold": float(_entry_value(entry, "unmatched_threshold",
                                                            where))})
        yaws.append([math.degrees(float(r))
                     for r in _entry_value(entry, "anchor_rotations", where)])
        strides.append(int(_entry_value(entry, "feature_map_stride", where)))
    for index in range(1, len(entries)):
        if yaws[index] != yaws[0] or strides[index] != strides[0]:
            raise InteropError(f"{source}: {ANCHORS}[{index}]: its anchor_rotations / "
                               "feature_map_stride differ from the first class's; ours share "
                               "them across classes")
    return classes, yaws[0], strides[0]


def check_head_counts(data: dict, source: str, classes: list, yaws: list,
                      keys=("anchor_number", "anchor_num", "num_class")) -> None:
    """Its model's per-class head counts (``keys`` of ``model.args``: yaws per class, or the
    number of classes) against its anchor list: they size its heads."""
    args = data.get("model", {}).get("args", {})
    for key in keys:
        expected = len(classes) if key == "num_class" else len(yaws)
        if args.get(key) != expected:
            raise InteropError(f"{source}: model.args.{key} is {args.get(key)!r}; its "
                               f"{ANCHORS} makes it {expected} (its head width)")


def as_opencood_hypes(data: dict, source: str) -> dict:
    """V2X-Real's hypes with the single-class anchor keys OpenCOOD's translation reads (the
    first class's; replaced by the class list afterwards) and its model's per-class head
    counts checked."""
    classes, yaws, stride = translate_classes(data, source)
    check_head_counts(data, source, classes, yaws)
    hypes = copy.deepcopy(data)
    # its datasets' default (OpenCOOD's is 7)
    hypes["train_params"].setdefault("max_cav", V2XREAL_DEFAULT_MAX_CAV)
    anchor_args = hypes["postprocess"]["anchor_args"]
    anchor_args.update(l=classes[0]["l"], w=classes[0]["w"], h=classes[0]["h"],
                       r=[math.radians(r) for r in yaws], num=len(yaws),
                       feature_stride=stride)
    hypes["postprocess"].setdefault("target_args", {}).update(
        pos_threshold=classes[0]["pos_threshold"], neg_threshold=classes[0]["neg_threshold"])
    return hypes


def set_classes(cfg: dict, data: dict, source: str) -> None:
    """Our translated ``cfg`` made the multi-class detector of the peer's anchor list, with
    its post-processing's filters (module docstring); ``anchor_number`` left to ``derive``."""
    classes, yaws, stride = translate_classes(data, source)
    post = cfg["postprocess"]
    post["classes"] = classes
    post["anchor_args"] = {"r": yaws, "feature_stride": stride, "placement": "cell_centre"}
    post["target_args"] = {"score_threshold": post["target_args"]["score_threshold"]}
    post.update(filters="v2xreal", pre_nms_max=REFERENCE_PRE_NMS)   # its post_process
    del cfg["model"]["args"]["anchor_number"]     # A = K x R: derived from the class list


def set_v2xreal_data(cfg: dict, data: dict, source: str) -> None:
    """Our V2X-Real reader (``fusion.dataset: v2xreal``) in the run's collaboration mode (its
    top-level ``dataset_mode``, which its datasets require)."""
    if "dataset_mode" not in data:
        raise InteropError(f"{source}: dataset_mode: missing (V2X-Real's collaboration mode: "
                           "vc, ic, v2v or i2i)")
    cfg["fusion"]["dataset"] = "v2xreal"
    cfg["fusion"]["dataset_mode"] = data["dataset_mode"]


def translate_v2xreal_config(data: dict, source: str) -> dict:
    """V2X-Real hypes -> our multi-class config (unresolved); InteropError naming the key."""
    v2xreal_rules(data, source)               # one of its models we map
    cfg = translate_config(as_opencood_hypes(data, source), source)
    set_classes(cfg, data, source)
    cfg["postprocess"]["gt_range"] = _gt_range(cfg["preprocess"]["cav_lidar_range"],
                                               V2XREAL_GT_RANGE)
    set_v2xreal_data(cfg, data, source)
    cfg["comm_range"] = V2XREAL_COM_RANGE
    if data["model"]["core_method"] == "point_pillar_intermediate":
        args = cfg["model"]["args"]
        args["fusion"]["stage"] = "backbone"  # its AttFusion fuses the shrunk map
        _check_attention_scale(args, source)
    return cfg


def _check_attention_scale(args: dict, source: str) -> None:
    """Its AttFusion divides the scores by sqrt(base_bev_backbone.num_filters[-1]), ours by
    sqrt(the fused map's width): the same only when the shrink keeps that width (256 in its
    yamls)."""
    width = args["shrink_header"]["dim"] if "shrink_header" in args else \
        sum(args["base_bev_backbone"]["num_upsample_filter"])
    scale = args["base_bev_backbone"]["num_filters"][-1]
    if scale != width:
        raise InteropError(f"{source}: model.args.base_bev_backbone.num_filters: its last "
                           f"entry {scale} scales V2X-Real's attention (sqrt), ours scales by "
                           f"the fused map's width {width}: only equal ones have a counterpart")


def v2xreal_rules(data: dict, source: str) -> Tuple[Rule, ...]:
    model = data.get("model")
    core_method = model.get("core_method") if isinstance(model, dict) else None
    if core_method not in V2XREAL_RULES:
        raise InteropError(f"{source}: model.core_method {core_method!r}: V2X-Real's model has "
                           f"no counterpart here (supported: {', '.join(V2XREAL_RULES)})")
    return V2XREAL_RULES[core_method]

