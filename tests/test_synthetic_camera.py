"""Synthetic cameras: OPV2V's camera conventions read back as HEAL reads them, a z-buffered
rasteriser that agrees with the ray-cast LiDAR, and the files the generator writes."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml
from PIL import Image

from opencood.data.synthetic import (GROUND_ID, Building, LidarConfig, Scene, Vehicle,
                                     cast_lidar, generate_dataset, get_preset)
from opencood.data.synthetic.camera import (SKY_ID, CameraConfig, depth_png, project_points,
                                            render_camera)
from opencood.data.synthetic.lidar import slab_intersect
from opencood.data.synthetic import writer_dairv2x
from opencood.data.synthetic.presets import with_rsu
from opencood.data.synthetic.world import World
from opencood.data.synthetic.writer import _DUMPER, photograph_agent, rebuild_world
from opencood.ops.transforms import matrix_to_pose, pose_to_matrix
from tests.tool_modules import load_tool

# HEAL's get_ext_int: camera -> lidar from the two UE4 poses, then UE4 axes -> OpenCV axes.
# Written out here (not imported) so that the test reads the files as a third party does.
HEAL_UE4_TO_OPENCV = np.array([[0, 0, 1, 0], [1, 0, 0, 0], [0, -1, 0, 0], [0, 0, 0, 1]],
                              dtype=np.float64)
FOCAL_800 = 400.0 / np.tan(np.radians(50.0))          # CARLA: W / (2 tan(fov / 2)), fov 100
SMALL = CameraConfig(width=400, height=300)


def _heal_camera_to_lidar(params, index):
    cords = params[f"camera{index}"]["cords"]
    camera_to_lidar = np.linalg.inv(pose_to_matrix(params["lidar_pose"])) @ pose_to_matrix(cords)
    return camera_to_lidar @ HEAL_UE4_TO_OPENCV


def _heal_pixel(params, index, point_lidar):
    """Pixel [u, v] and depth of a lidar-frame point, from the yaml as HEAL's reader takes it."""
    lidar_to_camera = np.linalg.inv(_heal_camera_to_lidar(params, index))
    camera = lidar_to_camera[:3, :3] @ point_lidar + lidar_to_camera[:3, 3]
    pixel = np.asarray(params[f"camera{index}"]["intrinsic"]) @ camera
    return pixel[:2] / pixel[2], camera[2]


def _one_cav_world(cav_id, lidar_pose):
    return World(grid=None, buildings=[], tracks=[], cav_ids=[cav_id],
                 lidar_poses={cav_id: np.asarray([lidar_pose])}, frames=1, dt=0.1)


# ------------------------------------------------------------------------------ conventions

def test_yaml_camera_params_read_as_heal_reads_them_put_a_corner_on_its_pixel():
    # A CAV heading +y (yaw 90) with its lidar at (10, 5, 1.9): the vehicle origin is 0.5 m
    # ahead, at (10, 5.5), so the front camera (2.5 m ahead, 1 m up) is at (10, 8, 1).
    # A car ahead, centred at (10, 25.5), heading +y, half extents (2.25, 1.0, 0.75): its rear
    # top corner on its left (local (-2.25, +1, 1.5)) is at world (9, 23.25, 1.5). Seen from the
    # camera that is 15.25 m ahead, 1 m to the right (UE4: +y right; the car's left side is the
    # world's -x side here, the camera's right) and 0.5 m up:
    # u = 400 + f / 15.25, v = 300 - 0.5 f / 15.25.
    lidar_pose = [10.0, 5.0, 1.9, 0.0, 90.0, 0.0]
    car = Vehicle(4321, 10.0, 25.5, 90.0, (2.25, 1.0, 0.75))
    params = {"lidar_pose": lidar_pose}
    images = photograph_agent(_one_cav_world(1000, lidar_pose), 1000, Scene([], [car]), params,
                              CameraConfig())
    params = yaml.safe_load(yaml.dump(params, Dumper=_DUMPER))
    front = params["camera0"]
    np.testing.assert_allclose(front["cords"], [10.0, 8.0, 1.0, 0.0, 90.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(front["intrinsic"], [[FOCAL_800, 0, 400], [0, FOCAL_800, 300],
                                                    [0, 0, 1]], atol=1e-6)
    # The extrinsic is OpenCDA's lidar -> camera in UE4 axes: the inverse of HEAL's matrix
    # before its axis change.
    np.testing.assert_allclose(
        front["extrinsic"], np.linalg.inv(_heal_camera_to_lidar(params, 0)
                                          @ np.linalg.inv(HEAL_UE4_TO_OPENCV)), atol=1e-6)
    corner_lidar = np.linalg.inv(pose_to_matrix(lidar_pose))[:3] @ [9.0, 23.25, 1.5, 1.0]
    (u, v), depth = _heal_pixel(params, 0, corner_lidar)
    np.testing.assert_allclose([u, v, depth],
                               [400 + FOCAL_800 / 15.25, 300 - 0.5 * FOCAL_800 / 15.25, 15.25],
                               atol=1e-4)
    # The picture agrees: the car just inside that corner (left of it and below), not outside.
    ids = images[0].ids
    row, col = int(round(v)), int(round(u))
    assert ids[row + 2, col - 2] == 4321 and ids[row - 2, col + 2] != 4321
    assert ids[row + 2, col + 2] != 4321 and ids[row - 2, col - 2] != 4321
    # The other cameras (right, left, back) look 100, -100 and 180 deg off the heading.
    yaws = [params[f"camera{i}"]["cords"][4] for i in range(4)]
    np.testing.assert_allclose(yaws, [90.0, -170.0, -10.0, -90.0], atol=1e-6)
    assert not (images[3].ids == 4321).any()          # the back camera does not see it


def test_occlusion_is_by_depth_not_by_drawing_order():
    # A car at 10 m in front of a wall at 30 m, straight ahead of a camera 1 m up looking +x.
    car = Vehicle(1111, 12.25, 0.0, 0.0, (2.25, 1.0, 0.75))
    wall = Building(-2, 32.0, 0.0, half_length=2.0, half_width=20.0, height=10.0)
    cords = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    image = render_camera(Scene([wall], [car]), cords, SMALL)
    centre_row, centre_col = SMALL.height // 2, SMALL.width // 2
    assert image.ids[centre_row, centre_col] == 1111
    assert image.depth[centre_row, centre_col] == pytest.approx(10.0, abs=1e-4)
    above = image.ids[:, centre_col]
    assert (above == -2).any() and (above == GROUND_ID).any() and (above == SKY_ID).any()
    np.testing.assert_allclose(image.depth[above == -2, centre_col], 30.0, atol=1e-3)
    # Each pixel shows whichever of the two, rendered alone, is nearer there.
    car_only = render_camera(Scene([], [car]), cords, SMALL)
    wall_only = render_camera(Scene([wall], []), cords, SMALL)
    nearer = np.where(car_only.depth <= wall_only.depth, car_only.ids, wall_only.ids)
    np.testing.assert_array_equal(image.ids, nearer)
    # The ground at row v is at depth 1 m * f / (v - cy) (camera 1 m up, looking level).
    row = SMALL.height - 1
    focal = SMALL.width / 2 / np.tan(np.radians(50.0))
    assert image.ids[row, 0] == GROUND_ID
    assert image.depth[row, 0] == pytest.approx(focal / (row - SMALL.height / 2), rel=1e-5)


def test_a_wall_reaching_behind_the_camera_is_clipped_at_the_near_plane():
    # A wall face along y = 5 from x = -50 to 50 (UE4 +y is the camera's right): the ray of
    # column u (xn = (u - cx) / f to the right per metre ahead) meets it at depth 5 / xn.
    wall = Building(-7, 0.0, 6.0, half_length=50.0, half_width=1.0, height=8.0)
    image = render_camera(Scene([wall]), [0.0, 0.0, 1.5, 0.0, 0.0, 0.0], SMALL)
    focal = SMALL.width / 2 / np.tan(np.radians(50.0))
    for col in (250, 320, 399):
        xn = (col - SMALL.width / 2) / focal
        assert image.ids[SMALL.height // 2, col] == -7
        assert image.depth[SMALL.height // 2, col] == pytest.approx(5.0 / xn, rel=1e-5)
    assert image.ids[SMALL.height // 2, 150] == SKY_ID        # left of centre: open sky


# ------------------------------------------------------------------- agreement with the LiDAR

def _unoccluded(camera_center, points_world, scene, exclude_ids):
    """(N,) bool: no box of the scene cuts the segment camera -> point (exact slab test)."""
    centers, half_sizes, yaws, ids, _ = scene.box_arrays()
    keep = ~np.isin(ids, exclude_ids)
    offsets = points_world - camera_center
    distance = np.linalg.norm(offsets, axis=1)
    t_near, _ = slab_intersect(camera_center, offsets / distance[:, None], centers[keep],
                               half_sizes[keep], yaws[keep])
    return (t_near >= distance[:, None] - 1e-3).all(axis=1)


def test_lidar_returns_land_on_the_pixels_of_the_object_they_hit():
    preset = get_preset("tiny")
    world = rebuild_world(preset, 0, "train", 0)
    scene, ego = world.scene_at(0), world.cav_ids[0]
    lidar_pose = [round(float(v), 6) for v in world.lidar_poses[ego][0]]
    lidar = dataclasses.replace(preset.lidar, range_noise_std=0.0, dropout=0.0)
    points, hit_ids = cast_lidar(scene, lidar_pose, lidar, np.random.default_rng(0),
                                 exclude_ids=[ego])
    points_world = points[:, :3].astype(np.float64) @ pose_to_matrix(lidar_pose)[:3, :3].T \
        + pose_to_matrix(lidar_pose)[:3, 3]
    params = {"lidar_pose": lidar_pose}
    # OPV2V's 800 x 600: a return within half a pixel of a silhouette may round to the pixel
    # beyond it, so smaller images put more of them on edges (400 x 300: 98.8% in one camera).
    full = CameraConfig()
    images = photograph_agent(world, ego, scene, params, full)
    checked, kinds = 0, set()
    for index, image in enumerate(images):
        cords = params[f"camera{index}"]["cords"]
        pixels, depth = project_points(points_world, cords, full)
        cols, rows = np.rint(pixels[:, 0]).astype(int), np.rint(pixels[:, 1]).astype(int)
        seen = (depth > full.near) & (cols >= 0) & (cols < full.width) & (rows >= 0) & \
            (rows < full.height)
        seen[seen] = _unoccluded(pose_to_matrix(cords)[:3, 3], points_world[seen], scene, [ego])
        agree = images[index].ids[rows[seen], cols[seen]] == hit_ids[seen]
        assert agree.mean() >= 0.99, (index, agree.mean())
        checked += int(seen.sum())
        kinds |= {"ground" if i == GROUND_ID else "building" if i < 0 else "vehicle"
                  for i in hit_ids[seen].tolist()}
    assert checked > 2000 and kinds == {"ground", "building", "vehicle"}


def test_every_pixel_is_what_an_exact_ray_through_its_centre_hits():
    """Pixels drawn at random from each camera of a real frame: the rasteriser's object id and
    depth equal those of an exact ray cast (slab test and ground plane) through the centre."""
    world = rebuild_world(get_preset("tiny"), 0, "train", 0)
    scene, ego = world.scene_at(1), world.cav_ids[-1]
    params = {"lidar_pose": [round(float(v), 6) for v in world.lidar_poses[ego][1]]}
    images = photograph_agent(world, ego, scene, params, SMALL)
    centers, half_sizes, yaws, ids, _ = scene.box_arrays()
    keep = ids != ego
    rng = np.random.default_rng(0)
    focal = SMALL.width / 2 / np.tan(np.radians(50.0))
    for index, image in enumerate(images):
        rows, cols = rng.integers(0, SMALL.height, 1500), rng.integers(0, SMALL.width, 1500)
        camera_to_world = pose_to_matrix(params[f"camera{index}"]["cords"]) @ HEAL_UE4_TO_OPENCV
        rays = np.stack([(cols - SMALL.width / 2) / focal, (rows - SMALL.height / 2) / focal,
                         np.ones(len(rows))], axis=1)               # OpenCV axes, z = 1
        dirs = rays @ camera_to_world[:3, :3].T
        origin = camera_to_world[:3, 3]
        lengths = np.linalg.norm(dirs, axis=1)
        t_box, _ = slab_intersect(origin, dirs / lengths[:, None], centers[keep],
                                  half_sizes[keep], yaws[keep])
        nearest = t_box.argmin(axis=1)
        box_depth = t_box[np.arange(len(rows)), nearest] / lengths    # z-depth (ray z = 1)
        with np.errstate(divide="ignore"):
            ground_depth = np.where(dirs[:, 2] < 0, -origin[2] / dirs[:, 2], np.inf)
        expected_ids = np.where(box_depth < ground_depth, ids[keep][nearest],
                                np.where(np.isfinite(ground_depth), GROUND_ID, SKY_ID))
        expected_depth = np.minimum(box_depth, ground_depth)
        agree = image.ids[rows, cols] == expected_ids
        assert agree.mean() >= 0.998, (index, agree.mean())
        finite = agree & np.isfinite(expected_depth)
        np.testing.assert_allclose(image.depth[rows, cols][finite], expected_depth[finite],
                                   rtol=1e-4)
        assert len(set(expected_ids.tolist())) > 3


# ---------------------------------------------------------------------------------- files

def test_depth_png_holds_metres_as_heal_reads_them():
    depth = np.array([[0.4, 12.4, 12.6], [254.7, 300.0, np.inf]])
    np.testing.assert_array_equal(depth_png(depth), [[0, 12, 13], [255, 255, 255]])
    assert depth_png(depth).dtype == np.uint8


TINY_CAMERAS = dataclasses.replace(
    with_rsu(get_preset("tiny"), "tiny_rsu"), frames=1,
    cameras=CameraConfig(width=80, height=60, depth=True))


@pytest.fixture(scope="module")
def camera_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("syn_cam")
    generate_dataset(out, preset=TINY_CAMERAS, seed=0, progress=False, splits=("test",))
    return out


def test_generator_writes_four_cameras_per_agent_rsu_included(camera_data):
    agents = sorted(p for p in (camera_data / "test").glob("*/*") if p.is_dir())
    assert any(a.name == "-1" for a in agents) and len(agents) >= 3
    for agent in agents:
        (stamp,) = [p.stem for p in agent.glob("*.pcd")]
        params = yaml.safe_load((agent / f"{stamp}.yaml").read_text())
        for index in range(4):
            rgb = Image.open(agent / f"{stamp}_camera{index}.png")
            depth = Image.open(agent / f"{stamp}_depth{index}.png")
            assert rgb.mode == "RGB" and rgb.size == (80, 60)
            assert depth.mode == "L" and depth.size == (80, 60)
            entry = params[f"camera{index}"]
            assert sorted(entry) == ["cords", "extrinsic", "intrinsic"]
            focal = 40.0 / np.tan(np.radians(50.0))
            np.testing.assert_allclose(entry["intrinsic"], [[focal, 0, 40], [0, focal, 30],
                                                            [0, 0, 1]], atol=1e-6)
        pitch = params["camera0"]["cords"][5]
        assert pitch == (-35.0 if agent.name == "-1" else pytest.approx(params["lidar_pose"][5],
                                                                       abs=1e-5))


def test_cameras_same_seed_same_bytes_and_lidar_files_unchanged(camera_data, tmp_path):
    again = tmp_path / "again"
    generate_dataset(again, preset=TINY_CAMERAS, seed=0, workers=2, progress=False,
                     splits=("test",))
    files = sorted(p.relative_to(camera_data) for p in (camera_data / "test").rglob("*.*"))
    assert len(files) > 30
    for name in files:
        assert (again / name).read_bytes() == (camera_data / name).read_bytes(), name
    # Without cameras: the same point clouds, and yaml files that differ by the camera keys only.
    plain = tmp_path / "plain"
    generate_dataset(plain, preset=dataclasses.replace(TINY_CAMERAS, cameras=None), seed=0,
                     progress=False, splits=("test",))
    for name in (n for n in files if n.suffix in (".pcd", ".yaml")):
        old, new = camera_data / name, plain / name
        if name.suffix == ".pcd":
            assert new.read_bytes() == old.read_bytes()
        else:
            with_cameras = yaml.safe_load(old.read_text())
            assert yaml.safe_load(new.read_text()) == {
                k: v for k, v in with_cameras.items() if not k.startswith("camera")}
    assert not list(plain.rglob("*.png"))


def test_cameras_refused_for_other_formats(tmp_path):
    with pytest.raises(ValueError, match="opv2v and dairv2x formats only, not 'v2v4real'"):
        generate_dataset(tmp_path / "x", preset=TINY_CAMERAS, data_format="v2v4real",
                         progress=False)


def test_generate_cli_cameras_are_opt_in(tmp_path, capsys):
    cli = load_tool("generate_synthetic")
    out = tmp_path / "data"
    assert cli.main(["--out", str(out), "--preset", "tiny", "--frames", "1", "--splits", "test",
                     "--cameras", "--camera-size", "40", "30", "--quiet"]) == 0
    pictures = sorted(p for p in out.rglob("*.png") if not p.name.endswith("_visibility.png"))
    assert pictures and all(p.stem.split("_")[1] in {f"camera{i}" for i in range(4)}
                            for p in pictures)
    # and HEAL's camera label of every agent frame (tests/test_camera_visibility.py)
    assert len(list(out.rglob("*_bev_visibility.png"))) == len(pictures) // 4
    assert Image.open(pictures[0]).size == (40, 30)
    record = yaml.safe_load((out / "generation.yaml").read_text())
    assert record["preset_config"]["cameras"] == {"width": 40, "height": 30, "fov_deg": 100.0,
                                                  "depth": False, "near": 0.05}
    capsys.readouterr()
    assert cli.main(["--out", str(tmp_path / "x"), "--preset", "tiny", "--depth"]) == 2
    assert cli.main(["--out", str(tmp_path / "x"), "--preset", "tiny", "--cameras",
                     "--camera-size", "1", "30"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --camera-size and --depth need --cameras",
        "error: --camera-size must be at least 2 x 2 pixels, got 1 30"]
    # The picture tool draws the yaml's boxes into the 4 images, in a 2 x 2 grid.
    agent = sorted((out / "test").glob("*/*"))[0]
    picture = load_tool("synthetic_camera_picture")
    assert picture.main(["--agent", str(agent), "--out", str(tmp_path / "grid.png"),
                         "--scale", "1"]) == 0
    grid = np.asarray(Image.open(tmp_path / "grid.png"))
    assert grid.shape == (60, 80, 3)
    assert picture.main(["--agent", str(tmp_path), "--out", str(tmp_path / "no.png")]) == 2


# --------------------------------------------------------------------------------- DAIR-V2X-C

def _dair_json(root, relative):
    return json.loads((root / relative).read_text())


def _dair_calib(entry) -> np.ndarray:
    """HEAL's rot_and_trans_to_trasnformation_matrix: {rotation, translation} -> (4, 4)."""
    matrix = np.eye(4)
    matrix[:3, :3] = entry["rotation"]
    matrix[:3, 3] = np.asarray(entry["translation"])[:, 0]
    return matrix


def test_dairv2x_cameras_read_back_as_heal_reads_them_reproduce_their_pictures(tmp_path):
    """Each side's camera pose, rebuilt from the files as a DAIR reader chains them (LiDAR ->
    world, then lidar_to_camera in OpenCV axes with cam_K), renders the written picture."""
    cfg = CameraConfig(width=160, height=120)
    preset = dataclasses.replace(get_preset("tiny"), frames=1, cameras=cfg)
    generate_dataset(tmp_path, preset=preset, seed=0, progress=False, splits=("test",),
                     data_format="dairv2x")
    root = tmp_path / writer_dairv2x.ROOT_NAME
    (pair,) = _dair_json(root, "cooperative/data_info.json")
    world = rebuild_world(writer_dairv2x.adapt_preset(preset), 0, "test", 0)
    scene = world.scene_at(0)
    vehicle_info, rsu_info = (_dair_json(root, f"{side}/data_info.json")[0]
                              for side in ("vehicle-side", "infrastructure-side"))
    novatel_to_world = _dair_json(root, "vehicle-side/" + vehicle_info[
        "calib_novatel_to_world_path"])
    lidar_to_novatel = _dair_json(root, "vehicle-side/" + vehicle_info[
        "calib_lidar_to_novatel_path"])["transform"]
    vehicle_to_world = _dair_calib(novatel_to_world) @ _dair_calib(lidar_to_novatel)
    rsu_to_world = _dair_calib(_dair_json(root, "infrastructure-side/" + rsu_info[
        "calib_virtuallidar_to_world_path"]))
    rsu_to_world[:2, 3] += [pair["system_error_offset"]["delta_x"],
                            pair["system_error_offset"]["delta_y"]]
    sides = (("vehicle-side", vehicle_info, vehicle_to_world, "calib_lidar_to_camera_path",
              pair["vehicle_image_path"], [world.cav_ids[0]]),
             ("infrastructure-side", rsu_info, rsu_to_world,
              "calib_virtuallidar_to_camera_path", pair["infrastructure_image_path"], []))
    for side, info, lidar_to_world, calib_key, image_path, exclude in sides:
        lidar_to_camera = _dair_calib(_dair_json(root, f"{side}/{info[calib_key]}"))
        intrinsic = np.reshape(
            _dair_json(root, f"{side}/{info['calib_camera_intrinsic_path']}")["cam_K"], (3, 3))
        np.testing.assert_allclose(intrinsic, [[80 / np.tan(np.radians(50)), 0, 80],
                                               [0, 80 / np.tan(np.radians(50)), 60], [0, 0, 1]])
        opencv_to_town = lidar_to_world @ np.linalg.inv(lidar_to_camera)
        opencv_to_town[:3, 3] -= writer_dairv2x.WORLD_ORIGIN
        cords = matrix_to_pose(opencv_to_town @ np.linalg.inv(HEAL_UE4_TO_OPENCV))
        expected = render_camera(scene, cords, cfg, exclude_ids=exclude).rgb
        written = np.asarray(Image.open(root / image_path).convert("RGB"))
        assert written.shape == (120, 160, 3)
        assert np.abs(written.astype(float) - expected).mean() < 3.0, side   # JPEG: ~1.5-2
        # A camera turned by 10 degrees would not reproduce it.
        turned = render_camera(scene, np.add(cords, [0, 0, 0, 0, 10.0, 0]), cfg,
                               exclude_ids=exclude).rgb
        assert np.abs(written.astype(float) - turned).mean() > 6.0, side
