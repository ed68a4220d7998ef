"""Multi-class detection (issue 38, docs/DESIGN.md §5.1): per-class anchors, target assignment
with per-class thresholds, the class loss, decoding and per-class NMS on hand-built cases, and
every model trained one step on a 3-class fake batch."""
import math
from pathlib import Path

import pytest
import torch

from opencood.config import load_config
from opencood.errors import ConfigError
from opencood.engine.task import DetectionTask
from opencood.losses import DetectionLoss
from opencood.models import build_model
from opencood.ops.nms import nms_rotated
from opencood.postprocess.box_coder import ResidualBoxCoder
from opencood.postprocess.target_assigner import assign_class_targets
from opencood.postprocess.voxel_postprocessor import VoxelPostprocessor, anchors_from_config
from opencood.registry import ENCODERS, FUSIONS, MODELS
from opencood.strategies import fuses_agents
from opencood.utils.fake_batch import fake_camera_batch, fake_collated_batch

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = ROOT / "hypes_yaml" / "synthetic"
# V2X-Real's three classes (its anchor_generator_config: sizes [l, w, h], the pedestrian's
# thresholds 0.5 / 0.35).
CLASSES = ("postprocess.classes=["
           "{name: vehicle, l: 3.9, w: 1.6, h: 1.56, z: -1.78}, "
           "{name: pedestrian, l: 0.8, w: 0.6, h: 1.73, z: -0.6, pos_threshold: 0.5, "
           "neg_threshold: 0.35}, "
           "{name: truck, l: 8.0, w: 3.0, h: 3.0, z: -1.78}]")
CROP = "[-12.8, -6.4, -3.0, 12.8, 6.4, 1.0]"      # 32 x 16 pillars of the synthetic 0.8 m cell
SCORE_SHIFT = 4.0                                  # an untrained head's logits raised: boxes
HETER_MODELS = {"heter_pyramid_collab", "heter_pyramid_single", "heter_model_late"}


def test_per_class_anchors_on_a_tiny_grid():
    # 4 x 2 cells of 1 m, stride 2: head cells centred at x = 1, 3 and y = 1; two classes on
    # the yaws 0 and 90 degrees, class-major per cell.
    classes = [{"l": 3.9, "w": 1.6, "h": 1.56, "z": -1.0},
               {"l": 0.8, "w": 0.6, "h": 1.73, "z": -0.6}]
    anchor_args = {"r": [0.0, 90.0], "feature_stride": 2, "placement": "cell_centre"}
    grid = {"range": [0.0, 0.0, -3.0, 4.0, 2.0, 1.0], "cell_size": [1.0, 1.0]}
    half = math.pi / 2
    for order, sizes in (("hwl", lambda c: [c["h"], c["w"], c["l"]]),
                         ("lwh", lambda c: [c["l"], c["w"], c["h"]])):
        anchors = anchors_from_config(anchor_args, grid, order, classes=classes)
        expected = torch.tensor([[[x, 1.0, c["z"], *sizes(c), yaw]
                                  for c in classes for yaw in (0.0, half)] for x in (1.0, 3.0)])
        assert anchors.shape == (1, 2, 4, 7)
        torch.testing.assert_close(anchors[0], expected)


def hand_built_targets(thresholds):
    """Four head cells along x (centres 0.5 .. 3.5 m, y 0.5), one 2 x 2 m anchor per class
    and cell (class-major: anchor n = 2 * cell + class). Sample 0 has a class-0 GT and a
    class-1 GT, both the 2 x 2 m square at x = 2: standup IoU 1/7, 3/5, 3/5, 1/7 with the four
    cells. Sample 1 only the class-0 one."""
    classes = [{"l": 2.0, "w": 2.0, "h": 1.5, "z": -1.0}] * 2
    anchor_args = {"r": [0.0], "feature_stride": 2, "placement": "cell_centre"}
    grid = {"range": [0.0, 0.0, -3.0, 4.0, 1.0, 1.0], "cell_size": [0.5, 0.5]}
    anchors = anchors_from_config(anchor_args, grid, "hwl", classes=classes)   # (1, 4, 2, 7)
    square = [2.0, 0.5, -1.0, 1.5, 2.0, 2.0, 0.0]
    gt_boxes = torch.tensor([[square, square], [square, [0.0] * 7]])
    gt_mask = torch.tensor([[True, True], [True, False]])
    gt_classes = torch.tensor([[0, 1], [0, 0]])
    return assign_class_targets(anchors, gt_boxes, gt_mask, gt_classes, thresholds)


def test_per_class_target_assignment_uses_each_class_thresholds_and_gt():
    # Class 0 (pos 0.55, neg 0.45): IoU 3/5 makes both middle anchors positive. Class 1 (pos
    # 0.65, neg 0.5): its GT's best anchor (first of the tie, cell 1) is forced positive, the
    # other 3/5 one is ignored. 1/7 is negative for both. No class-1 anchor sees a class-0 GT.
    targets = hand_built_targets([(0.55, 0.45), (0.65, 0.5)])
    assert targets["labels"].tolist() == [[0, 0, 1, 1, 1, -1, 0, 0],
                                          [0, 0, 1, 0, 1, 0, 0, 0]]
    assert targets["matched_gt"].tolist() == [[-1, -1, 0, 1, 0, -1, -1, -1],
                                              [-1, -1, 0, -1, 0, -1, -1, -1]]
    assert targets["class_targets"].tolist() == [[0, 0, 0, 1, 0, 0, 0, 0], [0] * 8]
    assert targets["num_positives"].tolist() == [3, 2]
    # The GT sits 0.5 m left of cell 1 and right of cell 2: x residual -/+ 0.5 over the
    # anchor's diagonal sqrt(8), the rest 0.
    half_step = 0.5 / math.sqrt(8.0)
    torch.testing.assert_close(targets["reg_targets"][0, [2, 3, 4], 0],
                               torch.tensor([half_step, half_step, -half_step]))
    assert targets["reg_targets"][0, [2, 3, 4], 1:].abs().max() == 0
    # The thresholds swapped swap the roles: class 0's second anchor is ignored now.
    swapped = hand_built_targets([(0.65, 0.5), (0.55, 0.45)])
    assert swapped["labels"][0].tolist() == [0, 0, 1, 1, -1, 1, 0, 0]


def test_per_class_nms_keeps_overlapping_boxes_of_different_classes():
    boxes = torch.tensor([[0.0, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0],
                          [0.2, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0],      # IoU ~0.9 with box 0
                          [20.0, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    assert nms_rotated(boxes, scores, 0.15).tolist() == [0, 2]
    assert nms_rotated(boxes, scores, 0.15, classes=torch.tensor([0, 1, 0])).tolist() == [0, 1, 2]
    assert nms_rotated(boxes, scores, 0.15, classes=torch.tensor([1, 1, 0])).tolist() == [0, 2]
    # The postprocessor of 2 classes keeps both, the one-class one (classes ignored) drops one.
    anchors = torch.zeros(1, 1, 2, 7)
    two = VoxelPostprocessor(anchors, ResidualBoxCoder(), 0.6, 0.45, 0.2, 0.15, 100, 500,
                             class_thresholds=[(0.6, 0.45), (0.5, 0.35)])
    kept = two.nms(boxes, scores, torch.tensor([0, 1, 0]))
    assert kept.scores.tolist() == pytest.approx([0.9, 0.8, 0.7])
    assert kept.classes.tolist() == [0, 1, 0]
    one = VoxelPostprocessor(anchors, ResidualBoxCoder(), 0.6, 0.45, 0.2, 0.15, 100, 500)
    assert one.nms(boxes, scores).scores.tolist() == pytest.approx([0.9, 0.7])


def test_decoding_takes_each_anchors_best_class():
    # One head cell, 2 classes x 1 yaw = 2 anchors, 2 logits each (channel a * 2 + class).
    anchors = torch.tensor([[[[0.0, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0],
                              [5.0, 0.0, -0.6, 1.7, 0.6, 0.8, 0.0]]]])
    post = VoxelPostprocessor(anchors, ResidualBoxCoder(), 0.6, 0.45, 0.2, 0.15, 100, 500,
                              class_thresholds=[(0.6, 0.45), (0.5, 0.35)])
    logits = torch.tensor([-1.0, 2.0, 3.0, -4.0]).view(1, 4, 1, 1)
    decoded = post.decode({"cls_preds": logits, "reg_preds": torch.zeros(1, 14, 1, 1)})[0]
    # Anchor 0's best logit is class 1's (2.0), anchor 1's class 0's (3.0).
    assert decoded.classes.tolist() == [1, 0]
    torch.testing.assert_close(decoded.scores, torch.sigmoid(torch.tensor([2.0, 3.0])))
    torch.testing.assert_close(decoded.boxes, anchors.reshape(2, 7))


def test_class_loss_is_the_focal_loss_of_each_class_logit_against_the_one_hot_class():
    # Zero logits: sigmoid 1/2, focal (1 - p_t)^2 = 1/4 for either target; alpha 0.25 for a
    # 1 target, 0.75 for a 0 target, times ln 2. Three anchors: positive of class 1,
    # negative, ignored; one positive normalises.
    outputs = {"cls_preds": torch.zeros(1, 6, 1, 1), "reg_preds": torch.zeros(1, 21, 1, 1)}
    targets = {"labels": torch.tensor([[1, 0, -1]]), "class_targets": torch.tensor([[1, 0, 0]]),
               "reg_targets": torch.zeros(1, 3, 7), "reg_weights": torch.tensor([[1.0, 0, 0]]),
               "dir_targets": torch.zeros(1, 3, dtype=torch.int64)}
    _, terms = DetectionLoss()(outputs, targets)
    ln2 = math.log(2.0)
    positive = (0.75 + 0.25) * 0.25 * ln2             # class 0 logit: 0 target; class 1: 1
    negative = 2 * 0.75 * 0.25 * ln2
    assert float(terms["cls_loss"]) == pytest.approx(positive + negative, rel=1e-6)
    # The one-hot class matters: the positive as class 0 costs the same by symmetry here, but
    # a class-1 logit raised lowers only the class-1 target's loss.
    raised = {**outputs, "cls_preds": torch.tensor([0.0, 3.0, 0, 0, 0, 0]).view(1, 6, 1, 1)}
    as_class_1 = float(DetectionLoss()(raised, targets)[1]["cls_loss"])
    as_class_0 = float(DetectionLoss()(raised, {**targets, "class_targets":
                                                torch.zeros(1, 3, dtype=torch.int64)})[1]
                       ["cls_loss"])
    assert as_class_1 < positive + negative < as_class_0


def test_a_class_list_is_checked_and_a_list_of_one_is_the_single_class_detector():
    smoke = SYNTHETIC / "smoke.yaml"
    with pytest.raises(ConfigError, match="postprocess.classes.*names a class twice"):
        load_config(smoke, ["postprocess.classes=[{name: car, l: 4, w: 2, h: 1.5, z: -1}, "
                            "{name: car, l: 4, w: 2, h: 1.5, z: -1}]"])
    with pytest.raises(ConfigError, match=r"postprocess.classes\[0\].neg_threshold"):
        load_config(smoke, ["postprocess.classes=[{name: car, l: 4, w: 2, h: 1.5, z: -1, "
                            "pos_threshold: 0.4, neg_threshold: 0.5}]"])
    cfg = load_config(smoke, [CLASSES])
    assert (cfg["model"]["args"]["num_class"], cfg["model"]["args"]["anchor_number"]) == (3, 6)
    with pytest.raises(ConfigError, match="model.args.anchor_number.* is 2, but .* make it 6"):
        load_config(smoke, [CLASSES, "model.args.anchor_number=2"])
    # One class named in the list, with the anchor and thresholds of anchor_args / target_args:
    # the same anchors and targets as no list.
    plain = load_config(smoke)
    one = load_config(smoke, ["postprocess.classes=[{name: car, l: 3.9, w: 1.6, h: 1.56, "
                              "z: -1.0, pos_threshold: 0.6, neg_threshold: 0.45}]"])
    post_plain = VoxelPostprocessor.from_config(plain, torch.device("cpu"))
    post_one = VoxelPostprocessor.from_config(one, torch.device("cpu"))
    assert torch.equal(post_plain.anchors, post_one.anchors)
    batch = fake_collated_batch(plain["preprocess"], batch_size=1, pillars_per_agent=4,
                                max_gt=4)
    got = post_one.targets(batch["gt_boxes"], batch["gt_mask"],
                           torch.zeros(1, 4, dtype=torch.int64))
    for key, value in post_plain.targets(batch["gt_boxes"], batch["gt_mask"]).items():
        assert torch.equal(got[key], value), key
    three = VoxelPostprocessor.from_config(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match="lists 3 classes but the batch has no gt_classes"):
        three.targets(batch["gt_boxes"], batch["gt_mask"])


def model_configs():
    """Every synthetic yaml: each registered model, fusion module and encoder."""
    names = sorted(p.name for p in SYNTHETIC.glob("*.yaml")
                   if p.name.startswith(("point_pillar_", "camera_small")))
    return names


def test_the_model_configs_cover_every_registered_model_fusion_and_encoder():
    models, fusions, encoders = set(), set(), set()
    for name in model_configs():
        cfg = load_config(SYNTHETIC / name)
        args = cfg["model"]["args"]
        models.add(cfg["model"]["core_method"])
        if args.get("fusion"):
            fusions.add(args["fusion"]["core_method"])
        encoders.add(args["encoder"]["core_method"] if args.get("encoder") else "pillar")
    # HEAL's heterogeneous models need a batch of agent modalities (no fake one yet): their
    # head is checked alone below.
    assert models | HETER_MODELS == set(MODELS.names()) and fusions == set(FUSIONS.names())
    assert encoders == set(ENCODERS.names())


@pytest.mark.parametrize("name", ["heter_pyramid_collab.yaml", "heter_pyramid_late.yaml"])
def test_the_heterogeneous_model_heads_are_sized_by_classes_and_yaws(name):
    head = build_model(load_config(SYNTHETIC / name, [CLASSES])["model"]).head
    assert (head.cls_conv.out_channels, head.reg_conv.out_channels) == (6 * 3, 6 * 7)


@pytest.mark.parametrize("name", model_configs())
def test_every_model_trains_and_decodes_three_classes(name):
    cfg = load_config(SYNTHETIC / name, [CLASSES, f"preprocess.cav_lidar_range={CROP}",
                                         f"postprocess.gt_range={CROP}",
                                         "postprocess.pre_nms_max=20"])     # a cheap NMS
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    task = DetectionTask.from_config(cfg, torch.device("cpu"))
    batch = fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=2,
                                pillars_per_agent=60, points_per_pillar=3, max_gt=6,
                                single_agent=not fuses_agents(model), num_classes=3)
    if "camera" in cfg["input_source"]:
        image_size = tuple(cfg["model"]["args"]["encoder"]["args"]["image_size"])
        batch.update(fake_camera_batch(int(batch["record_len"].sum()), image_size=image_size,
                                       cameras=1, depth="depth" in cfg["input_source"]))
    model.train()
    loss, terms, _ = task.training_loss(model, batch)
    loss.backward()
    assert all(math.isfinite(float(value)) for value in terms.values()), terms
    assert float(terms["cls_loss"]) > 0
    model.eval()
    with torch.no_grad():
        inputs, _ = task.eval_preparer(batch, with_targets=False)
        outputs = model(inputs)
    post = task.eval_preparer.postprocessor
    rows, _, height, width = outputs["reg_preds"].shape
    assert post.anchors.shape[:3] == (height, width, 6)                # 3 classes x 2 yaws
    assert outputs["cls_preds"].shape == (rows, 6 * 3, height, width)  # 3 logits per anchor
    decoded = post.decode({**outputs, "cls_preds": outputs["cls_preds"] + SCORE_SHIFT})
    classes = torch.cat([post.nms(*frame).classes for frame in decoded])
    assert len(classes) > 0 and 0 <= int(classes.min()) and int(classes.max()) < 3


def test_the_opencood_export_refuses_a_class_list():
    from opencood.interop.exporter import peer_config
    from opencood.interop.opencood_ckpt import InteropError
    path = ROOT / "hypes_yaml" / "opv2v" / "reference" / "point_pillar_no_fusion.yaml"
    peer_config(load_config(path), str(path))                 # exports as it is
    with pytest.raises(InteropError, match="postprocess.classes is .*detects one class"):
        peer_config(load_config(path, [CLASSES]), str(path))
