"""CoAlign's run folders -> ours (issue 26).

CoAlign (yifanlu0227/CoAlign) trains its fusion network as ``model.core_method:
point_pillar_baseline_multiscale`` (its ``coalign/pointpillar_coalign*.yaml``; its
``point_pillar_coalign.py`` subclasses that model unchanged): PointPillar pillars computed in
each agent's own frame (``fusion.args.proj_first: false``), a ResNet backbone
(``base_bev_backbone.resnet``, default true there), each scale's maps warped into the ego frame
(``normalize_pairwise_tfm`` + ``F.affine_grid``) and fused by AttFusion, a ``shrink_header``
(DownsampleConv), ``cls_head`` / ``reg_head`` / ``dir_head``. Its ``train.py`` writes
``config.yaml`` (``yaml.dump`` of the parsed hypes), ``net_epoch<N>.pth`` and one
``net_epoch_bestval_at<N>.pth``, bare state dicts; its ``load_saved_model`` picks as HEAL's
(:func:`opencood.interop.heal.pick_heal_checkpoint`).

Ours: ``point_pillar_intermediate`` with attfuse at stage ``multiscale``, ``proj_first: false``
(our warp, ``opencood.models.warp``), ``base_bev_backbone.resnet``, ``shrink_header`` and
``use_dir`` (key rules ``RULES["point_pillar_baseline_multiscale"]``). The heads equal theirs
on own-frame pillars of agents a few cells and degrees apart
(``tests/test_parity_opencood.py::test_coalign_parity``). Its box alignment (``box_align``) and
pose noise (``noise_setting``) belong to its dataset, not the network: the import notes them.

Refused, each in one line: another ``model.core_method``, a ``fusion_method`` other than
``att`` (its max / DiscoNet / V2VNet / V2X-ViT / When2comm fusions have no established mapping
here), a compressor, direction bins other than 2.
"""
from __future__ import annotations

import copy
from typing import List, Tuple

from opencood.interop.heal import _get, set_direction_head, set_own_frame_dataset
from opencood.interop.opencood_ckpt import RULES, InteropError, Rule
from opencood.interop.opencood_config import translate_config

CORE_METHOD = "point_pillar_baseline_multiscale"
BOX_ALIGN_NOTE = ("CoAlign's box_align (pose correction) and noise_setting are its dataset's, "
                  "not the network's: set box_align / wild_setting here to evaluate with them")


def _check(data: dict, source: str) -> None:
    core = _get(data, "model.core_method", source)
    if core != CORE_METHOD:
        raise InteropError(f"{source}: model.core_method {core!r} has no counterpart here "
                           f"(supported: {CORE_METHOD}, CoAlign's fusion network)")
    method = _get(data, "model.args.fusion_method", source)
    if method != "att":
        raise InteropError(f"{source}: model.args.fusion_method {method!r}: only 'att' "
                           "(CoAlign's multiscale AttFusion) has an established mapping here")
    if _get(data, "model.args.compression", source, None):
        raise InteropError(f"{source}: model.args.compression: its naive compressor has no "
                           "counterpart here")


def as_opencood_hypes(data: dict, source: str) -> dict:
    """CoAlign's hypes as OpenCOOD's AttFuse hypes (its backbone, shrink and heads added back
    by :func:`translate_coalign_config`), so one translation serves both."""
    _check(data, source)
    hypes = copy.deepcopy(data)
    hypes["model"]["core_method"] = "point_pillar_intermediate"
    hypes["fusion"] = {"core_method": "IntermediateFusionDataset", "args": {}}
    hypes["loss"] = {"args": {"cls_weight": _get(data, "loss.args.cls.weight", source, 1.0),
                              "reg": _get(data, "loss.args.reg.weight", source, 2.0)}}
    return hypes


def translate_coalign_config(data: dict, source: str) -> dict:
    """CoAlign hypes -> our config (unresolved); raises InteropError naming the key."""
    cfg = translate_config(as_opencood_hypes(data, source), source)
    args = cfg["model"]["args"]
    args["base_bev_backbone"]["resnet"] = bool(
        _get(data, "model.args.base_bev_backbone.resnet", source, True))   # its default
    dir_args = _get(data, "model.args.dir_args", source, None)
    args["use_dir"] = dir_args is not None
    if dir_args is not None:
        set_direction_head(cfg["loss"], data, source)
    set_own_frame_dataset(cfg["fusion"], data, source)
    return cfg


def coalign_rules(data: dict, source: str) -> Tuple[Rule, ...]:
    _check(data, source)
    return RULES[CORE_METHOD]


def coalign_notes(data: dict) -> List[str]:
    return [BOX_ALIGN_NOTE] if "box_align" in data or "noise_setting" in data else []
