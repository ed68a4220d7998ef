"""Write synthetic scenarios as V2V4Real files (``generate_synthetic.py --format v2v4real``).

Layout: ``<out>/<split>/<scenario>/{0,1}/<ts>.pcd|.yaml``, two CAVs per scenario (the world's
ego is folder ``0``), timestamps ``000000, 000001, ...``. Each yaml is what V2V4Real's own
dumper wrote (opencood.data.numpy_yaml): ``lidar_pose`` a 4x4 float64 numpy array (lidar -> map),
``gps`` numpy float64 scalars, ``ego_speed``, and ``vehicles``: every vehicle the CAV's LiDAR hits,
in the CAV's **own lidar frame** (``location`` = box centre, ``center`` 0, ``angle`` [roll, yaw,
pitch] degrees, half sizes ``extent``; vehicles only: V2V4Real labels cars), keyed by a per-CAV label number, with ``ass_id`` = the
world actor id when the other CAV labels the same vehicle, else -1, and ``obj_type: Car``.
Point clouds: the OPV2V ascii PCD layout (intensity packed in rgb, as open3d reads it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import yaml

from opencood.data.numpy_yaml import NumpyYamlDumper
from opencood.data.pcd import write_pcd
from opencood.data.synthetic.presets import Preset
from opencood.data.synthetic.world import VEHICLE_KIND_NAMES
from opencood.data.synthetic.writer import (sample_visibility, scan_frames, scenario_name,
                                            scenario_seed)
from opencood.ops.transforms import matrix_to_pose, pose_to_matrix

CAV_FOLDERS = ("0", "1")
GPS_ORIGIN = (34.0689, -118.4452)         # degrees: the map origin of the synthetic town
METRES_PER_DEGREE = 111_320.0


def adapt_preset(preset: Preset) -> Preset:
    """``preset`` with exactly two vehicle CAVs, no RSU, and frames numbered 0, 1, 2, ..."""
    town = dataclasses.replace(preset.town, cavs=(2, 2))
    return dataclasses.replace(preset, town=town, rsu=None, timestamp_step=1)


def own_frame_entry(entry: dict, world_to_lidar: np.ndarray, ass_id: int) -> dict:
    """An OPV2V world-frame vehicle entry -> the V2V4Real object in a lidar frame."""
    box_pose = [entry["location"][i] + entry["center"][i] for i in range(3)] + entry["angle"]
    x, y, z, roll, yaw, pitch = matrix_to_pose(world_to_lidar @ pose_to_matrix(box_pose))
    return {"location": [round(float(v), 6) for v in (x, y, z)], "center": [0.0, 0.0, 0.0],
            "extent": list(entry["extent"]),
            "angle": [round(float(v), 6) for v in (roll, yaw, pitch)],
            "ass_id": int(ass_id), "obj_type": "Car"}


def cav_objects(visible: dict, other_visible: dict, lidar_to_world: np.ndarray) -> dict:
    """{label key: object} of one CAV, keys 0, 1, ... in actor id order."""
    world_to_lidar = np.linalg.inv(lidar_to_world)
    return {key: own_frame_entry(visible[actor], world_to_lidar,
                                 actor if actor in other_visible else -1)
            for key, actor in enumerate(sorted(visible))}


def gps_of(lidar_to_world: np.ndarray) -> list:
    """[latitude, longitude] (numpy float64, as the data set stores them) of a lidar pose."""
    latitude = GPS_ORIGIN[0] + lidar_to_world[1, 3] / METRES_PER_DEGREE
    longitude = GPS_ORIGIN[1] + lidar_to_world[0, 3] / (
        METRES_PER_DEGREE * np.cos(np.radians(GPS_ORIGIN[0])))
    return [np.float64(latitude), np.float64(longitude)]


def frame_yaml(world, cav_id: int, frame: int, visible: dict, other_visible: dict) -> str:
    lidar_to_world = pose_to_matrix(world.lidar_poses[cav_id][frame])
    params = {"ego_speed": round(float(world.track(cav_id).speed_kmh), 4),
              "gps": gps_of(lidar_to_world), "lidar_pose": lidar_to_world,
              "vehicles": cav_objects(visible, other_visible, lidar_to_world)}
    return yaml.dump(params, Dumper=NumpyYamlDumper, default_flow_style=False, sort_keys=True)


def generate_scenario(out_dir, preset: Preset, seed: int, split: str, index: int,
                      global_index: int) -> dict:
    """Scan and write one scenario as V2V4Real files; returns the statistics the OPV2V writer
    returns (opencood.data.synthetic.writer.generate_scenario)."""
    _, _, name_seq = scenario_seed(seed, split, index).spawn(3)
    name = scenario_name(seed, global_index, np.random.default_rng(name_seq))
    scenario_dir = Path(out_dir) / split / name
    stats = {"split": split, "name": name, "cavs": 2, "rsus": 0, "frames": preset.frames,
             "points": 0, "gt": 0, "invisible": 0, "rsu_only": 0, "in_range": 0, "unseen": 0}
    for world, frame, scans in scan_frames(preset, seed, split, index, kinds=VEHICLE_KIND_NAMES):
        folders = dict(zip(world.cav_ids, CAV_FOLDERS))
        timestamp = f"{preset.timestamp_step * frame:06d}"
        for cav_id, folder in folders.items():
            other = next(c for c in world.cav_ids if c != cav_id)
            points, visible = scans[cav_id]
            cav_dir = scenario_dir / folder
            cav_dir.mkdir(parents=True, exist_ok=True)
            write_pcd(cav_dir / f"{timestamp}.pcd", points, intensity_field="rgb", data="ascii")
            (cav_dir / f"{timestamp}.yaml").write_text(
                frame_yaml(world, cav_id, frame, visible, scans[other][1]))
            stats["points"] += len(points)
        visible = {cav_id: scans[cav_id][1] for cav_id in world.cav_ids}
        poses = {cav_id: list(world.lidar_poses[cav_id][frame]) for cav_id in world.cav_ids}
        for key, count in sample_visibility(world, frame, visible, poses, preset,
                                            kinds=VEHICLE_KIND_NAMES).items():
            stats[key] += count
    return stats
