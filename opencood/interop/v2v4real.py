"""V2V4Real's run folders -> ours (issue 24): OpenCOOD's layout, with V2V4Real's differences.

V2V4Real (ucla-mobility/V2V4Real) is a fork of OpenCOOD: same ``train.py`` (``config.yaml`` =
``yaml.dump`` of the parsed hypes, ``net_epoch<N>.pth`` = bare ``model_without_ddp``
state dicts, no ``latest.pth``), same model names and state-dict keys. What differs and how it
is handled here:

* Its ``point_pillar`` (no / early / late fusion) may end with OpenCOOD's ``shrink_header``
  (``shrink_conv``, 384 -> 256 at stride 2) before heads of ``cls_head_dim`` channels: our
  ``point_pillar`` builds the same with ``model.args.shrink_header``.
* Its ``point_pillar_fcooper`` shrinks with a 3x3 conv at stride 2 (OpenCOOD's uses a 1x1):
  the generic shrink translation covers both.
* Its ``point_pillar_v2vnet`` always builds a temporal-encoding conv (``fusion_net.cnn``,
  C + 1 -> C over [features, time delay]) that our V2VNet has no counterpart for: refused, as
  are ``point_pillar_transformer`` (CoBEVT-style windows) and the domain-adaptation
  ``point_pillar_fax``.
* Its data is V2V4Real's (``fusion.dataset: v2v4real`` here; the yaml has no such key) and its
  test GT range is [-100, -40, -5, 100, 40, 3] (its ``datasets/__init__.py``), cut to the LiDAR
  range.
* Its ``load_saved_model`` takes the highest ``net_epoch<N>.pth`` (it never reads
  ``latest.pth``).
"""
from __future__ import annotations

from opencood.interop.opencood_ckpt import InteropError
from opencood.interop.opencood_config import translate_config

V2V4REAL_GT_RANGE = (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0)
REFUSED = {
    "point_pillar_v2vnet": "its V2VNet has a temporal-encoding conv (fusion_net.cnn, C+1 -> C "
                           "over features and time delay) that our V2VNet lacks",
    "point_pillar_transformer": "its multi-window transformer fusion has no counterpart here",
    "point_pillar_fax": "its domain-adaptation model has no counterpart here",
}


def translate_v2v4real_config(data: dict, source: str) -> dict:
    """V2V4Real hypes -> our config (unresolved); raises InteropError naming the key."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    core_method = model.get("core_method")
    if core_method in REFUSED:
        raise InteropError(f"{source}: model.core_method {core_method!r}: {REFUSED[core_method]}")
    cfg = translate_config(data, source)
    cfg["fusion"]["dataset"] = "v2v4real"
    lidar_range = cfg["preprocess"]["cav_lidar_range"]
    cfg["postprocess"]["gt_range"] = [
        float(v) for v in [max(a, b) for a, b in zip(V2V4REAL_GT_RANGE[:3], lidar_range[:3])]
        + [min(a, b) for a, b in zip(V2V4REAL_GT_RANGE[3:], lidar_range[3:])]]
    return cfg

