"""HEAL's camera agents (``lift_splat_shoot`` modalities) -> our ``lss`` encoder (issue 36).

HEAL trains its camera-only cooperative runs (``hypes_yaml/opv2v/CameraOnly/camera_*.yaml``) as
``heter_model_baseline`` with one modality (``m2``: EfficientNet-b0, ``m4``: ResNet-101) whose
``core_method`` is ``lift_splat_shoot`` (``heter_encoders.LiftSplatShoot``, the splat without
HEAL's BevEncode). After the encoder the network is the LiDAR one: ``backbone_m`` (OpenCOOD's
BaseBEVBackbone on ``inplanes`` = img_features channels), ``shrinker_m``, ``fusion_net``, the
heads; so our ``point_pillar_intermediate`` with ``encoder: {core_method: lss}`` is the same
network, and :mod:`opencood.interop.heal` translates everything but the encoder as for LiDAR.

HEAL key -> ours (tests/fixtures/peer_runs/heal_camera_*: HEAL's own model, shrunk):

  encoder_m.camencode.trunk._conv_stem / _bn0 / _blocks.<b>.<layer>   (efficientnet_pytorch)
      -> encoder.camera_encoder.trunk.features.<stage>.<i>...  (torchvision's EfficientNet-b0,
         ``camera_backbones.efficientnet_pytorch_to_ours``, one rule per block and layer)
  encoder_m.camencode.{conv1, bn1, layer1, layer2}.*  (ResNet-101, torchvision's names)
      -> encoder.camera_encoder.trunk.*
  encoder_m.camencode.{up1, up2, depth_head, image_head}.* -> encoder.camera_encoder.*

Refused in one line: HEAL's ``use_depth_gt``; a ``grid_conf`` whose x / y bounds are not the
``cav_lidar_range`` at the ``voxel_size`` cell (HEAL then centre-crops or pads the camera map
after the shrinker; ours writes the BEV grid itself); a backbone whose ``inplanes`` is not the
splat's width.

Depth supervision: HEAL trains the camera runs with a depth loss on depth images; the
imported config evaluates without it (``depth_supervision: false``: the depth head is kept and
used, only the loss input is not required), noted on import.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import List, Mapping, Tuple

import torch

from opencood.interop.opencood_ckpt import InteropError, Rule
from opencood.models.camera_backbones import (EFFICIENTNET_UNUSED_PREFIXES,
                                              efficientnet_pytorch_to_ours)
from opencood.models.lift_splat import args_from_heal

CAMERA_ENCODER = "lift_splat_shoot"        # HEAL's modality core_method of a camera agent
EFFICIENTNET_B0_BLOCKS = 16
EFFICIENTNET_LAYERS = ("_expand_conv", "_bn0", "_depthwise_conv", "_bn1", "_se_reduce",
                       "_se_expand", "_project_conv", "_bn2")
# what an imported camera run leaves out of HEAL's training, said on import
DEPTH_NOTE = ("imported with the lss encoder's depth_supervision: false (HEAL trains its camera "
              "runs with a depth loss on depth images; the depth head is kept, only the loss is "
              "off): to fine-tune with it set it true, input_source: [camera, depth] and "
              "loss.args.depth: {weight: 1.0} (docs/cameras.md)")
# EfficientNet-b0's classifier after its last stage (efficientnet_pytorch's names), in HEAL's
# state dict but never run: key -> (shape, fill as freshly initialised)
EFFICIENTNET_CLASSIFIER = OrderedDict([
    ("_conv_head.weight", ((1280, 320, 1, 1), 0.0)),
    ("_bn1.weight", ((1280,), 1.0)), ("_bn1.bias", ((1280,), 0.0)),
    ("_bn1.running_mean", ((1280,), 0.0)), ("_bn1.running_var", ((1280,), 1.0)),
    ("_bn1.num_batches_tracked", ((), 0)),
    ("_fc.weight", ((1000, 1280), 0.0)), ("_fc.bias", ((1000,), 0.0))])
# The OpenCOOD translation needs pillar arguments; a camera run's are replaced by the encoder
# right after it (``camera_model_args``), so these never reach a model.
PLACEHOLDER_PILLARS = {"use_norm": True, "use_absolute_xyz": True, "num_filters": [64]}


def is_camera(setting: Mapping) -> bool:
    """The modality's settings describe a lift-splat camera agent."""
    return setting.get("sensor_type") == "camera" and setting.get("core_method") == CAMERA_ENCODER


def _bound_of(lidar_range, voxel_size, axis: int) -> List[float]:
    return [float(lidar_range[axis]), float(lidar_range[axis + 3]), float(voxel_size[axis])]


def camera_encoder(setting: Mapping, lidar_range, voxel_size, source: str) -> dict:
    """``model.args.<m>`` of a camera modality -> our ``model.args.encoder`` ({core_method:
    lss, args}), x / y bounds left to the BEV grid after checking they are its."""
    name = f"{source}: model.args.{setting.get('_name', 'm')}.encoder_args"
    encoder_args = setting["encoder_args"]
    try:
        args = args_from_heal(encoder_args)
    except (KeyError, ValueError) as error:
        raise InteropError(f"{name}: {error}") from None
    for axis, key in enumerate(("xbound", "ybound")):
        grid = _bound_of(lidar_range, voxel_size, axis)
        if any(abs(float(a) - b) > 1e-6 for a, b in zip(args.pop(key), grid)):
            raise InteropError(f"{name}.grid_conf.{key} {list(encoder_args['grid_conf'][key])}"
                               f" is not cav_lidar_range at voxel_size ({grid}): HEAL crops "
                               "that camera map, ours writes the BEV grid itself")
    args["depth_supervision"] = False          # DEPTH_NOTE
    inplanes = setting.get("backbone_args", {}).get("inplanes", 64)
    splat_width = args["img_features"] * int(round((args["zbound"][1] - args["zbound"][0])
                                                   / args["zbound"][2]))
    if inplanes != splat_width:
        raise InteropError(f"{source}: backbone_args.inplanes {inplanes} is not the splat's "
                           f"{splat_width} channels (img_features x height cells)")
    return {"core_method": "lss", "args": args}


def data_aug_conf(setting: Mapping) -> dict:
    """Our ``camera.data_aug_conf`` from the modality's ``encoder_args.data_aug_conf`` (HEAL's
    keys are ours)."""
    return {key: value for key, value in setting["encoder_args"]["data_aug_conf"].items()}


def efficientnet_rules(peer: str, ours: str) -> Tuple[Rule, ...]:
    """One rule per efficientnet_pytorch layer of EfficientNet-b0 (stem, its BN, each block's
    layers) under the prefixes ``peer`` / ``ours``; the layer names from
    :func:`efficientnet_pytorch_to_ours`, so both directions use one mapping."""
    layers = ["_conv_stem", "_bn0"] + [f"_blocks.{block}.{layer}"
                                       for block in range(EFFICIENTNET_B0_BLOCKS)
                                       for layer in EFFICIENTNET_LAYERS]
    rules = []
    for layer in layers:
        try:
            mapped = efficientnet_pytorch_to_ours({f"{layer}.weight": torch.empty(0)})
        except KeyError:        # WeightMappingError: stage 1 has no expansion conv
            continue
        for key in mapped:
            rules.append(Rule(f"{peer}{layer}.{{p}}", f"{ours}{key[:-len('.weight')]}.{{p}}"))
    return tuple(rules)


def resnet101_rules(peer: str, ours: str) -> Tuple[Rule, ...]:
    """HEAL's ResNet-101 trunk (torchvision's conv1, bn1, layer1, layer2) -> ours, same names."""
    return (Rule(f"{peer}conv1.{{p}}", f"{ours}conv1.{{p}}"),
            Rule(f"{peer}bn1.{{p}}", f"{ours}bn1.{{p}}"),
            Rule(f"{peer}layer{{i}}.{{j}}.conv{{k}}.{{p}}", f"{ours}layer{{i}}.{{j}}.conv{{k}}.{{p}}"),
            Rule(f"{peer}layer{{i}}.{{j}}.bn{{k}}.{{p}}", f"{ours}layer{{i}}.{{j}}.bn{{k}}.{{p}}"),
            Rule(f"{peer}layer{{i}}.{{j}}.downsample.{{k}}.{{p}}",
                 f"{ours}layer{{i}}.{{j}}.downsample.{{k}}.{{p}}"))


def camera_encoder_rules(modality: str, camera_encoder_kind: str) -> Tuple[Rule, ...]:
    """Key rules of ``encoder_<modality>.camencode.*`` -> ``encoder.camera_encoder.*``."""
    peer, ours = f"encoder_{modality}.camencode.", "encoder.camera_encoder."
    trunk = efficientnet_rules(peer + "trunk.", ours + "trunk.") \
        if camera_encoder_kind == "EfficientNet" else resnet101_rules(peer, ours + "trunk.")
    heads = (Rule(f"{peer}up{{i}}.conv.{{j}}.{{p}}", f"{ours}up{{i}}.conv.{{j}}.{{p}}"),
             Rule(f"{peer}depth_head.{{p}}", f"{ours}depth_head.{{p}}"),
             Rule(f"{peer}image_head.{{p}}", f"{ours}image_head.{{p}}"))
    return trunk + heads


def unused_trunk_prefixes(modality: str) -> Tuple[str, ...]:
    """HEAL's EfficientNet keys its camera forward never reaches (``_conv_head``, ``_bn1``,
    ``_fc``: the classifier after the last stage), which our trunk does not build."""
    return tuple(f"encoder_{modality}.camencode.trunk.{prefix}"
                 for prefix in EFFICIENTNET_UNUSED_PREFIXES)
