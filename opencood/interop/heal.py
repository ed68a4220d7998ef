"""HEAL's run folders -> ours (issue 24).

HEAL (yifanlu0227/HEAL) trains its LiDAR baselines as ``heter_model_baseline`` with one
modality: ``train.py`` writes ``config.yaml`` (``yaml.dump`` of the parsed hypes),
``net_epoch<N>.pth`` every ``save_freq`` epochs and ``net_epoch_bestval_at<N>.pth`` (the best
validation loss, the previous one deleted), each a bare ``model.state_dict()``. Its
``load_saved_model`` (used by its inference) takes the bestval file when there is one (exactly
one), else the highest ``*epoch<N>.pth``; so does :func:`pick_heal_checkpoint`.

The model (``heter_model_baseline.py``), per modality ``m`` (``m1`` ...): ``encoder_m.`` (a
PointPillar encoder: ``pillar_vfe``, parameter-free ``scatter``), ``backbone_m.`` (OpenCOOD's
BaseBEVBackbone), ``shrinker_m.`` (a DownsampleConv, always), then ``fusion_net`` on the shrunk
single-scale maps, then ``cls_head``, ``reg_head`` and ``dir_head`` (HEAL, like CoAlign, has a
direction classifier; channel ``a * bins + j`` as ours). Our ``point_pillar_intermediate``
with ``shrink_header``, fusion at stage ``backbone`` and ``use_dir: true`` is the same network:

HEAL ``fusion_method``   our fusion   HEAL key prefix -> ours
max                      fcooper      encoder_m.pillar_vfe.pfn_layers -> encoder.vfe.layers
att                      attfuse      backbone_m. -> backbone. (ZeroPad2d shift as OpenCOOD)
v2vnet                   v2vnet       shrinker_m.layers.0.double_conv.{0,2} -> shrink.layers.{0,2}
                                      fusion_net.* as OpenCOOD's V2VNet; dir_head -> head.dir_conv

Camera modalities (``lift_splat_shoot`` encoders, HEAL's CameraOnly runs) import the same way
with our ``lss`` encoder in the slot (:mod:`opencood.interop.heal_camera`).

HEAL's heterogeneous models (``heter_pyramid_collab``, ``heter_pyramid_single``,
``heter_model_late``) are imported by :mod:`opencood.interop.heal_heter_run`.

Refused, each in one line: another ``model.core_method`` (multiscale, DiscoNet's
own model), more than one modality or an encoder other than PointPillar and lift-splat-shoot, the fusions whose
key mapping is not established here (``disconet``, ``v2xvit``, ``cobevt``, ``where2comm``,
``who2com``), single-supervision heads, a compressor, a second shrink after fusion, direction
bins other than 2.

HEAL fuses with ``proj_first: false`` (each agent's map computed in its own frame, then warped
to the ego with ``grid_sample``): the imported config does too (``fusion.args.proj_first:
false``, ``opencood.models.warp``). HEAL's warp and ours are not compared here (the parity
fixtures put all agents in one frame); the import says so (``notes``).
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import List, Optional, Tuple

from opencood.data.formats import format_names
from opencood.interop import heal_camera
from opencood.interop.opencood_ckpt import (PILLAR_RULES, SHRINK_RULES, V2VNET_RULES,
                                            InteropError, Rule)
from opencood.interop.opencood_config import translate_config

# HEAL fusion_method -> (the OpenCOOD model of the same fusion, our fusion module)
FUSIONS = {"max": ("point_pillar_fcooper", "fcooper"),
           "att": ("point_pillar_intermediate", "attfuse"),
           "v2vnet": ("point_pillar_v2vnet", "v2vnet")}
UNMAPPED_FUSIONS = ("disconet", "v2xvit", "cobevt", "where2comm", "who2com")
BESTVAL_FILE = re.compile(r"net_epoch_bestval_at(\d+)\.pth")
ANY_EPOCH_FILE = re.compile(r".*epoch(\d+)\.pth")
PROJ_FIRST_NOTE = ("imported with fusion.args.proj_first: false, as HEAL fuses (each agent's "
                   "map warped to the ego); HEAL's warp and ours are not compared here")


def pick_heal_checkpoint(peer_dir: Path, explicit: Optional[str]) -> Tuple[Path, int]:
    """(checkpoint, epoch) as HEAL's load_saved_model picks: the one bestval file, else the
    highest ``*epoch<N>.pth``."""
    if explicit:
        match = ANY_EPOCH_FILE.fullmatch(Path(explicit).name)
        return Path(explicit), int(match.group(1)) if match else -1
    best = sorted((int(m.group(1)), p) for p in peer_dir.iterdir()
                  if (m := BESTVAL_FILE.fullmatch(p.name)))
    if len(best) > 1:
        raise InteropError(f"{peer_dir}: {len(best)} net_epoch_bestval_at<N>.pth files (HEAL "
                           "keeps one); give --checkpoint FILE")
    if best:
        return best[0][1], best[0][0]
    epochs = sorted((int(m.group(1)), p) for p in peer_dir.iterdir()
                    if (m := ANY_EPOCH_FILE.fullmatch(p.name)))
    if not epochs:
        raise InteropError(f"{peer_dir}: no net_epoch<N>.pth or net_epoch_bestval_at<N>.pth "
                           "(give --checkpoint FILE)")
    return epochs[-1][1], epochs[-1][0]


def _get(data: dict, dotted: str, source: str, default=KeyError):
    node = data
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            if default is KeyError:
                raise InteropError(f"{source}: {dotted}: missing (required to translate the run)")
            return default
        node = node[key]
    return node


def heal_modality(data: dict, source: str) -> str:
    """The one modality (``m1`` ...) of a single-modality heter model, a LiDAR PointPillar or
    a lift-splat camera agent; refuses anything else in one line."""
    core = _get(data, "model.core_method", source)
    if core != "heter_model_baseline":
        raise InteropError(f"{source}: model.core_method {core!r} has no counterpart here "
                           "(supported: heter_model_baseline with one LiDAR PointPillar or "
                           "lift-splat camera modality)")
    args = _get(data, "model.args", source)
    modalities = [key for key in args if re.fullmatch(r"m\d+", str(key))]
    if len(modalities) != 1:
        raise InteropError(f"{source}: model.args has modalities {modalities}: only one "
                           "(single-modality training) has a counterpart here")
    name = modalities[0]
    if heal_camera.is_camera(_get(data, f"model.args.{name}", source)):
        expected_pairs = (("core_method", heal_camera.CAMERA_ENCODER), ("sensor_type", "camera"))
    else:
        expected_pairs = (("core_method", "point_pillar"), ("sensor_type", "lidar"))
    for key, expected in expected_pairs:
        value = _get(data, f"model.args.{name}.{key}", source)
        if value != expected:
            raise InteropError(f"{source}: model.args.{name}.{key} is {value!r}; only "
                               f"{expected!r} has a counterpart here")
    for key, why in (("supervise_single", "single-supervision heads (cls_head_single ...)"),
                     ("compressor", "its compressor"),
                     ("shrink_header", "a second shrink after fusion")):
        if _get(data, f"model.args.{key}", source, None):
            raise InteropError(f"{source}: model.args.{key}: {why} has no counterpart here")
    return name


def _fusion(data: dict, source: str) -> Tuple[str, str, str]:
    """(HEAL fusion_method, the OpenCOOD model of that fusion, our fusion module)."""
    method = _get(data, "model.args.fusion_method", source)
    if method in UNMAPPED_FUSIONS:
        raise InteropError(f"{source}: model.args.fusion_method {method!r}: HEAL's {method} "
                           "has no established key mapping to ours (supported: "
                           f"{', '.join(FUSIONS)})")
    if method not in FUSIONS:
        raise InteropError(f"{source}: model.args.fusion_method {method!r} has no counterpart "
                           f"here (supported: {', '.join(FUSIONS)})")
    return (method,) + FUSIONS[method]


def as_opencood_hypes(data: dict, source: str) -> dict:
    """HEAL's hypes rearranged as the OpenCOOD hypes of the same network, so that one
    translation (``translate_config``) serves both."""
    modality = heal_modality(data, source)
    method, opencood_model, _ = _fusion(data, source)
    strategy = _get(data, "fusion.core_method", source)
    if strategy not in ("intermediateheter", "intermediate"):
        raise InteropError(f"{source}: fusion.core_method {strategy!r} does not go with "
                           "heter_model_baseline (intermediate fusion)")
    m = f"model.args.{modality}"
    encoder = _get(data, f"{m}.encoder_args", source)
    preprocess = _get(data, f"heter.modality_setting.{modality}.preprocess", source, None) \
        or _get(data, "preprocess", source)
    args = {"lidar_range": encoder.get("lidar_range", _get(data, "model.args.lidar_range",
                                                           source)),
            "anchor_number": _get(data, "model.args.anchor_number", source),
            "base_bev_backbone": _get(data, f"{m}.backbone_args", source),
            "shrink_header": _get(data, f"{m}.shrink_header", source)}
    if heal_camera.is_camera(_get(data, m, source)):
        # the BEV grid is the preprocess grid; the encoder replaces the pillar arguments after
        # the translation (translate_heal_config)
        args.update(voxel_size=_get(data, "preprocess.args.voxel_size", source),
                    pillar_vfe=heal_camera.PLACEHOLDER_PILLARS,
                    point_pillar_scatter={"num_features": 64})
    else:
        args.update(voxel_size=_get(data, f"{m}.encoder_args.voxel_size", source),
                    pillar_vfe=_get(data, f"{m}.encoder_args.pillar_vfe", source),
                    point_pillar_scatter=_get(data, f"{m}.encoder_args.point_pillar_scatter",
                                              source))
    if method == "v2vnet":
        v2v = dict(_get(data, "model.args.v2vnet", source))
        v2v.update(voxel_size=args["voxel_size"],
                   downsample_rate=_get(data, "postprocess.anchor_args.feature_stride", source))
        args["v2vfusion"] = v2v
    loss = _get(data, "loss.args", source, {}) or {}
    hypes = {key: data[key] for key in ("name", "root_dir", "validate_dir", "test_dir",
                                        "train_params", "data_augment", "postprocess",
                                        "optimizer", "lr_scheduler") if key in data}
    hypes.update({
        "fusion": {"core_method": "IntermediateFusionDataset", "args": {}},
        "preprocess": {**preprocess, "cav_lidar_range": preprocess.get(
            "cav_lidar_range", _get(data, "cav_lidar_range", source))},
        "model": {"core_method": opencood_model, "args": args},
        "loss": {"args": {"cls_weight": _get(data, "loss.args.cls.weight", source, 1.0),
                          "reg": _get(data, "loss.args.reg.weight", source, 2.0)}
                 if isinstance(loss, dict) else {}},
    })
    return hypes


def set_direction_head(loss: dict, data: dict, source: str) -> None:
    """The peer's ``model.args.dir_args`` (HEAL's and CoAlign's direction head) -> our 2-bin
    head's loss offset (in our ``loss`` section); other bin counts are refused."""
    bins = _get(data, "model.args.dir_args.num_bins", source)
    if bins != 2:
        raise InteropError(f"{source}: model.args.dir_args.num_bins is {bins!r}; our direction "
                           "head has 2 bins")
    loss["args"]["dir_offset"] = float(_get(data, "model.args.dir_args.dir_offset",
                                                   source))


def set_own_frame_dataset(fusion: dict, data: dict, source: str) -> None:
    """The peer's ``fusion.dataset`` (a reader we have) and own-frame fusion in our ``fusion``
    section: HEAL and CoAlign compute every agent's map in its own frame and warp it to the
    ego, so do we."""
    dataset = _get(data, "fusion.dataset", source, "opv2v")
    if dataset not in format_names():
        raise InteropError(f"{source}: fusion.dataset {dataset!r} has no reader here "
                           f"({', '.join(format_names())})")
    fusion["dataset"] = dataset
    fusion["args"] = {"proj_first": False}


def translate_heal_config(data: dict, source: str) -> dict:
    """HEAL hypes -> our config (unresolved); raises InteropError naming the key."""
    cfg = translate_config(as_opencood_hypes(data, source), source)
    args = cfg["model"]["args"]
    args["use_dir"] = True
    args["fusion"]["stage"] = "backbone"            # after the shrinker, single scale
    set_direction_head(cfg["loss"], data, source)
    set_own_frame_dataset(cfg["fusion"], data, source)
    modality = heal_modality(data, source)
    setting = _get(data, f"model.args.{modality}", source)
    if heal_camera.is_camera(setting):
        del args["pillar_vfe"], args["point_pillar_scatter"]
        args["encoder"] = heal_camera.camera_encoder(
            setting, cfg["preprocess"]["cav_lidar_range"],
            cfg["preprocess"]["args"]["voxel_size"], f"{source}: model.args.{modality}")
        # the run reads cameras (no LiDAR) with HEAL's image augmentation
        cfg["input_source"] = ["camera"]
        cfg["camera"] = {"data_aug_conf": heal_camera.data_aug_conf(setting)}
    if cfg["fusion"]["dataset"] == "dairv2x":
        # every HEAL DAIR data set trains and evaluates on the two sides' own labels merged
        # (opencood.data.dairv2x), not on cooperative/label_world as CoAlign's do
        cfg["fusion"]["gt_source"] = "single_side"
    lidar_range = cfg["preprocess"]["cav_lidar_range"]
    gt_range = [float(v) for v in _get(data, "postprocess.gt_range", source, lidar_range)]
    cfg["postprocess"]["gt_range"] = [max(a, b) for a, b in zip(gt_range[:3], lidar_range[:3])] \
        + [min(a, b) for a, b in zip(gt_range[3:], lidar_range[3:])]
    return cfg


def heal_rules(data: dict, source: str) -> Tuple[Rule, ...]:
    """The key rules of HEAL's heter_model_baseline for this config (its modality prefix)."""
    modality = heal_modality(data, source)
    method = _fusion(data, source)[0]
    prefixes = (("pillar_vfe.", f"encoder_{modality}.pillar_vfe."),
                ("backbone.", f"backbone_{modality}."),
                ("shrink_conv.", f"shrinker_{modality}."))

    def rename(rule: Rule) -> Rule:
        for old, new in prefixes:
            if rule.peer.startswith(old):
                return dataclasses.replace(rule, peer=new + rule.peer[len(old):])
        return rule

    rules = [rename(rule) for rule in PILLAR_RULES + SHRINK_RULES]
    rules.append(Rule("dir_head.{p}", "head.dir_conv.{p}"))
    setting = _get(data, f"model.args.{modality}", source)
    if heal_camera.is_camera(setting):
        kind = _get(data, f"model.args.{modality}.encoder_args.camera_encoder", source)
        rules = [rule for rule in rules if not rule.peer.startswith(f"encoder_{modality}.")]
        rules.extend(heal_camera.camera_encoder_rules(modality, kind))
    if method == "v2vnet":
        rules.extend(V2VNET_RULES)
    return tuple(rules)


def heal_notes(data: dict) -> List[str]:
    notes = [PROJ_FIRST_NOTE]
    if heal_camera.is_camera(data["model"]["args"][heal_modality(data, "config.yaml")]):
        notes.append(heal_camera.DEPTH_NOTE)
    return notes


def heal_unused_keys(data: dict) -> Tuple[str, ...]:
    """Key prefixes of HEAL's state dict that its forward never runs and ours does not have
    (the EfficientNet's classification head of a camera agent): left out of the strict
    import."""
    modality = heal_modality(data, "config.yaml")
    setting = data["model"]["args"][modality]
    if not heal_camera.is_camera(setting) or \
            setting["encoder_args"].get("camera_encoder") != "EfficientNet":
        return ()
    return heal_camera.unused_trunk_prefixes(modality)
