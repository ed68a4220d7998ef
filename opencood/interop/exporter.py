"""One of our run folders -> a folder OpenCOOD's own code loads (issue 24): the inverse of
``importer``.

Only a model whose architecture exists in OpenCOOD (opencoodx 0.1.19) and that runs with the
reference options on is exported; anything else is refused in one line naming the setting:

our model                                            OpenCOOD model.core_method
point_pillar (no / early / late fusion)              point_pillar
point_pillar_intermediate + attfuse (multiscale)     point_pillar_intermediate
point_pillar_intermediate + fcooper (backbone)       point_pillar_fcooper
point_pillar_intermediate + v2vnet (backbone)        point_pillar_v2vnet
point_pillar_intermediate + v2xvit (backbone)        point_pillar_transformer (v2x-vit's)
point_pillar_intermediate + where2comm               point_pillar_where2comm (GitHub sources:
  (confidence "head"; multiscale or backbone)        not in opencoodx 0.1.19)
point_pillar_intermediate + cobevt (backbone;        point_pillar_cobevt (GitHub sources)
  slot_offset bias, mean over all slots)

Reference options required: ``pillar_vfe.padded_slots: reference``, ``use_dir: false``,
``postprocess.anchor_args.placement: reference``, V2VNet ``round_update: reference``, V2X-ViT
``warp: reference``, ``delay_table: learned``, ``prior_feed: true``; and the
widths OpenCOOD hard-codes (64 pillar features; heads on 384 channels, or 256 after the
shrink header), box order hwl, anchors at z = -1.

Written: ``config.yaml``, OpenCOOD's hypes in the form of its ``hypes_yaml`` files (plain yaml,
``yaml_parser: load_point_pillar_params``, which derives grid and anchor sizes when its
``load_yaml`` reads it), and ``net_epoch<N>.pth`` (N: the checkpoint's epoch), a bare state
dict with OpenCOOD's keys (``opencood_ckpt``, strict). Training-only settings are carried where
OpenCOOD has them (batch size, epochs, loss weights, optimiser, multistep schedule; any other
schedule becomes a constant one). As on import: everything is checked before anything is
written, into a hidden folder renamed into place at the end.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch
import yaml

from opencood.config import load_config
from opencood.config_schema import to_plain
from opencood.interop.opencood_ckpt import LINEAR_AS_CONV, RULES, InteropError, ours_to_peer_state
from opencood.interop.importer import our_state_shapes, staged_folder
from opencood.interop.opencood_config import DATASETS, OPENCOOD_ANCHOR_Z
from opencood.utils.checkpoint import load_checkpoint, run_checkpoint

# Our fusion module -> (OpenCOOD model, the stages it fuses at, whether it shrinks to 256
# channels before its heads: they are on 384 channels otherwise; None: its yaml's head_dim
# says the width)
INTERMEDIATE = {"attfuse": ("point_pillar_intermediate", ("multiscale",), False),
                "fcooper": ("point_pillar_fcooper", ("backbone",), True),
                "v2vnet": ("point_pillar_v2vnet", ("backbone",), True),
                "v2xvit": ("point_pillar_transformer", ("backbone",), True),   # v2x-vit's
                "where2comm": ("point_pillar_where2comm", ("multiscale", "backbone"), None),
                "cobevt": ("point_pillar_cobevt", ("backbone",), True)}
V2XVIT_WIDTH = 256                 # v2x-vit's split attention and heads are built for 256
SINGLE_AGENT_HEAD = 384            # OpenCOOD's PointPillar: cls/reg heads on 128 * 3 channels
SHRUNK_HEAD = 256                  # its F-Cooper and V2VNet: heads on 128 * 2 channels
PILLAR_FEATURES = 64               # its backbones are built on 64 scattered channels
# Our strategy -> OpenCOOD's dataset; no fusion runs the single-agent network, as late fusion
# does for every agent (OpenCOOD 0.1.19 has no separate no-fusion dataset).
STRATEGY_DATASET = {**{ours: theirs for theirs, ours in DATASETS.items()},
                    "no": "LateFusionDataset"}


class _Ours:
    """Our resolved config with one-line refusals naming the key."""

    def __init__(self, cfg: dict, source: str):
        self.cfg, self.source = cfg, source

    def get(self, dotted: str):
        node = self.cfg
        for key in dotted.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        return node

    def require(self, dotted: str, expected, why: str) -> None:
        value = self.get(dotted)
        if value != expected:
            raise InteropError(f"{self.source}: {dotted} is {value!r}; OpenCOOD needs "
                               f"{expected!r} ({why})")


def opencood_model(ours: _Ours) -> Tuple[str, Optional[dict]]:
    """(OpenCOOD core_method, our model.args.fusion or None), refusing what has no
    counterpart."""
    model = ours.get("model.core_method")
    fusion = ours.get("model.args.fusion")
    if model == "point_pillar":
        return "point_pillar", None
    if model != "point_pillar_intermediate" or not fusion:
        raise InteropError(f"{ours.source}: model.core_method {model!r} has no OpenCOOD "
                           "counterpart (point_pillar, point_pillar_intermediate)")
    name = fusion["core_method"]
    if name not in INTERMEDIATE:
        raise InteropError(f"{ours.source}: model.args.fusion.core_method {name!r} has no "
                           f"OpenCOOD 0.1.19 counterpart (exported: {', '.join(INTERMEDIATE)})")
    core_method, stages, _ = INTERMEDIATE[name]
    if ours.get("model.args.fusion.stage") not in stages:
        ours.require("model.args.fusion.stage", stages[0], f"where its {core_method} fuses")
    return core_method, fusion


def check_reference_options(ours: _Ours, core_method: str) -> None:
    """The options that make our modules compute what OpenCOOD's do (module docstring)."""
    why = "the reference option; see hypes_yaml/opv2v/reference/"
    ours.require("model.args.pillar_vfe.padded_slots", "reference", why)
    ours.require("model.args.use_dir", False, "OpenCOOD's heads have no direction classifier")
    ours.require("postprocess.anchor_args.placement", "reference", why)
    ours.require("postprocess.order", "hwl", "its target assignment supports hwl only")
    ours.require("postprocess.classes", None, "OpenCOOD 0.1.19 detects one class")
    ours.require("postprocess.anchor_args.z", OPENCOOD_ANCHOR_Z, "its anchors sit at z = -1")
    ours.require("model.args.point_pillar_scatter.num_features", PILLAR_FEATURES,
                 "its backbone input is hard-coded")
    ours.require("model.args.base_bev_backbone.resnet", False,
                 "its PointPillars backbones have plain conv blocks")
    ours.require("fusion.args.proj_first", True, "the exported configs read proj_first data")
    if core_method == "point_pillar_v2vnet":
        ours.require("model.args.fusion.args.round_update", "reference", why)
    if core_method == "point_pillar_transformer":
        ours.require("model.args.fusion.args.warp", "reference", why)
        ours.require("model.args.fusion.args.delay_table", "learned",
                     "its delay table is a trained tensor of its checkpoint")
        ours.require("model.args.fusion.args.prior_feed", True,
                     "its checkpoint holds the unused prior_feed layer")
    if core_method == "point_pillar_where2comm":
        ours.require("model.args.fusion.args.confidence", "head", why)
        ours.require("model.args.fusion.args.max_bytes_per_agent", None, "it has no budget")
    if core_method == "point_pillar_cobevt":
        ours.require("model.args.fusion.args.agent_bias", "slot_offset", why)
        ours.require("model.args.fusion.args.mean_over", "all_slots", why)
        ours.require("model.args.fusion.args.max_agents", ours.get("train_params.max_cav"),
                     "its agents are padded to max_cav slots")


def check_head_width(ours: _Ours, core_method: str, fusion: Optional[dict]) -> None:
    if fusion is not None and INTERMEDIATE[fusion["core_method"]][2] is None:
        return
    if fusion is None or not INTERMEDIATE[fusion["core_method"]][2]:
        upsample = ours.get("model.args.base_bev_backbone.num_upsample_filter")
        if sum(upsample) != SINGLE_AGENT_HEAD or ours.get("model.args.shrink_header"):
            raise InteropError(f"{ours.source}: model.args.base_bev_backbone."
                               f"num_upsample_filter {list(upsample)} and no shrink_header: "
                               f"OpenCOOD's {core_method} has its heads on 384 channels")
        return
    shrink = ours.get("model.args.shrink_header")
    if not shrink or shrink["dim"] != SHRUNK_HEAD:
        raise InteropError(f"{ours.source}: model.args.shrink_header {shrink!r}: OpenCOOD's "
                           f"{core_method} shrinks to {SHRUNK_HEAD} channels before its heads")


def peer_config(cfg: dict, source: str) -> Tuple[str, dict]:
    """(OpenCOOD core_method, its hypes) for our resolved ``cfg``; raises InteropError."""
    cfg = to_plain(cfg)             # plain data: translated into another program's yaml
    ours = _Ours(cfg, source)
    core_method, fusion = opencood_model(ours)
    check_reference_options(ours, core_method)
    check_head_width(ours, core_method, fusion)
    strategy = ours.get("fusion.core_method")
    if (strategy == "intermediate") != (fusion is not None) or strategy not in STRATEGY_DATASET:
        raise InteropError(f"{source}: fusion.core_method {strategy!r} does not go with "
                           f"OpenCOOD's {core_method}")
    lidar_range = [float(v) for v in cfg["preprocess"]["cav_lidar_range"]]
    hypes = {
        "name": str(cfg.get("name") or "opencood_export"),
        "root_dir": cfg.get("root_dir") or "", "validate_dir": cfg.get("validate_dir") or "",
        "yaml_parser": "load_point_pillar_params",
        "train_params": peer_train_params(cfg["train_params"]),
        "fusion": {"core_method": STRATEGY_DATASET[strategy],
                   "args": {"proj_first": True} if fusion is not None else []},
        "preprocess": peer_preprocess(cfg["preprocess"], lidar_range),
        "data_augment": [dict(entry) for entry in cfg.get("data_augment") or []],
        "postprocess": peer_postprocess(cfg["postprocess"], lidar_range),
        "model": {"core_method": core_method,
                  "args": peer_model_args(cfg, lidar_range, fusion)},
        "loss": {"core_method": "point_pillar_loss",
                 "args": {"cls_weight": float(cfg["loss"]["args"]["cls_weight"]),
                          "reg": float(cfg["loss"]["args"]["reg_weight"])}},
        "optimizer": {"core_method": cfg["optimizer"]["core_method"],
                      "lr": float(cfg["optimizer"]["lr"]),
                      "args": dict(cfg["optimizer"]["args"])},
        "lr_scheduler": peer_lr_scheduler(cfg["lr_scheduler"]),
    }
    return core_method, hypes


def peer_train_params(params: dict) -> dict:
    return {key: int(params[key]) for key in ("batch_size", "epoches", "eval_freq",
                                                 "save_freq", "max_cav")}


def peer_preprocess(preprocess: dict, lidar_range: list) -> dict:
    args = preprocess["args"]
    out = {"voxel_size": [float(v) for v in args["voxel_size"]],
           "max_points_per_voxel": int(args["max_points_per_voxel"])}
    for key in ("max_voxel_train", "max_voxel_test"):
        if args.get(key) is not None:
            out[key] = int(args[key])
    return {"core_method": "SpVoxelPreprocessor", "args": out, "cav_lidar_range": lidar_range}


def peer_postprocess(post: dict, lidar_range: list) -> dict:
    anchors = post["anchor_args"]
    rotations = [float(r) for r in anchors["r"]]
    return {"core_method": "VoxelPostprocessor",
            "anchor_args": {"cav_lidar_range": lidar_range, "l": float(anchors["l"]),
                            "w": float(anchors["w"]), "h": float(anchors["h"]),
                            "r": rotations, "feature_stride": int(anchors["feature_stride"]),
                            "num": len(rotations)},
            "target_args": {key: float(post["target_args"][key]) for key in
                            ("pos_threshold", "neg_threshold", "score_threshold")},
            "order": "hwl", "max_num": int(post["max_num"]),
            "nms_thresh": float(post["nms_thresh"])}


def peer_model_args(cfg: dict, lidar_range: list, fusion: Optional[dict]) -> dict:
    args = cfg["model"]["args"]
    anchor_number = int(args["anchor_number"])
    backbone = {key: [int(v) for v in args["base_bev_backbone"][key]]
                for key in ("layer_nums", "layer_strides", "num_filters", "upsample_strides",
                            "num_upsample_filter")}
    out = {"voxel_size": [float(v) for v in args["voxel_size"]], "lidar_range": lidar_range,
           "anchor_number": anchor_number, "anchor_num": anchor_number,
           "max_cav": int(cfg["train_params"]["max_cav"]), "compression": 0,
           "backbone_fix": False,
           "pillar_vfe": {"use_norm": True, "with_distance": bool(
               args["pillar_vfe"]["with_distance"]), "use_absolute_xyz": True,
               "num_filters": [int(v) for v in args["pillar_vfe"]["num_filters"]]},
           "point_pillar_scatter": {"num_features": int(
               args["point_pillar_scatter"]["num_features"])},
           "base_bev_backbone": {**backbone, "compression": 0}}
    if fusion is None:
        return out
    shrink = args.get("shrink_header")
    if shrink:
        kernel = int(shrink["kernel_size"])
        out["shrink_header"] = {"kernal_size": [kernel], "stride": [int(shrink["stride"])],
                                "padding": [kernel // 2], "dim": [int(shrink["dim"])],
                                "input_dim": sum(backbone["num_upsample_filter"])}
    if fusion["core_method"] == "v2vnet":
        out["v2vfusion"] = peer_v2vnet(cfg, fusion["args"], int(args["shrink_header"]["dim"]))
    if fusion["core_method"] == "v2xvit":
        out["transformer"] = {"encoder": peer_v2xvit(cfg, fusion["args"])}
    if fusion["core_method"] == "cobevt":
        fusion_args = fusion["args"]
        out["fax_fusion"] = {"input_dim": int(shrink["dim"]), "mlp_dim": int(fusion_args["mlp_dim"]),
                             "agent_size": int(fusion_args["max_agents"]),
                             "window_size": int(fusion_args["window"]),
                             "dim_head": int(fusion_args["dim_head"]),
                             "drop_out": float(fusion_args["dropout"]),
                             "depth": int(fusion_args["depth"]), "mask": True}
    if fusion["core_method"] == "where2comm":
        out["head_dim"] = int(shrink["dim"]) if shrink else sum(backbone["num_upsample_filter"])
        out["where2comm_fusion"] = peer_where2comm(cfg, fusion, backbone, out["head_dim"])
    return out


def peer_where2comm(cfg: dict, fusion: dict, backbone: dict, head_dim: int) -> dict:
    """OpenCOOD's where2comm_fusion (its GitHub sources): threshold 0 sends every cell there
    too (``elif self.threshold``), so ``fully`` stays false."""
    fusion_args = fusion["args"]
    communication = {"round": 1, "threshold": float(fusion_args["threshold"])}
    smoothing = fusion_args.get("smoothing")
    if smoothing:
        communication["gaussian_smooth"] = {"k_size": int(smoothing["kernel_size"]),
                                            "c_sigma": float(smoothing["sigma"])}
    return {"fully": False,
            "voxel_size": [float(v) for v in cfg["preprocess"]["args"]["voxel_size"]],
            "downsample_rate": int(cfg["postprocess"]["anchor_args"]["feature_stride"]),
            "in_channels": head_dim, "multi_scale": fusion["stage"] == "multiscale",
            "layer_nums": backbone["layer_nums"], "num_filters": backbone["num_filters"],
            "communication": communication}


def feature_cell(cfg: dict, fusion_args: dict) -> tuple:
    """(voxel size, feature stride), refusing a ``cell_size`` that is not their product (the
    peer derives the cell from them)."""
    voxel_size = [float(v) for v in cfg["preprocess"]["args"]["voxel_size"]]
    stride = int(cfg["postprocess"]["anchor_args"]["feature_stride"])
    cell = voxel_size[0] * stride
    if abs(cell - float(fusion_args["cell_size"])) > 1e-6:
        raise InteropError(f"model.args.fusion.args.cell_size {fusion_args['cell_size']} is "
                           f"not voxel x feature_stride ({cell:g}), which OpenCOOD derives")
    return voxel_size, stride


def peer_v2xvit(cfg: dict, fusion_args: dict) -> dict:
    """v2x-vit's V2XTEncoder settings (its point_pillar_v2xvit.yaml layout)."""
    voxel_size, stride = feature_cell(cfg, fusion_args)
    channels = int(cfg["model"]["args"]["shrink_header"]["dim"])
    if channels != V2XVIT_WIDTH:
        raise InteropError(f"model.args.shrink_header.dim {channels}: v2x-vit's transformer "
                           f"is built for {V2XVIT_WIDTH} channels")
    dropout = float(fusion_args["dropout"])
    use_rte = bool(fusion_args["use_delay_encoding"])
    ratio = int(fusion_args["rte_ratio"])
    return {"num_blocks": int(fusion_args["num_blocks"]), "depth": int(fusion_args["depth"]),
            "use_roi_mask": bool(fusion_args["roi_mask"]), "use_RTE": use_rte,
            "RTE_ratio": ratio,
            "cav_att_config": {"dim": channels, "use_hetero": True, "use_RTE": use_rte,
                               "RTE_ratio": ratio, "heads": int(fusion_args["heads"]),
                               "dim_head": int(fusion_args["dim_head"]), "dropout": dropout},
            "pwindow_att_config": {
                "dim": channels, "heads": [int(v) for v in fusion_args["window_heads"]],
                "dim_head": [int(v) for v in fusion_args["window_dim_heads"]],
                "dropout": dropout,
                "window_size": [int(v) for v in fusion_args["window_sizes"]],
                "relative_pos_embedding": True,
                "fusion_method": "split_attn" if fusion_args["window_merge"] == "split_attn"
                else "naive"},
            "feed_forward": {"mlp_dim": int(fusion_args["mlp_dim"]), "dropout": dropout},
            "sttf": {"voxel_size": voxel_size, "downsample_rate": stride}}


def peer_v2vnet(cfg: dict, fusion_args: dict, channels: int) -> dict:
    """OpenCOOD's v2vfusion: its warp grid is voxel x downsample_rate per feature cell."""
    voxel_size, stride = feature_cell(cfg, fusion_args)
    nx = round((cfg["preprocess"]["cav_lidar_range"][3] -
                cfg["preprocess"]["cav_lidar_range"][0]) / voxel_size[0])
    ny = round((cfg["preprocess"]["cav_lidar_range"][4] -
                cfg["preprocess"]["cav_lidar_range"][1]) / voxel_size[1])
    kernel = int(fusion_args["kernel_size"])
    return {"voxel_size": voxel_size, "downsample_rate": stride,
            "num_iteration": int(fusion_args["num_iteration"]), "in_channels": channels,
            "gru_flag": True, "agg_operator": "avg",
            "conv_gru": {"H": ny // stride, "W": nx // stride, "num_layers": 1,
                         "kernel_size": [[kernel, kernel]]}}


def peer_lr_scheduler(schedule: dict) -> dict:
    """Multistep as it is; any other schedule as a constant one (MultiStepLR, no milestone)."""
    if schedule["core_method"] == "multistep":
        return {"core_method": "multistep", "gamma": float(schedule["gamma"]),
                "step_size": [int(v) for v in schedule["step_size"]]}
    return {"core_method": "multistep", "gamma": 0.1, "step_size": []}


def peer_shapes(our_shapes: dict, core_method: str, rules=None) -> dict:
    """OpenCOOD's state-dict shapes, from those of our model built from the config (not from
    the checkpoint, so a tensor missing there is reported): every tensor our rules place, in
    our shape except where a rule changes the layout (the shrink kernel keeps its size: the
    exported yaml states it). A tensor no rule places is reported by the strict translation.
    ``rules``: another codebase's rules for ``core_method`` (V2X-Real's)."""
    shapes = {}
    for key, our_shape in our_shapes.items():
        for rule in rules or RULES[core_method]:
            peer_key = rule.ours_to_peer(key)
            if peer_key is None:
                continue
            shape = tuple(our_shape)
            if rule.transform is LINEAR_AS_CONV:
                shape = shape[:2]
            shapes[peer_key] = shape
            break
    return shapes


def translate_our_run(run_dir, checkpoint: Optional[str] = None, hypes_of=None, rules=None,
                      codebase: str = "OpenCOOD") -> Tuple[dict, dict, int]:
    """(the peer's hypes, its state dict, epoch) for our run folder; writes nothing. By default
    OpenCOOD's (``peer_config``, ``RULES``); ``hypes_of(cfg, source) -> (core_method, hypes)``
    and ``rules`` (core_method -> key rules) for another codebase of OpenCOOD's layout."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise InteropError(f"{run_dir}: no config.yaml (give one of our run folders)")
    cfg = load_config(config_path)
    core_method, hypes = (hypes_of or peer_config)(cfg, str(config_path))
    path = run_checkpoint(run_dir, checkpoint)
    saved = load_checkpoint(path)
    if "model" not in saved:
        raise InteropError(f"{path}: not a training checkpoint (no 'model' entry)")
    model_rules = (rules or RULES)[core_method]
    shapes = peer_shapes(our_state_shapes(cfg["model"]), core_method, model_rules)
    state = ours_to_peer_state(saved["model"], model_rules, shapes, str(path),
                               f"{codebase}'s {core_method}")
    return hypes, state, max(int(saved.get("epoch", 0)), 0)


def export_opencood_run(run_dir, out_dir, checkpoint: Optional[str] = None, hypes_of=None,
                        rules=None, codebase: str = "OpenCOOD") -> Path:
    """Translate our ``run_dir`` and write OpenCOOD's run folder ``out_dir`` (must not exist);
    another codebase of its layout with the arguments of :func:`translate_our_run`."""
    hypes, state, epoch = translate_our_run(run_dir, checkpoint, hypes_of, rules, codebase)
    with staged_folder(Path(out_dir), "export") as staging:
        (staging / "config.yaml").write_text(yaml.safe_dump(hypes, sort_keys=False))
        torch.save(state, staging / f"net_epoch{epoch}.pth")      # bare, as its train.py saves
    return Path(out_dir)
