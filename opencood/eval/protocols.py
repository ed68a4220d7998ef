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

* ``heal_dairv2x`` (HEAL's DAIR-V2X-C tables, its ``tools/inference.py`` on a ``heter`` yaml at
  the default ``--range 102.4,102.4``): global sort; the GT range becomes [-102.4, -102.4, -3.5,
  102.4, 102.4, 1.5] (the data set's GT filter widens z by 1 m each way, as HEAL's single-side
  GT does); GT kept with 8 corners (x, y) in it (``generate_gt_bbx_by_iou``), detections with 8
  corners in it, z included (``mask_boxes_outside_range_numpy`` in its ``post_process``).
  HEAL's inference also runs the model on the crop widened to that range; ours keeps the run's
  crop. tests/test_protocols.py compares it with HEAL's own evaluation code
  (tools/reference/heal_eval.py).

* ``heal`` (HEAL's own ``tools/inference.py`` and ``inference_heter_in_order.py`` with
  ``--range`` the run's range): global sort; GT in the config's ``postprocess.gt_range`` (the
  data set's filter, as HEAL's ``generate_object_center``); detections with 8 corners in that
  range, z included (``mask_boxes_outside_range_numpy`` in its ``post_process``). The default of
  ``tools/eval.py --heter_in_order`` / ``--modality_ap``; tests/test_heal_in_order.py compares
  it with HEAL's in-order script run on the same model (tools/reference/
  make_heal_in_order_fixture.py).

* ``v2xreal`` (V2X-Real's ``tools/inference.py`` + ``eval_utils.eval_final_results``): per class
  (its meta-classes vehicle, pedestrian, truck), detections and GT of that class only, each
  frame's detections sorted by score and the frames concatenated in data-set order, as
  ``v2v4real``; GT and detections with 8 corners (x, y) in its GT_RANGE [-100, -40, -15, 100,
  40, 15] (``get_mask_for_boxes_within_range_torch`` in ``generate_gt_bbx`` and
  ``post_process``); AP per class at 0.3 / 0.5 / 0.7, and their plain mean over every class,
  a class without GT counting as AP 0. tests/test_protocols.py compares it with V2X-Real's own
  evaluation code (tools/reference/v2xreal_eval.py).

Several classes (the config's class list): under every protocol a detection matches only GT of
its class, each class is scored alone and the headline AP is the class mean (opencood.eval.ap);
``ours`` and the others leave a class without GT out of the mean, ``v2xreal`` counts it as 0.

Matching (highest-IoU free GT, by descending score within the frame) and VOC all-point
interpolation are the same in all of them.
"""
from __future__ import annotations

import dataclasses
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
    # True: detections need their corners' z in box_range too (HEAL's 3-D prediction filter)
    detection_range_z: bool = False
    # metres the data set's GT range widens box_range's z by, each way (HEAL's DAIR GT: 1)
    gt_z_margin: float = 0.0
    # AP of a class without GT in a multi-class split: None (left out of the class mean) or the
    # value counted in it (V2X-Real's eval_final_results averages every class, an empty one as 0)
    empty_class_ap: Optional[float] = None
    # True (box_range None): detections kept in the evaluated config's gt_range as box_range
    # would keep them (at_gt_range binds it)
    detections_in_gt_range: bool = False

    def at_gt_range(self, gt_range) -> "APProtocol":
        """The protocol that scores a config whose ``postprocess.gt_range`` is ``gt_range``:
        itself, or with ``gt_range`` as its box range where it keeps detections there."""
        if self.box_range is not None or not self.detections_in_gt_range:
            return self
        return dataclasses.replace(self, box_range=tuple(float(v) for v in gt_range))

    def accumulator_args(self) -> Dict:
        """Keyword arguments of APAccumulator for this protocol."""
        box_range = None if self.box_range is None else list(self.box_range)
        return {"detection_sort": self.detection_sort, "detection_range": box_range,
                "gt_range": box_range if self.filters_gt else None,
                "detection_range_z": self.detection_range_z,
                "empty_class_ap": self.empty_class_ap}

    def config_overrides(self) -> List[str]:
        """--set overrides that make the data set keep this protocol's GT."""
        if self.box_range is None:
            return []
        low, high = list(self.box_range[:3]), list(self.box_range[3:])
        low[2], high[2] = low[2] - self.gt_z_margin, high[2] + self.gt_z_margin
        return [f"postprocess.gt_range=[{', '.join(f'{v:g}' for v in low + high)}]"]


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
    # HEAL's inference.py on its DAIR heter yamls (--range 102.4,102.4) + eval_utils
    "heal_dairv2x": APProtocol("heal_dairv2x", "global", (-102.4, -102.4, -3.5, 102.4, 102.4, 1.5),
                               "HEAL DAIR-V2X-C: global score sort, GT and detections with 8 "
                               "corners in +-102.4 m (detections: z too)", filters_gt=True,
                               detection_range_z=True, gt_z_margin=1.0),
    # HEAL's inference.py / inference_heter_in_order.py at the run's own --range
    "heal": APProtocol("heal", "global", None,
                       "HEAL: global score sort, GT in the config's gt_range, detections with 8 "
                       "corners in it (z too)", detection_range_z=True,
                       detections_in_gt_range=True),
    # V2X-Real's inference.py + eval_utils.eval_final_results: per class, V2V4Real's per-frame
    # sort and 8-corner filters with its GT_RANGE; the class mean counts an empty class as 0
    "v2xreal": APProtocol("v2xreal", "per_frame", (-100.0, -40.0, -15.0, 100.0, 40.0, 15.0),
                          "V2X-Real: per class, per-frame score sort, GT and detections with 8 "
                          "corners in +-100 x +-40 m, mean over every class", filters_gt=True,
                          empty_class_ap=0.0),
}
DEFAULT_PROTOCOL = "ours"
HEAL_PROTOCOL = "heal"          # tools/eval.py --heter_in_order / --modality_ap's default


def get_protocol(name: str) -> APProtocol:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise ConfigError(f"unknown AP protocol {name!r}; known: {', '.join(PROTOCOLS)}") from None
