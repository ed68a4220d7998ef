"""The AP protocols of the field, named, so every published figure says which one it used.

OPV2V AP is reported under two incompatible protocols, and mixing them explains many
"cannot reproduce the paper" reports:

* ``opencood`` (OpenCOOD, the OPV2V / V2X-ViT / CoBEVT papers): GT and detections within
  [-140, -40, -3, 140, 40, 1]; detections sorted by score *within each frame*, frames
  concatenated in data-set order. A confident detection in a late frame then counts after a
  weak one in an early frame, which lowers AP.
* ``coalign`` (CoAlign, HEAL): GT and detections within [-102.4, -102.4, -3, 102.4, 102.4, 1];
  detections sorted *globally* by score (VOC).
* ``ours`` (the default): global sort (VOC), GT within the config's ``postprocess.gt_range``,
  every detection kept. It is also HEAL's DAIR-V2X-C protocol with the hypes_yaml/dairv2x
  configs, whose gt_range is HEAL's (the crop with z widened by 1 m each way).
* ``v2v4real`` (the V2V4Real paper, its ``inference.py`` and ``eval_utils``): per-frame sort as
  ``opencood``; GT **and** detections kept only when their 8 corners lie (x, y) inside its
  GT_RANGE [-100, -40, -5, 100, 40, 3] (``get_mask_for_boxes_within_range_torch`` in its
  ``generate_gt_bbx`` and ``post_process``), after its data sets kept GT with 2 corners in that
  range and 2 in the crop (opencood.data.v2v4real). tests/test_protocols.py compares it with
  V2V4Real's own evaluation code run on the same boxes (tools/reference/v2v4real_eval.py).

Matching (highest-IoU free GT, by descending score within the frame) and VOC all-point
interpolation are the same in all of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from opencood.errors import ConfigError


@dataclass(frozen=True)
class APProtocol:
    name: str
    detection_sort: str                 # "global" or "per_frame" (opencood.eval.ap)
    box_range: Optional[Tuple[float, ...]]   # GT and detection range; None: the config's gt_range
    description: str
    # True: the evaluation also drops GT with a BEV corner outside box_range (the data set's GT
    # may keep boxes with fewer corners inside: V2V4Real's keeps 2)
    filters_gt: bool = False

    def accumulator_args(self) -> Dict:
        """Keyword arguments of APAccumulator for this protocol."""
        box_range = None if self.box_range is None else list(self.box_range)
        return {"detection_sort": self.detection_sort, "detection_range": box_range,
                "gt_range": box_range if self.filters_gt else None}

    def config_overrides(self) -> List[str]:
        """--set overrides that make the data set keep this protocol's GT."""
        if self.box_range is None:
            return []
        return [f"postprocess.gt_range=[{', '.join(f'{v:g}' for v in self.box_range)}]"]


PROTOCOLS = {
    "ours": APProtocol("ours", "global", None,
                       "global score sort, GT in the config's gt_range, all detections"),
    "opencood": APProtocol("opencood", "per_frame", (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0),
                           "OpenCOOD/OPV2V paper: per-frame score sort, range +-140 x +-40 m"),
    "coalign": APProtocol("coalign", "global", (-102.4, -102.4, -3.0, 102.4, 102.4, 1.0),
                          "CoAlign/HEAL: global score sort, range +-102.4 m"),
    # V2V4Real's inference + eval_utils: OpenCOOD's per-frame sort; GT and detections whose 8
    # corners lie (x, y) in its GT_RANGE (the hypes_yaml/v2v4real configs' gt_range).
    "v2v4real": APProtocol("v2v4real", "per_frame", (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0),
                           "V2V4Real paper: per-frame score sort, GT and detections with 8 "
                           "corners in +-100 x +-40 m", filters_gt=True),
}
DEFAULT_PROTOCOL = "ours"


def get_protocol(name: str) -> APProtocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ConfigError(f"unknown AP protocol {name!r}; known: {', '.join(PROTOCOLS)}") from None
