"""Anchors, residual box coding, direction bins and target assignment on hand-made scenes, and
assignment against the plain-Python reference (opencood/testing/reference_impls.py) on
random ones."""
import math

import pytest
import torch

from opencood.config import resolve_section
from opencood.ops.transforms import limit_period
from opencood.postprocess.anchors import generate_anchors
from opencood.postprocess.box_coder import ResidualBoxCoder
from opencood.postprocess.layout import flatten_anchor_maps
from opencood.postprocess.target_assigner import assign_targets, standup_bev
from opencood.postprocess.voxel_postprocessor import VoxelPostprocessor, anchors_from_config
from opencood.testing.reference_impls import reference_assign_targets
from opencood.utils.fake_batch import random_vehicle_boxes

OPV2V_RANGE = [-140.8, -40.0, -3.0, 140.8, 40.0, 1.0]
SMALL_RANGE = [0.0, 0.0, -3.0, 8.0, 8.0, 1.0]
SQRT5 = math.sqrt(5.0)      # diagonal of the 2 m x 1 m test anchors


def small_anchors():
    """4 x 4 cells at x, y in {1, 3, 5, 7}, yaws (0, pi/2), h=1.5 w=1 l=2.

    A yaw-0 anchor's standup box is [x-1, x+1] x [y-0.5, y+0.5] (area 2); a yaw-90 one is
    [x-0.5, x+0.5] x [y-1, y+1]. Flat index n = (i_y * 4 + i_x) * 2 + a.
    """
    return generate_anchors(SMALL_RANGE, [1, 1, 4], feature_stride=2, anchor_hwl=(1.5, 1.0, 2.0))


def flat(i_y, i_x, a):
    return (i_y * 4 + i_x) * 2 + a


# ---------------------------------------------------------------------------------- anchors


def test_anchor_grid_at_opv2v_geometry():
    anchors = generate_anchors(OPV2V_RANGE, [0.4, 0.4, 4])
    assert anchors.shape == (100, 352, 2, 7)
    assert anchors.dtype == torch.float32
    expected_first = torch.tensor([-140.4, -39.6, -1.0, 1.56, 1.6, 3.9, 0.0])
    expected_last = torch.tensor([140.4, 39.6, -1.0, 1.56, 1.6, 3.9, math.pi / 2])
    torch.testing.assert_close(anchors[0, 0, 0], expected_first)
    torch.testing.assert_close(anchors[99, 351, 1], expected_last)
    # x = -140.8 + (5 + 0.5) * 0.8, y = -40 + (3 + 0.5) * 0.8
    torch.testing.assert_close(anchors[3, 5, 0, :2], torch.tensor([-136.4, -37.2]))


def test_small_anchor_grid_and_config():
    anchors = small_anchors()
    assert anchors.shape == (4, 4, 2, 7)
    torch.testing.assert_close(anchors[1, 2, 1],
                               torch.tensor([5.0, 3.0, -1.0, 1.5, 1.0, 2.0, math.pi / 2]))
    anchor_args = resolve_section("postprocess", {"anchor_args": {
        "h": 1.5, "w": 1.0, "l": 2.0, "z": -1.0, "r": [0, 90], "feature_stride": 2}})["anchor_args"]
    bev_grid = {"range": SMALL_RANGE, "cell_size": [1, 1]}
    from_yaml = anchors_from_config(anchor_args, bev_grid, order="hwl")
    torch.testing.assert_close(from_yaml, anchors)


# -------------------------------------------------------------------------------- box coder


def random_boxes(count, dtype, seed):
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=generator, dtype=torch.float64)

    centre = (rand(count, 3) - 0.5) * torch.tensor([281.6, 80.0, 4.0], dtype=torch.float64)
    size = 0.5 + 5 * rand(count, 3)
    yaw = (rand(count, 1) - 0.5) * 4 * math.pi
    return torch.cat([centre, size, yaw], dim=1).to(dtype)


def test_encode_hand_values():
    coder = ResidualBoxCoder()
    anchor = torch.tensor([1.0, 2.0, -1.0, 1.5, 1.6, 3.9, 0.0])
    gt = torch.tensor([1.5, 2.0, -0.25, 3.0, 1.6, 3.9, 0.3])
    # diagonal sqrt(3.9^2 + 1.6^2) = 4.215448; dz = 0.75 / 1.5; dh = log 2
    expected = torch.tensor([0.5 / 4.215448, 0.0, 0.5, 0.693147, 0.0, 0.0, 0.3])
    torch.testing.assert_close(coder.encode(gt, anchor), expected)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_encode_decode_round_trip(dtype, tolerance):
    coder = ResidualBoxCoder()
    gt, anchors = random_boxes(1000, dtype, seed=0), random_boxes(1000, dtype, seed=1)
    decoded = coder.decode(coder.encode(gt, anchors), anchors)
    # float32 keeps ~7 digits: 1e-5 absolute plus 1e-6 relative to centres up to 140 m.
    torch.testing.assert_close(decoded, gt, atol=tolerance, rtol=1e-6)


def test_direction_bins_hand_picked():
    coder = ResidualBoxCoder(dir_offset=0.7854, num_dir_bins=2)
    yaws = torch.tensor([0.0, math.pi / 2, math.pi, -math.pi / 2, 0.8, 0.78, 3.9, 4.0])
    # yaw - 0.7854 wrapped to [0, 2pi): 5.498, 0.785, 2.356, 3.927, 0.015, 6.278, 3.115, 3.215
    assert coder.direction_targets(yaws).tolist() == [1, 0, 0, 1, 0, 1, 0, 1]
    four_bins = ResidualBoxCoder(dir_offset=0.0, num_dir_bins=4)
    # bin width pi/2 = 1.571: 0.1 -> 0, 1.7 -> 1, 3.2 -> 2, 4.8 -> 3, -0.1 = 6.183 -> 3
    yaws = torch.tensor([0.1, 1.7, 3.2, 4.8, -0.1])
    assert four_bins.direction_targets(yaws).tolist() == [0, 1, 2, 3, 3]


@pytest.mark.parametrize("num_bins", [2, 4])
def test_apply_direction_recovers_yaw_in_every_quadrant(num_bins):
    coder = ResidualBoxCoder(num_dir_bins=num_bins)
    true_yaw = torch.tensor([-3.0, -2.0, -1.0, -0.2, 0.0, 0.3, 1.2, math.pi / 2, 2.0, 3.0])
    bins = coder.direction_targets(true_yaw)
    logits = torch.nn.functional.one_hot(bins, num_bins).float()
    for turns in (-1, 0, 1, 2):
        # what the regression may output: the yaw up to a multiple of the bin width
        boxes = torch.zeros(len(true_yaw), 7)
        boxes[:, :6] = torch.tensor([1.0, 2.0, 3.0, 1.5, 1.6, 3.9])
        boxes[:, 6] = true_yaw + turns * 2 * math.pi / num_bins
        fixed = coder.apply_direction(boxes, logits)
        torch.testing.assert_close(fixed[:, :6], boxes[:, :6])
        wrapped_error = limit_period(fixed[:, 6] - true_yaw, 0.5, 2 * math.pi)
        torch.testing.assert_close(wrapped_error, torch.zeros_like(true_yaw), atol=1e-5, rtol=0)


def test_apply_direction_follows_the_predicted_bin():
    coder = ResidualBoxCoder()
    boxes = torch.tensor([[0.0, 0, 0, 1, 1, 1, 0.0]] * 2)
    # yaw 0 is in bin 1; predicting bin 0 turns it around to pi
    fixed = coder.apply_direction(boxes, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(fixed[:, 6], torch.tensor([2 * math.pi, math.pi]))


# ------------------------------------------------------------------------- target assignment

# Sample scene on the small grid (IoUs are of standup boxes):
#   GT_A [3, 3] l=2 w=1 yaw 0  == anchor (1,1,0) n=10: IoU 1 -> positive, zero residual.
#        The yaw-90 anchor n=11 at the same place: inter 1, union 3 -> 1/3 -> negative.
#   GT_B [5.4, 5] l=2 w=1 yaw pi: x [4.4, 6.4]. Anchor (2,2,0) n=20 x [4, 6]: inter 1.6,
#        union 2.4 -> 0.667 -> positive. Anchor (2,3,0) n=22: inter 0.4 / 3.6 -> negative.
#   GT_C [4.1, 7] l=4 w=1 yaw 0: x [2.1, 6.1]. Anchor (3,2,0) n=28 x [4, 6]: inter 2,
#        union 4 -> 0.5: below pos_iou but GT_C's best anchor -> positive.
#        Anchor (3,1,0) n=26 x [2, 4]: inter 1.9, union 4.1 -> 0.463 -> ignored.
#        Yaw-90 anchors n=27, n=29: inter 1, union 5 -> 0.2 -> negative.
GT_A = [3.0, 3.0, -1.0, 1.5, 1.0, 2.0, 0.0]
GT_B = [5.4, 5.0, -1.0, 1.5, 1.0, 2.0, math.pi]
GT_C = [4.1, 7.0, -1.0, 1.5, 1.0, 4.0, 0.0]


def test_standup_box_of_rotated_box():
    box = torch.tensor([[1.0, 2.0, 0.0, 1.0, 2.0, 4.0, math.pi / 6]])
    # half extents: x = cos30 * 2 + sin30 * 1 = 2.2321, y = sin30 * 2 + cos30 * 1 = 1.8660
    expected = torch.tensor([[1 - 2.232051, 2 - 1.866025, 1 + 2.232051, 2 + 1.866025]])
    torch.testing.assert_close(standup_bev(box), expected)


def test_hand_made_scene_batch_of_two():
    anchors = small_anchors()
    # sample 1 holds only GT_B; its padded rows hold GT_A which the mask must hide
    gt_boxes = torch.tensor([[GT_A, GT_B, GT_C], [GT_B, GT_A, GT_A]])
    gt_mask = torch.tensor([[True, True, True], [True, False, False]])
    targets = assign_targets(anchors, gt_boxes, gt_mask, pos_iou=0.6, neg_iou=0.45)

    expected_labels = torch.zeros(2, 32, dtype=torch.int64)
    expected_labels[0, [flat(1, 1, 0), flat(2, 2, 0), flat(3, 2, 0)]] = 1
    expected_labels[0, flat(3, 1, 0)] = -1
    expected_labels[1, flat(2, 2, 0)] = 1
    assert torch.equal(targets["labels"], expected_labels)
    assert targets["num_positives"].tolist() == [3, 1]
    assert torch.equal(targets["reg_weights"], (expected_labels == 1).float())

    expected_reg = torch.zeros(2, 32, 7)
    # GT_B: dx = 0.4 / sqrt5, dyaw = pi
    expected_reg[:, flat(2, 2, 0)] = torch.tensor([0.4 / SQRT5, 0, 0, 0, 0, 0, math.pi])
    # GT_C: dx = (4.1 - 5) / sqrt5, dl = log(4 / 2)
    expected_reg[0, flat(3, 2, 0)] = torch.tensor([-0.9 / SQRT5, 0, 0, 0, 0, math.log(2.0), 0])
    torch.testing.assert_close(targets["reg_targets"], expected_reg, atol=1e-6, rtol=1e-6)

    # yaw 0 -> bin 1, yaw pi -> bin 0; non-positives 0
    expected_dir = torch.zeros(2, 32, dtype=torch.int64)
    expected_dir[0, [flat(1, 1, 0), flat(3, 2, 0)]] = 1
    assert torch.equal(targets["dir_targets"], expected_dir)
    assert targets["matched_gt"][0, [flat(1, 1, 0), flat(2, 2, 0), flat(3, 2, 0)]].tolist() \
        == [0, 1, 2]
    assert targets["matched_gt"][1, flat(2, 2, 0)] == 0


def test_batched_equals_one_sample_at_a_time():
    anchors = small_anchors()
    gt_boxes = torch.tensor([[GT_A, GT_B, GT_C], [GT_C, GT_A, GT_A]])
    gt_mask = torch.tensor([[True, True, True], [True, True, False]])
    batched = assign_targets(anchors, gt_boxes, gt_mask)
    for sample in range(2):
        count = int(gt_mask[sample].sum())
        alone = assign_targets(anchors, gt_boxes[sample:sample + 1, :count],
                               gt_mask[sample:sample + 1, :count])
        for key in ("labels", "reg_targets", "dir_targets", "reg_weights", "matched_gt"):
            assert torch.equal(batched[key][sample], alone[key][0]), key


def test_lower_thresholds_add_positives_beyond_the_best_anchor():
    targets = assign_targets(small_anchors(), torch.tensor([[GT_C]]), torch.tensor([[True]]),
                             pos_iou=0.45, neg_iou=0.3)
    # n=28 (0.5, best) and n=26 (0.463 >= 0.45) positive; yaw-90 neighbours (0.2) negative
    expected = torch.zeros(1, 32, dtype=torch.int64)
    expected[0, [flat(3, 1, 0), flat(3, 2, 0)]] = 1
    assert torch.equal(targets["labels"], expected)


def test_best_anchor_regresses_to_its_gt_even_if_another_overlaps_it_more():
    # GT_K [4.3, 3] l=4 w=1: x [2.3, 6.3]; anchor n=12 x [4, 6]: 2 / 4 = 0.5 (K's best);
    #      anchor n=10 x [2, 4]: inter 1.7, union 4.3 -> 0.395.
    # GT_J [2.2, 3] 0.5 x 0.5: x [1.95, 2.45]; anchor n=10: inter 0.225, union 2.025 -> 0.111,
    #      its best; anchor n=8 x [0, 2]: 0.025 / 2.225 -> 0.011.
    # n=10 overlaps K more (0.395) yet is J's best anchor, so it regresses to J.
    gt_k = [4.3, 3.0, -1.0, 1.5, 1.0, 4.0, 0.0]
    gt_j = [2.2, 3.0, -1.0, 1.5, 0.5, 0.5, 0.0]
    targets = assign_targets(small_anchors(), torch.tensor([[gt_k, gt_j]]),
                             torch.tensor([[True, True]]))
    assert targets["labels"][0, flat(1, 1, 0)] == 1
    assert targets["labels"][0, flat(1, 2, 0)] == 1
    assert targets["matched_gt"][0, flat(1, 1, 0)] == 1
    assert targets["matched_gt"][0, flat(1, 2, 0)] == 0
    assert targets["num_positives"].tolist() == [2]


def test_two_gt_with_the_same_best_anchor_higher_iou_wins():
    # GT_Q [3.2, 3] 1 x 1: x [2.7, 3.7]; anchor n=10: inter 1, union 2 -> 0.5 (its best);
    #      yaw-90 anchor n=11 x [2.5, 3.5] y [2, 4]: inter 0.8, union 2.2 -> 0.364.
    # GT_A == anchor n=10 (IoU 1) also claims n=10 and wins although listed second.
    gt_q = [3.2, 3.0, -1.0, 1.5, 1.0, 1.0, 0.0]
    targets = assign_targets(small_anchors(), torch.tensor([[gt_q, GT_A]]),
                             torch.tensor([[True, True]]))
    assert targets["matched_gt"][0, flat(1, 1, 0)] == 1
    assert targets["num_positives"].tolist() == [1]
    assert targets["labels"][0, flat(1, 1, 1)] == 0          # max IoU 0.364 < 0.45


def test_duplicate_gt_tie_goes_to_the_lower_index():
    # two identical GT_A claim anchor n=10 with the same IoU 1: deterministic, index 0 wins
    targets = assign_targets(small_anchors(), torch.tensor([[GT_A, GT_A]]),
                             torch.tensor([[True, True]]))
    assert targets["matched_gt"][0, flat(1, 1, 0)] == 0
    assert targets["num_positives"].tolist() == [1]


def random_gt_scene(generator):
    """(2, 10, 7) float64 GT in a 40 x 20 m range, mask (2, 10): sample 0 has 9 boxes, two of
    them near-duplicates (they claim the same best anchor), sample 1 has 6; padded rows hold
    boxes the mask must hide."""
    gt_boxes = random_vehicle_boxes(20, generator, x_range=(2, 38),
                                    y_range=(2, 18)).reshape(2, 10, 7)
    gt_boxes[0, 1] = gt_boxes[0, 0]
    gt_boxes[0, 1, :2] += 0.1
    gt_mask = torch.arange(10) < torch.tensor([[9], [6]])
    return gt_boxes, gt_mask


@pytest.mark.parametrize("pos_iou, neg_iou", [(0.6, 0.45), (0.99, 0.3)])
def test_assignment_matches_the_plain_python_reference(pos_iou, neg_iou):
    # pos_iou 0.99 is out of reach: every positive is then a GT's claimed best anchor.
    anchors = generate_anchors([0, 0, -3, 40, 20, 1], [0.5, 0.5, 4]).double()  # (20, 40, 2, 7)
    gt_boxes, gt_mask = random_gt_scene(torch.Generator().manual_seed(5))
    targets = assign_targets(anchors, gt_boxes, gt_mask, pos_iou=pos_iou, neg_iou=neg_iou)
    for sample in range(2):
        real = gt_mask[sample].nonzero().flatten()
        labels, matched = reference_assign_targets(
            anchors.reshape(-1, 7).tolist(), gt_boxes[sample, real].tolist(), pos_iou, neg_iou)
        matched_rows = [int(real[m]) if m >= 0 else -1 for m in matched]   # masked -> padded
        assert targets["labels"][sample].tolist() == labels
        assert targets["matched_gt"][sample].tolist() == matched_rows
        assert {-1, 0, 1} <= set(labels)
    if pos_iou > 0.9:
        assert targets["num_positives"].tolist() == [8, 6]      # near-duplicates share one


def test_samples_without_gt_are_all_negative():
    anchors = small_anchors()
    for gt_boxes, gt_mask in ((torch.zeros(2, 0, 7), torch.zeros(2, 0, dtype=torch.bool)),
                              (torch.tensor([[GT_A], [GT_A]]), torch.tensor([[False], [False]]))):
        targets = assign_targets(anchors, gt_boxes, gt_mask)
        assert torch.equal(targets["labels"], torch.zeros(2, 32, dtype=torch.int64))
        assert torch.equal(targets["reg_targets"], torch.zeros(2, 32, 7))
        assert targets["num_positives"].tolist() == [0, 0]


def test_gt_outside_every_anchor_gets_no_positive():
    far_away = [50.0, 50.0, -1.0, 1.5, 1.0, 2.0, 0.0]
    targets = assign_targets(small_anchors(), torch.tensor([[far_away]]), torch.tensor([[True]]))
    assert targets["num_positives"].tolist() == [0]
    assert (targets["labels"] == 0).all()


# ------------------------------------------------------------------ head outputs and decoding


def test_flatten_predictions_lines_up_with_anchors():
    h_idx = torch.arange(4).view(1, 1, 4, 1)
    w_idx = torch.arange(4).view(1, 1, 1, 4)
    cls_preds = (torch.arange(2).view(1, 2, 1, 1) * 100 + h_idx * 10 + w_idx).float()
    reg_preds = (torch.arange(14).view(1, 14, 1, 1) * 100 + h_idx * 10 + w_idx).float()
    dir_preds = (torch.arange(4).view(1, 4, 1, 1) * 100 + h_idx * 10 + w_idx).float()
    cls, reg, direction = (flatten_anchor_maps(cls_preds, 1), flatten_anchor_maps(reg_preds, 7),
                           flatten_anchor_maps(dir_preds, 2))
    assert cls.shape == (1, 32) and reg.shape == (1, 32, 7) and direction.shape == (1, 32, 2)
    n = flat(1, 2, 1)                          # row 1, column 2, anchor 1
    assert cls[0, n] == 112                    # channel a=1 at (h=1, w=2)
    assert reg[0, n].tolist() == [(7 + k) * 100 + 12 for k in range(7)]  # channels 7..13
    assert direction[0, n].tolist() == [212, 312]                          # channels 2, 3
    torch.testing.assert_close(small_anchors().reshape(-1, 7)[n, [0, 1, 6]],
                               torch.tensor([5.0, 3.0, math.pi / 2]))


def test_decode_predictions_hand_made():
    anchors = small_anchors()
    cls_preds = torch.full((2, 2, 4, 4), -10.0)
    reg_preds = torch.zeros(2, 14, 4, 4)
    dir_preds = torch.zeros(2, 4, 4, 4)
    cls_preds[0, 0, 1, 1] = 2.0                # anchor (1, 1, 0) at (3, 3), yaw 0
    reg_preds[0, 0, 1, 1] = 0.5                # dx: x = 3 + 0.5 * sqrt5
    dir_preds[0, 0, 1, 1] = 1.0                # bin 0 for anchor 0: yaw 0 -> pi
    postprocessor = VoxelPostprocessor(anchors, ResidualBoxCoder(), pos_iou=0.6, neg_iou=0.45,
                                       score_threshold=0.5, nms_thresh=0.15, max_num=100,
                                       pre_nms_max=500)
    detections = postprocessor.decode({"cls_preds": cls_preds, "reg_preds": reg_preds,
                                       "dir_preds": dir_preds})
    boxes, scores, classes = detections[0]
    assert classes.tolist() == [0] * len(boxes)         # one class: every box class 0
    expected = torch.tensor([[3 + 0.5 * SQRT5, 3.0, -1.0, 1.5, 1.0, 2.0, math.pi]])
    torch.testing.assert_close(boxes, expected)
    torch.testing.assert_close(scores, torch.tensor([1 / (1 + math.exp(-2.0))]))
    assert detections[1][0].shape == (0, 7) and detections[1][1].shape == (0,)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_assignment_on_cuda_matches_cpu():
    anchors = small_anchors()
    gt_boxes = torch.tensor([[GT_A, GT_B, GT_C], [GT_C, GT_A, GT_A]])
    gt_mask = torch.tensor([[True, True, True], [True, True, False]])
    on_cpu = assign_targets(anchors, gt_boxes, gt_mask)
    on_gpu = assign_targets(anchors, gt_boxes.cuda(), gt_mask.cuda())
    for key, value in on_cpu.items():
        assert on_gpu[key].device.type == "cuda"
        torch.testing.assert_close(on_gpu[key].cpu(), value)


def test_postprocessor_targets_reuse_the_anchor_rectangles_bit_for_bit():
    # The anchors are fixed, so their standup rectangles are computed once (issue 40: fewer
    # operators per step); the targets stay those of assign_targets computing them each time.
    from opencood.utils.op_counts import OpCounter
    anchors = small_anchors()
    post = VoxelPostprocessor(anchors, ResidualBoxCoder(), pos_iou=0.6, neg_iou=0.45,
                              score_threshold=0.2, nms_thresh=0.15, max_num=100,
                              pre_nms_max=1000)
    gt_boxes = torch.tensor([[[1.0, 1.0, -1.0, 1.5, 1.0, 2.0, 0.3],
                              [5.0, 3.0, -1.0, 1.5, 1.2, 2.5, 1.4]],
                             [[3.0, 6.0, -1.0, 1.5, 1.0, 2.0, -0.2],
                              [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]])
    gt_mask = torch.tensor([[True, True], [True, False]])
    expected = assign_targets(anchors, gt_boxes, gt_mask, pos_iou=0.6, neg_iou=0.45)
    post.targets(gt_boxes, gt_mask)                       # computes the rectangles
    with OpCounter() as cached:
        got = post.targets(gt_boxes, gt_mask)
    with OpCounter() as uncached:
        assign_targets(anchors, gt_boxes, gt_mask, pos_iou=0.6, neg_iou=0.45)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    assert int(expected["num_positives"].sum()) >= 3
    # standup_bev of the anchors (17), and their 4 coordinate columns made contiguous
    assert uncached.kernels - cached.kernels == 21
    assert post.anchor_rects(torch.device("cpu"), torch.float32) is \
        post.anchor_rects(torch.device("cpu"), torch.float32)
