"""V2X-Real (``fusion.dataset: v2xreal``, opencood.data.v2xreal): our reader against V2X-Real's
own data set code sample by sample in its four collaboration modes (the data set's GT, and the
evaluation's GT through ``--protocol v2xreal``), the meta-class rules, the datasets'
``gt_classes``, a training step of the smoke config, the synthetic writer and the one-line
errors.

The fixture (tests/fixtures/v2xreal/v2xreal.npz) holds what V2X-Real's
``IntermediateFusionDataset``, built from its own point_pillar_intermediate_fusion.yaml as its
inference builds it (``train=False``), reads on the synthetic folders (seed 0) in modes
vc, ic, v2v and i2i; made by tools/reference/v2xreal_dataset.py in a side environment. We
regenerate the same folders and read them with ours set as that yaml sets it. The folders are
``tiny_multiclass``'s (pedestrians and cyclists too): a change to the synthetic world's road users
changes them, and the fixture is then remade with the script (its docstring has the commands).
"""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from opencood.config import load_config
from opencood.data.collate import collate_samples
from opencood.data.datasets import IntermediateFusionDataset, LateFusionDataset
from opencood.data.formats import open_split
from opencood.data.opv2v import OPV2VFormatError, OPV2VSplit
from opencood.data.synthetic import generate_dataset
from opencood.data.synthetic.world import OBJECT_CLASSES
from opencood.data.v2xreal import META_CLASSES, check_classes, meta_class, mode_agents
from opencood.engine.task import DetectionTask
from opencood.errors import ConfigError
from opencood.eval.ap import boxes_inside_bev_range
from opencood.eval.protocols import PROTOCOLS
from opencood.models import build_model
from opencood.ops.transforms import relative_transform
from tests.reference_fixtures import load_npz_fixture

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "v2xreal" / "v2xreal.npz"
REPO = Path(__file__).resolve().parents[1]
CENTRE_TOL = SIZE_TOL = 1e-4        # m
YAW_TOL = 1e-5                      # rad
TRANSFORM_TOL = 1e-8

pytestmark = pytest.mark.usefixtures("private_point_cache")


@pytest.fixture(scope="module")
def fixture():
    return load_npz_fixture(FIXTURE)


@pytest.fixture(scope="module")
def root(tmp_path_factory, fixture):
    """The synthetic folders the fixture was made from (generation is deterministic)."""
    _, meta = fixture
    out = tmp_path_factory.mktemp("v2xreal")
    generate_dataset(out, preset=meta["preset"], seed=meta["seed"], progress=False,
                     data_format="v2xreal")
    return out


def _reader(split_dir, mode, meta, **options):
    options = {"use_point_cache": False, "index_cache": False, **options}
    return open_split("v2xreal", split_dir, com_range=meta["comm_range"],
                      max_cav=meta["max_cav"], mode=mode, crop_range=meta["crop_range"],
                      classes=tuple(meta["classes"]), **options)


def _yaw_gap(a, b):
    return abs((a - b + math.pi) % (2 * math.pi) - math.pi)


def test_our_reader_reads_what_v2xreal_reads_in_every_mode(root, fixture):
    ref, meta = fixture
    position = 0
    compared = {"boxes": 0, "agents": 0, "evaluated": 0}
    for mode in ("vc", "ic", "v2v", "i2i"):
        for split in ("train", "validate", "test"):
            reader = _reader(root / split, mode, meta)
            for index in range(len(reader)):
                n = position
                position += 1
                info = reader.info(index)
                where = f"{mode} {split} {info.scenario}/{info.timestamp}"
                assert (ref["sample_mode"][n], ref["sample_split"][n], ref["sample_key"][n]) \
                    == (mode, split, f"{info.scenario}/{info.timestamp}"), where
                lo, hi = ref["agent_start"][n], ref["agent_start"][n + 1]
                assert [int(a) for a in info.cav_ids] == ref["agent_ids"][lo:hi].tolist(), where
                ego_pose = reader.lidar_pose(info.scenario, info.ego_id, info.timestamp)
                for cav_id, count, sums, to_ego in zip(
                        info.cav_ids, ref["agent_points"][lo:hi], ref["agent_sums"][lo:hi],
                        ref["agent_to_ego"][lo:hi]):
                    points = reader.load_cav_frame(info.scenario, cav_id, info.timestamp)["points"]
                    assert len(points) == count, (where, cav_id)
                    np.testing.assert_allclose(points.astype(np.float64).sum(axis=0), sums,
                                               rtol=1e-6, atol=1e-3)
                    np.testing.assert_allclose(
                        relative_transform(reader.lidar_pose(info.scenario, cav_id,
                                                             info.timestamp), ego_pose),
                        to_ego, atol=TRANSFORM_TOL, err_msg=f"{where} {cav_id}")
                    compared["agents"] += 1
                ids, boxes = reader.sample_gt(index, meta["gt_range"], meta["order"])
                classes = reader.object_classes(info.scenario, info.timestamp, ids)
                lo, hi = ref["box_start"][n], ref["box_start"][n + 1]
                assert sorted(ids.tolist()) == sorted(ref["box_ids"][lo:hi].tolist()), where
                ours = {i: (box, c) for i, box, c in zip(ids.tolist(), boxes, classes.tolist())}
                for box_id, ref_box, ref_class in zip(ref["box_ids"][lo:hi], ref["boxes"][lo:hi],
                                                      ref["box_classes"][lo:hi]):
                    box, class_id = ours[int(box_id)]
                    assert np.abs(box[:3] - ref_box[:3]).max() < CENTRE_TOL, (where, box_id)
                    assert np.abs(box[3:6] - ref_box[3:6]).max() < SIZE_TOL, (where, box_id)
                    assert _yaw_gap(box[6], ref_box[6]) < YAW_TOL, (where, box_id)
                    # V2X-Real's ids count from 1 in SUPER_CLASS_MAP's order, ours from 0
                    assert class_id + 1 == ref_class, (where, box_id)
                    compared["boxes"] += 1
                # the evaluation's GT: ours through --protocol v2xreal's GT filter
                inside = boxes_inside_bev_range(boxes, PROTOCOLS["v2xreal"].box_range,
                                                meta["order"])
                lo, hi = ref["eval_start"][n], ref["eval_start"][n + 1]
                assert sorted(zip(ids[inside].tolist(), (classes[inside] + 1).tolist())) == \
                    sorted(zip(ref["eval_ids"][lo:hi].tolist(),
                               ref["eval_classes"][lo:hi].tolist())), where
                compared["evaluated"] += hi - lo
    assert position == len(ref["sample_key"]) == 36
    assert compared == {"boxes": len(ref["box_ids"]), "agents": len(ref["agent_ids"]),
                        "evaluated": len(ref["eval_ids"])} and compared["boxes"] > 1000
    # the evaluation's filter (8 corners) drops some of the data set's GT (2 corners)
    assert 0 < len(ref["eval_ids"]) < len(ref["box_ids"])
    # every meta-class is compared (pedestrians and cyclists are class 2)
    assert set(ref["box_classes"].tolist()) == {1, 2, 3}


def test_meta_classes_follow_the_reference_map_and_its_lower_case_rule():
    assert META_CLASSES == ("vehicle", "pedestrian", "truck")
    assert [meta_class(name) for name in ("Car", "Van", "Truck", "Pedestrian", "BicycleRider",
                                          "Vehicle", "Bicycle", "car", "TrafficCone")] == \
        ["vehicle", "truck", "truck", "pedestrian", "pedestrian", "vehicle", None, None, None]
    # every kind the synthetic world writes has a meta-class
    assert all(meta_class(names.v2xreal) for names in OBJECT_CLASSES.values())


def test_modes_choose_the_ego_and_the_agents():
    folders = ["2", "-2", "1", "-1"]
    assert mode_agents(folders, "vc") == ["1", "2", "-1", "-2"]
    assert mode_agents(folders, "ic") == ["-1", "-2", "1", "2"]
    assert mode_agents(folders, "v2v") == ["1", "2"]
    assert mode_agents(folders, "i2i") == ["-1", "-2"]
    with pytest.raises(ConfigError, match="dataset_mode 'x2x': expected one of vc, ic, v2v, i2i"):
        mode_agents(folders, "x2x")
    with pytest.raises(ConfigError, match="'bus' not a V2X-Real meta-class"):
        check_classes(("vehicle", "bus"))


def test_labels_and_bins_are_what_the_world_scanned(root):
    scenario = next((root / "test").iterdir())
    assert sorted(p.name for p in scenario.iterdir()) == ["-1", "-2", "1", "2"]
    kinds = set()
    for agent in scenario.iterdir():
        params = yaml.safe_load((agent / "000000.yaml").read_text())
        assert len(params["lidar_pose"]) == 6 and (params["ego_speed"] == 0.0) == \
            agent.name.startswith("-")
        kinds |= {v["obj_type"] for v in params["vehicles"].values()}
        raw = np.fromfile(agent / "000000.bin", dtype=np.float32)
        assert raw.size % 4 == 0 and raw.size > 0
    assert kinds == {names.v2xreal for names in OBJECT_CLASSES.values()}


def test_evaluation_day_rule_and_file_errors(root, tmp_path, fixture):
    _, meta = fixture
    split = tmp_path / "test"
    shutil.copytree(root / "test", split)
    scenario_name = next(split.iterdir()).name
    (split / scenario_name).rename(split / "2023-04-07-10-00-00_1_0")
    # V2X-Real's test set drops that day outside v2v; training keeps it
    with pytest.raises(OPV2VFormatError, match="no scenario has an agent of mode 'vc'"):
        _reader(split, "vc", meta)
    assert len(_reader(split, "vc", meta, train=True)) == 3
    assert len(_reader(split, "v2v", meta)) == 3
    # the index cache keeps one index per mode (each holds its own agents' frames)
    for mode, agents in (("vc", ["1", "2", "-1"]), ("i2i", ["-1"]), ("vc", ["1", "2", "-1"])):
        cached = _reader(split, mode, meta, train=True, index_cache=True,
                         cache_dir=tmp_path / "cache")
        fresh = _reader(split, mode, meta, train=True)
        assert cached.info(0).cav_ids == fresh.info(0).cav_ids == agents
        np.testing.assert_array_equal(cached.sample_gt(0, meta["gt_range"])[1],
                                      fresh.sample_gt(0, meta["gt_range"])[1])
    assert sorted(p.name for p in (tmp_path / "cache").glob("v2xreal*")) == \
        ["v2xreal_i2i_index", "v2xreal_vc_index"]
    scenario = split / "2023-04-07-10-00-00_1_0"
    (scenario / "-1" / "000001.bin").unlink()
    assert len(_reader(split, "v2v", meta)) == 3      # v2v never opens the roadside units
    with pytest.raises(OPV2VFormatError, match=r"-1: missing 000001\.bin$"):
        _reader(split, "vc", meta, train=True)
    (scenario / "2" / "000002.yaml").unlink()
    with pytest.raises(OPV2VFormatError, match=r"2: missing 000002\.yaml \(labels and "
                                               r"calibration\)$"):
        _reader(split, "v2v", meta)
    shutil.copy(root / "test" / scenario_name / "2" / "000002.yaml", scenario / "2")
    frame = scenario / "1" / "000000.yaml"
    params = yaml.safe_load(frame.read_text())
    next(iter(params["vehicles"].values()))["obj_type"] = 3
    frame.write_text(yaml.safe_dump(params))
    with pytest.raises(OPV2VFormatError, match=r"000000\.yaml: 'vehicles\.\d+\.obj_type' must "
                                               r"be a class name, got 3"):
        _reader(split, "v2v", meta)


def _config(root, *overrides):
    return load_config(REPO / "hypes_yaml/v2xreal/smoke.yaml",
                       [f"validate_dir={root / 'validate'}", *overrides])


def test_datasets_emit_gt_classes_of_the_config_class_list(root):
    cfg = _config(root)
    dataset = IntermediateFusionDataset.from_config(cfg, root / "validate", train=False)
    sample = dataset[0]
    info = dataset.split.info(0)
    assert sample["gt_classes"].dtype == np.int64
    expected = dataset.split.object_classes(info.scenario, info.timestamp, sample["gt_ids"])
    assert sample["gt_classes"].tolist() == expected.tolist()
    # the classes fit the boxes: pedestrians and cyclists under 2 m long, vans and trucks over
    # 5 m, cars between (hwl: length is column 5)
    lengths = sample["gt_boxes"][:, 5]
    classes = sample["gt_classes"]
    assert set(classes.tolist()) == {0, 1, 2}
    assert lengths[classes == 1].max() < 2.0 < lengths[classes == 0].min()
    assert lengths[classes == 0].max() < 5.0 < lengths[classes == 2].min()
    # late fusion's per-agent training examples carry their own boxes' classes
    late = LateFusionDataset.from_config(cfg, root / "validate", train=False, per_cav=True)
    example = late[1]
    assert len(example["gt_classes"]) == len(example["gt_ids"]) > 0
    # one class: the meta-class vehicle alone, no gt_classes key
    single = IntermediateFusionDataset.from_config(_config(root, "postprocess.classes=null"),
                                                   root / "validate", train=False)
    vehicles = single[0]
    assert "gt_classes" not in vehicles
    assert vehicles["gt_ids"].tolist() == sample["gt_ids"][sample["gt_classes"] == 0].tolist()
    # an unknown class, a mode of another format, an unknown mode
    # OPV2V's labels have no classes: a class list there is refused on the first sample
    assert OPV2VSplit.object_classes(None, "s", "t", [1]) is None
    dataset.split.object_classes = lambda *args: None
    with pytest.raises(ConfigError, match="the v2xreal reader's labels carry no object "
                                          "classes"):
        dataset[0]
    with pytest.raises(ConfigError, match="'van' not a V2X-Real meta-class"):
        IntermediateFusionDataset.from_config(
            _config(root, "postprocess.classes=[{name: van, l: 5, w: 2, h: 2, z: -1}]"),
            root / "validate", train=False)
    with pytest.raises(ConfigError, match="dataset_mode"):
        load_config(REPO / "hypes_yaml/synthetic/smoke.yaml", ["fusion.dataset_mode=ic"])
    with pytest.raises(ConfigError, match="dataset_mode"):
        _config(root, "fusion.dataset_mode=x2x")


def test_the_smoke_config_trains_a_step_on_its_three_classes(root):
    """hypes_yaml/v2xreal/smoke.yaml on the synthetic V2X-Real training split: the batch's
    gt_classes reach the target assignment (every class with GT in the crop has positive
    anchors of its own class) and one step's loss is finite."""
    cfg = _config(root, f"root_dir={root / 'train'}")
    dataset = IntermediateFusionDataset.from_config(cfg, root / "train", train=True)
    batch = collate_samples([dataset[0], dataset[1]])
    task = DetectionTask.from_config(cfg, torch.device("cpu"))
    targets = task.preparer.targets(batch)
    positive_classes = set(targets["class_targets"][targets["labels"] == 1].tolist())
    gt_classes = set(batch["gt_classes"][batch["gt_mask"]].tolist())
    assert positive_classes == gt_classes == {0, 1, 2}
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    loss, terms, samples = task.training_loss(model, batch)
    loss.backward()
    assert samples == 2 and math.isfinite(float(loss.detach())) and terms["cls_loss"] > 0
