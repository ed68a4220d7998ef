"""OPV2V reader: the opv2v_mini fixture against the reference's numbers, plus made-up trees."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import yaml

from opencood.data import opv2v
from opencood.data.opv2v import (
    OPV2VFormatError,
    OPV2VSplit,
    load_frame_yaml,
    remove_own_body_points,
    vehicles_to_boxes,
)
from opencood.data.pcd import PcdError
from opencood.ops.transforms import apply_transform, points_in_range_mask

SPLITS = ("train", "validate", "test")
CROP_RANGE = (-140.8, -40.0, -3.0, 140.8, 40.0, 1.0)
DEFAULT_RANGE = (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0)
SCENARIO = "2021_09_09_13_20_58"


# ------------------------------------------------------------------- fixture vs reference

@pytest.fixture(scope="module")
def expected(fixture_root) -> dict:
    return json.loads((fixture_root / "expected.json").read_text())


@pytest.fixture(scope="module")
def loaded_splits(fixture_root, tmp_path_factory) -> dict:
    """{split: (OPV2VSplit, [load_sample(i) for every i])}, read once for the module."""
    cache_dir = tmp_path_factory.mktemp("opv2v_cache")
    loaded = {}
    for split in SPLITS:
        dataset = OPV2VSplit(fixture_root / split, cache_dir=cache_dir)
        loaded[split] = (dataset, [dataset.load_sample(i) for i in range(len(dataset))])
    return loaded


@pytest.mark.parametrize("split", SPLITS)
def test_fixture_index_ego_and_cavs_in_range(split, loaded_splits, expected):
    dataset, samples = loaded_splits[split]
    assert len(dataset) == len(expected[split]) == 4
    for entry in expected[split]:
        info = samples[entry["index"]]["info"]
        assert (info.scenario, info.ego_id) == (SCENARIO, entry["ego"])
        assert info.cav_ids == entry["cavs_in_range"], f"{split}[{entry['index']}]"
    assert [dataset.info(i).timestamp for i in range(4)] == ["000068", "000070", "000072", "000074"]


@pytest.mark.parametrize("split", SPLITS)
def test_fixture_cav_to_ego_transforms(split, loaded_splits, expected):
    _, samples = loaded_splits[split]
    for entry in expected[split]:
        cavs = samples[entry["index"]]["cavs"]
        assert sorted(cavs) == sorted(entry["transforms"])
        for cav_id, matrix in entry["transforms"].items():
            np.testing.assert_allclose(cavs[cav_id]["T_to_ego"], np.array(matrix), atol=1e-4,
                                       err_msg=f"{split}[{entry['index']}] cav {cav_id}")


@pytest.mark.parametrize("split", SPLITS)
def test_fixture_gt_boxes(split, loaded_splits, expected):
    _, samples = loaded_splits[split]
    for entry in expected[split]:
        sample = samples[entry["index"]]
        where = f"{split}[{entry['index']}]"
        assert sample["gt_ids"].dtype == np.int64 and sample["gt_boxes"].shape[1] == 7
        assert sample["gt_ids"].tolist() == sorted(int(k) for k in entry["boxes"]), where
        for actor_id, box in zip(sample["gt_ids"].tolist(), sample["gt_boxes"]):
            expected_box = np.array(entry["boxes"][str(actor_id)])
            np.testing.assert_allclose(box[:6], expected_box[:6], atol=1e-3,
                                       err_msg=f"{where} actor {actor_id}")
            yaw_error = (box[6] - expected_box[6] + math.pi) % (2 * math.pi) - math.pi
            assert abs(yaw_error) < 1e-3, f"{where} actor {actor_id}: yaw {box[6]}"


@pytest.mark.parametrize("split", SPLITS)
def test_fixture_point_counts(split, loaded_splits, expected):
    _, samples = loaded_splits[split]
    for entry in expected[split]:
        cavs = samples[entry["index"]]["cavs"]
        points_ego = np.concatenate([
            apply_transform(remove_own_body_points(cav["points"]), cav["T_to_ego"])
            for cav in cavs.values()])
        count = int(points_in_range_mask(points_ego, CROP_RANGE).sum())
        assert count == entry["points_in_range"], f"{split}[{entry['index']}]"


def test_fixture_frame_keeps_extra_keys_and_resolves_aliases(fixture_root):
    path = fixture_root / "train" / SCENARIO / "1001" / "000068.yaml"
    params = load_frame_yaml(path)
    # As in OPV2V's files, true_ego_pos is a yaml alias (*id001) of predicted_ego_pos.
    assert "true_ego_pos: *id001" in path.read_text()
    assert params["true_ego_pos"] == params["predicted_ego_pos"] \
        == [10.433013, 5.25, 0.0, 0.0, 30.0, 0.0]
    assert params["lidar_pose"] == [10.0, 5.0, 1.9, 0.3, 30.0, -0.4]
    assert params["plan_trajectory"] == [[13.0311, 6.75, 21.6], [15.6292, 8.25, 21.6]]
    assert params["ego_speed"] == pytest.approx(21.6)
    assert 201 in params["vehicles"]


def test_fixture_index_cache_is_reused_without_parsing_yaml(fixture_root, tmp_path, monkeypatch):
    split_dir = fixture_root / "validate"
    fresh = OPV2VSplit(split_dir, cache_dir=tmp_path, index_cache=True)
    assert list((tmp_path / "opv2v_index").glob("*.json")), "no index cache written"

    def fail_parse(path):
        raise AssertionError(f"yaml parsed again: {path}")

    monkeypatch.setattr(opv2v, "load_frame_yaml", fail_parse)
    cached = OPV2VSplit(split_dir, cache_dir=tmp_path, index_cache=True)
    assert [cached.info(i) for i in range(len(cached))] \
        == [fresh.info(i) for i in range(len(fresh))]
    frame_cached = cached.load_cav_frame(SCENARIO, "1010", "000070")
    frame_fresh = fresh.load_cav_frame(SCENARIO, "1010", "000070")
    assert frame_cached["params"] == frame_fresh["params"]       # int actor ids survive JSON
    assert all(isinstance(k, int) for k in frame_cached["vehicles"])
    with pytest.raises(AssertionError, match="yaml parsed again"):
        OPV2VSplit(split_dir, cache_dir=tmp_path, index_cache=False)


# ------------------------------------------------------------------------ made-up trees


def _write_pcd(path: Path, points: np.ndarray) -> None:
    """ASCII PCD as the reference tools write it: x y z rgb, intensity in the red byte."""
    rgb = np.round(points[:, 3] * 255).astype(np.int64) << 16
    header = ("# .PCD v0.7 - Point Cloud Data file format\nVERSION 0.7\nFIELDS x y z rgb\n"
              "SIZE 4 4 4 4\nTYPE F F F U\nCOUNT 1 1 1 1\n"
              f"WIDTH {len(points)}\nHEIGHT 1\nVIEWPOINT 0 0 0 1 0 0 0\n"
              f"POINTS {len(points)}\nDATA ascii\n")
    rows = "".join(f"{x:.6f} {y:.6f} {z:.6f} {c}\n" for (x, y, z, _), c in zip(points, rgb))
    path.write_text(header + rows)


def _vehicle(x, y, z=0.0, yaw=0.0):
    """A 4 x 2 x 1.5 m car whose box centre is 0.75 m above ``location``."""
    return {"location": [x, y, z], "center": [0.0, 0.0, 0.75], "extent": [2.0, 1.0, 0.75],
            "angle": [0.0, yaw, 0.0], "speed": 0.0}


def _write_frame(cav_dir: Path, timestamp: str, lidar_xy, vehicles=None, extra=None) -> None:
    cav_dir.mkdir(parents=True, exist_ok=True)
    params = {"lidar_pose": [float(lidar_xy[0]), float(lidar_xy[1]), 1.9, 0.0, 0.0, 0.0],
              "vehicles": vehicles if vehicles is not None else {}}
    params.update(extra or {})
    (cav_dir / f"{timestamp}.yaml").write_text(yaml.safe_dump(params))
    _write_pcd(cav_dir / f"{timestamp}.pcd", np.array([[5.0, 1.0, -1.0, 0.5],
                                                       [0.5, 0.2, -1.5, 0.2]]))


def _make_scenario(split_dir: Path, cav_positions: dict, timestamps=("000000", "000002"),
                   name="scene_a") -> Path:
    """One scenario with CAV folders named as ``cav_positions`` keys, lidar at the given x, y."""
    scenario_dir = split_dir / name
    for cav_id, xy in cav_positions.items():
        for timestamp in timestamps:
            _write_frame(scenario_dir / cav_id, timestamp, xy)
    (scenario_dir / "data_protocol.yaml").write_text("protocol: ignored\n")
    return scenario_dir


def _writable_copy(source: Path, target: Path) -> Path:
    """Copy of a (read-only) fixture tree that the test may modify and pytest may delete."""
    shutil.copytree(source, target)
    for path in [target, *target.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def _split(split_dir, tmp_path, **kwargs) -> OPV2VSplit:
    return OPV2VSplit(split_dir, cache_dir=tmp_path / "cache", **kwargs)


def test_index_cache_is_refreshed_when_a_yaml_changes(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = _make_scenario(split_dir, {"1": (0, 0), "2": (5, 0)})
    assert _split(split_dir, tmp_path).info(0).cav_ids == ["1", "2"]
    _write_frame(scenario_dir / "2", "000000", (123.25, 0))     # moves out of com_range
    reindexed = _split(split_dir, tmp_path)
    assert reindexed.info(0).cav_ids == ["1"]
    assert reindexed.load_cav_frame("scene_a", "2", "000000")["lidar_pose"][0] == 123.25


def test_progress_bar_only_for_large_splits(tmp_path, capsys):
    small = tmp_path / "small"
    _make_scenario(small, {"1": (0, 0), "2": (5, 0)})
    _split(small, tmp_path, index_cache=False)
    assert "indexing" not in capsys.readouterr().err
    large = tmp_path / "large"
    _make_scenario(large, {"1": (0, 0), "2": (5, 0)},
                   timestamps=[f"{2 * i:06d}" for i in range(101)])     # 202 frames
    assert len(_split(large, tmp_path, index_cache=False)) == 101
    assert "indexing large" in capsys.readouterr().err


def test_cav_order_string_sort_with_infrastructure_last(tmp_path):
    split_dir = tmp_path / "train"
    _make_scenario(split_dir, {"987": (10, 0), "-1": (0, 10), "1010": (5, 5), "1001": (0, 0)})
    dataset = _split(split_dir, tmp_path)
    assert len(dataset) == 2
    info = dataset.info(0)
    assert info.ego_id == "1001"
    assert info.cav_ids == ["1001", "1010", "987", "-1"]
    assert dataset.timestamps("scene_a") == ["000000", "000002"]


def test_infrastructure_ids_are_the_negative_integers():
    assert [opv2v.is_infrastructure(c) for c in ("-1", "-12", "1", "0", "1001", "-a", "-")] \
        == [True, True, False, False, False, False, False]


def test_rsus_sort_last_and_follow_com_range_like_vehicles(tmp_path):
    split_dir = tmp_path / "train"
    # "-1" is 80 m from the ego (dropped), "-2" 30 m (kept, after every vehicle).
    _make_scenario(split_dir, {"-2": (0, 30), "1001": (0, 0), "-1": (80, 0), "2002": (5, 0)})
    info = _split(split_dir, tmp_path).info(0)
    assert info.ego_id == "1001" and info.cav_ids == ["1001", "2002", "-2"]
    assert _split(split_dir, tmp_path, max_cav=2).info(0).cav_ids == ["1001", "2002"]


def test_scenario_of_rsus_alone_has_no_ego_and_raises_naming_it(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = _make_scenario(split_dir, {"-1": (0, 0), "-2": (5, 0)})
    with pytest.raises(OPV2VFormatError) as error:
        _split(split_dir, tmp_path)
    message = str(error.value)
    assert message.startswith(str(scenario_dir)) and "-1, -2" in message and "ego" in message


def test_scenarios_sorted_and_samples_follow_ego_timestamps(tmp_path):
    split_dir = tmp_path / "train"
    _make_scenario(split_dir, {"1": (0, 0), "2": (3, 0)}, timestamps=("000010", "000004"),
                   name="zeta")
    _make_scenario(split_dir, {"7": (0, 0)}, timestamps=("000001",), name="alpha")
    (split_dir / "notes.txt").write_text("not a scenario")
    dataset = _split(split_dir, tmp_path)
    assert [(dataset.info(i).scenario, dataset.info(i).timestamp) for i in range(len(dataset))] \
        == [("alpha", "000001"), ("zeta", "000004"), ("zeta", "000010")]


def test_com_range_drops_far_cavs_then_max_cav_keeps_the_nearest(tmp_path):
    split_dir = tmp_path / "train"
    # "2" is exactly 70 m away (kept, as the reference keeps distance == com_range), "3" is out.
    _make_scenario(split_dir, {"1": (0, 0), "2": (42, 56), "3": (70.5, 0), "4": (-3, 4),
                               "5": (1, 1)})
    assert _split(split_dir, tmp_path).info(0).cav_ids == ["1", "2", "4", "5"]
    # Range first, then the nearest to the ego ("5" at 1.4 m, "4" at 5 m; not "2" at 70 m,
    # although its folder sorts first), listed in folder order.
    truncated = _split(split_dir, tmp_path, max_cav=3)
    assert truncated.info(0).cav_ids == ["1", "4", "5"]
    assert _split(split_dir, tmp_path, max_cav=2).info(0).cav_ids == ["1", "5"]
    assert _split(split_dir, tmp_path, max_cav=1).info(1).cav_ids == ["1"]
    assert _split(split_dir, tmp_path, com_range=10.0).info(0).cav_ids == ["1", "4", "5"]


def test_missing_split_and_empty_split_raise_naming_the_folder(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(OPV2VFormatError) as error:
        _split(missing, tmp_path)
    assert str(error.value).startswith(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "data_protocol.yaml").write_text("x: 1\n")
    with pytest.raises(OPV2VFormatError) as error:
        _split(empty, tmp_path)
    assert str(error.value).startswith(str(empty))


def test_cav_lacking_a_timestamp_raises_naming_its_folder(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = _make_scenario(split_dir, {"1": (0, 0), "2": (5, 0)})
    (scenario_dir / "2" / "000002.yaml").unlink()
    with pytest.raises(OPV2VFormatError, match="000002.yaml") as error:
        _split(split_dir, tmp_path)
    assert str(error.value).startswith(str(scenario_dir / "2"))


def test_missing_pcd_is_reported_when_indexing(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = _make_scenario(split_dir, {"1": (0, 0), "2": (5, 0)})
    (scenario_dir / "1" / "000000.pcd").unlink()
    with pytest.raises(OPV2VFormatError, match="000000.pcd") as error:
        _split(split_dir, tmp_path)
    assert str(error.value).startswith(str(scenario_dir / "1"))


def test_yaml_without_lidar_pose_raises_naming_the_file(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = _make_scenario(split_dir, {"1": (0, 0), "2": (5, 0)})
    bad_yaml = scenario_dir / "2" / "000002.yaml"
    bad_yaml.write_text(yaml.safe_dump({"vehicles": {}, "ego_speed": 3.0}))
    with pytest.raises(OPV2VFormatError, match="lidar_pose") as error:
        load_frame_yaml(bad_yaml)
    assert str(error.value).startswith(str(bad_yaml))
    with pytest.raises(OPV2VFormatError, match="lidar_pose") as error:
        _split(split_dir, tmp_path)
    assert str(error.value).startswith(str(bad_yaml))


@pytest.mark.parametrize("bad_yaml_text, key", [
    ("lidar_pose: [1, 2, 3, 4, 5]\n", "lidar_pose"),
    ("lidar_pose: [1, 2, 3, 4, 5, north]\n", "lidar_pose"),
    ("lidar_pose: [0, 0, 0, 0, 0, 0]\nvehicles: [1, 2]\n", "vehicles"),
    ("lidar_pose: [0, 0, 0, 0, 0, 0]\nvehicles: {7: {location: [1, 2, 3], angle: [0, 0, 0]}}\n",
     "vehicles.7.extent"),
    ("lidar_pose: [0, 0, 0, 0\n", "invalid yaml"),
])
def test_malformed_yaml_errors_name_file_and_key(tmp_path, bad_yaml_text, key):
    path = tmp_path / "000000.yaml"
    path.write_text(bad_yaml_text)
    with pytest.raises(OPV2VFormatError) as error:
        load_frame_yaml(path)
    assert str(error.value).startswith(str(path)) and key in str(error.value)


def test_yaml_extra_keys_kept_vehicles_optional_and_exponent_floats(tmp_path):
    path = tmp_path / "000000.yaml"
    path.write_text("camera0:\n  cords: [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]\n"
                    "lidar_pose: [1e-05, 2.0, 3, 0.0, 90.0, 0.0]\nmy_key: hello\n")
    params = load_frame_yaml(path)
    assert params["vehicles"] == {}
    assert params["lidar_pose"] == [1e-05, 2.0, 3, 0.0, 90.0, 0.0]
    assert params["camera0"] == {"cords": [1.0, 2.0, 3.0, 0.0, 0.0, 0.0]}
    assert params["my_key"] == "hello"
    path.write_text("lidar_pose: [0, 0, 0, 0, 0, 0]\nvehicles: null\n")
    assert load_frame_yaml(path)["vehicles"] == {}


def test_extra_keys_reach_load_sample_and_params_are_private_copies(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = split_dir / "scene_a"
    for timestamp in ("000000", "000002"):
        _write_frame(scenario_dir / "1", timestamp, (0, 0),
                     extra={"plan_trajectory": [[1.0, 2.0, 3.0]], "custom": {"a": 1}})
    dataset = _split(split_dir, tmp_path)
    params = dataset.load_sample(0)["cavs"]["1"]["params"]
    assert params["plan_trajectory"] == [[1.0, 2.0, 3.0]] and params["custom"] == {"a": 1}
    params["lidar_pose"][0] = 999.0     # e.g. a pose-noise step editing its own copy
    assert dataset.load_cav_frame("scene_a", "1", "000000")["params"]["lidar_pose"][0] == 0.0


@pytest.mark.parametrize("use_point_cache", [True, False])
def test_corrupt_pcd_raises_naming_the_file(fixture_root, tmp_path, use_point_cache):
    split_dir = _writable_copy(fixture_root / "validate", tmp_path / "validate")
    bad_pcd = split_dir / SCENARIO / "1010" / "000070.pcd"
    lines = bad_pcd.read_text().splitlines(keepends=True)
    lines[20] = "1.0 2.0 oops\n"                  # one garbled row in an otherwise valid file
    bad_pcd.write_text("".join(lines))
    dataset = _split(split_dir, tmp_path, use_point_cache=use_point_cache)
    assert dataset.load_sample(0)["cavs"]["1010"]["points"].shape[1] == 4   # other frames fine
    with pytest.raises(PcdError) as error:
        dataset.load_sample(1)
    assert str(bad_pcd) in str(error.value)


def test_points_are_returned_raw_in_lidar_frame(tmp_path):
    split_dir = tmp_path / "train"
    _make_scenario(split_dir, {"1": (0, 0)})
    frame = _split(split_dir, tmp_path).load_cav_frame("scene_a", "1", "000000")
    assert frame["points"].dtype == np.float32
    # The second point is on the CAV's own body: load_cav_frame must not remove it.
    np.testing.assert_allclose(frame["points"], [[5.0, 1.0, -1.0, 0.5], [0.5, 0.2, -1.5, 0.2]],
                               atol=1 / 255)
    assert frame["lidar_pose"].dtype == np.float64 and frame["lidar_pose"].shape == (6,)


# ---------------------------------------------------------------- geometry of the reader

def test_remove_own_body_points_inclusive_bounds():
    points = np.array([[-1.95, -1.1, 0.0, 0.1],     # corner of the body box: removed
                       [2.95, 1.1, 0.0, 0.2],       # opposite corner: removed
                       [0.0, 0.0, 5.0, 0.3],        # above the roof, still inside x/y: removed
                       [2.951, 0.0, 0.0, 0.4],      # just in front: kept
                       [0.0, -1.101, 0.0, 0.5],     # just to the side: kept
                       [-1.951, 0.0, 0.0, 0.6]])    # just behind: kept
    kept = remove_own_body_points(points)
    np.testing.assert_array_equal(kept[:, 3], [0.4, 0.5, 0.6])


def test_vehicles_to_boxes_hand_case_with_centre_offset_and_lidar_pose():
    # Lidar at (10, 0, 0) facing world +y: world (10, 5) is 5 m ahead on the lidar x axis.
    lidar_pose = [10.0, 0.0, 0.0, 0.0, 90.0, 0.0]
    vehicles = {"7": {"location": [10.0, 4.0, -1.0], "center": [0.0, 1.0, 0.2],
                      "extent": [2.0, 0.8, 0.7], "angle": [0.0, 90.0, 0.0]}}
    ids, boxes = vehicles_to_boxes(vehicles, lidar_pose, DEFAULT_RANGE)
    assert ids.dtype == np.int64 and ids.tolist() == [7]
    np.testing.assert_allclose(boxes, [[5.0, 0.0, -0.8, 1.4, 1.6, 4.0, 0.0]], atol=1e-9)
    ids_lwh, boxes_lwh = vehicles_to_boxes(vehicles, lidar_pose, DEFAULT_RANGE, order="lwh")
    np.testing.assert_allclose(boxes_lwh, [[5.0, 0.0, -0.8, 4.0, 1.6, 1.4, 0.0]], atol=1e-9)


def test_vehicles_to_boxes_keeps_only_boxes_fully_in_range_including_z():
    lidar_pose = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    vehicles = {
        3: _vehicle(20.0, 0.0, z=0.0),       # z 0..1.5: top above zmax=1 -> dropped
        1: _vehicle(20.0, 5.0, z=-1.0),      # z -1..0.5: kept
        2: _vehicle(139.0, 0.0, z=-1.0),     # front at x=141, beyond 140 -> dropped
        4: _vehicle(-50.0, 37.5, z=-1.0),    # side at y=38.5: kept
        5: _vehicle(138.0, 0.0, z=-1.0),     # front exactly at x=140: kept (bounds inclusive)
        6: _vehicle(138.5, 9.0, z=-1.0, yaw=45.0),   # one BEV corner (2 of 8) past x=140
    }
    ids, boxes = vehicles_to_boxes(vehicles, lidar_pose, DEFAULT_RANGE)
    assert ids.tolist() == [1, 4, 5]
    np.testing.assert_allclose(boxes[:, :3], [[20.0, 5.0, -0.25], [-50.0, 37.5, -0.25],
                                              [138.0, 0.0, -0.25]], atol=1e-9)
    empty_ids, empty_boxes = vehicles_to_boxes({}, lidar_pose, DEFAULT_RANGE)
    assert empty_ids.shape == (0,) and empty_boxes.shape == (0, 7)


def test_vehicles_to_boxes_range_test_uses_the_rebuilt_level_box_as_the_reference_does():
    # Pitched 30 deg, the real corners reach z = -0.25 + 2 sin30 + 0.75 cos30 = 1.40 > zmax = 1,
    # but the 7-number box (h = 1.5 cos30, no pitch) tops out at 0.40: the reference keeps it.
    pitched = {**_vehicle(20.0, 0.0, z=-1.0), "angle": [0.0, 0.0, 30.0]}
    ids, boxes = vehicles_to_boxes({9: pitched}, [0.0] * 6, DEFAULT_RANGE)
    assert ids.tolist() == [9]
    assert boxes[0, 3] == pytest.approx(1.5 * math.cos(math.radians(30.0)))


def test_gt_is_union_first_seen_wins_cavs_excluded_sorted(tmp_path):
    split_dir = tmp_path / "train"
    scenario_dir = split_dir / "scene_a"
    _write_frame(scenario_dir / "1001", "000000", (0, 0), vehicles={
        5: _vehicle(10.0, 0.0, z=-1.0),
        1010: _vehicle(20.0, 0.0, z=-1.0)})          # the other CAV itself: never GT
    _write_frame(scenario_dir / "1010", "000000", (20, 0), vehicles={
        5: _vehicle(11.0, 3.0, z=-1.0),              # also seen by the ego: the ego's copy wins
        3: _vehicle(30.0, 0.0, z=-1.0)})
    sample = _split(split_dir, tmp_path).load_sample(0)
    assert sample["gt_ids"].tolist() == [3, 5]
    # The lidar sits 1.9 m up, so boxes at world z -1..0.5 are at -2.9..-1.4 in the lidar frame.
    np.testing.assert_allclose(sample["gt_boxes"][:, :3], [[30.0, 0.0, -2.15], [10.0, 0.0, -2.15]],
                               atol=1e-9)
    np.testing.assert_allclose(sample["cavs"]["1010"]["T_to_ego"][:3, 3], [20.0, 0.0, 0.0],
                               atol=1e-12)
