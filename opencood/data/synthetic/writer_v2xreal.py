"""Write synthetic scenarios as V2X-Real files (``generate_synthetic.py --format v2xreal``).

Layout (V2X-Real's release, read by its ``basedataset.py``)::

    <out>/<split>/<scenario>/<agent>/<ts>.bin|.yaml

two vehicles (folders ``1``, ``2``; the world's first CAV is ``1``) and two roadside units
(``-1``, ``-2``: negative ids are infrastructure) per scenario, timestamps ``000000, 000001,
...``, scenario names as V2X-Real's (``YYYY-MM-DD-HH-MM-SS_1_0``). ``<ts>.bin``: the LiDAR
sweep as float32 rows [x, y, z, intensity] in the agent's LiDAR frame. ``<ts>.yaml``:
``lidar_pose`` [x, y, z, roll, yaw, pitch] (m, degrees, world frame), ``ego_speed`` (km/h, 0 for
a roadside unit) and ``vehicles``: every object the agent's LiDAR hits, keyed by its world actor
id (the same id in every agent's labels), as OPV2V writes them (world-frame ``location``,
``center``, ``extent``, ``angle``) plus ``obj_type``, V2X-Real's raw class name of the object's
kind (``OBJECT_CLASSES``: Car, Van, Truck and, in multi-class worlds, Pedestrian and
BicycleRider), which its readers group into meta-classes (vehicle, truck, pedestrian).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import yaml

from opencood.data.synthetic.presets import Preset
from opencood.data.synthetic.world import OBJECT_CLASSES
from opencood.data.synthetic.writer import (_DUMPER, ALL_KINDS, sample_visibility, scan_frames,
                                            scenario_name, scenario_seed)

VEHICLE_FOLDERS = ("1", "2")
RSU_FOLDERS = ("-1", "-2")

def adapt_preset(preset: Preset) -> Preset:
    """``preset`` with exactly two vehicle CAVs and two roadside units, frames 0, 1, 2, ...;
    the roadside units' LiDAR is the preset's own RSU LiDAR, else the ``v2x`` presets' one."""
    from opencood.data.synthetic.presets import with_rsu
    town = dataclasses.replace(preset.town, cavs=(2, 2))
    rsu = preset.rsu or with_rsu(preset, preset.name).rsu
    return dataclasses.replace(preset, town=town, rsu=dataclasses.replace(rsu, count=(2, 2)),
                               timestamp_step=1)


def v2xreal_scenario_name(opv2v_name: str) -> str:
    """``2021_03_04_08_12_30`` -> ``2021-03-04-08-12-30_1_0`` (V2X-Real's naming)."""
    return opv2v_name.replace("_", "-") + "_1_0"


def labelled(world, visible: dict) -> dict:
    """An agent's OPV2V ``vehicles`` entries with V2X-Real's ``obj_type`` added."""
    return {actor: {**entry, "obj_type": OBJECT_CLASSES[world.track(actor).kind].v2xreal}
            for actor, entry in visible.items()}


def frame_yaml(world, agent_id: int, frame: int, visible: dict) -> str:
    pose = world.lidar_poses[agent_id][frame]
    is_rsu = agent_id in world.rsu_ids
    speed = 0.0 if is_rsu else round(float(world.track(agent_id).speed_kmh), 4)
    params = {"lidar_pose": [round(float(v), 6) for v in pose], "ego_speed": speed,
              "vehicles": labelled(world, visible)}
    return yaml.dump(params, Dumper=_DUMPER, default_flow_style=False, sort_keys=True)


def write_bin(path: Path, points: np.ndarray) -> None:
    """(N, 4) [x, y, z, intensity] as float32 rows, V2X-Real's ``.bin``."""
    np.ascontiguousarray(points[:, :4], dtype=np.float32).tofile(path)


def agent_folders(world) -> dict:
    """{world agent id: folder name}: vehicles ``1``, ``2``, roadside units ``-1``, ``-2``."""
    return {**dict(zip(world.cav_ids, VEHICLE_FOLDERS)), **dict(zip(world.rsu_ids, RSU_FOLDERS))}


def generate_scenario(out_dir, preset: Preset, seed: int, split: str, index: int,
                      global_index: int) -> dict:
    """Scan and write one scenario as V2X-Real files; returns the statistics the OPV2V writer
    returns (opencood.data.synthetic.writer.generate_scenario)."""
    _, _, name_seq = scenario_seed(seed, split, index).spawn(3)
    name = v2xreal_scenario_name(
        scenario_name(seed, global_index, np.random.default_rng(name_seq)))
    scenario_dir = Path(out_dir) / split / name
    stats = {"split": split, "name": name, "cavs": 2, "rsus": 2, "frames": preset.frames,
             "points": 0, "gt": 0, "invisible": 0, "rsu_only": 0, "in_range": 0, "unseen": 0}
    for world, frame, scans in scan_frames(preset, seed, split, index, kinds=ALL_KINDS):
        timestamp = f"{frame:06d}"
        for agent_id, folder in agent_folders(world).items():
            points, visible = scans[agent_id]
            agent_dir = scenario_dir / folder
            agent_dir.mkdir(parents=True, exist_ok=True)
            write_bin(agent_dir / f"{timestamp}.bin", points)
            (agent_dir / f"{timestamp}.yaml").write_text(
                frame_yaml(world, agent_id, frame, visible))
            stats["points"] += len(points)
        visible = {agent_id: scans[agent_id][1] for agent_id in world.agent_ids}
        poses = {agent_id: list(world.lidar_poses[agent_id][frame])
                 for agent_id in world.agent_ids}
        for key, count in sample_visibility(world, frame, visible, poses, preset,
                                            kinds=ALL_KINDS).items():
            stats[key] += count
    return stats
