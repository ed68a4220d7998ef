"""VOC AP, greedy matching and the AP accumulator against hand-computed values and, on random
frames, against the plain-Python reference (opencood/testing/reference_impls.py)."""
import itertools
import json

import numpy as np
import pytest
import torch

from opencood.eval.ap import APAccumulator, greedy_match, voc_ap
from opencood.testing.reference_impls import reference_ap
from opencood.utils.fake_batch import fake_detection_frames


def cars(*xy):
    """Axis-aligned 2 x 4 boxes (w=2, l=4, yaw 0) at the given (x, y) -> (K, 7) hwl array.

    Two such boxes shifted by d along x share (4 - d) x 2: IoU 1 (d=0), 7/9 (0.5), 0.6 (1),
    1/3 (2).
    """
    rows = [[x, y, 0.0, 1.5, 2.0, 4.0, 0.0] for x, y in xy]
    return np.array(rows, dtype=np.float64).reshape(-1, 7)


def test_voc_ap_by_hand():
    # recall [0.5, 0.5, 1.0], precision [1, 0.5, 2/3] -> padded recall [0, .5, .5, 1, 1],
    # precision [0, 1, .5, 2/3, 0] -> envelope [1, 1, 2/3, 2/3, 0];
    # AP = 0.5 * 1 + 0.5 * 2/3 = 5/6.
    assert voc_ap([0.5, 0.5, 1.0], [1.0, 0.5, 2 / 3]) == pytest.approx(5 / 6, abs=1e-12)
    assert voc_ap([], []) == 0.0


def test_greedy_match_takes_highest_free_iou():
    # Detection 1 has the higher score, so it picks first: GT 1 (0.6 beats 0.35). Detection 0
    # then finds GT 1 taken and matches GT 0 at 0.35 if the threshold allows it.
    iou = np.array([[0.35, 0.55],
                    [0.35, 0.60]])
    matched = greedy_match(iou, np.array([0.4, 0.9]), np.array([0.3, 0.5, 0.7]))
    assert matched.tolist() == [[0, 1],      # IoU 0.3: both TP
                                [-1, 1],     # IoU 0.5: only GT 0 is left, at 0.35 -> FP
                                [-1, -1]]    # IoU 0.7: nothing reaches it


# Three frames (hand-made; ego distance in brackets):
#   "a": GT g1 (10, 0) [10], g2 (49.5, 0) [49.5], g3 (60, 0) [60]
#        d1 (10, 0)   s=.90  IoU 1 with g1            -> TP everywhere
#        d3 (10.5, 0) s=.80  IoU 7/9 with g1, taken   -> FP everywhere   [own 10.5]
#        d2 (51.5, 0) s=.60  IoU 1/3 with g2          -> TP @.3, FP @.5/.7 [own 51.5]
#        d5 (50.5, 0) s=.55  IoU 0.6 with g2          -> FP @.3 (g2 taken by d2), TP @.5,
#                                                        FP @.7 [own 50.5]
#        d6 (60, 0)   s=.40  IoU 1 with g3            -> TP everywhere
#   "b": no GT;  d4 (20, 0) s=.70 and d7 (20, 10) s=.50 -> FP [own 20 and 22.36]
#   "c": GT g4 (-5, 0) [5]; no detections             -> a miss
FRAMES = {
    "a": (cars((10, 0), (10.5, 0), (51.5, 0), (50.5, 0), (60, 0)),
          np.array([0.90, 0.80, 0.60, 0.55, 0.40]),
          cars((10, 0), (49.5, 0), (60, 0))),
    "b": (cars((20, 0), (20, 10)), np.array([0.70, 0.50]), cars()),
    "c": (cars(), np.zeros(0), cars((-5, 0))),
}

# Global order d1 .9, d3 .8, d4 .7, d2 .6, d5 .55, d7 .5, d6 .4; 4 GT.
# @0.3: TP pattern 1 0 0 1 0 0 1 -> precision 1 .5 .33 .5 .4 .33 3/7, recall .25 .25 .25 .5 .5
#       .5 .75; envelope at the recall steps: 1, .5, 3/7 ->
#       AP = .25*1 + .25*.5 + .25*3/7 = 27/56 = 0.48214
# @0.5: TP pattern 1 0 0 0 1 0 1 -> precision 1 .5 .33 .25 .4 .33 3/7; recall steps at ranks
#       1, 5, 7 with envelope 1, 3/7, 3/7 -> AP = .25 + .25*3/7 + .25*3/7 = 13/28 = 0.46429
# @0.7: TP pattern 1 0 0 0 0 0 1 -> AP = .25*1 + .25*(2/7) = 9/28 = 0.32143
EXPECTED_AP = {"ap_30": 27 / 56, "ap_50": 13 / 28, "ap_70": 9 / 28}

# Per distance (TP -> its GT's bin, FP -> its own centre's bin):
#   0-30:   GT g1, g4 (2); dets d1 TP, d3, d4, d7 FP at every threshold -> AP = .5 * 1 = 0.5
#   30-50:  GT g2 (1); @.3 only d2 (TP) -> 1.0; @.5 only d5 (TP) -> 1.0; @.7 no dets -> 0.0
#   50-100: GT g3 (1); @.3 d5 FP (.55), d6 TP (.4) -> precision .5 at recall 1 -> 0.5;
#           @.5 d2 FP, d6 TP -> 0.5; @.7 d2, d5 FP, d6 TP -> 1/3
EXPECTED_DISTANCE = {
    "0-30": {"ap_30": 0.5, "ap_50": 0.5, "ap_70": 0.5, "num_gt": 2},
    "30-50": {"ap_30": 1.0, "ap_50": 1.0, "ap_70": 0.0, "num_gt": 1},
    "50-100": {"ap_30": 0.5, "ap_50": 0.5, "ap_70": 1 / 3, "num_gt": 1},
}


def accumulate(keys, as_torch=False):
    accumulator = APAccumulator()
    for key in keys:
        pred, scores, gt = FRAMES[key]
        if as_torch:
            pred, scores, gt = (torch.from_numpy(a).float() for a in (pred, scores, gt))
        accumulator.add_frame(pred, scores, gt, sample_key=key)
    return accumulator


def assert_results_equal(result, expected_ap, expected_distance):
    for name, value in expected_ap.items():
        assert result[name] == pytest.approx(value, abs=1e-12), name
    for bin_name, row in expected_distance.items():
        for name, value in row.items():
            assert result["distance"][bin_name][name] == pytest.approx(value, abs=1e-12), \
                (bin_name, name)


def test_hand_made_split():
    result = accumulate("abc").compute()
    assert_results_equal(result, EXPECTED_AP, EXPECTED_DISTANCE)
    assert (result["num_gt"], result["num_det"], result["num_frames"]) == (4, 7, 3)


def test_torch_float32_inputs_give_the_same_result():
    assert_results_equal(accumulate("abc", as_torch=True).compute(), EXPECTED_AP, EXPECTED_DISTANCE)


@pytest.mark.parametrize("batch_frames", [1, 2])
def test_matching_batch_size_does_not_matter(batch_frames):
    # Frames are matched in batches of one IoU call; batch edges must not change anything.
    accumulator = APAccumulator(match_batch_frames=batch_frames)
    for key in "abc":
        accumulator.add_frame(*FRAMES[key], sample_key=key)
    assert_results_equal(accumulator.compute(), EXPECTED_AP, EXPECTED_DISTANCE)


def test_frame_order_does_not_matter():
    reference = accumulate("abc").compute()
    for order in itertools.permutations("abc"):
        assert accumulate(order).compute() == reference


def test_score_ties_broken_by_sample_key_not_insertion_order():
    # One TP and one FP with the same score in two frames. TP ranked first: precision 1 at
    # recall .5 -> AP .5; FP first: precision .5 at recall .5 -> AP .25.
    def run(tp_key, fp_key, insertion):
        accumulator = APAccumulator()
        frames = {tp_key: (cars((0, 0)), cars((0, 0))), fp_key: (cars((0, 0)), cars((30, 0)))}
        for key in insertion(list(frames)):
            pred, gt = frames[key]
            accumulator.add_frame(pred, np.array([0.5]), gt, sample_key=key)
        return accumulator.compute()["ap_50"]

    for insertion in (lambda keys: keys, lambda keys: keys[::-1]):
        assert run("s1", "s2", insertion) == pytest.approx(0.5)
        assert run("s2", "s1", insertion) == pytest.approx(0.25)


def test_matches_the_plain_python_reference_on_random_frames():
    # Noisy copies of the GT (some duplicated) plus clutter, scores with ties across frames.
    frames = fake_detection_frames(num_frames=12, seed=3)
    thresholds = (0.3, 0.5, 0.7)
    accumulator = APAccumulator(thresholds)
    for index, (pred, scores, gt) in enumerate(frames):
        accumulator.add_frame(pred, scores, gt, sample_key=index)
    ours = accumulator.compute()
    reference = reference_ap([tuple(t.tolist() for t in frame) for frame in frames], thresholds)
    all_scores = torch.cat([scores for _, scores, _ in frames])
    assert all_scores.unique().numel() < all_scores.numel()      # ties must be exercised
    assert 0 < reference[0.7] < reference[0.5] < reference[0.3] < 1
    for threshold in thresholds:
        assert ours[f"ap_{round(threshold * 100)}"] == pytest.approx(reference[threshold],
                                                                     abs=1e-9)


def test_merge_equals_single_accumulator():
    reference = accumulate("abc").compute()
    rank0, rank1 = accumulate("ca"), accumulate("b")
    assert rank0.merge(rank1).compute() == reference
    # The gathered form is plain data: it survives a JSON round trip.
    state = json.loads(json.dumps(accumulate("b").state_dict()))
    assert accumulate("ac").merge(state).compute() == reference
    assert APAccumulator.from_state_dict(json.loads(json.dumps(
        accumulate("abc").state_dict()))).compute() == reference


def test_merge_refuses_duplicates_and_mismatched_settings():
    with pytest.raises(ValueError, match="already added"):
        accumulate("ab").merge(accumulate("b"))
    with pytest.raises(ValueError, match="thresholds or bins"):
        APAccumulator(iou_thresholds=(0.5,)).merge(accumulate("a"))


def test_no_gt_at_all_gives_zero():
    accumulator = APAccumulator()
    accumulator.add_frame(cars((0, 0)), np.array([0.9]), cars())
    accumulator.add_frame(np.zeros((0, 7)), np.zeros(0), np.zeros((0, 7)))
    result = accumulator.compute()
    assert (result["ap_30"], result["ap_50"], result["ap_70"]) == (0.0, 0.0, 0.0)
    assert result["num_gt"] == 0 and result["distance"]["0-30"]["num_gt"] == 0
    assert APAccumulator().compute()["ap_50"] == 0.0


def test_a_distance_bin_without_gt_has_no_ap():
    """The lite configs have no GT beyond ~53 m: that bin's AP is undefined (None), not 0.0,
    even when a false positive falls into it."""
    accumulator = APAccumulator()
    accumulator.add_frame(cars((10, 0), (70, 0)), np.array([0.9, 0.8]), cars((10, 0), (35, 0)))
    result = accumulator.compute()
    far = result["distance"]["50-100"]
    assert far["num_gt"] == 0 and (far["ap_30"], far["ap_50"], far["ap_70"]) == (None,) * 3
    assert result["distance"]["0-30"]["ap_50"] == 1.0
    assert result["distance"]["30-50"]["ap_50"] == 0.0   # a GT that no detection found


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="scores"):
        APAccumulator().add_frame(cars((0, 0)), np.array([0.5, 0.4]), cars())
    with pytest.raises(ValueError, match=r"\(K, 7\)"):
        APAccumulator().add_frame(np.zeros((2, 8)), np.zeros(2), cars())


def test_tuple_sample_keys_survive_json_gather():
    # (scenario, timestamp) keys come back from JSON as lists; merging must restore them so the
    # duplicate check and the tie order still work.
    rank0, rank1 = APAccumulator(), APAccumulator()
    rank0.add_frame(cars((0, 0)), np.array([0.5]), cars((0, 0)), sample_key=("s1", "000068"))
    rank1.add_frame(cars((0, 0)), np.array([0.5]), cars((30, 0)), sample_key=("s1", "000070"))
    gathered = json.loads(json.dumps(rank1.state_dict()))
    # Same tie as above: the TP frame ("000068") sorts first -> AP 0.5.
    assert rank0.merge(gathered).compute()["ap_50"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="already added"):
        rank0.merge(json.loads(json.dumps(rank1.state_dict())))


def visibility_case() -> APAccumulator:
    """GT A (x=0) seen by the ego (12 points), GT B (x=10) occluded (0 points); detections:
    0.9 on A, 0.8 on nothing (x=30), 0.7 on B."""
    accumulator = APAccumulator()
    accumulator.add_frame(cars((0, 0), (30, 0), (10, 0)), np.array([0.9, 0.8, 0.7]),
                          cars((0, 0), (10, 0)), sample_key=("s", "0"), gt_ego_points=[12, 0])
    return accumulator


def test_visibility_split_by_hand():
    result = visibility_case().compute()
    # Overall: TP, FP, TP over 2 GT -> AP 5/6 (test_voc_ap_by_hand).
    assert result["ap_50"] == pytest.approx(5 / 6)
    visible, occluded = result["visibility"]["ego-visible"], result["visibility"]["ego-occluded"]
    assert (visible["num_gt"], occluded["num_gt"]) == (1, 1)
    # Visible: the detection on B is ignored -> TP, FP over 1 GT: precision 1 at recall 1.
    assert visible["ap_50"] == pytest.approx(1.0)
    # Occluded: the detection on A is ignored -> FP, TP over 1 GT: precision 1/2 at recall 1.
    assert occluded["ap_30"] == occluded["ap_50"] == occluded["ap_70"] == pytest.approx(0.5)


def test_visibility_threshold_and_gather_round_trip():
    state = json.loads(json.dumps(visibility_case().state_dict()))
    assert APAccumulator.from_state_dict(state).compute() == visibility_case().compute()
    # With 13 points needed to count as seen, A (12 points) is occluded too: 2 GT, AP 5/6.
    strict = APAccumulator(visible_min_points=13)
    strict.add_frame(cars((0, 0), (30, 0), (10, 0)), np.array([0.9, 0.8, 0.7]),
                     cars((0, 0), (10, 0)), gt_ego_points=[12, 0])
    rows = strict.compute()["visibility"]
    assert rows["ego-occluded"]["num_gt"] == 2 and rows["ego-visible"]["num_gt"] == 0
    assert rows["ego-occluded"]["ap_50"] == pytest.approx(5 / 6)
    assert rows["ego-visible"]["ap_50"] is None     # no GT in the group: AP undefined
    with pytest.raises(ValueError, match="thresholds or bins"):
        strict.merge(visibility_case())


def test_visibility_needs_every_count():
    # One frame without counts (as in training) -> no visibility rows rather than a wrong split.
    accumulator = visibility_case()
    accumulator.add_frame(cars((0, 0)), np.array([0.5]), cars((0, 0)), sample_key=("s", "1"))
    assert "visibility" not in accumulator.compute()
    assert "visibility" not in accumulate("abc").compute()
    with pytest.raises(ValueError, match="gt_ego_points"):
        APAccumulator().add_frame(cars((0, 0)), np.array([0.5]), cars((0, 0)),
                                  gt_ego_points=[1, 2])


# ------------------------------------------------------------------------------- several classes
# Two classes, 0 "car" and 1 "pedestrian" (every box a 2 x 4 cars() box: only the labels differ,
# so the IoUs are those of cars()), three frames; (class) after each box:
#   "a": GT g1 (10, 0) (car), g2 (30, 0) (ped)
#        d1 (10, 0) car s=.90 -> TP car;  d2 (30, 0) car s=.80 -> IoU 1 with g2, a pedestrian:
#        FP car;  d3 (30, 0) ped s=.70 -> TP ped
#   "b": GT g3 (-20, 0) (ped)
#        d4 (-20, 0) car s=.95 -> FP car;  d5 (-21, 0) ped s=.60 -> IoU 0.6 with g3: TP ped @.3
#        and @.5, FP @.7
#   "c": GT g4 (40, 0) (car)
#        d6 (40, 0) ped s=.85 -> FP ped;  d7 (40, 0) car s=.50 -> TP car
# Global sort, car (2 GT): d4 FP .95, d1 TP .9, d2 FP .8, d7 TP .5 -> precision 0 1/2 1/3 1/2 at
#   recall 0 .5 .5 1; envelope 1/2 at both recall steps -> AP .5*.5 + .5*.5 = 1/2 (all IoUs 1).
# Pedestrian (2 GT): d6 FP .85, d3 TP .7, d5 .6 -> @.3/.5 FP TP TP: precision 0 1/2 2/3, recall
#   0 .5 1, envelope 2/3 twice -> AP 2/3; @.7 FP TP FP -> AP .5*.5 = 1/4.
# Class mean: @.3/.5 (1/2 + 2/3)/2 = 7/12; @.7 (1/2 + 1/4)/2 = 3/8.
# Per-frame sort (frames a, b, c): car TP FP FP TP -> precision 1 1/2 1/3 1/2 -> AP .5*1 + .5*.5
#   = 3/4; pedestrian (a: d3, b: d5, c: d6) @.5 TP TP FP -> 1, @.7 TP FP FP -> 1/2.
#   Class mean @.5 (3/4 + 1)/2 = 7/8, @.7 (3/4 + 1/2)/2 = 5/8.
CAR, PED = 0, 1
CLASS_FRAMES = {
    "a": (cars((10, 0), (30, 0), (30, 0)), [0.90, 0.80, 0.70], [CAR, CAR, PED],
          cars((10, 0), (30, 0)), [CAR, PED]),
    "b": (cars((-20, 0), (-21, 0)), [0.95, 0.60], [CAR, PED], cars((-20, 0)), [PED]),
    "c": (cars((40, 0), (40, 0)), [0.85, 0.50], [PED, CAR], cars((40, 0)), [CAR]),
}


def accumulate_classes(keys="abc", class_names=("car", "pedestrian"), **kwargs) -> APAccumulator:
    accumulator = APAccumulator(class_names=class_names, **kwargs)
    for key in keys:
        pred, scores, pred_classes, gt, gt_classes = CLASS_FRAMES[key]
        accumulator.add_frame(pred, np.array(scores), gt, sample_key=key,
                              pred_classes=pred_classes, gt_classes=gt_classes)
    return accumulator


def test_two_classes_three_frames_by_hand():
    result = accumulate_classes().compute()
    car, ped = result["per_class"]["car"], result["per_class"]["pedestrian"]
    assert (car["num_gt"], car["num_det"], ped["num_gt"], ped["num_det"]) == (2, 4, 2, 3)
    assert car["ap_30"] == car["ap_50"] == car["ap_70"] == pytest.approx(0.5, abs=1e-12)
    assert ped["ap_30"] == ped["ap_50"] == pytest.approx(2 / 3, abs=1e-12)
    assert ped["ap_70"] == pytest.approx(0.25, abs=1e-12)
    for key, mean in (("ap_30", 7 / 12), ("ap_50", 7 / 12), ("ap_70", 3 / 8)):
        assert result[key] == result["class_mean"][key] == pytest.approx(mean, abs=1e-12), key
    assert result["class_mean"]["classes"] == ["car", "pedestrian"]
    assert (result["num_gt"], result["num_det"], result["num_frames"]) == (4, 7, 3)
    # distance rows: the class mean of each bin (g1 10 m, g3 20 m: 0-30; g2 30 m, g4 40 m: 30-50)
    near = result["distance"]["0-30"]
    assert near["num_gt"] == 2 and result["distance"]["30-50"]["num_gt"] == 2
    # car 0-30: g1 with d1 TP (.9) and the FPs d4 (.95, 20 m) -> FP TP: AP 1/2; pedestrian
    # 0-30: g3 with d5 (TP @.5) alone -> AP 1; mean 3/4
    assert near["ap_50"] == pytest.approx(0.75, abs=1e-12)
    per_frame = accumulate_classes(detection_sort="per_frame").compute()
    assert per_frame["per_class"]["car"]["ap_50"] == pytest.approx(0.75, abs=1e-12)
    assert per_frame["ap_50"] == pytest.approx(7 / 8, abs=1e-12)
    assert per_frame["ap_70"] == pytest.approx(5 / 8, abs=1e-12)


def test_class_blind_matching_would_differ():
    """The same boxes scored as one class: d2 and d4 become TPs of pedestrian GT, d3 and d6
    duplicates: a different AP, so the class check above is what the numbers test."""
    accumulator = APAccumulator()
    for key in "abc":
        pred, scores, _, gt, _ = CLASS_FRAMES[key]
        accumulator.add_frame(pred, np.array(scores), gt, sample_key=key)
    assert accumulator.compute()["ap_50"] != pytest.approx(7 / 12, abs=1e-3)


def test_one_class_list_gives_the_single_class_result():
    """A class list of one name (all ids 0) changes nothing: same keys, same numbers."""
    single = accumulate("abc").compute()
    named = APAccumulator(class_names=["car"])
    for key in "abc":
        named.add_frame(*FRAMES[key], sample_key=key)
    assert named.compute() == single
    assert "per_class" not in single and "det_class" not in accumulate("a").state_dict()[
        "frames"][0]


def test_a_class_without_gt_is_left_out_or_counted_as_zero():
    """Three classes, the third ("truck") without GT or detections: ``ours`` leaves it out of
    the mean (7/12 @.5, as above); V2X-Real's rule counts it as 0: (1/2 + 2/3 + 0)/3 = 7/18."""
    names = ("car", "pedestrian", "truck")
    left_out = accumulate_classes(class_names=names).compute()
    assert left_out["per_class"]["truck"]["ap_50"] is None
    assert left_out["ap_50"] == pytest.approx(7 / 12, abs=1e-12)
    assert left_out["class_mean"]["classes"] == list(names)
    counted = accumulate_classes(class_names=names, empty_class_ap=0.0).compute()
    assert counted["per_class"]["truck"]["ap_50"] == 0.0
    assert counted["ap_50"] == pytest.approx(7 / 18, abs=1e-12)
    # no GT of any class: the headline stays numeric (0.0), as for one class
    empty = APAccumulator(class_names=names)
    empty.add_frame(cars((0, 0)), np.array([0.9]), cars(), pred_classes=[2], gt_classes=[])
    assert empty.compute()["ap_50"] == 0.0


def test_classes_survive_gather_and_refuse_other_class_lists():
    reference = accumulate_classes().compute()
    state = json.loads(json.dumps(accumulate_classes("b").state_dict()))
    assert accumulate_classes("ac").merge(state).compute() == reference
    assert APAccumulator.from_state_dict(json.loads(json.dumps(
        accumulate_classes().state_dict()))).compute() == reference
    with pytest.raises(ValueError, match="classes"):
        accumulate_classes("a", class_names=("car", "cyclist")).merge(state)
    with pytest.raises(ValueError, match="classes"):
        accumulate("a").merge(state)


def test_bad_class_ids_are_rejected():
    accumulator = APAccumulator(class_names=["car", "pedestrian"])
    with pytest.raises(ValueError, match="pred_classes needed"):
        accumulator.add_frame(cars((0, 0)), np.array([0.5]), cars(), gt_classes=[])
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        accumulator.add_frame(cars((0, 0)), np.array([0.5]), cars(), pred_classes=[2],
                              gt_classes=[])
    with pytest.raises(ValueError, match="1 boxes but 2 gt_classes"):
        accumulator.add_frame(cars(), np.zeros(0), cars((0, 0)), pred_classes=[],
                              gt_classes=[0, 1])
    with pytest.raises(ValueError, match="whole class ids"):
        accumulator.add_frame(cars((0, 0)), np.array([0.5]), cars(), pred_classes=[0.5],
                              gt_classes=[])
