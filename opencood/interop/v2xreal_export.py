"""Our multi-class runs -> V2X-Real's run folders (``tools/export_checkpoint.py --to v2xreal``):
the inverse of ``opencood.interop.v2xreal``.

What V2X-Real builds must compute what ours does, so the run needs the settings an import
gives: a class list (its heads score every class at every anchor), ``placement: cell_centre``
(its ``align_center``), the reference pillar slots, no direction head, intermediate fusion on
points projected first, and one of its five networks: ``point_pillar`` (heads on the 384
channels of the backbone, no shrink), ``attfuse`` at stage ``backbone`` after a shrink to 256
whose width is the backbone's last ``num_filters`` (its attention's scale), ``fcooper``,
``v2vnet`` (``round_update: reference``) and ``v2xvit`` (its reference options) after a
shrink to 256. Anything else is refused in one line naming the key. The hypes follow its yamls
(``anchor_generator_config`` in ``preprocess`` -- its ``yaml_parser`` reads it there -- and in
``postprocess.anchor_args``); the state dict has its keys (the import's rules run backwards,
strictly) and is written as its ``train.py`` saves (``net_epoch<N>.pth``, bare).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Tuple

from opencood.config_schema import to_plain
from opencood.interop.exporter import (STRATEGY_DATASET, _Ours, export_opencood_run,
                                       peer_lr_scheduler, peer_model_args, peer_preprocess,
                                       peer_train_params)
from opencood.interop.opencood_ckpt import InteropError
from opencood.interop.v2xreal import V2XREAL_RULES

# our fusion module (at stage backbone, after a shrink to 256) -> its model
FUSIONS = {"attfuse": "point_pillar_intermediate", "fcooper": "point_pillar_fcooper",
           "v2vnet": "point_pillar_v2vnet", "v2xvit": "point_pillar_transformer"}
SHRUNK_HEAD = 256           # its fusion models' heads read 128 * 2 channels
SINGLE_AGENT_HEAD = 384     # its point_pillar's heads read 128 * 3 channels


class _V2XRealOurs(_Ours):
    """Our resolved config, refusals saying what V2X-Real needs."""

    def require(self, dotted: str, expected, why: str) -> None:
        value = self.get(dotted)
        if value != expected:
            raise InteropError(f"{self.source}: {dotted} is {value!r}; V2X-Real needs "
                               f"{expected!r} ({why})")


def v2xreal_model(ours: _Ours) -> str:
    """Its ``model.core_method`` for our config, refusing what it has no counterpart for."""
    model, fusion = ours.get("model.core_method"), ours.get("model.args.fusion")
    if model == "point_pillar":
        upsample = ours.get("model.args.base_bev_backbone.num_upsample_filter")
        if sum(upsample) != SINGLE_AGENT_HEAD or ours.get("model.args.shrink_header"):
            raise InteropError(f"{ours.source}: model.args.base_bev_backbone.num_upsample_filter "
                               f"{list(upsample)} with shrink_header "
                               f"{ours.get('model.args.shrink_header')}: V2X-Real's "
                               "point_pillar has its heads on the 384 upsampled channels")
        return "point_pillar"
    if model != "point_pillar_intermediate" or not fusion or \
            fusion["core_method"] not in FUSIONS:
        name = fusion["core_method"] if fusion else None
        raise InteropError(f"{ours.source}: model {model!r} with fusion {name!r} has no "
                           f"V2X-Real counterpart (point_pillar; point_pillar_intermediate with "
                           f"{', '.join(FUSIONS)})")
    ours.require("model.args.fusion.stage", "backbone", "its fusion runs after the shrink")
    shrink = ours.get("model.args.shrink_header")
    if not shrink or shrink["dim"] != SHRUNK_HEAD:
        raise InteropError(f"{ours.source}: model.args.shrink_header {shrink!r}: V2X-Real's "
                           f"fusion models shrink to {SHRUNK_HEAD} channels before the heads")
    if fusion["core_method"] == "attfuse":
        ours.require("model.args.base_bev_backbone.num_filters",
                     [*ours.get("model.args.base_bev_backbone.num_filters")[:-1], SHRUNK_HEAD],
                     "its attention divides by sqrt of the last backbone width")
    return FUSIONS[fusion["core_method"]]


def check_options(ours: _Ours, core_method: str) -> None:
    why = "the setting an import from V2X-Real gives; docs/checkpoints.md"
    if ours.get("postprocess.classes") is None:
        raise InteropError(f"{ours.source}: postprocess.classes is not set; V2X-Real's heads "
                           "score a class list (give one, even of one class)")
    ours.require("postprocess.anchor_args.placement", "cell_centre", "its align_center")
    ours.require("postprocess.order", "hwl", "its target assignment supports hwl only")
    ours.require("model.args.pillar_vfe.padded_slots", "reference", why)
    ours.require("model.args.use_dir", False, "its heads have no direction classifier")
    ours.require("model.args.point_pillar_scatter.num_features", 64,
                 "its backbone input is hard-coded")
    ours.require("model.args.base_bev_backbone.resnet", False, "its backbone is plain convs")
    ours.require("fusion.args.proj_first", True, "its fusion datasets project points first")
    if core_method == "point_pillar_v2vnet":
        ours.require("model.args.fusion.args.round_update", "reference", why)
    if core_method == "point_pillar_transformer":
        for key, value in (("warp", "reference"), ("delay_table", "learned"),
                           ("prior_feed", True)):
            ours.require(f"model.args.fusion.args.{key}", value, why)


def anchor_generator_config(post: dict) -> list:
    """Our class list on the shared yaws -> its per-class entries (yaws in radians)."""
    anchors = post["anchor_args"]
    rotations = [math.radians(float(r)) for r in anchors["r"]]
    return [{"class_name": entry["name"],
             "anchor_sizes": [[float(entry["l"]), float(entry["w"]), float(entry["h"])]],
             "anchor_rotations": rotations, "anchor_bottom_heights": [float(entry["z"])],
             "align_center": True, "feature_map_stride": int(anchors["feature_stride"]),
             "matched_threshold": float(entry["pos_threshold"]),
             "unmatched_threshold": float(entry["neg_threshold"])}
            for entry in post["classes"]]


def preprocess_cell(cfg: dict) -> list:
    return [float(v) for v in cfg["preprocess"]["args"]["voxel_size"][:2]]


def warp_cell_as_stride(cfg: dict) -> dict:
    """``cfg`` for the OpenCOOD writers of V2VNet / V2X-ViT, which derive the warp's cell as
    voxel x ``feature_stride``: V2X-Real's yamls give ``downsample_rate: 4`` on a stride-2 map
    (its warp's 1.6 m cell; the import carries it as ``fusion.args.cell_size``), so the stride
    they read is the warp cell over the voxel, an integer or refused."""
    fusion = cfg["model"]["args"]["fusion"]
    if not fusion or "cell_size" not in fusion["args"]:
        return cfg
    rate = float(fusion["args"]["cell_size"]) / preprocess_cell(cfg)[0]
    if abs(rate - round(rate)) > 1e-6:
        raise InteropError(f"model.args.fusion.args.cell_size {fusion['args']['cell_size']} is "
                           "not a whole number of voxels (V2X-Real's downsample_rate)")
    post = {**cfg["postprocess"], "anchor_args": {**cfg["postprocess"]["anchor_args"],
                                                  "feature_stride": round(rate)}}
    return {**cfg, "postprocess": post}


def v2xreal_hypes(cfg: dict, source: str) -> Tuple[str, dict]:
    """(its core_method, its hypes) for our resolved ``cfg``; InteropError naming the key."""
    cfg = to_plain(cfg)             # plain data: written as another program's yaml
    ours = _V2XRealOurs(cfg, source)
    core_method = v2xreal_model(ours)
    check_options(ours, core_method)
    strategy = ours.get("fusion.core_method")
    fused = core_method != "point_pillar"
    if (strategy == "intermediate") != fused or strategy not in STRATEGY_DATASET:
        raise InteropError(f"{source}: fusion.core_method {strategy!r} does not go with "
                           f"V2X-Real's {core_method}")
    post = cfg["postprocess"]
    lidar_range = [float(v) for v in cfg["preprocess"]["cav_lidar_range"]]
    classes, yaws = len(post["classes"]), len(post["anchor_args"]["r"])
    generator = anchor_generator_config(post)
    model_args = peer_model_args(warp_cell_as_stride(cfg), lidar_range,
                                 cfg["model"]["args"]["fusion"])
    if "v2vfusion" in model_args:                 # its ConvGRU's size: the head map's
        stride = int(post["anchor_args"]["feature_stride"])
        model_args["v2vfusion"]["conv_gru"].update(
            H=round((lidar_range[4] - lidar_range[1]) / preprocess_cell(cfg)[1]) // stride,
            W=round((lidar_range[3] - lidar_range[0]) / preprocess_cell(cfg)[0]) // stride)
    model_args.update(anchor_number=yaws, anchor_num=yaws, num_class=classes)
    preprocess = peer_preprocess(cfg["preprocess"], lidar_range)
    preprocess.update(num_class=classes, anchor_generator_config=generator)
    hypes = {
        "name": str(cfg.get("name") or "v2xreal_export"),
        "root_dir": cfg.get("root_dir") or "", "validate_dir": cfg.get("validate_dir") or "",
        "yaml_parser": "load_point_pillar_params",
        "dataset_mode": cfg["fusion"]["dataset_mode"],     # its datasets require it
        "train_params": peer_train_params(cfg["train_params"]),
        "fusion": {"core_method": STRATEGY_DATASET[strategy],
                   "args": {"proj_first": True} if fused else []},
        "preprocess": preprocess,
        "data_augment": [dict(entry) for entry in cfg.get("data_augment") or []],
        "postprocess": {"core_method": "VoxelPostprocessor",
                        "anchor_args": {"cav_lidar_range": lidar_range, "num": yaws,
                                        "anchor_generator_config": generator},
                        "target_args": {"score_threshold":
                                        float(post["target_args"]["score_threshold"])},
                        "order": "hwl", "max_num": int(post["max_num"]),
                        "nms_thresh": float(post["nms_thresh"])},
        "model": {"core_method": core_method, "args": model_args},
        "loss": {"core_method": "point_pillar_loss",
                 "args": {"cls_weight": float(cfg["loss"]["args"]["cls_weight"]),
                          "reg": float(cfg["loss"]["args"]["reg_weight"]),
                          "num_class": classes}},
        "optimizer": {"core_method": cfg["optimizer"]["core_method"],
                      "lr": float(cfg["optimizer"]["lr"]),
                      "args": dict(cfg["optimizer"]["args"])},
        "lr_scheduler": peer_lr_scheduler(cfg["lr_scheduler"]),
    }
    return core_method, hypes


def export_v2xreal_run(run_dir, out_dir, checkpoint: Optional[str] = None) -> Path:
    """Translate our ``run_dir`` and write V2X-Real's run folder ``out_dir`` (must not
    exist; nothing written on a refusal)."""
    return export_opencood_run(run_dir, out_dir, checkpoint, v2xreal_hypes, V2XREAL_RULES,
                               "V2X-Real")
