"""Our ``heter_pyramid_collab`` / ``heter_pyramid_single`` / ``heter_model_late`` runs -> HEAL
run folders (issue 37 point 5): the inverse of :mod:`opencood.interop.heal_heter_run`.

Written: ``config.yaml``, HEAL's hypes (its ``MoreModality/HEAL`` yamls' layout: each type's
``model.args.<m>`` with ``encoder_args``, ``backbone_args``, ``aligner_args``, the pyramid's
``fusion_backbone``; the late model's as its ``Single/*_pretrain`` yamls, each type with
``layers_args``, ``shrink_header``, ``head_args``; the ``heter`` section as ours holds it) and
``net_epoch<N>.pth``, HEAL's keys made by the import's rules run backwards
(:func:`heal_heter.ours_to_heal_state`), completed with the parts HEAL builds and never runs
(an EfficientNet type's classifier, the late model's first ``layers`` stage: fresh-layer values,
:func:`with_never_run_parts`), so that HEAL's strict ``load_state_dict`` takes it.
``import(export(run))`` gives the run's model section and state dict back bit for bit
(tests/test_import_heal_heter.py); HEAL's own classes load every export strictly and give the
same heads (tools/reference/check_heal_heter_export.py). Refused in one line naming the key:
what HEAL's classes do not build (a pillar encoder without HEAL's PFN slots, a BevEncode after
the splat, a late type with an aligner).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import yaml

from opencood.config import load_config
from opencood.config_schema import to_plain
from opencood.interop.heal_export import heal_dir_args, heal_loss_args, heal_run_sections
from opencood.interop.heal_heter import heal_key_shapes, ours_to_heal_state
from opencood.interop.importer import staged_folder
from opencood.interop.opencood_ckpt import InteropError
from opencood.ops.voxelize import grid_size
from opencood.utils.checkpoint import load_checkpoint, run_checkpoint

EXPORTED = {"heter_pyramid_collab": "intermediateheter", "heter_pyramid_single": "lateheter",
            "heter_model_late": "lateheter"}
_BACKBONE_KEYS = ("layer_nums", "layer_strides", "num_filters", "upsample_strides",
                  "num_upsample_filter")


def _backbone(ours: dict, inplanes: int) -> dict:
    args = {key: [int(v) for v in ours[key]] for key in _BACKBONE_KEYS if ours.get(key)}
    return {**args, "inplanes": inplanes}


def _encoder(name: str, modality: dict, cfg: dict, source: str) -> Tuple[dict, int]:
    """(HEAL's ``encoder_args`` and ``core_method`` fields, the encoder's output channels)."""
    encoder, key = modality["encoder"], f"{source}: model.args.modalities.{name}.encoder"
    args = encoder["args"]
    if encoder["core_method"] == "pillar":
        vfe = args["pillar_vfe"]
        if vfe.get("padded_slots") != "reference":
            raise InteropError(f"{key}.args.pillar_vfe.padded_slots is "
                               f"{vfe.get('padded_slots')!r}; HEAL's PFN is 'reference'")
        features = int(args["point_pillar_scatter"]["num_features"])
        return {"core_method": "point_pillar", "encoder_args": {
            "lidar_range": [float(v) for v in modality["lidar_range"]],
            "voxel_size": [float(v) for v in modality["voxel_size"]],
            "pillar_vfe": {"use_norm": True, "with_distance": bool(vfe["with_distance"]),
                           "use_absolute_xyz": True,
                           "num_filters": [int(v) for v in vfe["num_filters"]]},
            "point_pillar_scatter": {"num_features": features}}}, features
    if encoder["core_method"] != "lss" or args.get("bev_encoder_channels") \
            or args["camera_encoder"] not in ("Resnet101", "EfficientNet"):
        raise InteropError(f"{key}: only pillar and lss (ResNet-101 or EfficientNet trunk, no "
                           "BevEncode) types are exported")
    grid = {"xbound": list(args["xbound"]), "ybound": list(args["ybound"]),
            "zbound": list(args["zbound"]),
            "ddiscr": [float(args["ddiscr"][0]), float(args["ddiscr"][1]), int(args["ddiscr"][2])],
            "mode": args["depth_mode"]}
    setting = cfg["heter"]["modality_setting"][name]
    height_cells = int(round((grid["zbound"][1] - grid["zbound"][0]) / grid["zbound"][2]))
    return {"core_method": "lift_splat_shoot", "encoder_args": {
        "anchor_number": int(cfg["model"]["args"]["anchor_number"]), "grid_conf": grid,
        "data_aug_conf": {**dict(setting["data_aug_conf"]),
                          "final_dim": [int(v) for v in args["image_size"]]},
        "img_downsample": int(args["img_downsample"]), "img_features": int(args["img_features"]),
        "use_depth_gt": False, "depth_supervision": bool(args["depth_supervision"]),
        "camera_encoder": args["camera_encoder"]},
        "camera_mask_args": {"cav_lidar_range": list(cfg["model"]["args"]["lidar_range"]),
                             "grid_conf": grid}}, int(args["img_features"]) * height_cells


def _aligner(modality: dict) -> dict:
    aligner = modality["aligner"]
    if aligner["core_method"] == "identity":
        return {"core_method": "identity"}
    return {"core_method": "convnext", "spatial_align": False,
            "args": {"num_of_blocks": int(aligner["num_of_blocks"]),
                     "dim": int(modality["backbone"]["num_filters"][-1]),
                     "kernel_size": int(aligner["kernel_size"])}}


def _shrink(shrink: dict, input_dim: int) -> dict:
    kernel = int(shrink["kernel_size"])
    return {"kernal_size": [kernel], "stride": [int(shrink["stride"])], "padding": [kernel // 2],
            "dim": [int(shrink["dim"])], "input_dim": input_dim}


def heal_preprocess(preprocess: dict) -> dict:
    """HEAL's preprocess section of one of ours: its voxel generator takes pillar caps, so our
    None (keep every pillar) becomes the grid's cell count, which keeps them all too."""
    lidar_range = [float(v) for v in preprocess["cav_lidar_range"]]
    cells = math.prod(grid_size(lidar_range, preprocess["args"]["voxel_size"]))
    args = dict(preprocess["args"])
    for key in ("max_voxel_train", "max_voxel_test"):
        args[key] = cells if args.get(key) is None else int(args[key])
    return {**preprocess, "args": args, "cav_lidar_range": lidar_range}


def heal_heter_section(cfg: dict) -> dict:
    """HEAL's ``heter`` section of our resolved ``cfg``: ours without its unset keys, each
    LiDAR type's ``preprocess`` written out (our None is the top-level one, which HEAL's data
    sets do not fall back to; the import reads a copy of the top-level one back as None)."""
    heter = {key: value for key, value in cfg["heter"].items() if value is not None}
    settings = {}
    for name, setting in heter["modality_setting"].items():
        setting = dict(setting)
        if setting["sensor_type"] == "lidar":
            setting["preprocess"] = heal_preprocess(setting["preprocess"] or cfg["preprocess"])
        settings[name] = setting
    return {**heter, "modality_setting": settings}


def heal_late_model_args(cfg: dict, source: str) -> dict:
    """HEAL's ``model.args`` of our resolved ``heter_model_late`` ``cfg`` (the layout of its
    ``Single/*_pretrain.yaml``): per type the encoder, backbone, ``layers_args`` (the first
    stage's input the backbone's width), shrink header and ``head_args``."""
    args = cfg["model"]["args"]
    ours = {"lidar_range": [float(v) for v in args["lidar_range"]],
            "anchor_number": int(args["anchor_number"]), "dir_args": heal_dir_args(cfg)}
    for name, modality in args["modalities"].items():
        if modality["aligner"]["core_method"] != "identity":
            raise InteropError(f"{source}: model.args.modalities.{name}.aligner is "
                               f"{modality['aligner']['core_method']!r}; HEAL's HeterModelLate "
                               "has no aligner (identity)")
        encoder, channels = _encoder(name, modality, cfg, source)
        layers = modality["layers"]
        shrink = _shrink(modality["shrink_header"],
                         sum(int(v) for v in layers["num_upsample_filter"]))
        ours[name] = {"sensor_type": modality["sensor_type"], **encoder,
                      "backbone_args": _backbone(modality["backbone"], channels),
                      "aligner_args": {"core_method": "identity"},
                      "layers_args": _backbone(layers, int(layers["num_filters"][0])),
                      "shrink_header": shrink, "head_args": {"in_head": shrink["dim"][0]}}
    return ours


def heal_model_args(cfg: dict, source: str) -> dict:
    """HEAL's ``model.args`` of our resolved heter pyramid ``cfg``."""
    args = cfg["model"]["args"]
    ours = {"lidar_range": [float(v) for v in args["lidar_range"]],
            "anchor_number": int(args["anchor_number"]), "dir_args": heal_dir_args(cfg)}
    for name, modality in args["modalities"].items():
        encoder, channels = _encoder(name, modality, cfg, source)
        ours[name] = {"sensor_type": modality["sensor_type"], **encoder,
                      "backbone_args": _backbone(modality["backbone"], channels),
                      "aligner_args": _aligner(modality)}
    fusion = args["fusion_backbone"]
    widths = [int(v) for v in next(iter(args["modalities"].values()))["backbone"]["num_filters"]]
    ours["fusion_backbone"] = {**_backbone(fusion, widths[-1]), "resnext": bool(fusion["resnext"]),
                               "anchor_number": int(args["anchor_number"])}
    in_head = sum(int(v) for v in fusion["num_upsample_filter"])
    if args.get("shrink_header"):
        ours["shrink_header"] = _shrink(args["shrink_header"], in_head)
        in_head = int(args["shrink_header"]["dim"])
    ours["in_head"] = in_head
    return ours


def heal_heter_hypes(cfg: dict, source: str) -> dict:
    """HEAL's hypes for our resolved heter pyramid ``cfg``."""
    dir_args = heal_dir_args(cfg)
    loss = cfg["loss"]["args"]
    loss_args = heal_loss_args(loss, dir_args, bool(loss.get("depth")))
    core = cfg["model"]["core_method"]
    if core == "heter_model_late":
        model_args = heal_late_model_args(cfg, source)
        loss_section = {"core_method": "point_pillar_depth_loss" if loss.get("depth")
                        else "point_pillar_loss", "args": loss_args}
    else:
        model_args = heal_model_args(cfg, source)
        loss_args["pyramid"] = {key: list(loss["pyramid"][key])
                                for key in ("relative_downsample", "weight")}
        loss_section = {"core_method": "point_pillar_pyramid_loss", "args": loss_args}
    return {**heal_run_sections(cfg, dir_args),
            "input_source": list(cfg["input_source"]), "heter": heal_heter_section(cfg),
            "fusion": {"core_method": EXPORTED[cfg["model"]["core_method"]],
                       "dataset": cfg["fusion"]["dataset"],
                       "args": {"proj_first": False, "grid_conf": "None",
                                "data_aug_conf": "None"}},
            "preprocess": heal_preprocess(cfg["preprocess"]),
            "model": {"core_method": core, "args": model_args}, "loss": loss_section}


def export_heal_heter_run(run_dir, out_dir, checkpoint: Optional[str] = None
                          ) -> Tuple[Path, List[str]]:
    """Write HEAL's run folder ``out_dir`` (must not exist) for our heter pyramid ``run_dir``."""
    run_dir = Path(run_dir)
    source = str(run_dir / "config.yaml")
    cfg = to_plain(load_config(run_dir / "config.yaml"))
    if cfg["model"]["core_method"] not in EXPORTED:
        raise InteropError(f"{source}: model.core_method {cfg['model']['core_method']!r}: "
                           f"exported to HEAL are {', '.join(EXPORTED)}")
    hypes = heal_heter_hypes(cfg, source)
    path = run_checkpoint(run_dir, checkpoint)
    saved = load_checkpoint(path)
    if "model" not in saved:
        raise InteropError(f"{path}: not a training checkpoint (no 'model' entry)")
    args = hypes["model"]["args"]
    cameras = {name: args[name]["encoder_args"]["camera_encoder"]
               for name in cfg["model"]["args"]["modalities"]
               if args[name]["sensor_type"] == "camera"}
    core = cfg["model"]["core_method"]
    state = ours_to_heal_state(saved["model"], cameras, list(cfg["model"]["args"]["modalities"]),
                               str(path), core)
    our_shapes = {key: tuple(value.shape) for key, value in saved["model"].items()}
    state = with_never_run_parts(state, heal_key_shapes(core, cfg["model"]["args"], our_shapes,
                                                        cameras))
    epoch = max(int(saved.get("epoch", 0)), 0)
    with staged_folder(Path(out_dir), "export") as staging:
        (staging / "config.yaml").write_text(yaml.safe_dump(hypes, sort_keys=False))
        torch.save(state, staging / f"net_epoch{epoch}.pth")
    return Path(out_dir), []


def never_run_fill(key: str, shape: Tuple[int, ...]) -> torch.Tensor:
    """A tensor of a part HEAL builds and never runs, as a fresh layer holds it: zero weights
    and biases, BatchNorm's identity (weight and running_var 1), no batches tracked."""
    if key.endswith("num_batches_tracked"):
        return torch.zeros(shape, dtype=torch.int64)
    one = key.endswith("running_var") or (key.endswith(".weight") and len(shape) == 1)
    return torch.full(shape, 1.0 if one else 0.0)


def with_never_run_parts(state: Dict[str, torch.Tensor], expected: Dict[str, Tuple[int, ...]]
                         ) -> Dict[str, torch.Tensor]:
    """``state`` (HEAL's keys) completed to every key of HEAL's model ``expected`` (key ->
    shape, :func:`heal_key_shapes`): the never-run parts ours does not build (an EfficientNet
    type's classifier, the late model's first ``layers`` stage) filled by
    :func:`never_run_fill`, so HEAL's strict ``load_state_dict`` takes the file."""
    extra = [key for key in state if key not in expected]
    if extra:
        raise InteropError(f"{extra[0]} has no place in HEAL's model ({len(extra)} such keys)")
    return {key: state[key] if key in state else never_run_fill(key, shape)
            for key, shape in expected.items()}


def is_heter_run(run_dir) -> bool:
    """Our run folder holds a heterogeneous model (exported by this module, not the camera
    export); False when it has no config (the camera export then says so)."""
    config = Path(run_dir) / "config.yaml"
    if not config.is_file():
        return False
    return load_config(config)["model"]["core_method"] in \
        ("heter_pyramid_collab", "heter_pyramid_single", "heter_model_late")
