"""OpenCOOD's run-folder ``config.yaml`` -> our config (issue 24).

Reading. OpenCOOD's ``train.py`` writes ``yaml.dump(hypes)`` of the hypes AFTER its
``yaml_parser`` ran, so the file carries python tags (the scatter's ``grid_size`` is a numpy
array: ``!!python/object/apply:numpy...``) and its own reader is ``yaml.Loader``, which executes
them. Ours is the safe loader of ``opencood.config`` (with its ``1e-3`` float resolver) plus one
rule: ``!!python/tuple`` becomes a list and every other ``!!python/...`` node becomes an inert
:class:`ForeignValue` (nothing is imported or called). The values those tags hold are derived
ones (grid size, anchor W/H), which we derive again from the range and the voxel size.

Translation. Everything that decides what the network computes and which boxes come out is
translated, and a setting we cannot reproduce is refused (one line naming the key) rather than
dropped: model and widths, fusion (and where it is applied), shrink header, V2VNet rounds and
kernel, pillar geometry (range, voxel size, points per pillar), anchors, target thresholds, score
threshold, NMS, box order. Training-only sections are carried where ours has the same meaning
(batch size, epochs, loss weights, optimiser, multistep schedule) and left at our defaults
otherwise. Conventions:

* OpenCOOD evaluates on ``validate_dir`` (its test-mode dataset reads it): it becomes our
  ``test_dir`` (and ``validate_dir``) unless the file names a ``test_dir``.
* ``postprocess.gt_range`` is OpenCOOD's test-time GT range [-140, -40, -3, 140, 40, 1] cut to
  the LiDAR range; anchors sit at z = -1 (OpenCOOD's constant).
* ``postprocess.filters: reference`` with ``pre_nms_max: 1000``: OpenCOOD's box filters and its
  number of NMS candidates (``max_num`` caps nothing there).
* ``train_params.max_cav``: OpenCOOD's default is 7 when the file has none.
* ``model.args.bn_momentum`` null: every BatchNorm keeps OpenCOOD's 0.01.
* The reference options of our modules are switched on, so the imported weights compute what
  they computed there: ``pillar_vfe.padded_slots: reference`` (padded point slots take part),
  ``use_dir: false`` (no direction head; yaws decoded as regressed),
  ``anchor_args.placement: reference`` (OpenCOOD's anchor centres) and, for V2VNet,
  ``round_update: reference`` (its GRU wiring); for V2X-ViT (the v2x-vit repository's
  ``point_pillar_transformer``) ``warp: reference`` (its STTF discretisation),
  ``delay_table: learned`` and ``prior_feed: true`` (its checkpoint's tensors).
* F-Cooper is applied to the backbone output after the shrink header (OpenCOOD's
  ``point_pillar_fcooper``), not to the scattered canvas (our default).
* ``wild_setting`` (OpenCOOD's noise settings) is not carried: evaluation noise is chosen at
  ``tools/eval.py`` time here (``--pose_noise``, ``--latency``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import yaml

from opencood.config import YamlLoader, yaml_error_line
from opencood.interop.opencood_ckpt import InteropError
from opencood.postprocess.voxel_postprocessor import REFERENCE_PRE_NMS

# OpenCOOD's test-time GT range (opencood/data_utils/datasets/__init__.py: GT_RANGE).
OPENCOOD_GT_RANGE = (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0)
OPENCOOD_DEFAULT_MAX_CAV = 7
OPENCOOD_ANCHOR_Z = -1.0

DATASETS = {"EarlyFusionDataset": "early", "LateFusionDataset": "late",
            "IntermediateFusionDataset": "intermediate"}
# OpenCOOD model.core_method -> (our model, our fusion module or None, needs intermediate)
MODELS = {
    "point_pillar": ("point_pillar", None),
    "point_pillar_intermediate": ("point_pillar_intermediate", "attfuse"),
    "point_pillar_fcooper": ("point_pillar_intermediate", "fcooper"),
    "point_pillar_v2vnet": ("point_pillar_intermediate", "v2vnet"),
    "point_pillar_transformer": ("point_pillar_intermediate", "v2xvit"),   # v2x-vit's
    # OpenCOOD's GitHub sources (not in opencoodx 0.1.19)
    "point_pillar_where2comm": ("point_pillar_intermediate", "where2comm"),
    "point_pillar_cobevt": ("point_pillar_intermediate", "cobevt"),
}
AUGMENTATIONS = ("random_world_flip", "random_world_rotation", "random_world_scaling")
OPTIMIZERS = ("Adam", "AdamW", "SGD")


class ForeignValue:
    """A ``!!python/...`` node of a foreign yaml, kept inert (never constructed)."""

    def __init__(self, tag: str):
        self.tag = tag

    def __repr__(self) -> str:
        return f"ForeignValue({self.tag})"


class PeerYamlLoader(YamlLoader):
    """Our safe loader, plus inert handling of python tags (module docstring)."""


def _python_tag(loader: PeerYamlLoader, suffix: str, node: yaml.Node) -> Any:
    if suffix == "tuple" and isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return ForeignValue(f"tag:yaml.org,2002:python/{suffix}")


PeerYamlLoader.add_multi_constructor("tag:yaml.org,2002:python/", _python_tag)


def read_opencood_yaml(path) -> dict:
    """OpenCOOD's ``config.yaml`` (or any of its hypes yamls) as a dict, read safely."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InteropError(f"{path}: not found (an OpenCOOD run folder holds config.yaml)") \
            from None
    except OSError as error:
        raise InteropError(f"{path}: cannot read ({error.strerror})") from None
    try:
        data = yaml.load(text, Loader=PeerYamlLoader)
    except yaml.YAMLError as error:
        raise InteropError(f"{path}: {yaml_error_line(error)}") from None
    if not isinstance(data, dict):
        raise InteropError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


class _Peer:
    """Dotted access to the peer config with one-line errors naming file and key."""

    def __init__(self, data: dict, source: str):
        self.data, self.source = data, source

    def error(self, dotted: str, problem: str) -> InteropError:
        return InteropError(f"{self.source}: {dotted}: {problem}")

    def get(self, dotted: str, default: Any = KeyError) -> Any:
        node: Any = self.data
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                if default is KeyError:
                    raise self.error(dotted, "missing (required to translate the run)")
                return default
            node = node[key]
        if isinstance(node, ForeignValue):
            raise self.error(dotted, f"holds a python object ({node.tag}), not a value")
        return node

    def one_of_list(self, dotted: str) -> Any:
        """OpenCOOD writes some scalars as one-entry lists (``dim: [256]``)."""
        value = self.get(dotted)
        if isinstance(value, list):
            if len(value) != 1:
                raise self.error(dotted, f"{value} has {len(value)} entries; one layer is "
                                         "supported here")
            return value[0]
        return value

    def require(self, dotted: str, expected: Any, why: str) -> None:
        value = self.get(dotted, expected)
        if value != expected:
            raise self.error(dotted, f"is {value!r}; only {expected!r} has a counterpart here "
                                     f"({why})")


def _gt_range(lidar_range, gt_range=OPENCOOD_GT_RANGE) -> list:
    """A codebase's test GT range (OpenCOOD's by default) cut to the LiDAR range."""
    low = [max(a, b) for a, b in zip(gt_range[:3], lidar_range[:3])]
    high = [min(a, b) for a, b in zip(gt_range[3:], lidar_range[3:])]
    return [float(v) for v in low + high]


def translate_config(data: dict, source: str) -> dict:
    """OpenCOOD hypes (as read by :func:`read_opencood_yaml`) -> our config, unresolved (pass
    it to ``opencood.config.resolve``). Raises InteropError naming ``source`` and the key."""
    peer = _Peer(data, source)
    core_method = peer.get("model.core_method")
    if core_method not in MODELS:
        raise peer.error("model.core_method", f"{core_method!r} has no counterpart here "
                                              f"(supported: {', '.join(MODELS)})")
    our_model, fusion_module = MODELS[core_method]
    dataset = peer.get("fusion.core_method")
    if dataset not in DATASETS:
        raise peer.error("fusion.core_method", f"{dataset!r} is not one of {', '.join(DATASETS)}")
    strategy = DATASETS[dataset]
    if (strategy == "intermediate") != (fusion_module is not None):
        raise peer.error("fusion.core_method", f"{dataset} does not go with model {core_method}")
    fusion_args = peer.get("fusion.args", {})
    if isinstance(fusion_args, dict) and fusion_args.get("proj_first", True) is False:
        raise peer.error("fusion.args.proj_first", "false (features fused in each agent's own "
                                                   "frame) has no counterpart here: our "
                                                   "intermediate fusion projects points first")

    lidar_range = [float(v) for v in peer.get("preprocess.cav_lidar_range")]
    cfg = {
        "name": str(peer.get("name", "opencood_import")),
        "fusion": {"core_method": strategy},
        "train_params": _train_params(peer),
        "preprocess": _preprocess(peer, lidar_range),
        "data_augment": _augmentations(peer),
        "postprocess": _postprocess(peer, lidar_range),
        "model": {"core_method": our_model,
                  "args": _model_args(peer, core_method, fusion_module)},
        "loss": {"core_method": "point_pillar_loss", "args": _loss_args(peer)},
        "optimizer": _optimizer(peer),
        "lr_scheduler": _lr_scheduler(peer),
    }
    for key in ("root_dir", "validate_dir"):
        if isinstance(data.get(key), str):
            cfg[key] = data[key]
    test_dir = data.get("test_dir", data.get("validate_dir"))
    if isinstance(test_dir, str):
        cfg["test_dir"] = test_dir
    return cfg


def _train_params(peer: _Peer) -> dict:
    params = {"batch_size": int(peer.get("train_params.batch_size")),
              "epoches": int(peer.get("train_params.epoches")),
              "max_cav": int(peer.get("train_params.max_cav", OPENCOOD_DEFAULT_MAX_CAV))}
    for key in ("eval_freq", "save_freq"):
        value = peer.get(f"train_params.{key}", None)
        if value is not None:
            params[key] = int(value)
    return params


def _preprocess(peer: _Peer, lidar_range: list) -> dict:
    peer.require("preprocess.core_method", "SpVoxelPreprocessor", "pillars")
    args = {"voxel_size": [float(v) for v in peer.get("preprocess.args.voxel_size")],
            "max_points_per_voxel": int(peer.get("preprocess.args.max_points_per_voxel"))}
    for key in ("max_voxel_train", "max_voxel_test"):
        value = peer.get(f"preprocess.args.{key}", None)
        if value is not None:
            args[key] = int(value)
    return {"core_method": "SpVoxelPreprocessor", "args": args, "cav_lidar_range": lidar_range}


def _augmentations(peer: _Peer) -> list:
    entries = peer.get("data_augment", []) or []
    out = []
    for index, entry in enumerate(entries):
        name = entry.get("NAME") if isinstance(entry, dict) else None
        if name not in AUGMENTATIONS:
            raise peer.error(f"data_augment[{index}].NAME", f"{name!r} has no counterpart here "
                                                            f"({', '.join(AUGMENTATIONS)})")
        out.append(dict(entry))
    return out


def _postprocess(peer: _Peer, lidar_range: list) -> dict:
    peer.require("postprocess.core_method", "VoxelPostprocessor", "anchor-based decoding")
    peer.require("postprocess.order", "hwl", "the box order our anchors and coder use")
    rotations = [float(r) for r in peer.get("postprocess.anchor_args.r")]
    number = peer.get("postprocess.anchor_args.num", len(rotations))
    if number != len(rotations):
        raise peer.error("postprocess.anchor_args.num", f"{number} anchors but "
                                                        f"{len(rotations)} rotations in r")
    anchors = {"l": float(peer.get("postprocess.anchor_args.l")),
               "w": float(peer.get("postprocess.anchor_args.w")),
               "h": float(peer.get("postprocess.anchor_args.h")),
               "z": OPENCOOD_ANCHOR_Z, "r": rotations,
               "feature_stride": int(peer.get("postprocess.anchor_args.feature_stride", 2)),
               "placement": "reference"}
    targets = {key: float(peer.get(f"postprocess.target_args.{key}"))
               for key in ("pos_threshold", "neg_threshold", "score_threshold")}
    return {"core_method": "VoxelPostprocessor", "gt_range": _gt_range(lidar_range),
            "anchor_args": anchors, "target_args": targets, "order": "hwl",
            "max_num": int(peer.get("postprocess.max_num", 100)),
            "nms_thresh": float(peer.get("postprocess.nms_thresh")), "filters": "reference",
            "pre_nms_max": REFERENCE_PRE_NMS}


def _model_args(peer: _Peer, core_method: str, fusion_module: Optional[str]) -> dict:
    m = "model.args"
    peer.require(f"{m}.pillar_vfe.use_norm", True, "our pillar layers always normalise")
    peer.require(f"{m}.pillar_vfe.use_absolute_xyz", True,
                 "our pillar features always keep x, y, z")
    for key in ("compression", "base_bev_backbone.compression"):
        value = peer.get(f"{m}.{key}", 0)
        if value:
            raise peer.error(f"{m}.{key}", f"{value}: the naive compressor has no counterpart "
                                           "here")
    args = {
        "lidar_range": [float(v) for v in peer.get(f"{m}.lidar_range")],
        "voxel_size": [float(v) for v in peer.get(f"{m}.voxel_size")],
        "anchor_number": int(peer.get(f"{m}.anchor_number")),
        "bn_momentum": None,
        "use_dir": False,
        "pillar_vfe": {"in_channels": 4,
                       "num_filters": [int(v) for v in peer.get(f"{m}.pillar_vfe.num_filters")],
                       "with_distance": bool(peer.get(f"{m}.pillar_vfe.with_distance", False)),
                       "padded_slots": "reference"},
        "point_pillar_scatter": {"num_features": int(peer.get(
            f"{m}.point_pillar_scatter.num_features"))},
        "base_bev_backbone": {key: [int(v) for v in peer.get(f"{m}.base_bev_backbone.{key}")]
                              for key in ("layer_nums", "layer_strides", "num_filters",
                                          "upsample_strides", "num_upsample_filter")},
        "fusion": None,
    }
    # OpenCOOD's point_pillar has no shrink header; V2V4Real's (same name) may have one.
    if "shrink_header" in peer.get(m):
        args["shrink_header"] = _shrink_header(peer, f"{m}.shrink_header")
    if fusion_module is None:
        return args
    fusion: dict = {"core_method": fusion_module, "args": {}}
    if fusion_module == "attfuse":
        fusion["stage"] = "multiscale"
    elif fusion_module == "fcooper":
        fusion["stage"] = "backbone"
    elif fusion_module == "v2xvit":
        fusion["stage"] = "backbone"
        fusion["args"] = _v2xvit_args(peer, f"{m}.transformer.encoder")
    elif fusion_module == "where2comm":
        fusion["stage"], fusion["args"] = _where2comm(peer, m, args)
    elif fusion_module == "cobevt":
        fusion["stage"], fusion["args"] = "backbone", _cobevt(peer, m, args)
    else:
        fusion["stage"] = "backbone"
        fusion["args"] = _v2vnet_args(peer, f"{m}.v2vfusion")
    args["fusion"] = fusion
    return args


def _shrink_header(peer: _Peer, key: str) -> dict:
    """OpenCOOD's DownsampleConv (one DoubleConv) -> our ShrinkHeader (first conv 3x3 with
    padding 1, or 1x1 without)."""
    kernel = int(peer.one_of_list(f"{key}.kernal_size"))     # OpenCOOD's spelling
    stride = int(peer.one_of_list(f"{key}.stride"))
    padding = int(peer.one_of_list(f"{key}.padding"))
    dim = int(peer.one_of_list(f"{key}.dim"))
    if (kernel, padding) not in ((3, 1), (1, 0)):
        raise peer.error(key, f"kernel {kernel}, padding {padding}: our shrink header's first "
                              "conv is 3x3 with padding 1 or 1x1 without")
    return {"dim": dim, "stride": stride, "kernel_size": kernel}


def _where2comm(peer: _Peer, m: str, args: dict) -> tuple:
    """OpenCOOD's where2comm_fusion -> (stage, our where2comm args with confidence "head")."""
    key = f"{m}.where2comm_fusion"
    head_in = args["shrink_header"]["dim"] if "shrink_header" in args else \
        sum(args["base_bev_backbone"]["num_upsample_filter"])
    peer.require(f"{m}.head_dim", head_in, "the width its heads read")
    multi_scale = bool(peer.get(f"{key}.multi_scale"))
    if multi_scale:
        for name in ("layer_nums", "num_filters"):
            peer.require(f"{key}.{name}", args["base_bev_backbone"][name],
                         "its per-scale fusion follows the backbone")
    threshold = 0.0 if peer.get(f"{key}.fully") else \
        float(peer.get(f"{key}.communication.threshold"))
    smoothing = None
    if "gaussian_smooth" in peer.get(f"{key}.communication"):
        smoothing = {"kernel_size": int(peer.get(f"{key}.communication.gaussian_smooth.k_size")),
                     "sigma": float(peer.get(f"{key}.communication.gaussian_smooth.c_sigma"))}
    return ("multiscale" if multi_scale else "backbone",
            {"confidence": "head", "threshold": threshold, "smoothing": smoothing,
             "max_bytes_per_agent": None, "fusion_mode": "attention"})


def _cobevt(peer: _Peer, m: str, args: dict) -> dict:
    """OpenCOOD's fax_fusion (SwapFusionEncoder with its key mask) -> our cobevt with the
    reference options (slot-indexed agent bias, mean over every slot)."""
    key = f"{m}.fax_fusion"
    peer.require(f"{key}.mask", True, "our CoBEVT masks padded agents as keys")
    width = args["shrink_header"]["dim"] if "shrink_header" in args else \
        sum(args["base_bev_backbone"]["num_upsample_filter"])
    peer.require(f"{key}.input_dim", width, "the width of the map it fuses")
    peer.require(f"{m}.max_cav", int(peer.get(f"{key}.agent_size")),
                 "its agents are padded to max_cav slots, its bias table has agent_size")
    return {"depth": int(peer.get(f"{key}.depth")),
            "window": int(peer.get(f"{key}.window_size")),
            "dim_head": int(peer.get(f"{key}.dim_head")),
            "mlp_dim": int(peer.get(f"{key}.mlp_dim")),
            "dropout": float(peer.get(f"{key}.drop_out")),
            "agent_bias": "slot_offset", "mean_over": "all_slots",
            "max_agents": int(peer.get(f"{key}.agent_size"))}


def _v2vnet_args(peer: _Peer, key: str) -> dict:
    peer.require(f"{key}.gru_flag", True, "our V2VNet always updates with a ConvGRU")
    peer.require(f"{key}.agg_operator", "avg", "our V2VNet averages messages")
    peer.require(f"{key}.conv_gru.num_layers", 1, "one ConvGRU layer")
    kernel = peer.one_of_list(f"{key}.conv_gru.kernel_size")
    if isinstance(kernel, (list, tuple)):
        if len(set(kernel)) != 1:
            raise peer.error(f"{key}.conv_gru.kernel_size", f"{kernel}: square kernels only")
        kernel = kernel[0]
    cell = float(peer.get(f"{key}.voxel_size")[0]) * float(peer.get(f"{key}.downsample_rate"))
    return {"num_iteration": int(peer.get(f"{key}.num_iteration")),
            "kernel_size": int(kernel), "cell_size": cell, "round_update": "reference"}


def _v2xvit_args(peer: _Peer, key: str) -> dict:
    """v2x-vit's V2XTEncoder settings -> our V2XViTArgs with its reference options."""
    cav, window = f"{key}.cav_att_config", f"{key}.pwindow_att_config"
    peer.require(f"{cav}.use_hetero", True, "our HMSA is the heterogeneous one")
    peer.require(f"{window}.relative_pos_embedding", True,
                 "our window attention has a relative-position bias")
    merge = peer.get(f"{window}.fusion_method")
    if merge not in ("split_attn", "naive"):
        raise peer.error(f"{window}.fusion_method", f"{merge!r}: split_attn or naive only")
    dims = {peer.get(f"{cav}.dim"), peer.get(f"{window}.dim")}
    if dims != {256}:
        raise peer.error(f"{cav}.dim", f"{sorted(dims)}: its split attention is built for 256")
    sttf = f"{key}.sttf"
    return {"depth": int(peer.get(f"{key}.depth")),
            "num_blocks": int(peer.get(f"{key}.num_blocks")),
            "heads": int(peer.get(f"{cav}.heads")), "dim_head": int(peer.get(f"{cav}.dim_head")),
            "window_sizes": [int(v) for v in peer.get(f"{window}.window_size")],
            "window_heads": [int(v) for v in peer.get(f"{window}.heads")],
            "window_dim_heads": [int(v) for v in peer.get(f"{window}.dim_head")],
            "window_merge": "split_attn" if merge == "split_attn" else "mean",
            "mlp_dim": int(peer.get(f"{key}.feed_forward.mlp_dim")),
            "dropout": float(peer.get(f"{key}.feed_forward.dropout")),
            "rte_ratio": int(peer.get(f"{cav}.RTE_ratio")),
            "use_delay_encoding": bool(peer.get(f"{cav}.use_RTE")),
            "delay_table": "learned",
            "cell_size": float(peer.get(f"{sttf}.voxel_size")[0]) *
            float(peer.get(f"{sttf}.downsample_rate")),
            "warp": "reference", "roi_mask": bool(peer.get(f"{key}.use_roi_mask")),
            "prior_feed": True}


def _loss_args(peer: _Peer) -> dict:
    args = peer.get("loss.args", {}) or {}
    out = {}
    if "cls_weight" in args:
        out["cls_weight"] = float(args["cls_weight"])
    if "reg" in args:
        out["reg_weight"] = float(args["reg"])
    return out


def _optimizer(peer: _Peer) -> dict:
    name = peer.get("optimizer.core_method", "Adam")
    return {"core_method": name if name in OPTIMIZERS else "Adam",
            "lr": float(peer.get("optimizer.lr")),
            "args": dict(peer.get("optimizer.args", {}) or {}) if name in OPTIMIZERS else {}}


def _lr_scheduler(peer: _Peer) -> dict:
    if peer.get("lr_scheduler.core_method", None) == "multistep":
        return {"core_method": "multistep",
                "step_size": [int(v) for v in peer.get("lr_scheduler.step_size")],
                "gamma": float(peer.get("lr_scheduler.gamma", 0.1))}
    return {"core_method": "constant"}
