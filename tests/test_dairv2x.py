"""DAIR-V2X-C: calib chains, the system error offset, world 8-corner labels, bad input, and the
synthetic world written in the format and read back (round trip)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from opencood.data.check import check_folder
from opencood.data.dairv2x import DairFormatError, DairV2XSplit
from opencood.data.datasets import IntermediateFusionDataset, LateFusionDataset
from opencood.data.opv2v import vehicles_to_boxes
from opencood.data.pcd import read_pcd, write_pcd
from opencood.data.synthetic import generate_dataset, get_preset
from opencood.data.synthetic.writer import SPLITS, scan_frames
from opencood.data.synthetic.writer_dairv2x import WORLD_ORIGIN, adapt_preset, virtual_lidar
from opencood.data.wild import WildSetting
from opencood.ops.transforms import pose_to_matrix
from opencood.strategies import choose_strategy
from test_v2v4real import _match_boxes

BIG_RANGE = [-1000.0, -1000.0, -100.0, 1000.0, 1000.0, 100.0]
SPLIT_FILE = {"train": "train.json", "validate": "val.json", "test": "test.json"}


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))


# ------------------------------------------------------------------------ a hand-made root

def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def _cloud(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_pcd(path, np.asarray(rows, dtype=np.float32), intensity_field="intensity",
              data="binary")


@pytest.fixture()
def hand_root(tmp_path) -> Path:
    """Vehicle frame 000007 paired with roadside frame 000042.

    Vehicle: lidar -> novatel turns 90 deg about z and lifts by (1, 0, 2); novatel -> world
    moves by (100, 200, 0): lidar -> world = turn 90 deg, then (101, 200, 2).
    Roadside: virtuallidar -> world at (110, 198, 5), no turn, plus the offset (0.5, -1.5).
    One label: a box centred at world (103, 201, 1.5), 4 m long along world +y, 2 m wide,
    1.5 m high, written as DAIR's 8 world corners; one traffic cone (not a vehicle).
    """
    root = tmp_path / "cooperative-vehicle-infrastructure"
    turn = [[0, -1, 0], [1, 0, 0], [0, 0, 1]]
    _write(root / "vehicle-side/calib/lidar_to_novatel/000007.json",
           {"transform": {"rotation": turn, "translation": [[1], [0], [2]]}})
    _write(root / "vehicle-side/calib/novatel_to_world/000007.json",
           {"rotation": np.eye(3).tolist(), "translation": [[100], [200], [0]]})
    _write(root / "infrastructure-side/calib/virtuallidar_to_world/000042.json",
           {"rotation": np.eye(3).tolist(), "translation": [[110], [198], [5]]})
    bottom, top = 0.75, 2.25
    corners = [[102, 203, bottom], [104, 203, bottom], [104, 199, bottom], [102, 199, bottom],
               [102, 203, top], [104, 203, top], [104, 199, top], [102, 199, top]]
    _write(root / "cooperative/label_world/000007.json",
           [{"type": "TrafficCone", "world_8_points": corners},
            {"type": "Van", "world_8_points": corners}])
    _cloud(root / "vehicle-side/velodyne/000007.pcd",
           [[5, 0, 0, 128], [float("nan"), 1, 1, 1], [9, 1, 0.5, 64]])
    _cloud(root / "infrastructure-side/velodyne/000042.pcd", [[3, 3, -4, 255]])
    _write(root / "cooperative/data_info.json", [{
        "vehicle_pointcloud_path": "vehicle-side/velodyne/000007.pcd",
        "infrastructure_pointcloud_path": "infrastructure-side/velodyne/000042.pcd",
        "cooperative_label_path": "cooperative/label_world/000007.json",
        "system_error_offset": {"delta_x": 0.5, "delta_y": -1.5}}])
    _write(root / "train.json", ["000007"])
    return root


def test_pose_chain_offset_and_8_corner_box_as_computed_by_hand(hand_root):
    split = DairV2XSplit(hand_root / "train.json")
    sample = split.load_sample(0, gt_range=BIG_RANGE)
    vehicle, roadside = sample["cavs"]["0"], sample["cavs"]["-1"]
    np.testing.assert_allclose(vehicle["lidar_pose"], [[0, -1, 0, 101], [1, 0, 0, 200],
                                                       [0, 0, 1, 2], [0, 0, 0, 1]], atol=1e-12)
    np.testing.assert_allclose(roadside["lidar_pose"][:3, 3], [110.5, 196.5, 5.0], atol=1e-12)
    # Roadside -> ego: world - (101, 200, 2), then turned by -90 deg: (x, y) -> (y, -x).
    np.testing.assert_allclose(roadside["T_to_ego"], [[0, 1, 0, -3.5], [-1, 0, 0, -9.5],
                                                      [0, 0, 1, 3], [0, 0, 0, 1]], atol=1e-12)
    # The van: world centre (103, 201, 1.5) -> ego (1, -2, -0.5); its front (DAIR's corners 0
    # and 1, +l/2) is the world +y side, which is the ego's +x (the ego faces +y): yaw 0.
    assert sample["gt_ids"].tolist() == [1]                 # position in the file; cone left out
    np.testing.assert_allclose(sample["gt_boxes"][0], [1.0, -2.0, -0.5, 1.5, 2.0, 4.0, 0.0],
                               atol=1e-9)
    # Intensity / 256 and the NaN row dropped (HEAL's read_pcd).
    np.testing.assert_allclose(vehicle["points"], [[5, 0, 0, 0.5], [9, 1, 0.5, 0.25]])
    assert split.label_set == "original"


def _no_index_written(tmp_path) -> bool:
    return not list((tmp_path / "cache").glob("dairv2x_index/*"))


@pytest.mark.parametrize("breakage, culprit, problem", [
    ("missing_calib", "vehicle-side/calib/novatel_to_world/000007.json", "file not found"),
    ("bad_label", "cooperative/label_world/000007.json", "invalid json at line 1"),
    ("no_pair", "cooperative/data_info.json", "no pair for vehicle frame 000007"),
    ("bad_calib", "infrastructure-side/calib/virtuallidar_to_world/000042.json",
     "'rotation' must hold 9"),
    ("bad_split", "train.json", "expected a json list"),
])
def test_bad_input_is_one_line_naming_the_file_and_writes_nothing(hand_root, tmp_path,
                                                                   breakage, culprit, problem):
    path = hand_root / culprit
    if breakage == "missing_calib":
        path.unlink()
    elif breakage == "bad_label":
        path.write_text('[{"type": "Car", "world_8_points": [[1, 2')
    elif breakage == "no_pair":
        _write(path, [])
    elif breakage == "bad_calib":
        _write(path, {"rotation": [[1, 0], [0, 1]], "translation": [[0], [0], [0]]})
    else:
        _write(path, {"train": ["000007"]})
    with pytest.raises(DairFormatError) as error:
        DairV2XSplit(hand_root / "train.json")
    message = str(error.value)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message
    assert _no_index_written(tmp_path)


def test_parsed_split_is_cached_and_a_changed_file_is_read_again(hand_root, tmp_path):
    first = DairV2XSplit(hand_root / "train.json")
    assert list((tmp_path / "cache").glob("dairv2x_index/*.json"))
    offset_file = hand_root / "cooperative/data_info.json"
    pairs = json.loads(offset_file.read_text())
    pairs[0]["system_error_offset"] = {"delta_x": 1.0, "delta_y": 0.0}
    _write(offset_file, pairs)
    again = DairV2XSplit(hand_root / "train.json")
    shift = again.load_cav_frame("", "-1", "000007")["lidar_pose"][:3, 3] \
        - first.load_cav_frame("", "-1", "000007")["lidar_pose"][:3, 3]
    np.testing.assert_allclose(shift, [0.5, 1.5, 0.0], atol=1e-12)


# ---------------------------------------------------------------------- synthetic, round trip

@pytest.fixture(scope="module")
def dair_root(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn_dair")
    generate_dataset(out, preset="tiny", seed=0, progress=False, data_format="dairv2x")
    return out / "cooperative-vehicle-infrastructure"


def test_round_trip_poses_boxes_and_points(dair_root):
    preset = adapt_preset(get_preset("tiny"))
    compared = 0
    for split in SPLITS:
        reader = DairV2XSplit(dair_root / SPLIT_FILE[split])
        assert reader.label_set == "complemented (CoAlign)" and len(reader) == preset.frames
        # the split file is not in time order: frame k is the sequence's k-th in time
        (sequence,) = reader.scenarios
        index_of = {reader.info(i).timestamp: i for i in range(len(reader))}
        for frame_index, (world, frame, scans) in enumerate(scan_frames(preset, 0, split, 0)):
            index = index_of[reader.timestamps(sequence)[frame_index]]
            sample = reader.load_sample(index, gt_range=BIG_RANGE)
            agents = {"0": world.cav_ids[0], "-1": world.rsu_ids[0]}
            assert sample["info"].cav_ids == ["0", "-1"]
            for agent, world_id in agents.items():
                points, pose = scans[world_id][0], world.lidar_poses[world_id][frame]
                if agent == "-1":
                    points, pose = virtual_lidar(points, pose)
                truth = pose_to_matrix(pose)
                truth[:3, 3] += WORLD_ORIGIN
                np.testing.assert_allclose(sample["cavs"][agent]["lidar_pose"], truth,
                                           atol=1e-6)       # the offset taken back out
                np.testing.assert_allclose(sample["cavs"][agent]["points"], points, atol=1e-6)
            seen = {}
            for _, visible in scans.values():
                seen.update(visible)
            _, expected = vehicles_to_boxes(seen, world.lidar_poses[world.cav_ids[0]][frame],
                                            BIG_RANGE)
            assert _match_boxes(sample["gt_boxes"], expected) < 1e-4
            compared += len(expected)
    assert compared > 30


def test_fusion_datasets_read_it_with_noise_latency_and_per_agent_gt(dair_root):
    common = dict(lidar_range=[-51.2, -25.6, -3.0, 51.2, 25.6, 1.0],
                  gt_range=[-51.2, -25.6, -4.0, 51.2, 25.6, 2.0], dataset="dairv2x",
                  com_range=100.0, max_cav=2)
    wild = WildSetting(loc_err=True, xyz_std=0.2, yaw_std=0.2, latency_frames=1)
    # sample 0: the latest frame (the split file lists it first), so one before it exists
    sample = IntermediateFusionDataset(dair_root / "test.json", wild=wild, **common)[0]
    assert sample["agent_ids"] == ["0", "-1"] and sample["agent_types"].tolist() == [0, 1]
    assert sample["agent_latency"].tolist() == [0, 1] and len(sample["gt_boxes"]) > 0
    late = LateFusionDataset(dair_root / "train.json", train=True, **common)
    own = late[1]                                  # the roadside unit's labels, its own frame
    whole = late.split.load_sample(0, gt_range=common["gt_range"])
    to_ego = whole["cavs"]["-1"]["T_to_ego"]
    shared = [i for i, box_id in enumerate(own["gt_ids"]) if box_id in whole["gt_ids"]]
    assert len(shared) > 3
    for i in shared:
        row = whole["gt_boxes"][whole["gt_ids"].tolist().index(own["gt_ids"][i])]
        np.testing.assert_allclose(to_ego[:3, :3] @ own["gt_boxes"][i, :3] + to_ego[:3, 3],
                                   row[:3], atol=1e-6)


def test_check_data_reads_dairv2x_and_names_a_bad_file(dair_root, tmp_path):
    report = check_folder(dair_root, progress=False, dataset="dairv2x")
    assert report.problems == [] and report.frames == 9 and report.points > 10_000
    copy = tmp_path / "root"
    shutil.copytree(dair_root, copy)
    bad_label = copy / "cooperative/label_world/100001.json"
    bad_label.write_text("[{")
    bad_cloud = copy / "infrastructure-side/velodyne/501002.pcd"
    bad_cloud.write_bytes(bad_cloud.read_bytes()[:-7])
    report = check_folder(copy, progress=False, dataset="dairv2x")
    assert len(report.problems) == 2
    assert report.problems[0].startswith(f"{bad_label}: invalid json")
    assert report.problems[1].startswith(f"{bad_cloud}: ")
    assert read_pcd(dair_root / "infrastructure-side/velodyne/501002.pcd").shape[1] == 4


def test_bench_loader_figure_takes_a_dair_root_or_split(dair_root):
    from tool_modules import load_tool
    bench = load_tool("bench")
    assert bench.resolve_split_dir(str(dair_root)) == dair_root / "train.json"
    assert bench.resolve_split_dir(str(dair_root / "val.json")) == dair_root / "val.json"


# ------------------------------------------------------- HEAL's single-side GT (issue 41)

def _side_label(kind, xyz, hwl, yaw):
    return {"type": kind, "3d_location": dict(zip("xyz", xyz)),
            "3d_dimensions": dict(zip("hwl", hwl)), "rotation": yaw}


@pytest.fixture()
def sides_root(hand_root) -> Path:
    """hand_root with each side's own labels. Vehicle lidar -> world: turn 90 deg, then
    (101, 200, 2); roadside -> world: (110.5, 196.5, 5) (offset included), no turn.

    Vehicle side (its lidar frame): a Car at (1, -2) yaw 0; a zero-size label (skipped, takes no
    position); a Pedestrian (position 1, not a vehicle); a Van at (10, 0) yaw 90 deg (position 2).
    Roadside (its frame), in the vehicle's frame: the Car again 0.2 m off in y (BEV IoU 0.82 with
    the vehicle's: dropped); a Car at (-3.5, 10.5) yaw -90 deg (no overlap: added); Cars at
    (10, 3.65) and (10, -3.55) yaw 90 deg, overlapping the Van by 0.35 x 2 m (IoU 0.7 / 15.3 =
    0.046 <= 0.05: added) and 0.45 x 2 m (IoU 0.9 / 15.1 = 0.060: dropped)."""
    size = [1.5, 2.0, 4.0]
    _write(hand_root / "vehicle-side/label/lidar/000007.json", [
        _side_label("Car", [1, -2, -0.5], size, 0.0),
        _side_label("Car", [3, 3, -0.5], [1.5, 2.0, 0.0], 0.0),
        _side_label("Pedestrian", [5, 5, -0.5], [1.7, 0.6, 0.6], 0.0),
        _side_label("Van", [10, 0, -0.5], size, np.pi / 2)])
    _write(hand_root / "infrastructure-side/label/virtuallidar/000042.json", [
        _side_label("Car", [-7.3, 4.5, -3.5], size, np.pi / 2),
        _side_label("Car", [-20, 0, -3.5], size, 0.0),
        _side_label("Bus", [-13.15, 13.5, -3.5], size, np.pi),
        _side_label("Car", [-5.95, 13.5, -3.5], size, np.pi)])
    return hand_root


def _same_boxes(got, expected):
    got, expected = np.asarray(got), np.asarray(expected, dtype=np.float64)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got[:, :6], expected[:, :6], atol=1e-9)
    gap = np.abs((got[:, 6] - expected[:, 6] + np.pi) % (2 * np.pi) - np.pi)
    assert gap.max() < 1e-9


def test_single_side_gt_merges_the_sides_by_bev_iou_as_computed_by_hand(sides_root):
    reader = DairV2XSplit(sides_root / "train.json", gt_source="single_side")
    ids, boxes = reader.sample_gt(0, BIG_RANGE)
    assert ids.tolist() == [0, 1, 2, 3]
    _same_boxes(boxes, [[1, -2, -0.5, 1.5, 2, 4, 0], [10, 0, -0.5, 1.5, 2, 4, np.pi / 2],
                        [-3.5, 10.5, -0.5, 1.5, 2, 4, -np.pi / 2],
                        [10, 3.65, -0.5, 1.5, 2, 4, np.pi / 2]])
    # late fusion's per-agent GT: each side's own labels in its own frame, HEAL's positions
    ids, boxes = reader.frame_boxes("frame_000007", "0", "000007", BIG_RANGE)
    assert ids.tolist() == [0, 2]
    ids, boxes = reader.frame_boxes("frame_000007", "-1", "000007", BIG_RANGE)
    assert ids.tolist() == [0, 1, 2, 3]
    _same_boxes(boxes[1:2], [[-20, 0, -3.5, 1.5, 2, 4, 0]])
    # the roadside unit beyond comm_range: the vehicle's labels alone
    alone = DairV2XSplit(sides_root / "train.json", gt_source="single_side", com_range=5.0)
    assert alone.sample_gt(0, BIG_RANGE)[0].tolist() == [0, 1]
    # a range keeping boxes with all 8 corners only, cut at y = 1.9: the Van (y -2..2) is out,
    # so the roadside Car it overlapped (y -5.55..-1.55) is merged in (range first, as HEAL)
    cut = [-50.0, -50.0, -10.0, 50.0, 1.9, 10.0]
    ids, boxes = reader.sample_gt(0, cut)
    assert ids.tolist() == [0, 1]
    _same_boxes(boxes, [[1, -2, -0.5, 1.5, 2, 4, 0], [10, -3.55, -0.5, 1.5, 2, 4, np.pi / 2]])
    # the cooperative source of the same pair (index cache of its own) is the one Van
    coop = DairV2XSplit(sides_root / "train.json")
    assert coop.sample_gt(0, BIG_RANGE)[0].tolist() == [1]
    assert reader.sample_gt(0, BIG_RANGE)[0].tolist() == [0, 1, 2, 3]


def test_the_gt_source_comes_from_the_config_and_the_dairv2x_preset_uses_heal_s(sides_root):
    from opencood.config import load_config
    from opencood.data.datasets import build_dataset
    config = Path(__file__).resolve().parents[1] / "hypes_yaml/dairv2x/base.yaml"
    cfg = load_config(config, [f"root_dir={sides_root / 'train.json'}"])
    assert cfg["fusion"]["gt_source"] == "single_side"
    dataset = build_dataset(cfg, "train", train=False,
                            strategy=choose_strategy(cfg, "intermediate"))
    assert dataset.split.gt_source == "single_side" and len(dataset.split.sample_gt(
        0, BIG_RANGE)[0]) == 4
    cfg = load_config(config, [f"root_dir={sides_root / 'train.json'}",
                               "fusion.gt_source=cooperative"])
    dataset = build_dataset(cfg, "train", train=False,
                            strategy=choose_strategy(cfg, "intermediate"))
    assert dataset.split.sample_gt(0, BIG_RANGE)[0].tolist() == [1]


def test_a_bad_single_side_label_is_one_line_naming_the_file(sides_root):
    path = sides_root / "infrastructure-side/label/virtuallidar/000042.json"
    path.write_text(json.dumps([{"type": "Car", "3d_location": {"x": 1, "y": 2},
                                 "3d_dimensions": {"h": 1, "w": 1, "l": 1}, "rotation": 0}]))
    with pytest.raises(DairFormatError, match=f"^{path}: label 0 has no 'z'$"):
        DairV2XSplit(sides_root / "train.json", gt_source="single_side")


# ------------------------------------------------------------ the split file's order (issue 41)

def test_samples_follow_the_split_file_and_latency_the_time_order(dair_root, tmp_path):
    """A split mixing two sequences (train's 0000 and test's 0002), neither in time order."""
    train = json.loads((dair_root / "train.json").read_text())
    test = json.loads((dair_root / "test.json").read_text())
    order = [train[1], test[0], train[2], test[2], train[0], test[1]]
    (dair_root / "mixed.json").write_text(json.dumps(order))
    reader = DairV2XSplit(dair_root / "mixed.json")
    assert [reader.info(i).timestamp for i in range(len(reader))] == order
    assert [reader.info(i).scenario for i in range(len(reader))] == ["0000", "0002"] * 3
    assert reader.timestamps("0000") == sorted(train) and reader.timestamps("0002") == sorted(test)
    # latency 1: the roadside unit sends the frame before in time of the same sequence
    dataset = IntermediateFusionDataset(dair_root / "mixed.json", dataset="dairv2x",
                                        wild=WildSetting(latency_frames=1))
    _, agents = dataset._agents(order.index(sorted(train)[1]))
    assert agents[1]["frame"][2] == sorted(train)[0] and agents[1]["latency"] == 1
    (dair_root / "mixed.json").unlink()


def test_synthetic_split_files_are_not_sorted(dair_root):
    for name in SPLIT_FILE.values():
        listed = json.loads((dair_root / name).read_text())
        assert listed != sorted(listed) and len(set(listed)) == len(listed) == 3
