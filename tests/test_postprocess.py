"""The registered detection postprocessor (issue 12): selection by ``postprocess.core_method``,
``postprocess.order: lwh`` equivalent to 'hwl' end to end, and the ``max_voxel_*`` pillar caps."""
import math
from pathlib import Path

import pytest
import torch

from opv2v_factory import write_simple_split
from opencood.config import load_config, replaced, resolve_section
from opencood.errors import ConfigError
from opencood.data.collate import collate_samples
from opencood.data.datasets import build_dataset
from opencood.strategies import choose_strategy
from opencood.data.pipeline import BatchPreparer
from opencood.engine.recipe import check_registered_names
from opencood.eval.inference import run_inference
from opencood.losses import build_loss
from opencood.models.build import build_model
from opencood.postprocess import VoxelPostprocessor, build_postprocessor
from opencood.postprocess.layout import BOX_CODE_SIZE
from opencood.utils.fake_batch import fake_collated_batch, random_vehicle_boxes
from opencood.utils.init import init_weights

SMOKE = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"
CPU = torch.device("cpu")
HWL_TO_LWH = [0, 1, 2, 5, 4, 3, 6]       # its own inverse


def smoke_config(data_dir=None, overrides=()) -> dict:
    split = [] if data_dir is None else [f"{key}={data_dir}" for key in
                                         ("root_dir", "validate_dir", "test_dir")]
    return load_config(SMOKE, [*split, *overrides])


# ------------------------------------------------------------------------------- registry


def test_yaml_core_method_selects_the_voxel_postprocessor():
    cfg = smoke_config()
    assert cfg["postprocess"]["core_method"] == "VoxelPostprocessor"
    postprocessor = build_postprocessor(cfg, CPU)
    assert type(postprocessor) is VoxelPostprocessor
    # smoke grid 64 x 32 pillars, stride 2 -> 16 x 32 cells, 2 yaws
    assert postprocessor.anchors.shape == (16, 32, 2, 7)
    assert (postprocessor.order, postprocessor.score_threshold, postprocessor.nms_thresh) == \
        ("hwl", 0.2, 0.15)
    # Absent from a yaml: the schema gives OpenCOOD's default (no read site restates it).
    absent = {key: value for key, value in cfg["postprocess"].items() if key != "core_method"}
    cfg = {**cfg, "postprocess": resolve_section("postprocess", absent)}
    assert type(build_postprocessor(cfg, CPU)) is VoxelPostprocessor


def test_unknown_core_method_is_a_one_line_config_error_naming_the_key():
    cfg = smoke_config(overrides=["postprocess.core_method=VoxelPostprocesor"])
    with pytest.raises(ConfigError) as built:
        build_postprocessor(cfg, CPU)
    with pytest.raises(ConfigError) as checked:
        check_registered_names(cfg, "x.yaml")
    for message in (str(built.value), str(checked.value)):
        assert "\n" not in message
        assert "postprocess.core_method" in message and "'VoxelPostprocesor'" in message
        assert "VoxelPostprocessor" in message.split("registered")[-1]
    assert str(checked.value).startswith("x.yaml: postprocess.core_method")


def test_unknown_order_is_a_config_error_naming_the_key():
    """Checked once, by the schema, when the config is resolved (not again at the read site)."""
    with pytest.raises(ConfigError, match=r"key 'postprocess.order' is 'whl'; expected one of "
                                          r"hwl, lwh$"):
        smoke_config(overrides=["postprocess.order=whl"])


def test_head_channels_follow_the_layout():
    cfg = smoke_config()
    head = build_model(cfg["model"]).head
    anchors_per_cell = build_postprocessor(cfg, CPU).num_anchors_per_location
    assert head.reg_conv.out_channels == BOX_CODE_SIZE * anchors_per_cell == 14
    assert head.dir_conv.out_channels == 2 * anchors_per_cell


def test_decode_refuses_a_head_that_disagrees_with_the_anchors():
    postprocessor = build_postprocessor(smoke_config(), CPU)
    outputs = {"cls_preds": torch.zeros(1, 3, 16, 32), "reg_preds": torch.zeros(1, 21, 16, 32)}
    with pytest.raises(ValueError, match="1536 anchors per sample but the postprocessor has 1024"):
        postprocessor.decode(outputs)


# ---------------------------------------------------------------------------- order: lwh


def lwh_head_from(model_hwl: torch.nn.Module, cfg_lwh: dict) -> torch.nn.Module:
    """The same detector for 'lwh' boxes: regression channels a*7 + k permuted like the box
    columns (codes keep the box order), every other weight shared."""
    model = build_model(cfg_lwh["model"])
    model.load_state_dict(model_hwl.state_dict())
    anchors = model.head.num_anchors
    rows = [a * BOX_CODE_SIZE + k for a in range(anchors) for k in HWL_TO_LWH]
    with torch.no_grad():
        model.head.reg_conv.weight.copy_(model_hwl.head.reg_conv.weight[rows])
        model.head.reg_conv.bias.copy_(model_hwl.head.reg_conv.bias[rows])
    return model


def test_lwh_targets_are_the_hwl_targets_with_sizes_swapped():
    cfg_hwl = smoke_config()
    hwl = build_postprocessor(cfg_hwl, CPU)
    lwh = build_postprocessor(smoke_config(overrides=["postprocess.order=lwh"]), CPU)
    assert torch.equal(lwh.anchors, hwl.anchors[..., HWL_TO_LWH])
    assert lwh.anchors[0, 0, 0, 3:6].tolist() == pytest.approx([3.9, 1.6, 1.56])
    generator = torch.Generator().manual_seed(0)
    gt_hwl = torch.stack([random_vehicle_boxes(6, generator, (-24, 24), (-12, 12))
                          for _ in range(2)]).float()                           # (2, 6, 7)
    gt_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    targets_hwl = hwl.targets(gt_hwl, gt_mask)
    targets_lwh = lwh.targets(gt_hwl[..., HWL_TO_LWH], gt_mask)
    assert int(targets_hwl["num_positives"].sum()) >= 10     # a real assignment, not all zero
    for key in ("labels", "dir_targets", "reg_weights", "num_positives", "matched_gt"):
        assert torch.equal(targets_lwh[key], targets_hwl[key]), key
    assert torch.equal(targets_lwh["reg_targets"], targets_hwl["reg_targets"][..., HWL_TO_LWH])


def test_lwh_run_and_hwl_run_give_the_same_loss_and_ap(tmp_path):
    """The same data and detector through both orders: the reader, anchors, coder, loss, NMS
    and AP of an 'lwh' run give exactly the 'hwl' numbers (boxes with columns 3 and 5 swapped)."""
    data = write_simple_split(tmp_path / "test", num_cavs=2,
                              timestamps=("000000", "000002", "000004"))
    cheap_nms = "postprocess.pre_nms_max=64"             # keeps the rotated-IoU NMS cheap
    cfg_hwl = smoke_config(data, [cheap_nms])
    cfg_lwh = smoke_config(data, ["postprocess.order=lwh", cheap_nms])
    torch.manual_seed(0)
    model_hwl = init_weights(build_model(cfg_hwl["model"]), cls_prior=0.1)
    with torch.no_grad():                                # scores peak where the points are
        model_hwl.head.cls_conv.weight.abs_()
    model_lwh = lwh_head_from(model_hwl, cfg_lwh)
    criterion = build_loss(cfg_hwl["loss"])
    results = {}
    for order, cfg, model in (("hwl", cfg_hwl, model_hwl), ("lwh", cfg_lwh, model_lwh)):
        preparer = BatchPreparer.from_config(cfg, CPU, training=False)
        dataset = build_dataset(cfg, "test", train=False, strategy=choose_strategy(cfg))
        inputs, targets = preparer(collate_samples([dataset[0], dataset[1]]))
        model.train()
        terms = criterion(model(inputs), targets)[1]
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collate_samples)
        boxes = {}
        metrics = run_inference(model, loader, preparer, CPU, choose_strategy(cfg),
                                on_sample=lambda key, b, r, det, s: boxes.update({key: det})
                                )["accumulator"].compute()
        results[order] = (dataset[0]["gt_boxes"], terms, boxes, metrics)
    (gt_hwl, terms_hwl, boxes_hwl, ap_hwl), (gt_lwh, terms_lwh, boxes_lwh, ap_lwh) = \
        results["hwl"], results["lwh"]
    assert torch.equal(torch.as_tensor(gt_lwh), torch.as_tensor(gt_hwl)[:, HWL_TO_LWH])
    for name, value in terms_hwl.items():     # the same terms, summed in another column order
        torch.testing.assert_close(terms_lwh[name], value, rtol=1e-6, atol=0)
    assert boxes_hwl.keys() == boxes_lwh.keys() and sum(map(len, boxes_hwl.values())) > 0
    for key, boxes in boxes_hwl.items():
        assert torch.equal(boxes_lwh[key], boxes[:, HWL_TO_LWH])
    assert ap_hwl["ap_30"] > 0
    for key in ("ap_30", "ap_50", "ap_70", "num_det", "num_gt"):
        assert ap_lwh[key] == ap_hwl[key], key


# ------------------------------------------------------------------------ max_voxel caps


def pillars_per_agent(inputs: dict, agents: int) -> list:
    return torch.bincount(inputs["voxel_coords"][:, 0], minlength=agents).tolist()


def test_max_voxel_caps_pillars_per_agent_by_mode():
    cfg = smoke_config()
    batch = fake_collated_batch(cfg["preprocess"], batch_size=1, agents_per_sample=3,
                                pillars_per_agent=300,
                                points_per_pillar=2, seed=0)
    uncapped = BatchPreparer.from_config(cfg, CPU).model_inputs(batch)
    occupied = pillars_per_agent(uncapped, 3)
    assert min(occupied) > 250
    cfg = replaced(cfg, {"preprocess.args.max_voxel_train": 100,
                         "preprocess.args.max_voxel_test": 200})
    train = BatchPreparer.from_config(cfg, CPU, training=True).model_inputs(batch)
    test = BatchPreparer.from_config(cfg, CPU, training=False).model_inputs(batch)
    assert pillars_per_agent(train, 3) == [100] * 3
    assert pillars_per_agent(test, 3) == [200] * 3
    # The kept pillars are each agent's first in key order, with all their points.
    first = torch.cat([torch.nonzero(uncapped["voxel_coords"][:, 0] == agent).squeeze(1)[:100]
                       for agent in range(3)])
    for key in ("voxel_coords", "voxel_num_points", "voxel_features"):
        assert torch.equal(train[key], uncapped[key][first]), key


def test_max_voxel_cap_not_hit_changes_nothing():
    cfg = smoke_config()
    batch = fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=2,
                                pillars_per_agent=300,
                                points_per_pillar=3, seed=1)
    uncapped = BatchPreparer.from_config(cfg, CPU).model_inputs(batch)
    cfg = replaced(cfg, {"preprocess.args.max_voxel_train": 2048,       # the whole grid
                         "preprocess.args.max_voxel_test": 2048})
    capped = BatchPreparer.from_config(cfg, CPU).model_inputs(batch)
    for key in ("voxel_coords", "voxel_num_points", "voxel_features"):
        assert torch.equal(capped[key], uncapped[key]), key
    assert math.prod(uncapped["voxel_coords"].shape) > 0
