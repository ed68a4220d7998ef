"""The field's AP protocols (opencood.eval.protocols), pinned on hand-made cases where they differ,
and against the plain-Python reference on random frames."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from opencood.config import apply_overrides
from opencood.eval.ap import APAccumulator, boxes_inside_bev_range
from opencood.eval.protocols import PROTOCOLS
from opencood.testing.reference_impls import reference_ap
from opencood.utils.fake_batch import fake_detection_frames
from test_ap import cars

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "reference_eval"


def protocol_ap(protocol: str, frames) -> dict:
    accumulator = APAccumulator(**PROTOCOLS[protocol].accumulator_args())
    for index, (pred, scores, gt) in enumerate(frames):
        accumulator.add_frame(pred, np.asarray(scores, dtype=np.float64), gt, sample_key=index)
    return accumulator.compute()


def test_a_weak_fp_in_an_early_frame_costs_half_the_ap_under_per_frame_sorts():
    """Frame 0: one FP at score 0.2; frame 1: one TP at 0.9; one GT. Per-frame order ranks the FP
    first: recall [0, 1], precision [0, 1/2] -> AP 1/2. A global sort ranks the TP first: 1."""
    frames = [(cars((60, 0)), [0.2], cars()), (cars((10, 0)), [0.9], cars((10, 0)))]
    assert protocol_ap("opencood", frames)["ap_50"] == pytest.approx(0.5, abs=1e-12)
    assert protocol_ap("coalign", frames)["ap_50"] == 1.0
    assert protocol_ap("ours", frames)["ap_50"] == 1.0
    # V2V4Real's eval_utils sorts per frame as OpenCOOD does (issue 39: a global sort passed).
    assert protocol_ap("v2v4real", frames)["ap_50"] == pytest.approx(0.5, abs=1e-12)


def test_detections_outside_the_protocol_range_are_dropped():
    """An FP at x=120 m lies inside OpenCOOD's +-140 m but outside CoAlign's +-102.4 m."""
    frames = [(cars((10, 0), (120, 0)), [0.5, 0.9], cars((10, 0)))]
    assert protocol_ap("coalign", frames)["ap_50"] == 1.0        # the FP is out of range
    assert protocol_ap("opencood", frames)["ap_50"] == pytest.approx(0.5)   # FP ranked first
    assert protocol_ap("ours", frames)["ap_50"] == pytest.approx(0.5)       # nothing dropped


def test_bev_range_needs_every_corner_inside():
    # A 4 m long car centred 1.5 m from the edge sticks out; at 2 m it touches the edge (kept).
    boxes = cars((138.5, 0), (138.0, 0), (0, 39.0), (0, 38.0))
    inside = boxes_inside_bev_range(boxes, PROTOCOLS["opencood"].box_range, "hwl")
    assert inside.tolist() == [False, True, True, True]


@pytest.mark.parametrize("sort", ["per_frame", "global"])
def test_both_sorts_match_the_plain_python_reference(sort):
    """Random frames spread beyond +-40 m, so no range here: the sort alone is compared."""
    frames = fake_detection_frames(num_frames=12, seed=5)
    accumulator = APAccumulator(detection_sort=sort)
    for index, (pred, scores, gt) in enumerate(frames):
        accumulator.add_frame(pred, scores, gt, sample_key=index)
    ours = accumulator.compute()
    reference = reference_ap([tuple(t.tolist() for t in frame) for frame in frames],
                             (0.3, 0.5, 0.7), sort=sort)
    for threshold, key in ((0.3, "ap_30"), (0.5, "ap_50"), (0.7, "ap_70")):
        assert ours[key] == pytest.approx(reference[threshold], abs=1e-12), key
    other = reference_ap([tuple(t.tolist() for t in frame) for frame in frames], (0.5,),
                         sort="global" if sort == "per_frame" else "per_frame")
    assert other[0.5] != pytest.approx(reference[0.5], abs=1e-6)   # the case tells them apart


def test_accumulators_of_different_protocols_refuse_to_merge():
    frames = [(cars((10, 0)), [0.9], cars((10, 0)))]
    per_frame = APAccumulator(**PROTOCOLS["opencood"].accumulator_args())
    global_sort = APAccumulator(**PROTOCOLS["coalign"].accumulator_args())
    global_sort.add_frame(*frames[0], sample_key=1)
    with pytest.raises(ValueError, match="detection sort or range"):
        per_frame.merge(global_sort.state_dict())
    round_trip = APAccumulator.from_state_dict(per_frame.state_dict())
    assert round_trip.detection_sort == "per_frame"
    assert round_trip.detection_range == list(PROTOCOLS["opencood"].box_range)


def test_protocol_ranges_reach_the_data_sets_gt_range():
    cfg = {"postprocess": {"gt_range": [-1, -1, -1, 1, 1, 1]}}
    for name in ("opencood", "coalign"):
        resolved = apply_overrides(cfg, PROTOCOLS[name].config_overrides())
        assert resolved["postprocess"]["gt_range"] == pytest.approx(PROTOCOLS[name].box_range)
    assert PROTOCOLS["ours"].config_overrides() == []


def test_unknown_sort_is_refused():
    with pytest.raises(ValueError, match="per_frame"):
        APAccumulator(detection_sort="by_frame")


# ------------------------------------------------------------------- V2V4Real's evaluation

def test_v2v4real_drops_gt_and_detections_with_a_corner_outside_its_range():
    """A 4 m car along x at y = 39.5 (2 m wide: y 38.5..40.5) has 2 of its 4 BEV corners beyond
    y = 40: V2V4Real's data set keeps it (2 corners in), its evaluation does not (all 8). GT:
    that car and one at (20, 0); detections: both, the edge one scored first. Both filters drop
    the edge pair: one TP, AP 1. Dropping the GT alone leaves the edge detection an FP ranked
    first: recall [0, 1], precision [0, 1/2], AP 1/2."""
    edge, centre = (10.0, 39.5), (20.0, 0.0)
    frames = [(cars(edge, centre), [0.9, 0.8], cars(edge, centre))]
    assert protocol_ap("v2v4real", frames)["ap_50"] == 1.0
    accumulator = APAccumulator(detection_sort="per_frame",
                                gt_range=PROTOCOLS["v2v4real"].box_range)
    accumulator.add_frame(*frames[0], sample_key=0)
    assert accumulator.compute()["ap_50"] == pytest.approx(0.5)
    assert PROTOCOLS["v2v4real"].accumulator_args()["gt_range"] == \
        list(PROTOCOLS["v2v4real"].box_range)
    assert PROTOCOLS["opencood"].accumulator_args()["gt_range"] is None


def test_v2v4real_protocol_equals_v2v4real_s_own_evaluation_code():
    """tests/fixtures/reference_eval/v2v4real_eval.npz: made-up frames evaluated by V2V4Real's
    eval_utils with its range filters (tools/reference/v2v4real_eval.py, side environment)."""
    data = np.load(FIXTURES / "v2v4real_eval.npz")
    accumulator = APAccumulator(**PROTOCOLS["v2v4real"].accumulator_args())
    pred_kept, gt_kept = [], []
    for index in range(len(data["frame_start"]) - 1):
        lo, hi = data["frame_start"][index:index + 2]
        g_lo, g_hi = data["gt_start"][index:index + 2]
        pred, gt = data["pred_boxes"][lo:hi], data["gt_boxes"][g_lo:g_hi]
        accumulator.add_frame(pred, data["pred_scores"][lo:hi], gt, sample_key=index)
        if not data["no_detections"][index]:
            pred_kept.append(boxes_inside_bev_range(pred.astype(np.float64),
                                                    PROTOCOLS["v2v4real"].box_range, "hwl"))
        gt_kept.append(boxes_inside_bev_range(gt.astype(np.float64),
                                              PROTOCOLS["v2v4real"].box_range, "hwl"))
    # the case has boxes on both sides of every filter, and the two filters agree box by box
    assert 0 < data["gt_kept"].sum() < len(data["gt_kept"])
    assert 0 < data["pred_kept"].sum() < len(data["pred_kept"])
    assert np.concatenate(pred_kept).tolist() == data["pred_kept"].tolist()
    assert np.concatenate(gt_kept).tolist() == data["gt_kept"].tolist()
    result = accumulator.compute()
    assert 0.3 < float(data["ap_70"]) < float(data["ap_50"]) < 1.0
    assert result["ap_50"] == pytest.approx(float(data["ap_50"]), abs=1e-6)
    assert result["ap_70"] == pytest.approx(float(data["ap_70"]), abs=1e-6)


def _fixture_ap(name: str, accumulator_args: dict) -> tuple:
    """Our AP of a reference-evaluation fixture's frames -> (result, the fixture)."""
    data = np.load(FIXTURES / f"{name}.npz")
    accumulator = APAccumulator(**accumulator_args)
    for index in range(len(data["frame_start"]) - 1):
        lo, hi = data["frame_start"][index:index + 2]
        g_lo, g_hi = data["gt_start"][index:index + 2]
        accumulator.add_frame(data["pred_boxes"][lo:hi], data["pred_scores"][lo:hi],
                              data["gt_boxes"][g_lo:g_hi], sample_key=index)
    return accumulator.compute(), data


def test_heal_dairv2x_protocol_equals_heal_s_own_evaluation_code():
    """tests/fixtures/reference_eval/heal_eval.npz: made-up frames evaluated by HEAL's
    eval_utils with the range filters of its DAIR inference (tools/reference/heal_eval.py)."""
    protocol = PROTOCOLS["heal_dairv2x"]
    result, data = _fixture_ap("heal_eval", protocol.accumulator_args())
    for key in ("ap_30", "ap_50", "ap_70"):
        assert result[key] == pytest.approx(float(data[key]), abs=1e-6), key
    # every rule matters on this case: detections' z, the GT filter, the global sort
    for change in ({"detection_range_z": False}, {"gt_range": None},
                   {"detection_sort": "per_frame"}):
        other, _ = _fixture_ap("heal_eval", {**protocol.accumulator_args(), **change})
        assert abs(other["ap_50"] - float(data["ap_50"])) > 1e-3, change
    # the data set's GT range: HEAL's single-side GT widens z by 1 m each way
    assert protocol.config_overrides() == ["postprocess.gt_range=[-102.4, -102.4, -4.5, 102.4, "
                                           "102.4, 2.5]"]


# ------------------------------------------------------------------- V2X-Real's evaluation

def _v2xreal_fixture_ap(data, drop_class=None, **changes) -> dict:
    """Our AP of tests/fixtures/reference_eval/v2xreal_eval.npz's frames (without the boxes of
    ``drop_class``) under the v2xreal protocol with ``changes`` to its accumulator arguments."""
    args = {**PROTOCOLS["v2xreal"].accumulator_args(), **changes}
    accumulator = APAccumulator(class_names=[str(n) for n in data["class_names"]], **args)
    for index in range(len(data["frame_start"]) - 1):
        det = slice(*data["frame_start"][index:index + 2])
        gt = slice(*data["gt_start"][index:index + 2])
        keep_det = data["pred_classes"][det] != drop_class
        keep_gt = data["gt_classes"][gt] != drop_class
        accumulator.add_frame(data["pred_boxes"][det][keep_det], data["pred_scores"][det][keep_det],
                              data["gt_boxes"][gt][keep_gt], sample_key=index,
                              pred_classes=data["pred_classes"][det][keep_det],
                              gt_classes=data["gt_classes"][gt][keep_gt])
    return accumulator.compute()


def test_v2xreal_protocol_equals_v2x_real_s_own_evaluation_code():
    """tests/fixtures/reference_eval/v2xreal_eval.npz: made-up frames of three classes scored
    by V2X-Real's inference loop and eval_utils.eval_final_results
    (tools/reference/v2xreal_eval.py, side environment): per class and the mean, at 0.3 / 0.5 /
    0.7, also with the truck class empty (V2X-Real counts it as 0)."""
    data = np.load(FIXTURES / "v2xreal_eval.npz")
    names = [str(n) for n in data["class_names"]]
    box_range = PROTOCOLS["v2xreal"].box_range
    pred_kept = boxes_inside_bev_range(data["pred_boxes"].astype(np.float64), box_range, "hwl")
    gt_kept = boxes_inside_bev_range(data["gt_boxes"].astype(np.float64), box_range, "hwl")
    assert pred_kept.tolist() == data["pred_kept"].tolist()
    assert gt_kept.tolist() == data["gt_kept"].tolist()
    assert 0 < gt_kept.sum() < len(gt_kept) and 0 < pred_kept.sum() < len(pred_kept)
    keys = ("ap_30", "ap_50", "ap_70")
    for drop, ap, mean in ((None, data["ap"], data["mean_ap"]),
                           (2, data["ap_no_truck"], data["mean_ap_no_truck"])):
        result = _v2xreal_fixture_ap(data, drop_class=drop)
        for row, name in enumerate(names):
            for column, key in enumerate(keys):
                assert result["per_class"][name][key] == pytest.approx(ap[row, column],
                                                                       abs=1e-6), (drop, name, key)
        for column, key in enumerate(keys):
            assert result[key] == pytest.approx(mean[column], abs=1e-6), (drop, key)
    # the case is not trivial: every class scored, APs apart, and each rule matters
    assert (0.2 < data["ap"][:, 1]).all() and (data["ap"][:, 1] < 1).all()
    assert data["ap_no_truck"][2].tolist() == [0.0, 0.0, 0.0]
    for drop, change in ((None, {"detection_sort": "global"}), (None, {"gt_range": None}),
                         (2, {"empty_class_ap": None})):
        other = _v2xreal_fixture_ap(data, drop_class=drop, **change)
        reference = data["mean_ap"] if drop is None else data["mean_ap_no_truck"]
        assert abs(other["ap_50"] - reference[1]) > 1e-3, change
