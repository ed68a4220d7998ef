"""Pedestrians and cyclists in the synthetic world (issue 38 point 4): where they move, how fast,
that the LiDAR sees them, that the formats with classes label them and the others do not, and
that the default presets still draw and write exactly what they did."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from opencood.config import load_config
from opencood.data.dairv2x import DairV2XSplit
from opencood.data.datasets import build_dataset
from opencood.data.numpy_yaml import NumpyYamlLoader
from opencood.data.pcd import read_pcd
from opencood.data.synthetic import (OBJECT_CLASSES, LidarConfig, Scene, Vehicle, cast_lidar,
                                     generate_dataset, get_preset, visible_vehicles)
from opencood.data.synthetic.camera import CameraConfig, render_camera
from opencood.data.synthetic.world import (ROAD_USER_KINDS, VEHICLE_KIND_NAMES, VEHICLE_KINDS,
                                           footprints_overlap)
from opencood.data.synthetic.writer import ALL_KINDS, rebuild_world
from opencood.data.synthetic.writer_dairv2x import ROOT_NAME, WORLD_ORIGIN, adapt_preset
from opencood.data.synthetic.writer_v2v4real import adapt_preset as v2v4real_adapt
from opencood.ops.transforms import apply_transform, pose_to_matrix
from opencood.strategies import choose_strategy
from tool_modules import load_tool

# Digests of what the default presets drew and wrote before road users existed (seed 0):
# the worlds of train scenario 0 and the files of the test split of ``tiny`` cut to 1 frame.
DEFAULT_WORLDS = {"tiny": "c85c1003b6497e35", "v2x_small": "cd69289275330350"}
DEFAULT_FILES = {"opv2v": "57e90a3df55faa2f", "dairv2x": "5a7f6956c9785627",
                 "v2v4real": "bf7ffce454ab113e"}
REPO = Path(__file__).resolve().parents[1]
BIG_RANGE = [-1000.0, -1000.0, -100.0, 1000.0, 1000.0, 100.0]


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))


def _world_digest(world) -> str:
    digest = hashlib.sha256()
    for track in world.tracks:
        digest.update(repr((track.actor_id, track.kind, track.extent, track.reflectivity,
                            track.speed_kmh)).encode())
        digest.update(track.poses.tobytes())
    for agent_id in world.agent_ids:
        digest.update(world.lidar_poses[agent_id].tobytes())
    return digest.hexdigest()[:16]


def _files_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.name != "generation.yaml":
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def test_default_presets_draw_and_write_what_they_did_and_road_users_come_last(tmp_path):
    for name, expected in DEFAULT_WORLDS.items():
        assert _world_digest(rebuild_world(get_preset(name), 0, "train", 0)) == expected, name
    one_frame = dataclasses.replace(get_preset("tiny"), frames=1)
    for data_format, expected in DEFAULT_FILES.items():
        out = tmp_path / data_format
        generate_dataset(out, preset=one_frame, progress=False, splits=("test",),
                         data_format=data_format)
        assert _files_digest(out) == expected, data_format
    # The multi-class world is the default one plus road users drawn after everything else.
    plain = rebuild_world(get_preset("tiny"), 0, "train", 0)
    multi = rebuild_world(get_preset("tiny_multiclass"), 0, "train", 0)
    vehicles = [t for t in multi.tracks if t.kind in VEHICLE_KIND_NAMES]
    assert [t.actor_id for t in vehicles] == [t.actor_id for t in plain.tracks]
    assert all(np.array_equal(a.poses, b.poses) for a, b in zip(vehicles, plain.tracks))
    assert multi.lidar_poses.keys() == plain.lidar_poses.keys()


def _lateral_and_along(grid, pose) -> tuple:
    """(signed offset from the centre line of the street the pose heads along, right of its
    heading positive; distance along that street to the nearest crossing street's centre)."""
    x, y, yaw = pose
    heading = np.array([np.cos(np.radians(yaw)), np.sin(np.radians(yaw))])
    if abs(heading[0]) > abs(heading[1]):            # along x: a street of constant y
        line = grid.ys[np.argmin(np.abs(grid.ys - y))]
        offset, along = y - line, np.abs(grid.xs - x).min()
    else:
        line = grid.xs[np.argmin(np.abs(grid.xs - x))]
        offset, along = x - line, np.abs(grid.ys - y).min()
    right = np.array([heading[1], -heading[0]])
    sign = np.sign(right[1] if abs(heading[0]) > abs(heading[1]) else right[0])
    return float(sign * offset), float(along)


def test_pedestrians_walk_sidewalks_or_crosswalks_and_cyclists_ride_the_curb_side():
    preset = get_preset("small_multiclass")
    town, users = preset.town, preset.road_users
    world = rebuild_world(preset, 0, "train", 0)
    walkers = crossers = cyclists = 0
    sidewalk = (town.lanes_per_direction * town.lane_width + town.parking_width,
                town.half_street)                                            # 6.0 .. 8.5 m
    for track in world.tracks:
        if track.kind in VEHICLE_KIND_NAMES:
            continue
        sizes = 2 * np.asarray(track.extent)
        assert all(low <= size <= high for size, (low, high)
                   in zip(sizes, ROAD_USER_KINDS[track.kind])), (track.kind, sizes)
        step = np.linalg.norm(np.diff(track.poses[:, :2], axis=0), axis=1)    # metres per frame
        speed = step * 3.6 / preset.frame_dt
        if track.kind == "pedestrian":
            assert 3.0 <= track.speed_kmh <= 6.0
            np.testing.assert_allclose(speed, track.speed_kmh, rtol=1e-6)    # straight lines
            for pose in track.poses:
                offset, along = _lateral_and_along(world.grid, pose)
                if sidewalk[0] <= offset <= sidewalk[1]:                    # on its right walk
                    assert sidewalk[0] + 0.9 - 1e-9 <= offset <= sidewalk[1] - 0.5 + 1e-9
                    assert along >= town.half_street - 1e-9   # between the building lines
                    walkers += 1
                else:     # crossing a street (heading across it): 9.5 m from the centre of
                    # the intersection beside it, from one sidewalk's middle to the other's
                    assert abs(offset) == pytest.approx(town.half_street + users.crosswalk_offset)
                    assert along <= (sidewalk[0] + sidewalk[1]) / 2 + 1e-9
                    crossers += 1
        else:
            assert 12.0 <= track.speed_kmh <= 20.0
            assert (speed <= track.speed_kmh + 1e-6).all()       # corners are cut: <= the arc
            assert (speed >= 0.9 * track.speed_kmh).all()
            for pose in track.poses:
                if min(abs(np.cos(np.radians(pose[2]))), abs(np.sin(np.radians(pose[2])))) < 1e-6:
                    offset, _ = _lateral_and_along(world.grid, pose)      # keeps right, curb
                    assert offset == pytest.approx(town.lane_width - users.cyclist_curb_gap)
                    cyclists += 1
    frames = preset.frames
    assert walkers >= 20 * frames and crossers >= frames and cyclists >= 10 * frames
    # No track touches another at any frame (footprints as they are, no margin).
    poses = np.stack([t.poses for t in world.tracks], axis=1)                  # (F, K, 3)
    extents = np.array([t.extent for t in world.tracks])
    for index, track in enumerate(world.tracks):
        if track.kind not in VEHICLE_KIND_NAMES:
            others = np.arange(len(world.tracks)) != index
            assert not footprints_overlap(track.poses, np.asarray(track.extent),
                                          poses[:, others], extents[others], margin=0.0)


def test_lidar_and_camera_see_a_pedestrian_ten_metres_away_and_only_class_formats_list_it():
    lidar = LidarConfig(beams=16, fov_deg=(-25.0, 5.0), azimuth_steps=360, max_range=60.0,
                        range_noise_std=0.0, dropout=0.0)
    walker = Vehicle(3001, 10.0, 0.0, 90.0, (0.3, 0.3, 0.875), kind="pedestrian")
    scene = Scene([], [walker])
    points, hit_ids = cast_lidar(scene, [0.0, 0.0, 1.9, 0.0, 0.0, 0.0], lidar,
                                 np.random.default_rng(0))
    on_walker = points[hit_ids == 3001]
    # It is 1.75 m tall, facing +y: legs (0 - 0.875 m up, 0.18 m deep), torso (to 1.505 m,
    # 0.3 m) and head (to 1.75 m, 0.135 m), near faces at x = 9.82, 9.7 and 9.865. 1 deg
    # azimuth steps see the 0.6 m torso at 10 m as 3-4 columns, the 2 deg beams between -10.6
    # deg (its foot) and -1.5 deg (its head) are 5, fewer columns on legs and head.
    assert 10 <= len(on_walker) <= 20
    height = on_walker[:, 2] + 1.9
    near_face = np.where(height < 0.875, 9.82, np.where(height < 1.505, 9.7, 9.865))
    np.testing.assert_allclose(on_walker[:, 0], near_face, atol=1e-4)
    assert {9.82, 9.7, 9.865} == set(near_face.tolist())
    # A cyclist side-on (1.8 m long along y, 0.6 m wide, 1.75 m tall): below 0.77 m only its
    # bicycle (0.15 m wide: near face x = 9.925), above 0.98 m only its rider (x = 9.7, over
    # y in [-0.405, 0.225]: its 0.63 m sits 0.09 m behind the middle).
    rider = Vehicle(3002, 10.0, 0.0, 90.0, (0.9, 0.3, 0.875), kind="cyclist")
    rider_points, rider_ids = cast_lidar(Scene([], [rider]), [0.0, 0.0, 1.9, 0.0, 0.0, 0.0],
                                         lidar, np.random.default_rng(0))
    on_rider = rider_points[rider_ids == 3002]
    height = on_rider[:, 2] + 1.9
    np.testing.assert_allclose(on_rider[height < 0.77, 0], 9.925, atol=1e-4)
    np.testing.assert_allclose(on_rider[height > 0.98, 0], 9.7, atol=1e-4)
    assert (height < 0.77).sum() >= 3 and (height > 0.98).sum() >= 3
    assert (-0.405 - 1e-4 <= on_rider[height > 0.98, 1]).all()
    assert (on_rider[height > 0.98, 1] <= 0.225 + 1e-4).all()
    assert list(visible_vehicles(hit_ids, scene.vehicles, [], ALL_KINDS)) == [3001]
    assert visible_vehicles(hit_ids, scene.vehicles, []) == {}     # OPV2V lists vehicles only
    # A camera 1.5 m up looking at it (80 x 60, f = 40 / tan 50 deg = 33.56 px, pixel centres
    # at integers): the torso spans u = 40 -+ 33.56 * 0.3 / 9.7 (columns 39-41) and v = 30 -
    # 33.56 * 0.005 / 9.7 to 30 + 33.56 * 0.625 / 9.7 = 32.2 (rows 30-32); the legs u = 40 -+
    # 33.56 * 0.18 / 9.82 (column 40) and v to 30 + 33.56 * 1.5 / 9.82 = 35.1 (rows 33-35);
    # the head, v 29.15 - 29.98, holds no pixel centre.
    image = render_camera(scene, [0.0, 0.0, 1.5, 0.0, 0.0, 0.0], CameraConfig(width=80, height=60))
    ids = np.where(image.face_buffer >= 0, image.face_ids[np.maximum(image.face_buffer, 0)], -9)
    expected = np.full(ids.shape, np.nan)
    expected[30:33, 39:42], expected[33:36, 40] = 9.7, 9.82
    np.testing.assert_array_equal(ids == 3001, np.isfinite(expected))
    np.testing.assert_allclose(image.depth[ids == 3001], expected[ids == 3001], atol=1e-5)
    assert {c.dairv2x for c in OBJECT_CLASSES.values()} == {"Car", "Van", "Truck", "Pedestrian",
                                                            "Cyclist"}
    assert set(OBJECT_CLASSES) == set(VEHICLE_KINDS) | set(ROAD_USER_KINDS)


def test_dair_labels_each_type_its_reader_keeps_vehicles_or_classes_others_list_vehicles(
        tmp_path):
    generate = load_tool("generate_synthetic")
    preset = generate.sized_preset("tiny", frames=1, multiclass=True)
    assert preset.name == "tiny_multiclass" and preset.road_users.pedestrians == 7
    assert generate.sized_preset("tiny").road_users is None
    dair, opv2v, v2v4real = tmp_path / "dair", tmp_path / "opv2v", tmp_path / "v2v4real"
    generate_dataset(dair, preset=preset, progress=False, splits=("test",),
                     data_format="dairv2x")
    generate_dataset(opv2v, preset=preset, progress=False, splits=("test",))
    generate_dataset(v2v4real, preset=preset, progress=False, splits=("test",),
                     data_format="v2v4real")
    record = yaml.safe_load((opv2v / "generation.yaml").read_text())
    assert record["preset_config"]["road_users"]["cyclists"] == 3
    world = rebuild_world(adapt_preset(preset), 0, "test", 0)       # DAIR's: 1 vehicle, 1 RSU
    centres = np.array([t.poses[0, :2] for t in world.tracks])
    root = dair / ROOT_NAME
    (label_file,) = (root / "cooperative" / "label_world").iterdir()
    labels = json.loads(label_file.read_text())
    for label in labels:                  # the box's world centre finds its track, hence kind
        centre = np.mean(label["world_8_points"], axis=0) - WORLD_ORIGIN
        nearest = np.argmin(np.linalg.norm(centres - centre[:2], axis=1))
        assert np.linalg.norm(centres[nearest] - centre[:2]) < 1e-4
        assert label["type"] == OBJECT_CLASSES[world.tracks[nearest].kind].dairv2x
    types = [label["type"] for label in labels]
    assert {"Pedestrian", "Cyclist"} <= set(types)
    sample = DairV2XSplit(root / "test.json").load_sample(0, gt_range=BIG_RANGE)
    assert len(sample["gt_boxes"]) == sum(t in ("Car", "Van", "Truck") for t in types)
    # Multi-class (postprocess.classes, cooperative labels): DAIR's merge (Van, Truck: Car),
    # class id = position in the list; the sizes tell the classes apart.
    cfg = load_config(REPO / "hypes_yaml/dairv2x/base.yaml", [
        f"validate_dir={root / 'test.json'}", "fusion.gt_source=cooperative",
        "postprocess.classes=[{name: Car, l: 3.9, w: 1.6, h: 1.56, z: -1.78}, "
        "{name: Pedestrian, l: 0.8, w: 0.6, h: 1.73, z: -0.6}, "
        "{name: Cyclist, l: 1.76, w: 0.6, h: 1.73, z: -0.6}]"])
    dataset = build_dataset(cfg, "validate", train=False,
                            strategy=choose_strategy(cfg, "intermediate"))
    sample = dataset[0]
    class_of_type = {"Car": 0, "Van": 0, "Truck": 0, "Pedestrian": 1, "Cyclist": 2}
    assert sample["gt_classes"].tolist() == [class_of_type[types[i]] for i in sample["gt_ids"]]
    lengths = sample["gt_boxes"][:, 5]                             # [x, y, z, h, w, l, yaw]
    for class_id, (low, high) in enumerate([(4.2, 10.0), (0.5, 0.8), (1.6, 1.9)]):
        in_class = lengths[sample["gt_classes"] == class_id]
        assert len(in_class) and ((low - 1e-3 <= in_class) & (in_class <= high + 1e-3)).all()
    # class Car is exactly the single-class reader's vehicles (Car, Van, Truck)
    multi = dataset.split
    ids = multi.sample_gt(0, BIG_RANGE)[0]
    info = multi.info(0)
    cars = ids[multi.object_classes(info.scenario, info.timestamp, ids) == 0]
    assert cars.tolist() == DairV2XSplit(root / "test.json").sample_gt(0, BIG_RANGE)[0].tolist()
    assert {types[i] for i in cars} == {"Car", "Van", "Truck"}
    with pytest.raises(ValueError, match="'Van' not a DAIR-V2X class"):
        DairV2XSplit(root / "test.json", classes=("Car", "Van"))
    with pytest.raises(ValueError, match="cooperative labels only"):
        DairV2XSplit(root / "test.json", classes=("Car",), gt_source="single_side")
    # OPV2V: road users are in the clouds, never in ``vehicles``.
    world = rebuild_world(preset, 0, "test", 0)
    road_users = {t.actor_id: t for t in world.tracks if t.kind not in VEHICLE_KIND_NAMES}
    hit = 0
    for params_file in sorted(opv2v.glob("test/*/*/*.yaml")):
        params = yaml.safe_load(params_file.read_text())
        assert set(params["vehicles"]).isdisjoint(road_users)
        points = apply_transform(read_pcd(params_file.with_suffix(".pcd")).astype(np.float64),
                                 pose_to_matrix(params["lidar_pose"]))
        for track in road_users.values():
            local = apply_transform(points, np.linalg.inv(pose_to_matrix(
                [*track.poses[0, :2], track.extent[2], 0.0, track.poses[0, 2], 0.0])))
            hit += int((np.abs(local[:, :3]) <= np.asarray(track.extent) + 0.05).all(1).any())
    assert hit >= 2
    # V2V4Real (cars only): every object's centre, back in the world, is a vehicle's.
    world = rebuild_world(v2v4real_adapt(preset), 0, "test", 0)
    kinds = {tuple(np.round(t.poses[0, :2], 3)): t.kind for t in world.tracks}
    listed = 0
    for params_file in sorted(v2v4real.glob("test/*/*/*.yaml")):
        params = yaml.load(params_file.read_text(), Loader=NumpyYamlLoader)
        for entry in params["vehicles"].values():
            centre = apply_transform(np.array([entry["location"]]), params["lidar_pose"])[0]
            assert kinds[tuple(np.round(centre[:2], 3))] in VEHICLE_KIND_NAMES
            listed += 1
    assert listed >= 10
