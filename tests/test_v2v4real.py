"""V2V4Real: numpy-tagged yaml read safely, own-frame boxes to the ego, 4x4 pose noise, the
synthetic world written in the format and read back (round trip)."""
from __future__ import annotations

import math
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from opencood.data.check import check_folder
from opencood.config import load_config
from opencood.data.datasets import IntermediateFusionDataset, LateFusionDataset, build_dataset
from opencood.strategies import choose_strategy
from opencood.data.numpy_yaml import NumpyYamlDumper, NumpyYamlLoader
from opencood.data.opv2v import OPV2VFormatError, OPV2VSplit, vehicles_to_boxes
from opencood.data.pcd import write_pcd
from opencood.data.formats import open_split
from opencood.data.synthetic import generate_dataset, get_preset
from opencood.data.synthetic.writer import SPLITS, scan_frames
from opencood.data.synthetic.writer_v2v4real import adapt_preset
from opencood.data.v2v4real import V2V4RealSplit, load_v2v4real_yaml
from opencood.data.wild import WildSetting, noisy_pose
from opencood.ops.transforms import pose_to_matrix

BIG_RANGE = [-1000.0, -1000.0, -100.0, 1000.0, 1000.0, 100.0]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))


# ------------------------------------------------------------------------------ numpy yaml

def test_reads_what_pyyaml_wrote_from_numpy_and_writes_what_it_reads():
    data = {"lidar_pose": pose_to_matrix([1.5, -2.0, 1.9, 0.1, 30.0, -0.2]),
            "gps": [np.float64(34.07), np.float64(-118.44)], "n": np.int64(7)}
    ours = yaml.load(yaml.dump(data), Loader=NumpyYamlLoader)     # PyYAML's unsafe dumper
    np.testing.assert_array_equal(ours["lidar_pose"], data["lidar_pose"])
    assert ours["gps"] == data["gps"] and isinstance(ours["gps"][0], np.float64)
    assert ours["n"] == 7 and isinstance(ours["n"], np.int64)
    text = yaml.dump(data, Dumper=NumpyYamlDumper)
    assert "numpy.core.multiarray._reconstruct" in text      # the published files' spelling
    with warnings.catch_warnings():                           # numpy.core is deprecated in 2.x
        warnings.simplefilter("ignore")
        theirs = yaml.load(text, Loader=yaml.UnsafeLoader)    # what the reference would get
    np.testing.assert_array_equal(theirs["lidar_pose"], data["lidar_pose"])
    assert theirs["gps"] == data["gps"]


@pytest.mark.parametrize("layout", ["big-endian", "fortran", "big-endian fortran"])
def test_big_endian_and_fortran_ordered_arrays_load_equal_to_the_original(layout):
    # PyYAML's dumper pickles an array as it is in memory: a '>f8' dtype keeps its byte order in
    # the dtype's state, a Fortran-ordered one sets fortran_order and writes its bytes column
    # first. An asymmetric pose tells a transpose or a byte swap from the original.
    pose = pose_to_matrix([1.5, -2.0, 1.9, 0.1, 30.0, -0.2])
    pose[3, :3] = [7.0, 8.0, 9.0]
    array = pose.astype(">f8") if "big-endian" in layout else pose
    array = np.asfortranarray(array) if "fortran" in layout else array
    text = yaml.dump({"lidar_pose": array})                  # PyYAML's unsafe dumper
    assert ("fortran" in layout) == ("- true\n  - !!binary" in text)       # fortran_order
    assert ("big-endian" in layout) == ("- '>'" in text)                   # the dtype's order
    ours = yaml.load(text, Loader=NumpyYamlLoader)
    np.testing.assert_array_equal(ours["lidar_pose"], pose)
    assert ours["lidar_pose"].flags.c_contiguous and ours["lidar_pose"].dtype.isnative
    again = yaml.load(yaml.dump(ours, Dumper=NumpyYamlDumper), Loader=NumpyYamlLoader)
    np.testing.assert_array_equal(again["lidar_pose"], pose)


@pytest.mark.parametrize("tag", [
    "!!python/object/apply:os.system ['touch {marker}']",
    "!!python/object/new:os.system ['touch {marker}']",
    "!!python/name:os.system ''",
    "!!python/object/apply:subprocess.call [['touch', '{marker}']]",
])
def test_unsafe_tag_is_a_one_line_error_naming_the_file_and_never_runs(tmp_path, tag):
    marker = tmp_path / "ran"
    path = tmp_path / "000000.yaml"
    path.write_text(f"lidar_pose: {tag.format(marker=marker)}\nvehicles: {{}}\n")
    with pytest.raises(OPV2VFormatError) as error:
        load_v2v4real_yaml(path)
    message = str(error.value)
    assert message.startswith(f"{path}: refused yaml tag !!python/") and "\n" not in message
    assert not marker.exists()


def test_object_dtype_array_is_refused(tmp_path):
    # An object array would unpickle its payload; only numeric dtypes are rebuilt.
    text = yaml.dump({"lidar_pose": np.eye(4)}).replace("- f8", "- O8")
    path = tmp_path / "000000.yaml"
    path.write_text(text)
    with pytest.raises(OPV2VFormatError, match="not a plain number type"):
        load_v2v4real_yaml(path)


@pytest.mark.parametrize("text, problem", [
    ("lidar_pose: [1, 2, 3, 0, 0, 0]\n", "must be a 4x4 matrix"),
    ("vehicles: {}\n", "'lidar_pose' is missing"),
    ("lidar_pose: [[1, 0]\n", "invalid yaml at line"),
])
def test_bad_frame_yaml_is_a_one_line_error_naming_the_file(tmp_path, text, problem):
    path = tmp_path / "000000.yaml"
    path.write_text(text)
    with pytest.raises(OPV2VFormatError) as error:
        load_v2v4real_yaml(path)
    assert str(error.value).startswith(f"{path}: ") and problem in str(error.value)
    assert "\n" not in str(error.value)


# -------------------------------------------------------------------------------- geometry

def _object(location, yaw_deg, ass_id=-1, center=(0.0, 0.0, 0.0), obj_type="Car"):
    return {"location": list(location), "center": list(center), "extent": [2.0, 1.0, 0.75],
            "angle": [0.0, yaw_deg, 0.0], "ass_id": ass_id, "obj_type": obj_type}


def _write_frame(folder: Path, lidar_pose: np.ndarray, vehicles: dict) -> None:
    folder.mkdir(parents=True)
    write_pcd(folder / "000000.pcd", np.array([[5.0, 5.0, 0.0, 0.5], [9.0, 1.0, 0.5, 0.2]]))
    (folder / "000000.yaml").write_text(yaml.dump(
        {"lidar_pose": lidar_pose, "gps": [np.float64(34.0), np.float64(-118.0)],
         "vehicles": vehicles}, Dumper=NumpyYamlDumper))


@pytest.fixture()
def hand_tree(tmp_path) -> Path:
    """Ego (folder 0) at (10, 5) facing +y (yaw 90); CAV 1 at (20, 5) facing +x (yaw 0)."""
    ego_pose = pose_to_matrix([10.0, 5.0, 0.0, 0.0, 90.0, 0.0])
    cav_pose = pose_to_matrix([20.0, 5.0, 0.0, 0.0, 0.0, 0.0])
    split = tmp_path / "train"
    _write_frame(split / "s" / "0", ego_pose, {
        0: _object([-0.5, -12.0, 0.8], -90.0, ass_id=77),      # CAV 1's key 0, seen slightly off
        1: _object([0.0, 0.0, 0.0], 0.0, obj_type="Pedestrian")})
    _write_frame(split / "s" / "1", cav_pose, {
        0: _object([3.0, 0.0, 0.8], 0.0, ass_id=77),
        # pose = location + center (center not rotated): (3, 4, 0.8) facing +y
        3: _object([2.0, 4.0, 0.8], 90.0, center=(1.0, 0.0, 0.0))})
    return split


def test_own_frame_boxes_reach_the_ego_as_computed_by_hand(hand_tree):
    sample = V2V4RealSplit(hand_tree).load_sample(0, gt_range=BIG_RANGE)
    # CAV 1 -> ego: world = cav + (20, 5); ego = rotate(world - (10, 5), -90 deg): (x, y) -> (y, -x)
    np.testing.assert_allclose(sample["cavs"]["1"]["T_to_ego"],
                               [[0, 1, 0, 0], [-1, 0, 0, -10], [0, 0, 1, 0], [0, 0, 0, 1]],
                               atol=1e-12)
    # ids: ass_id 77 (the ego's box wins); key 3 of CAV 1 without ass_id -> 3 + 100 * 1.
    # The ego's pedestrian (key 1) is left out.
    assert sample["gt_ids"].tolist() == [77, 103]
    h, w, length = 1.5, 2.0, 4.0
    np.testing.assert_allclose(sample["gt_boxes"][0], [-0.5, -12.0, 0.8, h, w, length,
                                                       -math.pi / 2], atol=1e-9)
    np.testing.assert_allclose(sample["gt_boxes"][1], [4.0, -13.0, 0.8, h, w, length, 0.0],
                               atol=1e-9)


@pytest.mark.parametrize("gt_range, kept", [
    ([1.5, -20.0, -5.0, 2.5, 20.0, 5.0], [103]),     # 4 corners in range
    ([1.5, -20.0, -5.0, 2.5, 20.0, 1.0], [103]),     # exactly 2: the bottom ones at x = 2
    ([1.5, -13.0, -5.0, 2.5, 20.0, 1.0], []),        # 1: only (2, -12, 0.05)
])
def test_a_box_with_two_corners_in_range_is_kept_one_with_one_is_not(hand_tree, gt_range, kept):
    # Box 103 spans x 2..6, y -14..-12, z 0.05..1.55 (length 4 along ego x at yaw 0). A range
    # ending at x = 2.5 holds its 4 corners at x = 2; a top at z = 1 leaves the 2 bottom ones
    # (kept: the reference's mask_boxes_outside_range_numpy keeps >= 2 corners); a y from -13
    # leaves 1 (dropped). Box 77 (the ego's x -1.5..0.5, CAV 1's x -1..1) is outside.
    sample = V2V4RealSplit(hand_tree).load_sample(0, gt_range=gt_range)
    assert sample["gt_ids"].tolist() == kept


def test_pose_noise_on_a_4x4_pose_is_the_noise_of_its_6_numbers():
    pose = [12.0, -3.0, 1.9, 0.2, 35.0, -0.1]
    setting = WildSetting(loc_err=True, xyz_std=0.5, yaw_std=3.0)
    noisy_numbers = noisy_pose(pose, setting, np.random.default_rng(4))
    noisy_matrix = noisy_pose(pose_to_matrix(pose), setting, np.random.default_rng(4))
    assert noisy_matrix.shape == (4, 4)
    np.testing.assert_allclose(noisy_matrix, pose_to_matrix(noisy_numbers), atol=1e-12)
    assert not np.allclose(noisy_matrix, pose_to_matrix(pose))


# ---------------------------------------------------------------------- synthetic, round trip

@pytest.fixture(scope="module")
def v2v4real_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn_v2v4real")
    generate_dataset(out, preset="tiny", seed=0, progress=False, data_format="v2v4real")
    return out


def test_layout_two_cavs_numpy_tagged_poses_and_own_frame_labels(v2v4real_data):
    for split in SPLITS:
        scenario = next((v2v4real_data / split).iterdir())
        assert sorted(p.name for p in scenario.iterdir()) == ["0", "1"]
        text = (scenario / "1" / "000000.yaml").read_text()
        assert "lidar_pose: !!python/object/apply:numpy.core.multiarray._reconstruct" in text
        assert "gps:\n- !!python/object/apply:numpy.core.multiarray.scalar" in text
        assert "ass_id:" in text and "obj_type: Car" in text
    # The OPV2V reader cannot read it (and says why, naming a file): the format is different.
    with pytest.raises(OPV2VFormatError, match="refused|lidar_pose|could not determine"):
        OPV2VSplit(v2v4real_data / "train")


def test_round_trip_boxes_and_points(v2v4real_data):
    preset = adapt_preset(get_preset("tiny"))
    compared = 0
    for split in SPLITS:
        reader = open_split("v2v4real", v2v4real_data / split)
        for (world, frame, scans), index in zip(scan_frames(preset, 0, split, 0), range(99)):
            sample = reader.load_sample(index, gt_range=BIG_RANGE)
            ego_pose = world.lidar_poses[world.cav_ids[0]][frame]
            # The generator's truth: every vehicle a CAV hit, from the world, to the ego frame.
            seen = {}
            for _, visible in scans.values():
                seen.update(visible)
            _, expected = vehicles_to_boxes(seen, ego_pose, BIG_RANGE)
            assert _match_boxes(sample["gt_boxes"], expected) < 2e-4
            for folder, cav_id in zip(("0", "1"), world.cav_ids):
                np.testing.assert_allclose(sample["cavs"][folder]["points"][:, :3],
                                           scans[cav_id][0][:, :3], atol=2e-6)
                np.testing.assert_allclose(sample["cavs"][folder]["lidar_pose"],
                                           pose_to_matrix(world.lidar_poses[cav_id][frame]))
            compared += len(expected)
    assert compared > 50


def _match_boxes(got: np.ndarray, expected: np.ndarray) -> float:
    """Largest difference between each expected box and the read box nearest it (same count)."""
    assert got.shape == expected.shape
    worst = 0.0
    for box in expected:
        nearest = got[np.argmin(np.linalg.norm(got[:, :2] - box[:2], axis=1))]
        yaw_gap = abs((nearest[6] - box[6] + math.pi) % (2 * math.pi) - math.pi)
        worst = max(worst, float(np.abs(nearest[:6] - box[:6]).max()), yaw_gap)
    return worst


def test_every_fusion_dataset_reads_it_with_noise_latency_and_late_per_cav(v2v4real_data):
    wild = WildSetting(loc_err=True, xyz_std=0.2, yaw_std=0.2, latency_frames=1)
    common = dict(lidar_range=[-51.2, -25.6, -3.0, 51.2, 25.6, 1.0],
                  gt_range=[-51.2, -25.6, -3.0, 51.2, 25.6, 3.0], dataset="v2v4real")
    sample = IntermediateFusionDataset(v2v4real_data / "test", wild=wild, **common)[2]
    assert sample["agent_ids"] == ["0", "1"] and sample["agent_latency"].tolist() == [0, 1]
    assert len(sample["gt_boxes"]) > 0 and (sample["gt_ego_points"] >= 0).all()
    # Late fusion's per-CAV GT of CAV 1 is its own labels in its own frame: moved to the ego
    # they are the sample's GT boxes of the same ids.
    late = LateFusionDataset(v2v4real_data / "train", train=True, **common)
    assert len(late) == 2 * 3
    own = late[1]
    whole = late.split.load_sample(0, gt_range=common["gt_range"])
    to_ego = whole["cavs"]["1"]["T_to_ego"]
    shared = [i for i, box_id in enumerate(own["gt_ids"]) if box_id in whole["gt_ids"]]
    assert len(shared) > 3
    for i in shared:
        centre = to_ego[:3, :3] @ own["gt_boxes"][i, :3] + to_ego[:3, 3]
        row = whole["gt_boxes"][whole["gt_ids"].tolist().index(own["gt_ids"][i])]
        np.testing.assert_allclose(centre, row[:3], atol=1e-3)


def test_communication_range_is_measured_between_the_4x4_poses(v2v4real_data):
    world, frame, _ = next(scan_frames(adapt_preset(get_preset("tiny")), 0, "train", 0))
    ego, other = (world.lidar_poses[c][frame] for c in world.cav_ids)
    distance = math.hypot(ego[0] - other[0], ego[1] - other[1])
    near = V2V4RealSplit(v2v4real_data / "train", com_range=distance - 0.01)
    far = V2V4RealSplit(v2v4real_data / "train", com_range=distance + 0.01)
    assert near.info(0).cav_ids == ["0"] and far.info(0).cav_ids == ["0", "1"]


def test_parse_cache_is_its_own_and_reused_without_parsing(v2v4real_data, tmp_path,
                                                           monkeypatch):
    fresh = V2V4RealSplit(v2v4real_data / "validate", cache_dir=tmp_path)
    assert list((tmp_path / "v2v4real_index").glob("*.json"))
    assert not (tmp_path / "opv2v_index").exists()

    def fail_parse(path):
        raise AssertionError(f"yaml parsed again: {path}")

    monkeypatch.setattr(V2V4RealSplit, "load_frame", staticmethod(fail_parse))
    cached = V2V4RealSplit(v2v4real_data / "validate", cache_dir=tmp_path)
    np.testing.assert_array_equal(cached.load_sample(1, BIG_RANGE)["gt_boxes"],
                                  fresh.load_sample(1, BIG_RANGE)["gt_boxes"])


def test_check_data_reads_v2v4real_and_names_a_bad_file(v2v4real_data, tmp_path):
    report = check_folder(v2v4real_data, progress=False, dataset="v2v4real")
    assert report.problems == [] and report.frames == 18
    copy = tmp_path / "train"
    shutil.copytree(v2v4real_data / "train", copy)
    bad = next(copy.glob("*/1/000001.yaml"))
    bad.write_text(bad.read_text().replace("ego_speed:", "x: !!python/object/apply:os.getcwd []\n"
                                                         "ego_speed:"))
    report = check_folder(copy, progress=False, dataset="v2v4real")
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{bad}: refused yaml tag")


def test_a_refused_tag_in_a_split_stops_the_index_and_writes_no_cache(v2v4real_data, tmp_path):
    copy = tmp_path / "train"
    shutil.copytree(v2v4real_data / "train", copy)
    marker = tmp_path / "ran"
    bad = next(copy.glob("*/0/000002.yaml"))
    bad.write_text(f"boom: !!python/object/apply:os.system ['touch {marker}']\n"
                   + bad.read_text())
    with pytest.raises(OPV2VFormatError, match=f"^{bad}: refused yaml tag"):
        V2V4RealSplit(copy, cache_dir=tmp_path / "cache")
    assert not marker.exists() and not list((tmp_path / "cache").rglob("*.json"))


# ------------------------------------------------------------------- the crop filter (issue 41)

def test_crop_filter_runs_per_cav_before_the_union_and_counts_z(hand_tree):
    """V2V4Real's fusion datasets keep a CAV's box only with >= 2 corners in cav_lidar_range too.
    Id 77: the ego's box spans ego x -1.5..0.5, CAV 1's x -1..1. A crop from x = 0.75 drops the
    ego's and keeps CAV 1's (its corners at x = 1): the union then holds CAV 1's box, centre
    (0, -13) instead of the ego's (-0.5, -12). All boxes span z 0.05..1.55: a crop topping at
    z = 0.5 holds their 4 bottom corners (kept), one topping at z = 0 none (all dropped)."""
    big = BIG_RANGE
    crop = [0.75, -20.0, -5.0, 10.0, 20.0, 5.0]
    sample = V2V4RealSplit(hand_tree, crop_range=crop).load_sample(0, gt_range=big)
    assert sample["gt_ids"].tolist() == [77, 103]
    np.testing.assert_allclose(sample["gt_boxes"][0, :3], [0.0, -13.0, 0.8], atol=1e-9)
    low_top = [-20.0, -20.0, -5.0, 20.0, 20.0, 0.5]
    assert V2V4RealSplit(hand_tree, crop_range=low_top).sample_gt(0, big)[0].tolist() == [77, 103]
    below = [-20.0, -20.0, -5.0, 20.0, 20.0, 0.0]
    assert V2V4RealSplit(hand_tree, crop_range=below).sample_gt(0, big)[0].tolist() == []
    # without the crop filter the ego's box 77 wins
    ids, boxes = V2V4RealSplit(hand_tree).sample_gt(0, big)
    np.testing.assert_allclose(boxes[ids.tolist().index(77), :3], [-0.5, -12.0, 0.8], atol=1e-9)


def test_datasets_built_from_a_config_crop_filter_with_its_cav_lidar_range(hand_tree):
    cfg = load_config(Path(__file__).resolve().parents[1] / "hypes_yaml/v2v4real/smoke.yaml",
                      [f"root_dir={hand_tree}", "preprocess.cav_lidar_range="
                       "[0.75, -20, -5, 10, 20, 5]", "postprocess.gt_range="
                       "[-100, -40, -5, 100, 40, 3]"])
    dataset = build_dataset(cfg, "train", train=False, strategy=choose_strategy(cfg))
    assert dataset.split.crop_range == [0.75, -20.0, -5.0, 10.0, 20.0, 5.0]
    assert dataset.split.sample_gt(0, dataset.gt_range)[0].tolist() == [77, 103]
    ids, boxes = dataset.split.sample_gt(0, dataset.gt_range)
    np.testing.assert_allclose(boxes[0, :3], [0.0, -13.0, 0.8], atol=1e-9)
