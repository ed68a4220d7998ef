"""Write synthetic scenarios as DAIR-V2X-C files (``generate_synthetic.py --format dairv2x``).

One vehicle and one roadside unit at the intersection it drives towards (the ``v2x`` presets'
RSU: a LiDAR 4-5 m up on a pole, looking down), written under
``<out>/cooperative-vehicle-infrastructure/`` in the layout opencood.data.dairv2x reads:

* world coordinates are the town's shifted by ``WORLD_ORIGIN`` (a UTM-like offset of hundreds
  of kilometres, as DAIR's world frame has: float32 poses would lose centimetres);
* vehicle pose = ``novatel_to_world`` @ ``lidar_to_novatel`` (a fixed mount ``LIDAR_TO_NOVATEL``);
  the roadside unit's cloud and pose are in a *virtual* LiDAR frame, as DAIR's are: the pole's
  LiDAR lowered to ``VIRTUAL_LIDAR_HEIGHT`` above the ground (level, same x, y, yaw), so its
  ground and cars fall in the z range of the vehicle's configs; its ``virtuallidar_to_world``
  is written with the translation minus the pair's ``system_error_offset`` (non-zero, drawn per
  scenario), which a reader adds back;
* ``cooperative/label_world``: world 8-corner boxes (DAIR's corner order) of every object either
  agent's LiDAR hits (CoAlign's complemented labels), each with its own ``type`` (the world
  kind's ``OBJECT_CLASSES`` name: Car, Van, Truck and, in multi-class worlds, Pedestrian and
  Cyclist; readers keep the vehicle types); ``label_world_backup``: the original kind,
  only those in front of the vehicle (x > 0 in its lidar frame, where DAIR's camera looks);
* single-side labels, as DAIR ships them (HEAL's reader opens them for every pair; HEAL's
  DAIR GT is made of them): ``vehicle-side/label/lidar`` (what the vehicle's LiDAR hits, in its
  lidar frame; CoAlign's complemented kind), ``vehicle-side/label/lidar_backup`` (those in
  front, the original kind) and ``infrastructure-side/label/virtuallidar`` (what the roadside
  unit hits, in its virtual LiDAR frame): ``3d_location`` the box centre, ``rotation`` its yaw
  in that frame. As on real DAIR-V2X-C, where each side was annotated on its own, they are not
  the cooperative boxes: each box is off by its own small error (``SIDE_LABEL_ERROR``: centre,
  sizes, yaw) and a box is missing with probability ``SIDE_LABEL_MISS`` (drawn from the
  scenario's own stream, so the scans draw as in the other formats);
* clouds: binary PCD ``x y z intensity`` with intensity in 0..255 (the synthetic 0..1 times 256);
* ids: vehicle frames ``100000 + 1000 * scenario + frame``, roadside frames ``500000 + ...``;
  ``train.json``, ``val.json``, ``test.json`` list the vehicle frame ids of each split, not
  sorted (real split files are not): the split's sequences interleaved frame by frame, each
  one's frames latest first (:func:`split_order`);
* with cameras (``--cameras``), one per side as DAIR has: ``image/<frame>.jpg`` rendered as the
  OPV2V writer renders (camera.py; the vehicle's is OPV2V's front camera, the roadside unit's
  its front camera on the pole, pitched down), ``calib/camera_intrinsic`` ({cam_K: 9 numbers,
  cam_D: 5 zeros, no distortion}) and ``calib/lidar_to_camera`` (vehicle) or
  ``calib/virtuallidar_to_camera`` (roadside unit): LiDAR -> camera in OpenCV axes (x right,
  y down, z forward) as DAIR's files and HEAL's reader (no axis change) have them. The image
  size is the ``CameraConfig``'s (800 x 600, fov 100 by default), not DAIR's 1920 x 1080.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import cv2
import numpy as np

from opencood.data.pcd import write_pcd
from opencood.data.synthetic.camera import (UE4_FROM_OPENCV, CameraConfig, intrinsic_matrix,
                                            render_camera, rsu_camera_cords,
                                            vehicle_camera_cords)
from opencood.data.synthetic.presets import RSU_FOV_DEG, Preset
from opencood.data.synthetic.world import LIDAR_MOUNT_X, OBJECT_CLASSES, RsuConfig
from opencood.data.synthetic.writer import (OutputDirError, sample_visibility, scan_frames,
                                            scenario_seed)
from opencood.ops.transforms import pose_to_matrix

ROOT_NAME = "cooperative-vehicle-infrastructure"
OUTPUT_NAMES = (ROOT_NAME,)
SPLIT_FILES = {"train": "train.json", "validate": "val.json", "test": "test.json"}
WORLD_ORIGIN = np.array([456_000.0, 4_403_000.0, 20.0])     # metres added to the town frame
LIDAR_TO_NOVATEL = pose_to_matrix([0.92, -0.04, 1.35, 0.3, 1.2, -0.4])
MAX_FRAMES = 1000                                            # frame ids step by scenario * 1000
OFFSET_RANGE = (-1.5, 1.5)                                   # metres, system_error_offset
VIRTUAL_LIDAR_HEIGHT = 1.9                                   # metres above the ground
# A single-side label's own error, standard deviations: centre x, y, z (m), sizes (relative),
# yaw (rad); and the chance that a side left a box it saw unlabelled.
SIDE_LABEL_ERROR = {"xy": 0.08, "z": 0.04, "size": 0.02, "yaw": 0.02}
SIDE_LABEL_MISS = 0.1

# The DAIR-V2X-C writer writes its image folders and camera calibration (--cameras).
WRITES_CAMERAS = True


def virtual_lidar(points: np.ndarray, pose) -> tuple:
    """A roadside unit's cloud (N, 4) and pose [x, y, z, roll, yaw, pitch] (level, z its height
    above the ground) -> the same in its virtual LiDAR frame, ``VIRTUAL_LIDAR_HEIGHT`` up."""
    drop = float(pose[2]) - VIRTUAL_LIDAR_HEIGHT
    lowered = np.asarray(points, dtype=np.float32).copy()
    lowered[:, 2] += np.float32(drop)
    return lowered, virtual_lidar_pose(pose)


def virtual_lidar_pose(pose) -> list:
    """The pose of a roadside unit's virtual LiDAR: its own, lowered to VIRTUAL_LIDAR_HEIGHT."""
    return [pose[0], pose[1], VIRTUAL_LIDAR_HEIGHT, pose[3], pose[4], pose[5]]


def adapt_preset(preset: Preset) -> Preset:
    """``preset`` with one vehicle and one roadside unit (the v2x presets' RSU), 10 Hz ids."""
    if preset.frames >= MAX_FRAMES:
        raise ValueError(f"the dairv2x format numbers at most {MAX_FRAMES - 1} frames per "
                         f"scenario, got {preset.frames}")
    rsu = preset.rsu or RsuConfig(lidar=dataclasses.replace(preset.lidar, fov_deg=RSU_FOV_DEG))
    town = dataclasses.replace(preset.town, cavs=(1, 1))
    return dataclasses.replace(preset, town=town, rsu=dataclasses.replace(rsu, count=(1, 1)),
                               com_range=100.0)


def frame_ids(global_index: int, frame: int) -> tuple:
    """(vehicle frame id, infrastructure frame id), 6 digits, never equal."""
    number = 1000 * global_index + frame
    return f"{100000 + number:06d}", f"{500000 + number:06d}"


def system_error_offset(seed: int, split: str, index: int) -> dict:
    """The scenario's {delta_x, delta_y}: its own stream, so the scans draw as in other formats."""
    rng = np.random.default_rng(scenario_seed(seed, split, index).spawn(4)[3])
    delta_x, delta_y = rng.uniform(*OFFSET_RANGE, size=2)
    return {"delta_x": round(float(delta_x), 6), "delta_y": round(float(delta_y), 6)}


def calib_json(matrix: np.ndarray) -> dict:
    """DAIR's {rotation (3x3), translation ([[x], [y], [z]])} of a (4, 4)."""
    return {"rotation": matrix[:3, :3].tolist(), "translation": matrix[:3, 3:4].tolist()}


def dair_corners(entry: dict) -> np.ndarray:
    """(8, 3) world corners of an OPV2V world entry in DAIR's order: bottom face
    (+l/2, +w/2), (+l/2, -w/2), (-l/2, -w/2), (-l/2, +w/2), then the top face."""
    half_l, half_w, half_h = entry["extent"]
    local = np.array([[1, 1, -1], [1, -1, -1], [-1, -1, -1], [-1, 1, -1],
                      [1, 1, 1], [1, -1, 1], [-1, -1, 1], [-1, 1, 1]]) * [half_l, half_w, half_h]
    pose = [entry["location"][i] + entry["center"][i] for i in range(3)] + list(entry["angle"])
    box_to_world = pose_to_matrix(pose)
    return local @ box_to_world[:3, :3].T + box_to_world[:3, 3] + WORLD_ORIGIN


def label(entry: dict, kind: str) -> dict:
    corners = dair_corners(entry)
    half_l, half_w, half_h = entry["extent"]
    return {"type": OBJECT_CLASSES[kind].dairv2x, "occluded_state": 0, "truncated_state": 0,
            "3d_dimensions": {"h": 2 * half_h, "w": 2 * half_w, "l": 2 * half_l},
            "3d_location": dict(zip("xyz", corners.mean(axis=0).tolist())),
            "rotation": float(np.radians(entry["angle"][1])),
            "world_8_points": corners.tolist()}


def side_label(entry: dict, kind: str, world_to_lidar: np.ndarray, error=None) -> dict:
    """A single-side label (DAIR's ``label/lidar`` kind) of an OPV2V world entry, in the lidar
    frame ``world_to_lidar`` (4, 4) maps DAIR's world to: centre, sizes and yaw of the box.
    ``error``: (7,) added to [x, y, z], multiplying [h, w, l] by 1 + it, added to the yaw."""
    error = np.zeros(7) if error is None else np.asarray(error, dtype=np.float64)
    corners = dair_corners(entry) @ world_to_lidar[:3, :3].T + world_to_lidar[:3, 3]
    half_l, half_w, half_h = entry["extent"]
    forward = corners[0] - corners[3]                   # +l/2 minus -l/2 along the box's x
    h, w, length = 2 * np.array([half_h, half_w, half_l]) * (1.0 + error[3:6])
    return {"type": OBJECT_CLASSES[kind].dairv2x, "occluded_state": 0, "truncated_state": 0,
            "alpha": 0.0, "3d_dimensions": {"h": float(h), "w": float(w), "l": float(length)},
            "3d_location": dict(zip("xyz", (corners.mean(axis=0) + error[:3]).tolist())),
            "rotation": float(np.arctan2(forward[1], forward[0]) + error[6])}


def side_label_draws(rng: np.random.Generator, count: int) -> tuple:
    """(errors (count, 7), kept (count,) bool) of one side's labels of one frame."""
    sigma = SIDE_LABEL_ERROR
    scale = np.array([sigma["xy"], sigma["xy"], sigma["z"]] + [sigma["size"]] * 3 +
                     [sigma["yaw"]])
    errors = rng.normal(size=(count, 7)) * scale
    return errors, rng.random(count) >= SIDE_LABEL_MISS


def side_label_rng(seed: int, split: str, index: int) -> np.random.Generator:
    """The scenario's stream of single-side label errors, apart from the scans' streams."""
    return np.random.default_rng(scenario_seed(seed, split, index).spawn(5)[4])


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))


def _write_cloud(path: Path, points: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = points.astype(np.float32).copy()
    raw[:, 3] *= 256.0                       # DAIR stores 0..255; readers divide by 256
    write_pcd(path, raw, intensity_field="intensity", data="binary")


def write_pair(root: Path, world, frame: int, scans: dict, ids: tuple, offset: dict,
               label_rng: np.random.Generator) -> dict:
    """Write one (vehicle, roadside unit) frame pair; returns its data_info entries.
    ``label_rng``: the single-side labels' errors and misses."""
    vehicle_id, rsu_id = world.cav_ids[0], world.rsu_ids[0]
    vehicle_frame, rsu_frame = ids
    lidar_to_world = pose_to_matrix(world.lidar_poses[vehicle_id][frame])
    lidar_to_world[:3, 3] += WORLD_ORIGIN
    rsu_points, rsu_pose = virtual_lidar(scans[rsu_id][0], world.lidar_poses[rsu_id][frame])
    rsu_to_world = pose_to_matrix(rsu_pose)
    rsu_to_world[:3, 3] += WORLD_ORIGIN
    rsu_calib = rsu_to_world.copy()
    rsu_calib[:2, 3] -= [offset["delta_x"], offset["delta_y"]]
    calib = root / "vehicle-side" / "calib"
    _write_json(calib / "lidar_to_novatel" / f"{vehicle_frame}.json",
                {"transform": calib_json(LIDAR_TO_NOVATEL)})
    _write_json(calib / "novatel_to_world" / f"{vehicle_frame}.json",
                calib_json(lidar_to_world @ np.linalg.inv(LIDAR_TO_NOVATEL)))
    _write_json(root / "infrastructure-side" / "calib" / "virtuallidar_to_world" /
                f"{rsu_frame}.json", calib_json(rsu_calib))
    _write_cloud(root / "vehicle-side" / "velodyne" / f"{vehicle_frame}.pcd", scans[vehicle_id][0])
    _write_cloud(root / "infrastructure-side" / "velodyne" / f"{rsu_frame}.pcd", rsu_points)
    _write_labels(root, world, vehicle_frame, scans, lidar_to_world)
    _write_side_labels(root / "vehicle-side" / "label", vehicle_frame, world,
                       scans[vehicle_id][1], lidar_to_world, ("lidar", "lidar_backup"),
                       label_rng)
    _write_side_labels(root / "infrastructure-side" / "label", rsu_frame, world,
                       scans[rsu_id][1], rsu_to_world, ("virtuallidar", None), label_rng)
    return _pair_info(vehicle_frame, rsu_frame, offset)


def write_cameras(root: Path, world, frame: int, ids: tuple, cfg: CameraConfig) -> None:
    """One camera per side: ``image/<frame>.jpg`` and its calib files (module docstring)."""
    vehicle_id, rsu_id = world.cav_ids[0], world.rsu_ids[0]
    vehicle_pose = world.lidar_poses[vehicle_id][frame]
    rsu_pose = world.lidar_poses[rsu_id][frame]
    scene = world.scene_at(frame)
    sides = (("vehicle-side", ids[0], vehicle_camera_cords(vehicle_pose, LIDAR_MOUNT_X)[0],
              vehicle_pose, [vehicle_id], "lidar_to_camera"),
             ("infrastructure-side", ids[1], rsu_camera_cords(rsu_pose)[0],
              virtual_lidar_pose(rsu_pose), [], "virtuallidar_to_camera"))
    intrinsic = {"cam_K": intrinsic_matrix(cfg).ravel().tolist(), "cam_D": [0.0] * 5}
    for side, frame_id, cords, lidar_pose, exclude, calib_name in sides:
        image = render_camera(scene, cords, cfg, exclude_ids=exclude)
        ok, encoded = cv2.imencode(".jpg", cv2.cvtColor(image.rgb, cv2.COLOR_RGB2BGR))
        path = root / side / "image" / f"{frame_id}.jpg"
        if not ok:
            raise OutputDirError(f"cannot encode {path} as JPEG")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encoded.tobytes())
        lidar_to_camera = np.linalg.inv(pose_to_matrix(cords) @ UE4_FROM_OPENCV) @ \
            pose_to_matrix(lidar_pose)
        _write_json(root / side / "calib" / calib_name / f"{frame_id}.json",
                    calib_json(lidar_to_camera))
        _write_json(root / side / "calib" / "camera_intrinsic" / f"{frame_id}.json", intrinsic)


def _write_labels(root: Path, world, vehicle_frame: str, scans: dict, lidar_to_world) -> None:
    seen = {}
    for _, visible in scans.values():
        seen.update(visible)
    labels = [label(seen[actor], world.track(actor).kind) for actor in sorted(seen)]
    world_to_lidar = np.linalg.inv(lidar_to_world)
    in_front = [item for item in labels
                if (world_to_lidar[:3, :3] @ np.mean(item["world_8_points"], axis=0)
                    + world_to_lidar[:3, 3])[0] > 0]
    cooperative = root / "cooperative"
    _write_json(cooperative / "label_world" / f"{vehicle_frame}.json", labels)
    _write_json(cooperative / "label_world_backup" / f"{vehicle_frame}.json", in_front)


def _write_side_labels(folder: Path, frame_id: str, world, visible: dict, lidar_to_world,
                       names: tuple, rng: np.random.Generator) -> None:
    """One agent's single-side labels: ``names[0]`` every vehicle its LiDAR hit (each with its
    own error, some missing: :func:`side_label_draws`), ``names[1]`` (when given) those of them
    in front of it (x > 0), both in its lidar frame."""
    world_to_lidar = np.linalg.inv(lidar_to_world)
    actors = sorted(visible)
    errors, kept = side_label_draws(rng, len(actors))
    labels = [side_label(visible[actor], world.track(actor).kind, world_to_lidar, error)
              for actor, error, keep in zip(actors, errors, kept) if keep]
    _write_json(folder / names[0] / f"{frame_id}.json", labels)
    if names[1] is not None:
        _write_json(folder / names[1] / f"{frame_id}.json",
                    [item for item in labels if item["3d_location"]["x"] > 0])


def _pair_info(vehicle_frame: str, rsu_frame: str, offset: dict) -> dict:
    return {"infrastructure_image_path": f"infrastructure-side/image/{rsu_frame}.jpg",
            "infrastructure_pointcloud_path": f"infrastructure-side/velodyne/{rsu_frame}.pcd",
            "vehicle_image_path": f"vehicle-side/image/{vehicle_frame}.jpg",
            "vehicle_pointcloud_path": f"vehicle-side/velodyne/{vehicle_frame}.pcd",
            "cooperative_label_path": f"cooperative/label_world/{vehicle_frame}.json",
            "system_error_offset": offset}


def _side_info(frame_id: str, batch: str, timestamp: int, calib_keys: dict) -> dict:
    """A vehicle-side or infrastructure-side data_info.json entry (the keys readers use)."""
    return {"image_path": f"image/{frame_id}.jpg", "pointcloud_path": f"velodyne/{frame_id}.pcd",
            "pointcloud_timestamp": str(timestamp), "batch_id": batch,
            **{key: f"calib/{folder}/{frame_id}.json" for key, folder in calib_keys.items()}}


def generate_scenario(out_dir, preset: Preset, seed: int, split: str, index: int,
                      global_index: int) -> dict:
    """Scan and write one scenario (one recorded sequence, ``batch_id`` = its number); returns
    the OPV2V writer's statistics plus the data_info entries and the split's frame ids."""
    root = Path(out_dir) / ROOT_NAME
    offset = system_error_offset(seed, split, index)
    label_rng = side_label_rng(seed, split, index)
    batch = f"{global_index:04d}"
    stats = {"split": split, "name": batch, "cavs": 1, "rsus": 1, "frames": preset.frames,
             "points": 0, "gt": 0, "invisible": 0, "rsu_only": 0, "in_range": 0, "unseen": 0,
             "pairs": [], "vehicle_infos": [], "infrastructure_infos": [], "vehicle_ids": []}
    for world, frame, scans in scan_frames(preset, seed, split, index):    # every kind
        ids = frame_ids(global_index, frame)
        stats["pairs"].append(write_pair(root, world, frame, scans, ids, offset, label_rng))
        timestamp = 1_626_000_000_000_000 + 100_000 * (1000 * global_index + frame)   # us
        vehicle_calib = {"calib_lidar_to_novatel_path": "lidar_to_novatel",
                         "calib_novatel_to_world_path": "novatel_to_world"}
        rsu_calib = {"calib_virtuallidar_to_world_path": "virtuallidar_to_world"}
        if preset.cameras is not None:
            write_cameras(root, world, frame, ids, preset.cameras)
            vehicle_calib.update(calib_camera_intrinsic_path="camera_intrinsic",
                                 calib_lidar_to_camera_path="lidar_to_camera")
            rsu_calib.update(calib_camera_intrinsic_path="camera_intrinsic",
                             calib_virtuallidar_to_camera_path="virtuallidar_to_camera")
        stats["vehicle_infos"].append(_side_info(ids[0], batch, timestamp, vehicle_calib))
        stats["infrastructure_infos"].append(_side_info(ids[1], batch, timestamp, rsu_calib))
        stats["vehicle_ids"].append(ids[0])
        stats["points"] += sum(len(points) for points, _ in scans.values())
        visible = {agent: found for agent, (_, found) in scans.items()}
        poses = {agent: list(world.lidar_poses[agent][frame]) for agent in world.agent_ids}
        for key, count in sample_visibility(world, frame, visible, poses, preset).items():
            stats[key] += count
    return stats


def split_order(sequences: list) -> list:
    """A split file's list from its sequences' vehicle frame ids (each in time order): the
    sequences interleaved frame by frame, each one's frames latest first. Never the sorted
    order (for 2+ frames), so a reader that sorts cannot pass for one that follows the file."""
    reversed_sequences = [list(reversed(ids)) for ids in sequences]
    longest = max((len(ids) for ids in sequences), default=0)
    return [ids[step] for step in range(longest) for ids in reversed_sequences
            if step < len(ids)]


def finish(out_dir, results: list) -> None:
    """The index files: cooperative, vehicle-side and infrastructure-side data_info.json and
    the split jsons, from every scenario's entries (then dropped from the results)."""
    root = Path(out_dir) / ROOT_NAME
    _write_json(root / "cooperative" / "data_info.json",
                [pair for r in results for pair in r["pairs"]])
    _write_json(root / "vehicle-side" / "data_info.json",
                [info for r in results for info in r["vehicle_infos"]])
    _write_json(root / "infrastructure-side" / "data_info.json",
                [info for r in results for info in r["infrastructure_infos"]])
    for split, name in SPLIT_FILES.items():
        _write_json(root / name, split_order([r["vehicle_ids"] for r in results
                                              if r["split"] == split]))
    for result in results:
        for key in ("pairs", "vehicle_infos", "infrastructure_infos", "vehicle_ids"):
            result.pop(key)
