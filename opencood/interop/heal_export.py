"""One of our camera runs -> a HEAL run folder (issue 36, point 6): the inverse of the
``--from heal`` camera import (:mod:`opencood.interop.heal_camera`).

Exported: our ``point_pillar_intermediate`` with the ``lss`` encoder, a ``shrink_header``,
fusion at stage ``backbone`` (fcooper, attfuse or v2vnet) and the direction head, i.e. exactly
what the import builds from HEAL's ``heter_model_baseline`` with one ``lift_splat_shoot``
camera modality (HEAL's CameraOnly runs). Written: ``config.yaml``, HEAL's hypes in the layout
of its CameraOnly yamls (``yaml_parser: load_general_params``; the modality ``m2``, every agent
mapped to it), and ``net_epoch<N>.pth``, a bare state dict with HEAL's keys made by the
import's own key rules run backwards (``heal.heal_rules`` of the written config, so the two
directions cannot drift apart). HEAL's EfficientNet keeps its classifier (``_conv_head``,
``_bn1``, ``_fc``), which its forward never runs and our trunk does not build: written as a
freshly initialised layer would hold them (zero weights, BatchNorm's identity), so HEAL's
strict ``load_state_dict`` takes the file. ``import(export(run))`` gives the run's state dict
back bit for bit, and ``export(import(heal run))`` HEAL's (tests/test_import_heal_camera.py).

Refused in one line naming the key: anything that is not that network (a LiDAR encoder, no
shrink, another fusion or stage, no direction head, HEAL's BevEncode after the splat, a splat
grid other than the BEV grid). HEAL fuses every agent in its own frame: a run trained with
``fusion.args.proj_first: true`` is exported all the same (the weights do not depend on the
frame; HEAL then evaluates it its own way), said in the returned notes.
"""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import yaml

from opencood.config import load_config
from opencood.config_schema import to_plain
from opencood.interop.heal import FUSIONS, heal_rules
from opencood.interop.heal_camera import CAMERA_ENCODER, EFFICIENTNET_CLASSIFIER
from opencood.interop.importer import our_state_shapes, staged_folder
from opencood.interop.opencood_ckpt import InteropError, ours_to_peer_state, peer_shapes_by_rules
from opencood.utils.checkpoint import load_checkpoint, run_checkpoint

MODALITY = "m2"                    # as HEAL's CameraOnly yamls name their camera agent
HEAL_MODALITIES = ("m1", "m2", "m3", "m4")        # what HEAL's assignment files name
HEAL_FUSION = {ours: theirs for theirs, (_, ours) in FUSIONS.items()}
# heter_model_baseline's modules in the order its state dict lists them (our heads come before
# our shrink): the export keeps that order, each group in ours
HEAL_MODULE_ORDER = (f"encoder_{MODALITY}.", f"backbone_{MODALITY}.", f"shrinker_{MODALITY}.",
                     "fusion_net.", "cls_head.", "reg_head.", "dir_head.")
PROJ_FIRST_NOTE = ("trained with fusion.args.proj_first: true; HEAL warps each agent's map to "
                   "the ego (own-frame fusion) when it evaluates the export")


def _get(cfg: dict, dotted: str):
    node = cfg
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _require(cfg: dict, dotted: str, expected, why: str, source: str) -> None:
    value = _get(cfg, dotted)
    if value != expected:
        raise InteropError(f"{source}: {dotted} is {value!r}; HEAL's camera model needs "
                           f"{expected!r} ({why})")


def check_exportable(cfg: dict, source: str) -> None:
    """The network the camera import builds, or one line naming what differs."""
    _require(cfg, "model.core_method", "point_pillar_intermediate",
             "heter_model_baseline is an intermediate-fusion model", source)
    _require(cfg, "model.args.encoder.core_method", "lss", "a lift_splat_shoot agent", source)
    fusion = _get(cfg, "model.args.fusion.core_method")
    if fusion not in HEAL_FUSION:
        raise InteropError(f"{source}: model.args.fusion.core_method {fusion!r} has no HEAL "
                           f"counterpart here (exported: {', '.join(HEAL_FUSION)})")
    _require(cfg, "model.args.fusion.stage", "backbone", "HEAL fuses the shrunk maps", source)
    if not _get(cfg, "model.args.shrink_header"):
        raise InteropError(f"{source}: model.args.shrink_header is missing; HEAL's "
                           "heter_model_baseline always shrinks before fusing")
    _require(cfg, "model.args.use_dir", True, "HEAL's dir_head", source)
    trunk = _get(cfg, "model.args.encoder.args.camera_encoder")
    if trunk not in ("EfficientNet", "Resnet101"):
        raise InteropError(f"{source}: model.args.encoder.args.camera_encoder {trunk!r} has no "
                           "HEAL counterpart (exported: EfficientNet, Resnet101)")
    width = _get(cfg, "model.args.encoder.args.trunk_width")
    if width not in (None, 512):                # None: a config written before the key
        raise InteropError(f"{source}: model.args.encoder.args.trunk_width is {width!r}; "
                           "HEAL's CamEncode heads read 512 channels")
    _require(cfg, "model.args.encoder.args.bev_encoder_channels", None,
             "HEAL's lift_splat_shoot agent has no BevEncode", source)
    _require(cfg, "model.args.base_bev_backbone.resnet", False,
             "HEAL's camera runs use the plain BaseBEVBackbone", source)
    _require(cfg, "postprocess.order", "hwl", "its CameraOnly configs", source)
    _require(cfg, "postprocess.anchor_args.placement", "reference", "HEAL's anchors", source)
    for axis in ("xbound", "ybound"):
        _require(cfg, f"model.args.encoder.args.{axis}", None,
                 "the splat writes the BEV grid, which HEAL's grid_conf then states", source)


def heal_grid_conf(cfg: dict) -> dict:
    """HEAL's ``grid_conf`` of our encoder: x / y from the BEV grid (range at the cell size)."""
    encoder = cfg["model"]["args"]["encoder"]["args"]
    lidar_range = [float(v) for v in cfg["preprocess"]["cav_lidar_range"]]
    cell = [float(v) for v in cfg["preprocess"]["args"]["voxel_size"]]
    d_min, d_max, bins = encoder["ddiscr"]
    return {"xbound": [lidar_range[0], lidar_range[3], cell[0]],
            "ybound": [lidar_range[1], lidar_range[4], cell[1]],
            "zbound": [float(v) for v in encoder["zbound"]],
            "ddiscr": [float(d_min), float(d_max), int(bins)], "mode": encoder["depth_mode"]}


def heal_data_aug_conf(cfg: dict) -> dict:
    """HEAL's ``data_aug_conf``: our camera section's, ``final_dim`` the encoder's image."""
    encoder = cfg["model"]["args"]["encoder"]["args"]
    ours = dict((cfg.get("camera") or {}).get("data_aug_conf") or {})
    conf = {"H": 600, "W": 800, "resize_lim": [0.65, 0.7], "bot_pct_lim": [0.0, 0.05],
            "rot_lim": [-3.6, 3.6], "rand_flip": False, "Ncams": 4,
            "cams": ["camera0", "camera1", "camera2", "camera3"]}
    conf.update({key: value for key, value in ours.items() if value is not None})
    conf["final_dim"] = [int(v) for v in encoder["image_size"]]
    return conf


def heal_modality_args(cfg: dict) -> dict:
    """``model.args.m2``: the camera agent's encoder, backbone and shrinker."""
    args = cfg["model"]["args"]
    encoder = args["encoder"]["args"]
    grid = heal_grid_conf(cfg)
    backbone = {key: [int(v) for v in args["base_bev_backbone"][key]]
                for key in ("layer_nums", "layer_strides", "num_filters", "upsample_strides",
                            "num_upsample_filter")}
    height_cells = int(round((grid["zbound"][1] - grid["zbound"][0]) / grid["zbound"][2]))
    backbone["inplanes"] = int(encoder["img_features"]) * height_cells
    shrink = args["shrink_header"]
    kernel = int(shrink["kernel_size"])
    return {"core_method": CAMERA_ENCODER, "sensor_type": "camera",
            "encoder_args": {"anchor_number": int(args["anchor_number"]),
                             "grid_conf": grid, "data_aug_conf": heal_data_aug_conf(cfg),
                             "img_downsample": int(encoder["img_downsample"]),
                             "img_features": int(encoder["img_features"]),
                             "use_depth_gt": False,
                             "depth_supervision": bool(encoder["depth_supervision"]),
                             "camera_encoder": encoder["camera_encoder"]},
            "camera_mask_args": {"cav_lidar_range": list(cfg["preprocess"]["cav_lidar_range"]),
                                 "grid_conf": grid},
            "backbone_args": backbone,
            "shrink_header": {"kernal_size": [kernel], "stride": [int(shrink["stride"])],
                              "padding": [kernel // 2], "dim": [int(shrink["dim"])],
                              "input_dim": sum(backbone["num_upsample_filter"])}}


def heal_hypes(cfg: dict) -> dict:
    """HEAL's hypes (its CameraOnly yamls' layout) for our resolved camera ``cfg``."""
    args = cfg["model"]["args"]
    lidar_range = [float(v) for v in cfg["preprocess"]["cav_lidar_range"]]
    loss = cfg["loss"]["args"]
    dir_args = heal_dir_args(cfg)
    modality = heal_modality_args(cfg)
    fusion = args["fusion"]
    model_args = {"lidar_range": lidar_range, "anchor_number": int(args["anchor_number"]),
                  "ego_modality": MODALITY, "fusion_method": HEAL_FUSION[fusion["core_method"]],
                  "in_head": int(args["shrink_header"]["dim"]), "dir_args": dir_args,
                  MODALITY: modality}
    if fusion["core_method"] == "attfuse":
        model_args["att"] = {"feat_dim": int(args["shrink_header"]["dim"])}
    if fusion["core_method"] == "v2vnet":
        model_args["v2vnet"] = heal_v2vnet(cfg, fusion["args"])
    depth = bool(modality["encoder_args"]["depth_supervision"])
    return {
        **heal_run_sections(cfg, dir_args),
        "input_source": ["camera", "depth"] if depth else ["camera"],
        "heter": {"assignment_path": "opencood/logs/heter_modality_assign/opv2v_4modality.json",
                  "ego_modality": MODALITY,
                  "mapping_dict": {name: MODALITY for name in HEAL_MODALITIES},
                  "modality_setting": {MODALITY: {
                      "sensor_type": "camera", "core_method": CAMERA_ENCODER,
                      "grid_conf": modality["encoder_args"]["grid_conf"],
                      "data_aug_conf": modality["encoder_args"]["data_aug_conf"]}}},
        "fusion": {"core_method": "intermediateheter", "dataset": cfg["fusion"]["dataset"],
                   "args": {"proj_first": False, "grid_conf": "None", "data_aug_conf": "None"}},
        "preprocess": {"core_method": "SpVoxelPreprocessor",
                       "args": {"voxel_size": [float(v) for v in
                                               cfg["preprocess"]["args"]["voxel_size"]],
                                "max_points_per_voxel": 1, "max_voxel_train": 1,
                                "max_voxel_test": 1},
                       "cav_lidar_range": lidar_range},
        "model": {"core_method": "heter_model_baseline", "args": model_args},
        "loss": {"core_method": "point_pillar_depth_loss" if depth else "point_pillar_loss",
                 "args": heal_loss_args(loss, dir_args, depth)},
    }


def heal_dir_args(cfg: dict) -> dict:
    """HEAL's ``dir_args`` (2 bins) from our loss's offset and the anchors' yaws."""
    return {"dir_offset": float(cfg["loss"]["args"]["dir_offset"]), "num_bins": 2,
            "anchor_yaw": [float(r) for r in cfg["postprocess"]["anchor_args"]["r"]]}


def heal_run_sections(cfg: dict, dir_args: dict) -> dict:
    """The hypes sections every HEAL export shares (names and folders, training, augmentation,
    post-processing, optimiser), from our resolved ``cfg``."""
    lidar_range = [float(v) for v in cfg["preprocess"]["cav_lidar_range"]]
    post = cfg["postprocess"]
    anchors = post["anchor_args"]
    return {
        "name": str(cfg.get("name") or "heal_export"),
        "root_dir": cfg.get("root_dir") or "", "validate_dir": cfg.get("validate_dir") or "",
        "test_dir": cfg.get("test_dir") or cfg.get("validate_dir") or "",
        "yaml_parser": "load_general_params",
        "label_type": str(cfg.get("label_type") or "lidar"),
        "comm_range": float(cfg["comm_range"]),
        "cav_lidar_range": lidar_range,
        "train_params": {key: int(cfg["train_params"][key]) for key in
                         ("batch_size", "epoches", "eval_freq", "save_freq", "max_cav")},
        "data_augment": [dict(entry) for entry in cfg.get("data_augment") or []],
        "postprocess": {"core_method": "VoxelPostprocessor",
                        "gt_range": [float(v) for v in post["gt_range"]],
                        "anchor_args": {"cav_lidar_range": lidar_range,
                                        "l": float(anchors["l"]), "w": float(anchors["w"]),
                                        "h": float(anchors["h"]),
                                        "r": [float(r) for r in anchors["r"]],
                                        "feature_stride": int(anchors["feature_stride"]),
                                        "num": len(anchors["r"])},
                        "target_args": {key: float(post["target_args"][key]) for key in
                                        ("pos_threshold", "neg_threshold", "score_threshold")},
                        "dir_args": dir_args, "order": "hwl",
                        "max_num": int(post["max_num"]), "nms_thresh": float(post["nms_thresh"])},
        "optimizer": {"core_method": cfg["optimizer"]["core_method"],
                      "lr": float(cfg["optimizer"]["lr"]),
                      "args": dict(cfg["optimizer"]["args"])},
        "lr_scheduler": {"core_method": "multistep", "gamma": float(cfg["lr_scheduler"]["gamma"]),
                         "step_size": [int(v) for v in cfg["lr_scheduler"]["step_size"]]
                         if cfg["lr_scheduler"]["core_method"] == "multistep" else []},
    }


def heal_loss_args(loss: dict, dir_args: dict, depth: bool) -> dict:
    """HEAL's point_pillar(_depth)_loss arguments from ours."""
    args = {"pos_cls_weight": 2.0,
            "cls": {"type": "SigmoidFocalLoss", "alpha": float(loss["focal_alpha"]),
                    "gamma": float(loss["focal_gamma"]), "weight": float(loss["cls_weight"])},
            "reg": {"type": "WeightedSmoothL1Loss", "sigma": 3.0, "codewise": True,
                    "weight": float(loss["reg_weight"])},
            "dir": {"type": "WeightedSoftmaxClassificationLoss",
                    "weight": float(loss["dir_weight"]), "args": dir_args}}
    if depth:
        args["depth"] = {"weight": 1.0}
    return args


def heal_v2vnet(cfg: dict, fusion_args: dict) -> dict:
    """HEAL's ``model.args.v2vnet`` (the import reads it as OpenCOOD's v2vfusion)."""
    from opencood.interop.exporter import peer_v2vnet
    v2v = peer_v2vnet(cfg, fusion_args, int(cfg["model"]["args"]["shrink_header"]["dim"]))
    return {key: value for key, value in v2v.items()
            if key not in ("voxel_size", "downsample_rate")}


def in_heal_order(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``state`` with its keys grouped by module in HEAL's order (``HEAL_MODULE_ORDER``)."""
    def group(key: str) -> int:
        return next(index for index, prefix in enumerate(HEAL_MODULE_ORDER)
                    if key.startswith(prefix))
    return OrderedDict(sorted(state.items(), key=lambda item: group(item[0])))


def with_classifier(state: Dict[str, torch.Tensor], modality: str) -> Dict[str, torch.Tensor]:
    """``state`` with HEAL's never-run EfficientNet classifier keys added after the trunk's
    last block (its state dict's order), filled as freshly initialised."""
    trunk = f"encoder_{modality}.camencode.trunk."
    last_trunk_key = [key for key in state if key.startswith(trunk)][-1]
    out = OrderedDict()
    for key, value in state.items():
        out[key] = value
        if key == last_trunk_key:
            for name, (shape, fill) in EFFICIENTNET_CLASSIFIER.items():
                dtype = torch.int64 if name.endswith("num_batches_tracked") else torch.float32
                out[trunk + name] = torch.full(shape, fill, dtype=dtype)
    return out


def translate_our_camera_run(run_dir, checkpoint: Optional[str] = None
                             ) -> Tuple[dict, Dict[str, torch.Tensor], int, List[str]]:
    """(HEAL hypes, HEAL state dict, epoch, notes) for our camera run folder; writes nothing."""
    run_dir = Path(run_dir)
    config_path = run_dir / "config.yaml"
    if not config_path.is_file():
        raise InteropError(f"{run_dir}: no config.yaml (give one of our run folders)")
    cfg = to_plain(load_config(config_path))       # translated into HEAL's yaml: plain data
    source = str(config_path)
    check_exportable(cfg, source)
    hypes = heal_hypes(cfg)
    rules = heal_rules(hypes, source)
    path = run_checkpoint(run_dir, checkpoint)
    saved = load_checkpoint(path)
    if "model" not in saved:
        raise InteropError(f"{path}: not a training checkpoint (no 'model' entry)")
    shapes = peer_shapes_by_rules(our_state_shapes(cfg["model"]), rules)
    state = in_heal_order(ours_to_peer_state(saved["model"], rules, shapes, str(path),
                                             "HEAL's heter_model_baseline"))
    if cfg["model"]["args"]["encoder"]["args"]["camera_encoder"] == "EfficientNet":
        state = with_classifier(state, MODALITY)
    notes = [PROJ_FIRST_NOTE] if cfg["fusion"]["args"]["proj_first"] else []
    return hypes, state, max(int(saved.get("epoch", 0)), 0), notes


def export_heal_run(run_dir, out_dir, checkpoint: Optional[str] = None) -> Tuple[Path, List[str]]:
    """Write HEAL's run folder ``out_dir`` (must not exist) for our camera ``run_dir``;
    returns (out_dir, notes)."""
    hypes, state, epoch, notes = translate_our_camera_run(run_dir, checkpoint)
    with staged_folder(Path(out_dir), "export") as staging:
        (staging / "config.yaml").write_text(yaml.safe_dump(hypes, sort_keys=False))
        torch.save(state, staging / f"net_epoch{epoch}.pth")      # bare, as its train.py saves
    return Path(out_dir), notes
