"""Synthetic world: ray casting on hand-made geometry, visibility lists, generator files."""
from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from opencood.data.datasets import NoFusionDataset
from opencood.data.opv2v import OPV2VSplit, remove_own_body_points, vehicles_to_boxes
from opencood.data.pcd import read_pcd
from opencood.data.synthetic import (GROUND_ID, Building, LidarConfig, OutputDirError, Scene,
                                     Vehicle, cast_lidar, generate_dataset, get_preset,
                                     visible_vehicles)
from opencood.data.synthetic.world import footprints_overlap
from opencood.data.synthetic.writer import SPLITS, rebuild_world
from opencood.ops.transforms import apply_transform, pose_to_matrix
from opencood.utils.vis_bev import AGENT_COLORS, GT_COLOR, OCCLUDED_GT_COLOR, BevCanvas

NOISELESS = LidarConfig(beams=16, fov_deg=(-25.0, 5.0), azimuth_steps=360, max_range=60.0,
                        range_noise_std=0.0, dropout=0.0)
CAR = (2.3, 0.95, 0.75)                     # half length, width, height
LIDAR_HEIGHT = 1.9


def _lidar_pose(x, y, yaw_deg=0.0):
    return [x, y, LIDAR_HEIGHT, 0.0, yaw_deg, 0.0]


def _scan(scene, pose, cfg=NOISELESS, seed=0, exclude=()):
    return cast_lidar(scene, pose, cfg, np.random.default_rng(seed), exclude_ids=exclude)


# ------------------------------------------------------------------------------ ray casting

def test_vertical_ray_hits_ground_below_the_lidar():
    cfg = dataclasses.replace(NOISELESS, beams=1, fov_deg=(-90.0, -90.0), azimuth_steps=1)
    points, ids = _scan(Scene(), [3.0, -2.0, 1.7, 0.0, 0.0, 0.0], cfg)
    assert points.shape == (1, 4) and ids.tolist() == [GROUND_ID]
    np.testing.assert_allclose(points[0, :3], [0.0, 0.0, -1.7], atol=1e-5)


def test_slanted_ray_hits_ground_at_hand_computed_range():
    # 30 degrees down from 1.7 m: the ground is 1.7 / sin(30) = 3.4 m along the ray.
    cfg = dataclasses.replace(NOISELESS, beams=1, fov_deg=(-30.0, -30.0), azimuth_steps=8)
    points, ids = _scan(Scene(), [0.0, 0.0, 1.7, 0.0, 0.0, 0.0], cfg)
    assert len(points) == 8 and (ids == GROUND_ID).all()
    np.testing.assert_allclose(np.linalg.norm(points[:, :3], axis=1), 3.4, rtol=1e-5)
    np.testing.assert_allclose(points[:, 2], -1.7, atol=1e-5)


def test_wall_in_front_returns_points_at_its_distance():
    # A building face at x = 12 (centre 14, half length 2); a rotated one whose face is at y = 9.
    front = Building(-2, 14.0, 0.0, half_length=2.0, half_width=6.0, height=8.0)
    side = Building(-3, 0.0, 10.0, half_length=4.0, half_width=1.0, height=8.0, yaw_deg=0.0)
    # Rotated by 90 degrees: 4 m half length along y, 1 m along x, so its face is at x = -19
    # (unrotated it would be at x = -16).
    side_rotated = Building(-4, -20.0, 0.0, half_length=4.0, half_width=1.0, height=8.0,
                            yaw_deg=90.0)
    points, ids = _scan(Scene([front, side, side_rotated]), _lidar_pose(0.0, 0.0))
    on_front, on_side, on_rotated = points[ids == -2], points[ids == -3], points[ids == -4]
    assert len(on_front) > 20 and len(on_side) > 5 and len(on_rotated) > 5
    np.testing.assert_allclose(on_front[:, 0], 12.0, atol=1e-4)
    np.testing.assert_allclose(on_side[:, 1], 9.0, atol=1e-4)
    np.testing.assert_allclose(on_rotated[:, 0], -19.0, atol=1e-4)
    assert on_front[:, 2].max() < 8.0 - LIDAR_HEIGHT + 1e-4


def test_lidar_pose_rotates_the_returned_frame():
    wall = Building(-2, 0.0, 14.0, half_length=6.0, half_width=2.0, height=8.0)
    points, ids = _scan(Scene([wall]), _lidar_pose(0.0, 0.0, yaw_deg=90.0))
    # The wall is straight ahead (lidar x) when the lidar faces +y (yaw 90).
    np.testing.assert_allclose(points[ids == -2, 0], 12.0, atol=1e-4)


def test_dropout_one_gives_no_points():
    cfg = dataclasses.replace(NOISELESS, dropout=1.0)
    points, ids = _scan(Scene(), _lidar_pose(0.0, 0.0), cfg)
    assert points.shape == (0, 4) and ids.shape == (0,)


def test_range_limit_is_respected():
    wall = Building(-2, 16.0, 0.0, half_length=1.0, half_width=6.0, height=8.0)
    cfg = dataclasses.replace(NOISELESS, max_range=10.0)
    points, ids = _scan(Scene([wall]), _lidar_pose(0.0, 0.0), cfg)
    assert len(points) > 0 and not (ids == -2).any()
    assert np.linalg.norm(points[:, :3], axis=1).max() <= 10.0 + 1e-4


def test_own_body_is_excluded_and_scan_is_deterministic():
    own = Vehicle(7, 0.0, 0.0, 0.0, CAR)        # the lidar sits 1.9 m up, above its roof
    scene = Scene([], [own])
    _, ids_with_body = _scan(scene, _lidar_pose(0.0, 0.0))
    assert (ids_with_body == 7).sum() > 0
    noisy = dataclasses.replace(NOISELESS, range_noise_std=0.05, dropout=0.2)
    first = _scan(scene, _lidar_pose(0.0, 0.0), noisy, seed=3, exclude=[7])
    again = _scan(scene, _lidar_pose(0.0, 0.0), noisy, seed=3, exclude=[7])
    other = _scan(scene, _lidar_pose(0.0, 0.0), noisy, seed=4, exclude=[7])
    assert not (first[1] == 7).any()
    np.testing.assert_array_equal(first[0], again[0])
    assert first[0].shape != other[0].shape or not np.array_equal(first[0], other[0])
    assert ((first[0][:, 3] >= 0) & (first[0][:, 3] <= 1)).all()


# ------------------------------------------------------------------------- visibility lists

def test_building_hides_a_car_from_one_cav_but_not_the_other():
    cav_a = Vehicle(1001, 0.0, 0.0, 0.0, CAR)
    cav_b = Vehicle(1002, 10.0, -20.0, 0.0, CAR)
    car_c = Vehicle(2001, 30.0, 0.0, 150.0, CAR)     # oblique: a yaw sign error shows
    wall = Building(-2, 15.0, 0.0, half_length=2.0, half_width=10.0, height=10.0)
    scene = Scene([wall], [cav_a, cav_b, car_c])
    cav_ids = [1001, 1002]
    points_a, ids_a = _scan(scene, _lidar_pose(0.0, 0.0), exclude=[1001])
    points_b, ids_b = _scan(scene, _lidar_pose(10.0, -20.0), exclude=[1002])
    listed_a = visible_vehicles(ids_a, scene.vehicles, cav_ids)
    listed_b = visible_vehicles(ids_b, scene.vehicles, cav_ids)
    assert (ids_a == 1002).any() and 1002 not in listed_a       # CAVs are never listed
    assert not (ids_a == 2001).any() and 2001 not in listed_a   # behind the wall
    assert (ids_b == 2001).any() and list(listed_b) == [2001]
    entry = listed_b[2001]
    assert entry["location"] == [30.0, 0.0, 0.0] and entry["center"] == [0.0, 0.0, 0.75]
    assert entry["extent"] == list(CAR) and entry["angle"] == [0.0, 150.0, 0.0]
    # B's points labelled as C really lie in C's box (world frame).
    on_c = apply_transform(points_b[ids_b == 2001], pose_to_matrix(_lidar_pose(10.0, -20.0)))
    assert _inside_box(on_c, entry, margin=1e-3).all()


def test_footprint_overlap_test():
    extent = (2.0, 1.0, 0.75)
    poses_old = np.array([[[0.0, 0.0, 0.0]]])
    assert footprints_overlap(np.array([[3.5, 0.0, 0.0]]), extent, poses_old, [extent], 0.0)
    assert not footprints_overlap(np.array([[4.5, 0.0, 0.0]]), extent, poses_old, [extent], 0.0)
    # Rotated 90 degrees next to it: touches only once the margin grows the boxes.
    beside = np.array([[3.2, 0.0, 90.0]])
    assert not footprints_overlap(beside, extent, poses_old, [extent], 0.0)
    assert footprints_overlap(beside, extent, poses_old, [extent], 0.2)
    # Overlap at a later frame counts.
    moving = np.array([[10.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    assert footprints_overlap(moving, extent, np.repeat(poses_old, 2, axis=0), [extent], 0.0)


# ------------------------------------------------------------------------------- generator

def _inside_box(points_world, entry, margin):
    """(N,) bool: points (N, 3+) world frame inside the yaml vehicle box grown by margin."""
    box_pose = [l + c for l, c in zip(entry["location"], entry["center"])] + list(entry["angle"])
    local = apply_transform(points_world[:, :3].astype(np.float64),
                            np.linalg.inv(pose_to_matrix(box_pose)))
    return (np.abs(local) <= np.asarray(entry["extent"]) + margin).all(axis=1)


def _all_files(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn_tiny")
    summary = generate_dataset(out, preset="tiny", seed=0, workers=1, progress=False)
    return out, summary


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))


def test_layout_and_summary(tiny_data):
    out, summary = tiny_data
    preset = get_preset("tiny")
    for split in SPLITS:
        scenarios = sorted((out / split).iterdir())
        assert len(scenarios) == preset.scenarios[split]
        for scenario in scenarios:
            assert len(scenario.name) == 19 and scenario.name.count("_") == 5
            cavs = sorted(scenario.iterdir())
            assert 2 <= len(cavs) <= 3 and all(c.name.isdigit() and len(c.name) == 4
                                               for c in cavs)
            stamps = sorted(p.stem for p in cavs[0].glob("*.pcd"))
            assert len(stamps) == preset.frames and all(len(s) == 6 for s in stamps)
            assert np.diff([int(s) for s in stamps]).tolist() == [2] * (preset.frames - 1)
            header = (cavs[0] / f"{stamps[0]}.pcd").read_text().split("DATA ascii\n")[0]
            assert "FIELDS x y z rgb" in header and "TYPE F F F U" in header
    record = yaml.safe_load((out / "generation.yaml").read_text())
    assert record["preset"] == "tiny" and record["seed"] == 0
    assert summary["scenarios"] == preset.scenarios
    assert summary["mean_points_per_frame"] > 1000


def test_same_seed_same_bytes_any_workers_other_seed_differs(tiny_data, tmp_path):
    out, _ = tiny_data
    again = tmp_path / "again"
    generate_dataset(again, preset="tiny", seed=0, workers=2, progress=False)
    assert _all_files(again) == _all_files(out)
    one_scenario = dataclasses.replace(get_preset("tiny"), scenarios={"train": 1})
    other = tmp_path / "other"
    generate_dataset(other, preset=one_scenario, seed=1, workers=1, progress=False)
    ours = {k: v for k, v in _all_files(out).items() if k.startswith("train")}
    theirs = {k: v for k, v in _all_files(other).items() if k.startswith("train")}
    assert sorted(ours) != sorted(theirs)
    assert set(ours.values()).isdisjoint(theirs.values())


def test_one_split_alone_is_that_split_of_the_whole_data_set(tiny_data, tmp_path):
    """``splits=("test",)`` (tests/test_e2e_parity.py regenerates its frames so) writes the
    test split byte for byte as the whole data set has it, and nothing else."""
    out, _ = tiny_data
    alone = tmp_path / "alone"
    generate_dataset(alone, preset="tiny", seed=0, progress=False, splits=("test",))
    whole = {k: v for k, v in _all_files(out).items() if k.startswith("test")}
    assert {k: v for k, v in _all_files(alone).items() if k != "generation.yaml"} == whole
    with pytest.raises(ValueError, match="splits"):
        generate_dataset(tmp_path / "bad", preset="tiny", progress=False, splits=("tests",))


def test_vehicle_lists_match_the_clouds(tiny_data):
    out, _ = tiny_data
    assert _check_vehicle_lists(out, get_preset("tiny")) > 20


def _check_vehicle_lists(out: Path, preset) -> int:
    """Every listed vehicle has a point in its box; every non-CAV vehicle with one is listed
    (RSUs included). Returns how many listings were checked."""
    checked = 0
    for split in SPLITS:
        world = rebuild_world(preset, 0, split, 0)
        scenario = next((out / split).iterdir())
        assert sorted(int(c.name) for c in scenario.iterdir()) == sorted(world.agent_ids)
        for frame, pcd in enumerate(sorted((scenario / str(world.cav_ids[0])).glob("*.pcd"))):
            for agent_id in world.agent_ids:
                folder = scenario / str(agent_id)
                params = yaml.safe_load((folder / f"{pcd.stem}.yaml").read_text())
                points = apply_transform(read_pcd(folder / pcd.name).astype(np.float64),
                                         pose_to_matrix(params["lidar_pose"]))
                for actor_id, entry in params["vehicles"].items():
                    # 0.1 m: the range noise (std 2 cm) may push a surface point just outside.
                    assert _inside_box(points, entry, margin=0.1).any(), (agent_id, actor_id)
                for track in world.tracks:
                    vehicle = track.vehicle_at(frame)
                    if vehicle.actor_id in world.cav_ids:
                        assert vehicle.actor_id not in params["vehicles"]
                        continue
                    entry = {"location": [vehicle.x, vehicle.y, 0.0],
                             "center": [0.0, 0.0, vehicle.extent[2]],
                             "extent": list(vehicle.extent), "angle": [0, vehicle.yaw_deg, 0]}
                    if _inside_box(points, entry, margin=-0.05).any():
                        assert vehicle.actor_id in params["vehicles"], (agent_id, track.actor_id)
                checked += len(params["vehicles"])
    return checked


def test_reader_reads_the_data_and_agrees_with_the_summary(tiny_data):
    out, summary = tiny_data
    preset = get_preset("tiny")
    gt_total, invisible_total = 0, 0
    for split in SPLITS:
        data = OPV2VSplit(out / split)
        assert len(data) == preset.scenarios[split] * preset.frames
        for index in range(len(data)):
            sample = data.load_sample(index, gt_range=preset.eval_range)
            info = sample["info"]
            assert info.ego_id == min(info.cav_ids, key=int) and len(info.cav_ids) >= 2
            ego = sample["cavs"][info.ego_id]
            assert ego["points"].shape[1] == 4 and len(ego["points"]) > 1000
            np.testing.assert_allclose(ego["T_to_ego"], np.eye(4), atol=1e-9)
            ego_ids = set(vehicles_to_boxes(ego["vehicles"], ego["lidar_pose"],
                                            preset.eval_range)[0].tolist())
            gt_total += len(sample["gt_ids"])
            invisible_total += len(set(sample["gt_ids"].tolist()) - ego_ids)
    assert gt_total > 0
    assert summary["gt_per_sample"] == pytest.approx(gt_total / (3 * preset.frames), abs=0.01)
    assert summary["invisible_to_ego_share"] == pytest.approx(invisible_total / gt_total,
                                                              abs=1e-3)


def test_ego_point_counts_agree_with_the_generators_visibility(tiny_data):
    # The eval datasets count the ego's returns in each GT box (the AP visibility split); a car
    # is occluded for the ego (0 returns) exactly when the generator left it out of the ego's
    # `vehicles`, i.e. no ego ray hit it.
    out, _ = tiny_data
    preset = get_preset("tiny")
    dataset = NoFusionDataset(out / "test", lidar_range=list(preset.eval_range),
                              gt_range=list(preset.eval_range), train=False)
    occluded = 0
    for index in range(len(dataset)):
        sample = dataset[index]
        ego = dataset._load_agents(index)["agents"][0]
        seen_by_ego = {int(actor) for actor in ego["vehicles"]}
        for actor, count in zip(sample["gt_ids"].tolist(), sample["gt_ego_points"].tolist()):
            assert (count > 0) == (actor in seen_by_ego), (index, actor, count)
            occluded += count == 0
    assert occluded > 0


def test_bad_preset_and_bad_out_dir(tmp_path):
    with pytest.raises(ValueError, match="tiny, small, opv2v"):
        generate_dataset(tmp_path / "x", preset="huge")
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    with pytest.raises(OutputDirError, match="cannot write"):
        generate_dataset(blocker / "out", preset="tiny", progress=False)


def test_refuses_to_mix_with_existing_data(tiny_data):
    out, _ = tiny_data
    with pytest.raises(OutputDirError, match="already holds"):
        generate_dataset(out, preset="tiny", progress=False)


# --------------------------------------------------------------------------- visualisation

def test_bev_canvas_draws_boxes_and_points_where_they_are():
    canvas = BevCanvas((-10, -5, 10, 5), pixels_per_meter=10)
    assert canvas.image.shape == (100, 200, 3)
    canvas.draw_points(np.array([[1.0, 2.0, 0.0]]), (255, 0, 0))
    assert canvas.image[70, 110].tolist() == [255, 0, 0]           # row = (y+5)*10
    canvas.draw_boxes(np.array([[0.0, 0.0, 0.0, 1.5, 2.0, 4.0, 0.0]]), GT_COLOR, thickness=1)
    assert canvas.image[50, 120].tolist() == list(GT_COLOR)        # front edge at x = +2


def _visualize_main():
    """tools/ is not a package: load the script as a module."""
    path = Path(__file__).resolve().parents[1] / "tools" / "visualize.py"
    spec = importlib.util.spec_from_file_location("visualize_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_visualize_writes_png(tiny_data, tmp_path, capsys):
    main = _visualize_main()
    out, _ = tiny_data
    png = tmp_path / "vis.png"
    code = main(["--data", str(out / "train"), "--index", "1", "--out", str(png),
                 "--range", "-30", "-20", "30", "20", "--ppm", "5"])
    assert code == 0 and png.stat().st_size > 0
    image = cv2.imread(str(png))
    assert image.shape == (200, 300, 3)
    assert (np.all(image == AGENT_COLORS[0], axis=2)).sum() > 100       # the ego's points
    assert (np.all(image == AGENT_COLORS[1], axis=2)).sum() > 100       # another CAV's
    assert (np.all(image == GT_COLOR, axis=2)).sum() > 20
    # Test sample 0 of seed 0 has cars only the other CAV sees: drawn in their own colour.
    capsys.readouterr()
    assert main(["--data", str(out / "test"), "--index", "0", "--out", str(png),
                 "--range", "-30", "-20", "30", "20", "--ppm", "5"]) == 0
    occluded = int(re.search(r"\((\d+) occluded for the ego\)", capsys.readouterr().out)[1])
    lavender = (np.all(cv2.imread(str(png)) == OCCLUDED_GT_COLOR, axis=2)).sum()
    assert occluded >= 1 and lavender > 20 * occluded
    assert main(["--data", str(out / "train"), "--index", "999", "--out", str(png)]) == 2
    assert main(["--data", str(out / "missing"), "--index", "0", "--out", str(png)]) == 2


def _generate_cli():
    spec = importlib.util.spec_from_file_location(
        "generate_synthetic", Path(__file__).resolve().parents[1] / "tools" / "generate_synthetic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_cli_resizes_a_preset(tmp_path, capsys):
    cli = _generate_cli()
    out = tmp_path / "data"
    assert cli.main(["--out", str(out), "--preset", "tiny", "--frames", "2",
                     "--scenarios", "1", "1", "2", "--quiet"]) == 0
    for split, scenarios in (("train", 1), ("validate", 1), ("test", 2)):
        assert len(OPV2VSplit(out / split)) == scenarios * 2, split
    record = yaml.safe_load((out / "generation.yaml").read_text())
    assert record["preset_config"]["frames"] == 2
    assert record["preset_config"]["scenarios"] == {"train": 1, "validate": 1, "test": 2}
    capsys.readouterr()
    assert cli.main(["--out", str(tmp_path / "x"), "--preset", "tiny", "--frames", "0"]) == 2
    assert cli.main(["--out", str(tmp_path / "x"), "--preset", "tiny",
                     "--scenarios", "1", "0", "1"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == ["error: --frames must be >= 1, got 0",
                      "error: --scenarios needs >= 1 scenario per split, got [1, 0, 1]"]


# --------------------------------------------------------------------------- roadside units

# v2x_small cut down to 3 scenarios of 3 frames: seconds, and every split has an RSU.
V2X_LITE = dataclasses.replace(get_preset("v2x_small"),
                               scenarios={"train": 1, "validate": 1, "test": 1}, frames=3)


@pytest.fixture(scope="module")
def v2x_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn_v2x")
    summary = generate_dataset(out, preset=V2X_LITE, seed=0, workers=1, progress=False)
    return out, summary


def test_elevated_rsu_sees_a_car_behind_a_wall_that_every_vehicle_misses():
    # A 2.5 m wall at x 10..12 hides the car at x = 30 from LiDARs 1.9 m up (their rays that
    # clear the wall still rise); from 4.5 m the rays that clear it come down on the car's roof
    # and near face at elevations -5.3 .. -9.2 deg, inside the v2x presets' RSU beam pattern.
    cav_a = Vehicle(1001, 0.0, 0.0, 0.0, CAR)
    cav_b = Vehicle(1002, -10.0, 4.0, 0.0, CAR)
    hidden = Vehicle(2001, 30.0, 0.0, 0.0, CAR)
    wall = Building(-2, 11.0, 0.0, half_length=1.0, half_width=12.0, height=2.5)
    scene = Scene([wall], [cav_a, cav_b, hidden])
    rsu_lidar = dataclasses.replace(get_preset("v2x_small").rsu.lidar, range_noise_std=0.0,
                                    dropout=0.0)
    rsu_pose = [0.0, -6.0, 4.5, 0.0, 30.0, 0.0]
    rsu_points, rsu_ids = _scan(scene, rsu_pose, rsu_lidar)
    _, ids_a = _scan(scene, _lidar_pose(0.0, 0.0), get_preset("v2x_small").lidar, exclude=[1001])
    _, ids_b = _scan(scene, _lidar_pose(-10.0, 4.0), get_preset("v2x_small").lidar,
                     exclude=[1002])
    cav_ids = [1001, 1002]
    assert 2001 not in visible_vehicles(ids_a, scene.vehicles, cav_ids)
    assert 2001 not in visible_vehicles(ids_b, scene.vehicles, cav_ids)
    listed = visible_vehicles(rsu_ids, scene.vehicles, cav_ids)
    assert 2001 in listed and 1001 not in listed
    # The RSU's returns on the car lie on it: the elevated, rotated pose is applied right.
    on_car = apply_transform(rsu_points[rsu_ids == 2001], pose_to_matrix(rsu_pose))
    assert len(on_car) >= 3 and _inside_box(on_car, listed[2001], margin=1e-3).all()


def test_v2x_scenarios_have_a_static_rsu_written_as_v2xset_writes_it(v2x_data):
    out, summary = v2x_data
    for scenario in sorted(out.glob("*/*")):
        rsu_dirs = [d for d in scenario.iterdir() if d.name.startswith("-")]
        assert [d.name for d in rsu_dirs] == ["-1"], scenario
        frames = [yaml.safe_load(f.read_text()) for f in sorted(rsu_dirs[0].glob("*.yaml"))]
        assert len(frames) == V2X_LITE.frames
        pose = frames[0]["lidar_pose"]
        assert 4.0 <= pose[2] <= 5.0 and pose[3] == pose[5] == 0.0
        for params in frames:
            assert params["lidar_pose"] == params["true_ego_pos"] == pose       # never moves
            assert params["RSU"] is True and params["ego_speed"] == 0.0
            assert "plan_trajectory" not in params
        vehicle_dir = next(d for d in scenario.iterdir() if not d.name.startswith("-"))
        vehicle_frame = yaml.safe_load(next(vehicle_dir.glob("*.yaml")).read_text())
        assert vehicle_frame["RSU"] is False and "plan_trajectory" in vehicle_frame
    assert summary["rsus_per_scenario"] == {"min": 1, "max": 1, "mean": 1.0}
    assert 0.0 < summary["seen_only_by_rsu_share"] < 1.0


def test_v2x_vehicle_lists_match_the_clouds(v2x_data):
    out, _ = v2x_data
    assert _check_vehicle_lists(out, V2X_LITE) > 20


def test_v2x_reader_makes_a_vehicle_the_ego_and_the_rsu_the_last_agent(v2x_data):
    out, _ = v2x_data
    for split in SPLITS:
        data = OPV2VSplit(out / split)
        for index in range(len(data)):
            sample = data.load_sample(index, gt_range=V2X_LITE.eval_range)
            info = sample["info"]
            assert int(info.ego_id) > 0 and info.cav_ids[-1] == "-1"
            rsu = sample["cavs"]["-1"]
            ego_pose = sample["cavs"][info.ego_id]["lidar_pose"]
            assert np.hypot(*(rsu["lidar_pose"][:2] - ego_pose[:2])) <= data.com_range
            # No return of an RSU falls in the own-body box that readers crop from every agent.
            assert len(remove_own_body_points(rsu["points"])) == len(rsu["points"]) > 1000


def test_v2x_same_seed_same_bytes_any_workers(v2x_data, tmp_path):
    out, _ = v2x_data
    again = tmp_path / "again"
    generate_dataset(again, preset=V2X_LITE, seed=0, workers=2, progress=False)
    assert _all_files(again) == _all_files(out)
