"""Write small hand-made OPV2V trees for tests (exact control over poses, points and boxes)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from opencood.data.pcd import write_pcd


def vehicle(x, y, yaw_deg=0.0, half_lwh=(2.2, 0.95, 0.75)):
    """A vehicle entry of the ``vehicles`` yaml map, standing on the ground at (x, y)."""
    return {"location": [float(x), float(y), 0.0], "center": [0.0, 0.0, float(half_lwh[2])],
            "extent": [float(v) for v in half_lwh], "angle": [0.0, float(yaw_deg), 0.0],
            "speed": 20.0}


def box_points(x_lidar, y_lidar, count=30, z=-1.0, spread=0.6, seed=0):
    """(count, 4) points clustered around a lidar-frame position (a car seen by a LiDAR)."""
    rng = np.random.default_rng(seed)
    points = np.zeros((count, 4), np.float32)
    points[:, 0] = x_lidar + rng.uniform(-spread, spread, count)
    points[:, 1] = y_lidar + rng.uniform(-spread, spread, count)
    points[:, 2] = z + rng.uniform(-0.3, 0.3, count)
    points[:, 3] = rng.uniform(0, 1, count)
    return points


def write_frame(folder: Path, timestamp: str, points, lidar_pose, vehicles):
    folder.mkdir(parents=True, exist_ok=True)
    write_pcd(folder / f"{timestamp}.pcd", np.asarray(points, np.float32).reshape(-1, 4))
    params = {"lidar_pose": [float(v) for v in lidar_pose],
              "true_ego_pos": [float(v) for v in lidar_pose], "ego_speed": 20.0,
              "vehicles": vehicles}
    (folder / f"{timestamp}.yaml").write_text(yaml.safe_dump(params))


ROAD_CARS = {100 + i: (5.0 + 12.0 * i, 3.5 * (-1) ** i) for i in range(4)}   # id -> world x, y


def write_road_rsu(split_dir: Path, xy=(10.0, -8.0), height=4.5, rsu_id="-1",
                   timestamps=("000000", "000002", "000004"), scenario="2021_01_01_00_00_00"):
    """A roadside unit beside ``write_simple_split``'s road: lidar ``height`` m up at ``xy``,
    seeing every car (30 points each), plus one return in the own-body box of its frame (where a
    vehicle's roof would be) that readers crop from every agent, as OpenCOOD does."""
    pose = [float(xy[0]), float(xy[1]), float(height), 0.0, 0.0, 0.0]
    car_z = 0.75 - height                  # car centre 0.75 m above the ground, in its frame
    for step, stamp in enumerate(timestamps):
        clouds = [box_points(x - xy[0], y - xy[1], z=car_z, seed=actor + 100 * step)
                  for actor, (x, y) in ROAD_CARS.items()]
        in_body_box = np.array([[0.5, 0.2, 0.1 - height, 0.5]], np.float32)
        vehicles = {actor: vehicle(x, y) for actor, (x, y) in ROAD_CARS.items()}
        write_frame(split_dir / scenario / rsu_id, stamp, np.concatenate(clouds + [in_body_box]),
                    pose, vehicles)
    return split_dir


def write_simple_split(split_dir: Path, num_cavs=2, timestamps=("000000", "000002", "000004"),
                       spacing=20.0, empty_cloud_at=None, no_vehicles_at=None,
                       scenario="2021_01_01_00_00_00"):
    """A straight road: CAVs ``spacing`` metres apart along x, cars between and beyond them.

    Every CAV sees every car (points at the car's position in its own frame). CAV lidar poses
    are [k * spacing, 0, 1.9, 0, 0, 0]. ``empty_cloud_at``/``no_vehicles_at`` name a timestamp
    whose ego cloud is empty / whose frames list no vehicles, for the edge-case tests.
    """
    cars_world = ROAD_CARS
    for cav in range(num_cavs):
        cav_id = str(1000 + cav)
        pose = [cav * spacing, 0.0, 1.9, 0.0, 0.0, 0.0]
        for step, stamp in enumerate(timestamps):
            vehicles = {} if stamp == no_vehicles_at else {
                actor: vehicle(x, y) for actor, (x, y) in cars_world.items()}
            clouds = [box_points(x - pose[0], y, seed=actor + 7 * cav + 100 * step)
                      for actor, (x, y) in cars_world.items()]
            points = np.concatenate(clouds)
            if stamp == empty_cloud_at and cav == 0:
                points = np.zeros((0, 4), np.float32)
            write_frame(split_dir / scenario / cav_id, stamp, points, pose, vehicles)
    return split_dir


def frame_stamps(count: int) -> tuple:
    """``count`` OPV2V timestamps 000000, 000002, ... (the simulator saves every other frame)."""
    return tuple(f"{2 * i:06d}" for i in range(count))
