"""HEAL's heterogeneous run folders -> ours (issue 37 point 5): ``--from heal`` of runs whose
``model.core_method`` is ``heter_pyramid_collab`` (HEAL's stage one and its final
collaboration), ``heter_pyramid_single`` (a type trained or aligned alone, stage two) or
``heter_model_late`` (its late baseline).

The run folder is HEAL's (``config.yaml`` + ``net_epoch*.pth``, the checkpoint picked as HEAL's
loader picks it, :func:`opencood.interop.heal.pick_heal_checkpoint`). Written: our config with
the model of the same name (``model.args`` from :mod:`opencood.interop.heal_heter`), HEAL's
``heter`` section (our schema reads it as HEAL does, docs/heterogeneous.md), own-frame fusion
(``proj_first: false``, as HEAL fuses), HEAL's pyramid loss for the pyramid models; and the
state dict placed strictly by :func:`heal_heter.heal_state_to_ours` (every tensor of HEAL's has
one place of ours with its shape and every one of ours is filled, else one line naming the key
and the file). HEAL's ``layers_<m>.resnet.layer0`` of the late model, which its forward never
runs, is the only thing dropped (``heal_heter.LATE_UNUSED``).

With ``merge`` (``--merge RUN ...``), the weights are HEAL's ``merge_final`` of those run
folders (:mod:`opencood.interop.heal_merge`), placed as strictly. HEAL's ``label_type`` is
kept: ``camera`` labels each agent with what its ``bev_visibility`` map shows where HEAL's data
set does (opencood.data.datasets ``BaseFusionDataset._camera_labelled``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

from opencood.config import ConfigError, resolve
from opencood.interop import heal_heter, heal_merge
from opencood.interop.heal import (PROJ_FIRST_NOTE, _get, pick_heal_checkpoint,
                                   set_direction_head, set_own_frame_dataset)
from opencood.interop.heal_camera import PLACEHOLDER_PILLARS
from opencood.interop.opencood_ckpt import InteropError
from opencood.interop.opencood_config import translate_config
from opencood.strategies import choose_strategy
from opencood.utils.checkpoint import load_checkpoint

# HEAL's model -> (its fusion.core_method, our fusion strategy)
HETER_MODELS = {"heter_pyramid_collab": ("intermediateheter", "intermediate"),
                "heter_pyramid_single": ("lateheter", "late"),
                "heter_model_late": ("lateheter", "late")}
HETER_KEYS = ("assignment_path", "ego_modality", "mapping_dict", "lidar_channels_dict",
              "cav_preference")
SETTING_KEYS = ("sensor_type", "core_method", "preprocess", "data_aug_conf", "grid_conf")
# HEAL's final_infer yamls (inference only) name no pyramid loss: its stage-one yamls' weights
STAGE_ONE_PYRAMID = {"relative_downsample": [1, 2, 4], "weight": [0.4, 0.2, 0.1]}
PYRAMID_NOTE = ("the config names no loss.args.pyramid (HEAL's final_infer yamls evaluate "
                "only): training this run uses the occupancy weights of HEAL's stage-one "
                "yamls, relative_downsample [1, 2, 4], weight [0.4, 0.2, 0.1]")
# what HEAL's data sections need of a model for the shared translation; replaced afterwards
_PLACEHOLDER_MODEL = {"args": {
    "pillar_vfe": PLACEHOLDER_PILLARS, "point_pillar_scatter": {"num_features": 64},
    "base_bev_backbone": {"layer_nums": [1], "layer_strides": [1], "num_filters": [64],
                          "upsample_strides": [1], "num_upsample_filter": [64]}}}


def is_heal_heter(data: Mapping) -> bool:
    """HEAL's hypes name one of its heterogeneous models."""
    return (data.get("model") or {}).get("core_method") in HETER_MODELS


def _model_args(data: dict, core: str, source: str) -> dict:
    args = _get(data, "model.args", source)
    try:
        if core == "heter_model_late":
            return heal_heter.late_model_args_from_heal(args)
        return heal_heter.model_args_from_heal(args)
    except KeyError as error:
        raise InteropError(f"{source}: model.args: (HEAL's {core}) {error} is missing") \
            from None


def _preprocess_keys(preprocess: Mapping) -> dict:
    """The keys of a HEAL preprocess section that ours reads."""
    return {key: preprocess[key] for key in ("core_method", "args", "cav_lidar_range")
            if key in preprocess}


def _heter_section(data: dict, modalities, source: str) -> dict:
    """HEAL's ``heter`` section, the keys our schema reads; each model type's setting (a camera
    type's image augmentation from its encoder when the section omits it)."""
    heter = _get(data, "heter", source)
    ours = {key: heter[key] for key in HETER_KEYS if heter.get(key) is not None}
    settings = {}
    for name, model_setting in modalities.items():
        setting = dict(_get(data, f"heter.modality_setting.{name}", source))
        setting = {key: setting[key] for key in SETTING_KEYS if setting.get(key) is not None}
        if setting.get("sensor_type") == "camera" and "data_aug_conf" not in setting:
            setting["data_aug_conf"] = _get(
                data, f"model.args.{name}.encoder_args.data_aug_conf", source)
        if isinstance(setting.get("preprocess"), Mapping):
            setting["preprocess"] = _preprocess_keys(setting["preprocess"])
            # a copy of the top-level section is our None (the export writes it out)
            if setting["preprocess"] == _preprocess_keys(data.get("preprocess") or {}):
                del setting["preprocess"]
        settings[name] = setting
    ours["modality_setting"] = settings
    # HEAL's yamls name beams of types they leave out: only the model's are kept
    if "lidar_channels_dict" in ours:
        ours["lidar_channels_dict"] = {name: channels for name, channels in
                                       ours["lidar_channels_dict"].items() if name in settings}
    return ours


def _loss(cfg_loss: dict, data: dict, core: str, source: str) -> dict:
    if core == "heter_model_late":
        return cfg_loss
    pyramid = _get(data, "loss.args.pyramid", source, STAGE_ONE_PYRAMID)
    args = {**cfg_loss["args"], "dir_weight": float(_get(data, "loss.args.dir.weight", source,
                                                         0.2)),
            "pyramid": {"relative_downsample": list(pyramid["relative_downsample"]),
                        "weight": list(pyramid["weight"])}}
    return {"core_method": "point_pillar_pyramid_loss", "args": args}


def _label_type(data: dict, source: str) -> str:
    """HEAL's ``label_type`` (its yamls: lidar or camera; default lidar)."""
    label_type = _get(data, "label_type", source, "lidar")
    if label_type not in ("lidar", "camera"):
        raise InteropError(f"{source}: label_type is {label_type!r}; HEAL's are 'lidar' and "
                           f"'camera'")
    return label_type


def translate_heal_heter_config(data: dict, source: str) -> Tuple[dict, List[str]]:
    """HEAL's hypes of a heterogeneous model -> (our config, unresolved; notes)."""
    core = _get(data, "model.core_method", source)
    dataset, strategy = HETER_MODELS[core]
    if _get(data, "fusion.core_method", source) != dataset:
        raise InteropError(f"{source}: fusion.core_method is "
                           f"{_get(data, 'fusion.core_method', source)!r}; HEAL runs {core} "
                           f"with {dataset!r}")
    hypes = {key: data[key] for key in ("name", "root_dir", "validate_dir", "test_dir",
                                        "train_params", "data_augment", "postprocess",
                                        "preprocess", "optimizer", "lr_scheduler", "loss")
             if key in data}
    hypes["model"] = {"core_method": "point_pillar", "args": {
        **_PLACEHOLDER_MODEL["args"],
        "lidar_range": _get(data, "preprocess.cav_lidar_range", source),
        "voxel_size": _get(data, "preprocess.args.voxel_size", source),
        "anchor_number": _get(data, "model.args.anchor_number", source)}}
    hypes["fusion"] = {"core_method": "LateFusionDataset", "args": {}}
    hypes["loss"] = {"args": {"cls_weight": _get(data, "loss.args.cls.weight", source, 1.0),
                              "reg": _get(data, "loss.args.reg.weight", source, 2.0)}}
    cfg = translate_config(hypes, source)
    model_args = _model_args(data, core, source)
    cfg["model"] = {"core_method": core, "args": model_args}
    cfg["fusion"] = {"core_method": strategy}
    set_own_frame_dataset(cfg["fusion"], data, source)
    if strategy == "late":
        # each agent detects in its own frame and only boxes travel: no feature warp to set
        cfg["fusion"]["args"] = {}
    cfg["loss"] = _loss(cfg["loss"], data, core, source)
    set_direction_head(cfg["loss"], data, source)
    cfg["heter"] = _heter_section(data, model_args["modalities"], source)
    cfg["label_type"] = _label_type(data, source)
    cfg["input_source"] = [sensor for sensor in _get(data, "input_source", source, ["lidar"])
                           if sensor in ("lidar", "camera", "depth")]
    notes = [PROJ_FIRST_NOTE] if strategy == "intermediate" else []
    if core != "heter_model_late" and _get(data, "loss.args.pyramid", source, None) is None:
        notes.append(PYRAMID_NOTE)
    return cfg, notes


def heal_heter_state(data: dict, state: Mapping, our_shapes: Mapping, cfg: dict,
                     source: str) -> dict:
    """HEAL's state dict of this run -> ours (keys and shapes of ``our_shapes``), strictly."""
    args = _get(data, "model.args", source)
    modalities = list(cfg["model"]["args"]["modalities"])
    camera_encoders = heal_heter.camera_encoders_of(args)
    if data["model"]["core_method"] == "heter_model_late":
        return heal_heter.heal_late_state_to_ours(state, camera_encoders, our_shapes,
                                                  modalities, source)
    return heal_heter.heal_state_to_ours(state, camera_encoders, our_shapes, modalities, source)


def merged_state(data: dict, run_dirs: Sequence, our_shapes: Mapping, cfg: dict,
                 source: str) -> dict:
    """Our state dict from HEAL's merge of ``run_dirs`` (:mod:`heal_merge`) for the model of
    ``data``, strictly: each merged tensor checked against HEAL's model, naming its file."""
    state, origin = heal_merge.merged_heal_state(run_dirs)
    core = data["model"]["core_method"]
    expected = heal_heter.heal_key_shapes(core, cfg["model"]["args"], our_shapes,
                                          heal_heter.camera_encoders_of(data["model"]["args"]))
    heal_merge.check_merged_keys(state, origin, expected, f"HEAL's {core} of {source}")
    return heal_heter_state(data, state, our_shapes, cfg, f"the merge for {source}")


def translate_heal_heter_run(peer_dir: Path, data: dict, source: str,
                             checkpoint: Optional[str], our_state_shapes: Callable[[dict], dict],
                             merge: Optional[Sequence] = None) -> Tuple[dict, dict, dict]:
    """(our resolved config, our state dict, provenance) of HEAL's heterogeneous run folder;
    ``our_state_shapes(model_section)`` gives our model's state-dict shapes (the importer's,
    passed in so this module does not import the importer that imports it). ``merge``: the
    run folders HEAL's ``merge_final`` assembles (the base last) give the weights instead of
    ``peer_dir``'s checkpoint (HEAL's merged file is ``net_epoch1.pth``: epoch 1)."""
    unresolved, notes = translate_heal_heter_config(data, source)
    try:
        cfg = resolve(unresolved, f"{source} (translated)")
        choose_strategy(cfg)            # what tools/eval.py checks of the fusion section
    except ConfigError as error:
        raise InteropError(str(error)) from None
    our_shapes = our_state_shapes(cfg["model"])
    if merge:
        ours = merged_state(data, merge, our_shapes, unresolved, source)
        paths = [str(pick_heal_checkpoint(Path(run), None)[0].resolve()) for run in merge]
        checkpoint_text, epoch = f"merge_final of {', '.join(paths)}", 1
    else:
        path, epoch = pick_heal_checkpoint(peer_dir, checkpoint)
        ours = heal_heter_state(data, load_checkpoint(path), our_shapes, unresolved, str(path))
        checkpoint_text = str(Path(path).resolve())
    provenance = {"codebase": "heal", "run_dir": str(peer_dir.resolve()),
                  "checkpoint": checkpoint_text, "epoch": epoch,
                  "model": data["model"]["core_method"], "notes": notes}
    return cfg, ours, provenance
