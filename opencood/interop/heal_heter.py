"""HEAL's heterogeneous pyramid models <-> ours: ``model.args`` and state dicts (issue 37).

HEAL's ``HeterPyramidCollab`` / ``HeterPyramidSingle`` (``model.core_method``
``heter_pyramid_collab`` / ``heter_pyramid_single``) are ours of the same names
(``opencood.models.heter_pyramid``). :func:`model_args_from_heal` turns HEAL's ``model.args``
(agent types ``m1``..``mN`` as top-level keys) into ours (``modalities: {m1: ...}``), and
:func:`heal_state_to_ours` places every tensor of its state dict, strictly: each HEAL key lands
on one of ours with the same shape and every one of ours is filled, or :class:`InteropError`
names the keys in one line.

HEAL key (per modality m)                          our key
encoder_m.pillar_vfe.pfn_layers.{i}.*              branches.m.encoder.vfe.layers.{i}.*
encoder_m.camencode.* (lift-splat)                 branches.m.encoder.camera_encoder.* (1)
backbone_m.resnet.layer{i}.{k}.conv1/bn1/conv2/bn2  branches.m.backbone.blocks.{i}.{k}.residual.
  /downsample.{0,1}                                  {0,1,3,4} / shortcut.{0,1}
aligner_m.channel_align.model.{b}.*                branches.m.aligner.{b}.* (ConvNeXt)
pyramid_backbone.resnet.layer{i}.{k}.conv1..bn3    pyramid.backbone.blocks.{i}.{k}.residual.
                                                     {0,1,3,4,6,7} (ResNeXt: three convs)
pyramid_backbone.deblocks.{i}.{j}.*                pyramid.backbone.deblocks.{i}.{j}.*
pyramid_backbone.single_head_{i}.*                 pyramid.occupancy_heads.{i}.*
shrink_conv.layers.0.double_conv.{0,2}.*           shrink.layers.{0,2}.*
cls_head / reg_head / dir_head                     head.cls_conv / reg_conv / dir_conv

1. As :func:`opencood.models.lift_splat.heal_to_ours` (EfficientNet keys renamed).
"""
from __future__ import annotations

import copy
import dataclasses
import re
from typing import Dict, Mapping, Tuple

import torch

from opencood.interop.heal_camera import EFFICIENTNET_CLASSIFIER, camera_encoder_rules
from opencood.interop.opencood_ckpt import (SHRINK_RULES, InteropError, Rule,
                                            ours_to_peer_state, peer_shapes_by_rules,
                                            peer_state_to_ours, strip_ddp_prefix)
from opencood.models.lift_splat import args_from_heal as lss_args_from_heal
from opencood.models.lift_splat import heal_to_ours as lss_heal_to_ours

# HEAL's ResNet / ResNeXt block children -> our residual Sequential's indices
_BLOCK_CHILDREN = (("conv1", "residual.0"), ("bn1", "residual.1"), ("conv2", "residual.3"),
                   ("bn2", "residual.4"), ("conv3", "residual.6"), ("bn3", "residual.7"),
                   ("downsample.0", "shortcut.0"), ("downsample.1", "shortcut.1"))
_CONVNEXT_CHILDREN = ("dwconv", "norm", "pwconv1", "pwconv2")


def _resnet_rules(theirs: str, ours: str) -> Tuple[Rule, ...]:
    """``theirs.resnet.layer{i}.{k}`` (HEAL's ResNetModified) -> ``ours.blocks.{i}.{k}``."""
    return tuple(Rule(f"{theirs}.resnet.layer{{i}}.{{k}}.{child}.{{p}}",
                      f"{ours}.blocks.{{i}}.{{k}}.{mine}.{{p}}") for child, mine in _BLOCK_CHILDREN) \
        + (Rule(f"{theirs}.deblocks.{{i}}.{{j}}.{{p}}", f"{ours}.deblocks.{{i}}.{{j}}.{{p}}"),)


def modality_rules(name: str, branch: str = "") -> Tuple[Rule, ...]:
    """The rules of agent type ``name`` (its lift-splat encoder aside: module doc (1)), its
    branch at ``branch`` in our model (default ``branches.<name>``)."""
    branch = branch or f"branches.{name}"
    rules = [Rule(f"encoder_{name}.pillar_vfe.pfn_layers.{{i}}.{part}.{{p}}",
                  f"{branch}.encoder.vfe.layers.{{i}}.{part}.{{p}}") for part in ("linear", "norm")]
    rules += _resnet_rules(f"backbone_{name}", f"{branch}.backbone")
    rules += [Rule(f"aligner_{name}.channel_align.model.{{b}}.{child}.{{p}}",
                   f"{branch}.aligner.{{b}}.{child}.{{p}}") for child in _CONVNEXT_CHILDREN]
    rules.append(Rule(f"aligner_{name}.channel_align.model.{{b}}.gamma",
                      f"{branch}.aligner.{{b}}.gamma"))
    return tuple(rules)


SHARED_RULES = _resnet_rules("pyramid_backbone", "pyramid.backbone") + (
    Rule("pyramid_backbone.single_head_{i}.{p}", "pyramid.occupancy_heads.{i}.{p}"),
    *SHRINK_RULES,
    Rule("cls_head.{p}", "head.cls_conv.{p}"),
    Rule("reg_head.{p}", "head.reg_conv.{p}"),
    Rule("dir_head.{p}", "head.dir_conv.{p}"),
)


def late_rules(name: str) -> Tuple[Rule, ...]:
    """HEAL's ``HeterModelLate`` agent type ``name`` -> our ``detectors.<name>``: its branch,
    ``layers`` stage i >= 1 -> ``stages.{i-1}`` (stage 0 never runs: :data:`LATE_UNUSED`), its
    shrink and heads."""
    ours = f"detectors.{name}"
    rules = list(modality_rules(name, f"{ours}.branch"))
    rules += [Rule(f"layers_{name}.resnet.layer{{i}}.{{k}}.{child}.{{p}}",
                   f"{ours}.stages.{{i}}.{{k}}.{mine}.{{p}}", shift={"i": -1})
              for child, mine in _BLOCK_CHILDREN]
    rules.append(Rule(f"layers_{name}.deblocks.{{i}}.{{j}}.{{p}}",
                      f"{ours}.deblocks.{{i}}.{{j}}.{{p}}"))
    rules += [Rule(f"shrink_conv_{name}.layers.0.double_conv.{k}.{{p}}",
                   f"{ours}.shrink.layers.{k}.{{p}}") for k in (0, 2)]
    rules += [Rule(f"{head}_head_{name}.{{p}}", f"{ours}.head.{head}_conv.{{p}}")
              for head in ("cls", "reg", "dir")]
    return tuple(rules)


# HeterModelLate builds a first stage in ``layers_<m>`` that its forward skips (the backbone's
# output is its first scale): imported as known-unused, not placed
LATE_UNUSED = re.compile(r"layers_m\d+\.resnet\.layer0\.")


def heal_late_state_to_ours(state: Mapping[str, torch.Tensor],
                            camera_encoders: Mapping[str, str],
                            our_shapes: Mapping[str, Tuple[int, ...]], modalities,
                            source: str = "checkpoint") -> Dict[str, torch.Tensor]:
    """HEAL's ``HeterModelLate`` state dict -> our ``heter_model_late``, strictly (its unused
    first ``layers`` stages dropped by name)."""
    state = {k: v for k, v in strip_ddp_prefix(state).items() if not LATE_UNUSED.match(k)}
    rules = sum((late_rules(name) for name in modalities), ())
    return heal_state_to_ours(state, camera_encoders, our_shapes, modalities, source,
                              rules=rules, encoder_prefix="detectors.{}.branch.encoder.")


def heal_state_to_ours(state: Mapping[str, torch.Tensor], camera_encoders: Mapping[str, str],
                       our_shapes: Mapping[str, Tuple[int, ...]], modalities,
                       source: str = "checkpoint", rules: Tuple[Rule, ...] = (),
                       encoder_prefix: str = "branches.{}.encoder."
                       ) -> Dict[str, torch.Tensor]:
    """HEAL's heter pyramid state dict -> ours (keys and shapes of ``our_shapes``), strictly.

    camera_encoders: camera modality -> HEAL's ``camera_encoder`` (EfficientNet / Resnet101);
    modalities: every agent type's name; rules / encoder_prefix: another model's (the late
    model's, :func:`heal_late_state_to_ours`). An EfficientNet type's never-run classifier
    (``_conv_head``, ``_bn1``, ``_fc``: our trunk does not build it) is dropped by name."""
    unused = tuple(efficientnet_classifier_shapes(camera_encoders))
    state = {key: value for key, value in strip_ddp_prefix(state).items() if key not in unused}
    camera_part: Dict[str, torch.Tensor] = {}
    rest = {}
    for key, tensor in state.items():
        modality = next((m for m in camera_encoders if key.startswith(f"encoder_{m}.")), None)
        if modality is None:
            rest[key] = tensor
            continue
        local = key[len(f"encoder_{modality}."):]
        mapped = lss_heal_to_ours({local: tensor}, camera_encoders[modality])
        if len(mapped) != 1:
            raise InteropError(f"{source}: {key} has no place in our lift-splat encoder")
        (ours, value), = mapped.items()
        target = encoder_prefix.format(modality) + ours
        if target not in our_shapes or tuple(our_shapes[target]) != tuple(value.shape):
            raise InteropError(f"{source}: {key} {tuple(value.shape)} does not fit {target} "
                               f"{tuple(our_shapes.get(target, ()))} of our model")
        camera_part[target] = value
    rules = rules or sum((modality_rules(name) for name in modalities), ()) + SHARED_RULES
    remaining = {k: v for k, v in our_shapes.items() if k not in camera_part}
    placed = peer_state_to_ours(rest, rules, remaining, source, "our heter pyramid model")
    return {key: (camera_part[key] if key in camera_part else placed[key]) for key in our_shapes}


def _backbone_from_heal(backbone: Mapping) -> dict:
    keys = ("layer_nums", "layer_strides", "num_filters", "upsample_strides",
            "num_upsample_filter")
    return {key: list(backbone[key]) for key in keys if key in backbone}


def _encoder_from_heal(name: str, setting: Mapping) -> dict:
    core, args = setting["core_method"], setting["encoder_args"]
    if core == "point_pillar":
        vfe = args["pillar_vfe"]
        if not vfe.get("use_norm", True) or not vfe.get("use_absolute_xyz", True):
            raise InteropError(f"model.args.{name}.encoder_args.pillar_vfe: only use_norm and "
                               "use_absolute_xyz true (HEAL's configs) are reproduced")
        return {"core_method": "pillar", "args": {
            "pillar_vfe": {"num_filters": list(vfe["num_filters"]),
                           "with_distance": bool(vfe.get("with_distance", False)),
                           # HEAL's PFN layers take the padded point slots in (OpenCOOD's)
                           "padded_slots": "reference"},
            "point_pillar_scatter": {"num_features": args["point_pillar_scatter"]["num_features"]}}}
    if core == "lift_splat_shoot":
        return {"core_method": "lss", "args": lss_args_from_heal(args)}
    raise InteropError(f"model.args.{name}.core_method {core!r}: only point_pillar and "
                       "lift_splat_shoot agents are reproduced")


def _aligner_from_heal(name: str, aligner: Mapping) -> dict:
    core = aligner["core_method"]
    if core == "identity":
        return {"core_method": "identity"}
    if core != "convnext" or aligner.get("spatial_align") or aligner["args"].get("deform"):
        raise InteropError(f"model.args.{name}.aligner_args: only identity and convnext "
                           "(no spatial_align, no deform) are reproduced")
    return {"core_method": "convnext", "num_of_blocks": aligner["args"]["num_of_blocks"],
            "kernel_size": aligner["args"].get("kernel_size", 7)}


def _shrink_from_heal(shrink: Mapping) -> dict:
    if len(shrink["dim"]) != 1 or shrink["padding"][0] != shrink["kernal_size"][0] // 2:
        raise InteropError("model.args.shrink_header: one layer with padding kernel // 2 is "
                           "reproduced")
    return {"dim": shrink["dim"][0], "stride": shrink["stride"][0],
            "kernel_size": shrink["kernal_size"][0]}


def model_args_from_heal(args: Mapping) -> dict:
    """HEAL's ``model.args`` of a heter pyramid model -> our ``model.args`` (each LiDAR type
    keeps its encoder's pillar grid; the model's own is the first LiDAR type's)."""
    args = copy.deepcopy(dict(args))
    names = [key for key in args if key.startswith("m") and key[1:].isdigit()]
    modalities, voxel_sizes = {}, []
    for name in names:
        setting = args[name]
        modalities[name] = {"sensor_type": setting["sensor_type"],
                            "encoder": _encoder_from_heal(name, setting),
                            "backbone": _backbone_from_heal(setting["backbone_args"]),
                            "aligner": _aligner_from_heal(name, setting["aligner_args"])}
        if setting["sensor_type"] == "lidar":
            encoder_args = setting["encoder_args"]
            modalities[name].update(lidar_range=list(encoder_args["lidar_range"]),
                                    voxel_size=list(encoder_args["voxel_size"]))
            voxel_sizes.append(list(encoder_args["voxel_size"]))
    if args.get("compressor"):
        raise InteropError("model.args.compressor (HEAL's NaiveCompressor) is not reproduced")
    fusion = args["fusion_backbone"]
    ours = {"lidar_range": list(args["lidar_range"]), "anchor_number": args["anchor_number"],
            "modalities": modalities,
            "fusion_backbone": {**_backbone_from_heal(fusion), "resnet": True,
                                "resnext": bool(fusion.get("resnext", False)),
                                "align_corners": bool(fusion.get("align_corners", False))}}
    if voxel_sizes:
        ours["voxel_size"] = voxel_sizes[0]
    if "shrink_header" in args:
        ours["shrink_header"] = _shrink_from_heal(args["shrink_header"])
    return ours


def camera_encoders_of(args: Mapping) -> Dict[str, str]:
    """HEAL's ``model.args`` -> {camera modality: its camera_encoder}."""
    return {name: setting["encoder_args"]["camera_encoder"] for name, setting in args.items()
            if name.startswith("m") and name[1:].isdigit()
            and setting.get("sensor_type") == "camera"}


def late_model_args_from_heal(args: Mapping) -> dict:
    """HEAL's ``model.args`` of ``heter_model_late`` -> ours (per type: the branch's keys with
    an identity aligner, ``layers`` from ``layers_args``, its shrink header)."""
    args = copy.deepcopy(dict(args))
    names = [key for key in args if key.startswith("m") and key[1:].isdigit()]
    ours = model_args_from_heal({**{name: {**args[name], "aligner_args": {"core_method":
                                                                          "identity"}}
                                        for name in names},
                                 "lidar_range": args["lidar_range"],
                                 "anchor_number": args["anchor_number"],
                                 "fusion_backbone": {}})
    ours.pop("fusion_backbone")
    for name in names:
        ours["modalities"][name].update(
            layers={**_backbone_from_heal(args[name]["layers_args"]), "resnet": True},
            shrink_header=_shrink_from_heal(args[name]["shrink_header"]))
    return ours


def camera_rules(name: str, camera_encoder: str, branch: str = "") -> Tuple[Rule, ...]:
    """HEAL's ``encoder_<name>.camencode.*`` <-> our ``<branch>.encoder.camera_encoder.*``: the
    camera import's rules (:func:`heal_camera.camera_encoder_rules`) under the type's branch,
    the same places :func:`lss_heal_to_ours` gives, as rules that also run backwards."""
    branch = branch or f"branches.{name}"
    return tuple(dataclasses.replace(rule, ours=f"{branch}.{rule.ours}")
                 for rule in camera_encoder_rules(name, camera_encoder))


def ours_to_heal_state(state: Mapping[str, torch.Tensor], camera_encoders: Mapping[str, str],
                       modalities, source: str = "checkpoint",
                       core: str = "heter_pyramid_collab") -> Dict[str, torch.Tensor]:
    """Our state dict of ``core`` (``heter_pyramid_collab`` / ``_single``,
    ``heter_model_late``) -> HEAL's keys, the inverse of :func:`heal_state_to_ours` by the same
    rules run backwards, strictly (every one of ours placed, HEAL's shapes those of ours). The
    never-run parts HEAL's strict load also wants (:func:`heal_key_shapes`) are not added
    here."""
    rules = heal_rules_of(core, camera_encoders, modalities)
    shapes = peer_shapes_by_rules({key: tuple(value.shape) for key, value in state.items()},
                                  rules)
    return ours_to_peer_state(state, rules, shapes, source, f"HEAL's {core}")


def late_first_stage_shapes(model_args: Mapping) -> Dict[str, Tuple[int, ...]]:
    """HEAL's ``layers_<m>.resnet.layer0.*`` key -> shape for our ``heter_model_late``
    ``model.args``: the first ``layers`` stage HEAL builds (from the branch's width, its
    ``layers_args.inplanes``) and never runs, which ours does not build (``LATE_UNUSED``)."""
    from opencood.models.backbone import make_residual_stage
    shapes = {}
    for name, modality in model_args["modalities"].items():
        layers = modality["layers"]
        width = int(layers["num_filters"][0])
        with torch.device("meta"):
            stage = make_residual_stage(width, width, int(layers["layer_strides"][0]),
                                        int(layers["layer_nums"][0]))
        rules = tuple(Rule(f"layers_{name}.resnet.layer0.{{k}}.{child}.{{p}}",
                           f"{{k}}.{mine}.{{p}}") for child, mine in _BLOCK_CHILDREN)
        shapes.update(peer_shapes_by_rules({key: tuple(value.shape) for key, value in
                                            stage.state_dict().items()}, rules))
    return shapes


def efficientnet_classifier_shapes(camera_encoders: Mapping[str, str]
                                   ) -> Dict[str, Tuple[int, ...]]:
    """HEAL's never-run EfficientNet classifier keys (``_conv_head``, ``_bn1``, ``_fc`` of
    each EfficientNet camera type's trunk) -> shape."""
    return {f"encoder_{name}.camencode.trunk.{key}": tuple(shape)
            for name, kind in camera_encoders.items() if kind == "EfficientNet"
            for key, (shape, _) in EFFICIENTNET_CLASSIFIER.items()}


def heal_rules_of(core: str, camera_encoders: Mapping[str, str], modalities
                  ) -> Tuple[Rule, ...]:
    """Every key rule between HEAL's ``core`` model and ours (camera trunks included)."""
    if core == "heter_model_late":
        return sum((camera_rules(name, camera_encoders[name], f"detectors.{name}.branch")
                    for name in camera_encoders), ()) \
            + sum((late_rules(name) for name in modalities), ())
    return sum((camera_rules(name, camera_encoders[name]) for name in camera_encoders), ()) \
        + sum((modality_rules(name) for name in modalities), ()) + SHARED_RULES


def heal_key_shapes(core: str, model_args: Mapping, our_shapes: Mapping[str, Tuple[int, ...]],
                    camera_encoders: Mapping[str, str]) -> Dict[str, Tuple[int, ...]]:
    """Every key (-> shape) of HEAL's ``core`` model that our ``model.args`` / state-dict
    shapes ``our_shapes`` correspond to: what HEAL's strict ``load_state_dict`` wants, the
    never-run parts ours does not build (EfficientNet classifier, the late model's first
    ``layers`` stage) included."""
    modalities = list(model_args["modalities"])
    shapes = peer_shapes_by_rules(our_shapes, heal_rules_of(core, camera_encoders, modalities))
    shapes.update(efficientnet_classifier_shapes(camera_encoders))
    if core == "heter_model_late":
        shapes.update(late_first_stage_shapes(model_args))
    return shapes
