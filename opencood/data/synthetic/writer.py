"""Write synthetic scenarios as OPV2V files and summarise what was generated.

Layout (docs/DESIGN.md §2): ``<out>/<split>/<scenario>/<cav_id>/<ts>.pcd|.yaml`` plus
``<out>/generation.yaml`` (preset, seed, summary). Roadside units, in presets that have them, are
written as V2XSet writes them (OpenCDA's data dumper): folders ``-1``, ``-2``, ... with the same
files, their yaml without ``plan_trajectory``, ``ego_speed: 0.0`` and ``RSU: true`` (the
vehicles of such a data set carry ``RSU: false``). Every scenario draws from its own
``SeedSequence((seed, split, index))``, so the files depend on the seed only, never on the number
of worker processes or the order in which workers finish.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import multiprocessing
import shutil
import time
from pathlib import Path

import cv2
import numpy as np
import yaml
from tqdm import tqdm

from opencood.data.camera_visibility import (MIN_VISIBLE_PIXELS, map_path, visibility_map,
                                             write_visibility_map)
from opencood.data.formats import get_format, writer_formats
from opencood.data.heter import depth_files, hetero_path, in_order_modalities, lidar_file
from opencood.data.opv2v import vehicles_to_boxes
from opencood.data.pcd import write_pcd
from opencood.data.synthetic.camera import (CameraConfig, camera_entry, depth_png, render_camera,
                                            rsu_camera_cords, vehicle_camera_cords)
from opencood.data.synthetic.lidar import cast_lidar
from opencood.data.synthetic.presets import Preset, get_preset
from opencood.data.synthetic.world import (LIDAR_MOUNT_X, OBJECT_CLASSES, VEHICLE_KIND_NAMES,
                                           World, build_world)
from opencood.errors import OpencoodError

SPLITS = ("train", "validate", "test")
ALL_KINDS = tuple(OBJECT_CLASSES)         # what the formats with classes label
FIRST_TIMESTAMP = (30, 120)               # first frame number drawn in this range (x 2)
PLAN_HORIZONS_S = (0.5, 1.0, 1.5, 2.0, 2.5)
POSE_NOISE_STD = (0.05, 0.05, 0.0, 0.0, 0.2, 0.0)   # predicted_ego_pos: localisation error
MAX_AGENTS = 5                            # the reader's default max_cav, for the summary


# libyaml's emitter is faster; for our block-style mappings of numbers its output is the same
# text as the pure-Python one (checked byte for byte), so files do not depend on it.
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class OutputDirError(OpencoodError, OSError):
    """The output folder cannot be used (not writable, or already holds a data set)."""


# ---------------------------------------------------------------------------------------------
# Naming and seeding

def scenario_seed(seed: int, split: str, index: int) -> np.random.SeedSequence:
    """Independent stream of scenario ``index`` of ``split``."""
    return np.random.SeedSequence([int(seed), SPLITS.index(split), int(index)])


def scenario_name(seed: int, global_index: int, jitter_rng: np.random.Generator) -> str:
    """OPV2V-style ``YYYY_MM_DD_HH_MM_SS``: a seed-dependent day, one 37-minute slot per
    scenario (so names never collide) and a random second inside the first 10 minutes of it."""
    day = int(np.random.SeedSequence(int(seed)).generate_state(1)[0] % 365)
    start = datetime.datetime(2021, 1, 1, 8, 0, 0) + datetime.timedelta(days=day)
    offset = datetime.timedelta(minutes=37 * global_index,
                                seconds=int(jitter_rng.integers(0, 600)))
    return (start + offset).strftime("%Y_%m_%d_%H_%M_%S")


def _plain(value):
    """Tuples -> lists and numpy scalars -> Python numbers, recursively, for yaml."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def _rounded(values, digits=6) -> list:
    return [round(float(v), digits) for v in values]


def _wrap_deg(angle: float) -> float:
    """Wrap degrees into (-180, 180]."""
    wrapped = (float(angle) + 180.0) % 360.0 - 180.0
    return 180.0 if wrapped == -180.0 else wrapped


# ---------------------------------------------------------------------------------------------
# Per-frame content

def vehicle_entry(vehicle) -> dict:
    """The OPV2V ``vehicles`` entry of a world Vehicle (origin on the ground, box above it)."""
    half_l, half_w, half_h = vehicle.extent
    return {"location": _rounded([vehicle.x, vehicle.y, 0.0]),
            "center": _rounded([0.0, 0.0, half_h]),
            "extent": _rounded([half_l, half_w, half_h]),
            "angle": _rounded([0.0, _wrap_deg(vehicle.yaw_deg), 0.0]),
            "speed": round(float(vehicle.speed_kmh), 4)}


def visible_vehicles(hit_ids, vehicles, cav_ids, kinds=VEHICLE_KIND_NAMES) -> dict:
    """``vehicles`` entry of one CAV's frame: every non-CAV object of one of ``kinds`` hit by
    at least one point.

    hit_ids (N,): object id per point of the CAV's cloud; vehicles: world Vehicles of the frame;
    cav_ids: ids of all CAVs of the scenario (never listed, docs/DESIGN.md §2); kinds: the
    world kinds listed (default the vehicles: OPV2V's ``vehicles``; a format with classes
    passes ``ALL_KINDS``). Returns {actor_id (int): entry}, sorted by id.
    """
    hit = set(np.unique(np.asarray(hit_ids)).tolist())
    excluded = {int(c) for c in cav_ids}
    return {int(v.actor_id): vehicle_entry(v) for v in sorted(vehicles, key=lambda v: v.actor_id)
            if v.actor_id in hit and v.actor_id not in excluded and v.kind in kinds}


def frame_params(world: World, cav_id: int, frame: int, vehicles: dict, rng) -> dict:
    """The yaml mapping of one CAV at one frame."""
    track = world.track(cav_id)
    x, y, yaw = track.poses[frame]
    true_pose = np.array([x, y, 0.0, 0.0, yaw, 0.0])
    predicted = true_pose + rng.normal(0.0, POSE_NOISE_STD)
    plan = track.future_poses(frame, world.dt, PLAN_HORIZONS_S)
    lidar_pose = world.lidar_poses[cav_id][frame]
    return {
        "lidar_pose": _rounded(list(lidar_pose[:4]) + [_wrap_deg(lidar_pose[4]), lidar_pose[5]]),
        "true_ego_pos": _rounded(list(true_pose[:4]) + [_wrap_deg(yaw), 0.0]),
        "predicted_ego_pos": _rounded(list(predicted[:4]) + [_wrap_deg(predicted[4]), 0.0]),
        "ego_speed": round(float(track.speed_kmh), 4),
        "plan_trajectory": [_rounded([px, py, track.speed_kmh], 4) for px, py, _ in plan],
        "vehicles": vehicles,
    }


def rsu_frame_params(world: World, rsu_id: int, frame: int, vehicles: dict) -> dict:
    """The yaml mapping of a roadside unit at one frame: its pose is surveyed, not estimated,
    so ``predicted_ego_pos`` is the true one, and it neither moves nor plans."""
    pose = world.lidar_poses[rsu_id][frame]
    pose_written = _rounded(list(pose[:4]) + [_wrap_deg(pose[4]), pose[5]])
    # Three separate lists: one shared list would be dumped as a yaml anchor and aliases.
    return {"lidar_pose": pose_written, "true_ego_pos": list(pose_written),
            "predicted_ego_pos": list(pose_written), "ego_speed": 0.0, "RSU": True,
            "vehicles": vehicles}


def scan_agent(world: World, agent_id: int, frame: int, scene, preset: Preset, rng,
               kinds=VEHICLE_KIND_NAMES):
    """One agent's sweep at one frame: (points_lidar (N, 4), yaml mapping), whose ``vehicles``
    lists the objects of ``kinds`` it hits.

    A vehicle CAV's rays pass through its own body; an RSU has none. In a data set with RSUs
    the vehicles are marked ``RSU: false``, as the V2XSet dumper marks them.
    """
    is_rsu = agent_id in world.rsu_ids
    lidar_cfg = preset.rsu.lidar if is_rsu else preset.lidar
    points_lidar, hit_ids = cast_lidar(scene, world.lidar_poses[agent_id][frame], lidar_cfg, rng,
                                       exclude_ids=() if is_rsu else [agent_id])
    vehicles = visible_vehicles(hit_ids, scene.vehicles, world.cav_ids, kinds)
    if is_rsu:
        return points_lidar, rsu_frame_params(world, agent_id, frame, vehicles)
    params = frame_params(world, agent_id, frame, vehicles, rng)
    if world.rsu_ids:
        params["RSU"] = False
    return points_lidar, params


def scan_hetero_lidars(world: World, agent_id: int, frame: int, scene, preset: Preset,
                       rng) -> dict:
    """OPV2V-H's extra LiDARs of one agent at one frame: {beams: points (N, 4) in its lidar
    frame}, each the agent's own LiDAR (same pose, FOV, azimuth steps, range, noise) with
    ``beams`` beams, drawing from ``rng`` (the scenario's own stream: the other files stay
    byte-identical with or without them)."""
    is_rsu = agent_id in world.rsu_ids
    base = preset.rsu.lidar if is_rsu else preset.lidar
    return {beams: cast_lidar(scene, world.lidar_poses[agent_id][frame],
                              dataclasses.replace(base, beams=int(beams)), rng,
                              exclude_ids=() if is_rsu else [agent_id])[0]
            for beams in preset.hetero_lidars or ()}


def photograph_agent(world: World, agent_id: int, scene, params: dict, cfg: CameraConfig):
    """One agent's 4 cameras at one frame: adds ``camera0..3`` to ``params`` (its yaml mapping,
    with ``lidar_pose`` as written) and returns the CameraImages, in OPV2V's order (front,
    right, left, back). A vehicle's cameras do not see its own body (its LiDAR's rays pass
    through it too); an RSU has none."""
    is_rsu = agent_id in world.rsu_ids
    lidar_pose = params["lidar_pose"]
    all_cords = rsu_camera_cords(lidar_pose) if is_rsu else \
        vehicle_camera_cords(lidar_pose, LIDAR_MOUNT_X)
    images = []
    for index, cords in enumerate(all_cords):
        cords = _rounded(list(cords[:4]) + [_wrap_deg(cords[4]), cords[5]])
        params[f"camera{index}"] = camera_entry(cords, lidar_pose, cfg)
        images.append(render_camera(scene, cords, cfg, exclude_ids=() if is_rsu else [agent_id]))
    return images


UNBOUNDED = (-1e9, -1e9, -1e9, 1e9, 1e9, 1e9)


def camera_visibility_map(scene, images, lidar_pose) -> np.ndarray:
    """HEAL's ``bev_visibility`` map (opencood.data.camera_visibility) of one agent from its
    CameraImages: the vehicles with at least ``MIN_VISIBLE_PIXELS`` pixels in one of its
    cameras (the z-buffer's nearest surface: unoccluded), in its frame of ``lidar_pose`` (as
    written)."""
    seen = set()
    vehicle_ids = {v.actor_id for v in scene.vehicles if v.kind in VEHICLE_KIND_NAMES}
    for image in images:
        if not len(image.face_ids):
            continue
        pixels_per_face = np.bincount(image.face_buffer[image.face_buffer >= 0],
                                      minlength=len(image.face_ids))
        per_object = {}
        for object_id, pixels in zip(image.face_ids.tolist(), pixels_per_face.tolist()):
            per_object[object_id] = per_object.get(object_id, 0) + pixels
        seen.update(i for i, pixels in per_object.items()
                    if i in vehicle_ids and pixels >= MIN_VISIBLE_PIXELS)
    entries = {v.actor_id: vehicle_entry(v) for v in scene.vehicles if v.actor_id in seen}
    _, boxes = vehicles_to_boxes(entries, lidar_pose, UNBOUNDED)
    return visibility_map(boxes)


def write_frame(cav_dir: Path, timestamp: str, points_lidar: np.ndarray, params: dict,
                images=(), depth: bool = False, hetero_points=None,
                visibility: np.ndarray | None = None):
    """``<cav_dir>/<timestamp>.pcd`` (reference ascii layout) and ``.yaml``; with ``images``
    (CameraImages) also ``<timestamp>_camera<i>.png`` and, with ``depth``, OPV2V-H's
    ``<timestamp>_depth<i>.png``; ``hetero_points`` ({beams: points}): OPV2V-H's
    ``<timestamp>_<beams>.pcd``. OPV2V-H's files go where HEAL looks for them
    (``opencood.data.heter``: beside the others unless the path says ``OPV2V``). With
    ``visibility`` HEAL's ``<timestamp>_bev_visibility.png`` (:func:`camera_visibility_map`)."""
    write_pcd(cav_dir / f"{timestamp}.pcd", points_lidar, intensity_field="rgb", data="ascii")
    text = yaml.dump(params, Dumper=_DUMPER, default_flow_style=False, sort_keys=True)
    (cav_dir / f"{timestamp}.yaml").write_text(text)
    for beams, points in (hetero_points or {}).items():
        write_pcd(lidar_file(cav_dir, timestamp, beams), points, intensity_field="rgb",
                  data="ascii")
    depth_paths = depth_files(cav_dir, timestamp, len(images))
    for index, image in enumerate(images):
        _write_png(cav_dir / f"{timestamp}_camera{index}.png",
                   cv2.cvtColor(image.rgb, cv2.COLOR_RGB2BGR))
        if depth:
            _write_png(depth_paths[index], depth_png(image.depth))
    if visibility is not None:
        write_visibility_map(map_path(cav_dir, timestamp), visibility)


def _write_png(path: Path, pixels: np.ndarray):
    ok, encoded = cv2.imencode(".png", pixels)
    if not ok:
        raise OutputDirError(f"cannot encode {path} as PNG")
    path.write_bytes(encoded.tobytes())


# ---------------------------------------------------------------------------------------------
# Statistics of one sample, with the reader's own GT rules

def sample_visibility(world: World, frame: int, visible: dict, lidar_poses: dict,
                      preset: Preset, kinds=ALL_KINDS) -> dict:
    """Counts for one (scenario, frame) sample, ego = world.cav_ids[0]; ``lidar_poses``:
    {agent_id: pose as written to the yaml}, so the counts are what a reader of the files gets;
    ``kinds``: the world kinds the format labels (``visible`` lists only those; the
    vehicle-only formats pass ``VEHICLE_KIND_NAMES``).

    gt: vehicles in the ego's eval range seen by some agent within com_range (the sample's GT);
    invisible: those of them the ego has no return from; rsu_only: those no vehicle CAV sees
    (only an RSU does); in_range: all non-CAV vehicles in the eval range; unseen: those in range
    that no agent in range sees.
    """
    ego_id = world.cav_ids[0]
    ego_pose = np.asarray(lidar_poses[ego_id])
    in_com = [a for a in world.agent_ids
              if np.hypot(*(np.asarray(lidar_poses[a][:2]) - ego_pose[:2])) <= preset.com_range]
    seen = {a: set(vehicles_to_boxes(visible[a], ego_pose, preset.eval_range)[0].tolist())
            for a in in_com[:MAX_AGENTS]}
    gt = set().union(*seen.values())
    seen_by_vehicles = set().union(*(ids for a, ids in seen.items() if a not in world.rsu_ids))
    everyone = {int(t.actor_id): vehicle_entry(t.vehicle_at(frame)) for t in world.tracks
                if t.actor_id not in world.cav_ids and t.kind in kinds}
    in_range = set(vehicles_to_boxes(everyone, ego_pose, preset.eval_range)[0].tolist())
    return {"gt": len(gt), "invisible": len(gt - set(visible[ego_id])),
            "rsu_only": len(gt - seen_by_vehicles), "in_range": len(in_range),
            "unseen": len(in_range - gt)}


# ---------------------------------------------------------------------------------------------
# Scenarios and the data set

def rebuild_world(preset: Preset, seed: int, split: str, index: int) -> World:
    """The World of scenario ``index`` of ``split``, exactly as ``generate_dataset`` built it
    (tests use it to check the files against the full scene)."""
    world_seq = scenario_seed(seed, split, index).spawn(3)[0]
    return build_world(preset.town, preset.frames, preset.frame_dt,
                       np.random.default_rng(world_seq), rsu=preset.rsu,
                       road_users=preset.road_users)


def scan_frames(preset: Preset, seed: int, split: str, index: int, kinds=ALL_KINDS):
    """Yield ``(world, frame, scans)`` for each frame of a scenario, ``scans`` = {agent_id:
    (points (N, 4) in its lidar frame, {actor_id: OPV2V world-frame entry} of the objects of
    ``kinds`` it hits (default every kind; the vehicle-only formats pass
    ``VEHICLE_KIND_NAMES``); ``world.track(actor_id).kind`` is each one's kind)}: the same
    draws whatever format the scenario is then written in (tests rebuild them with this)."""
    _, lidar_seq, _ = scenario_seed(seed, split, index).spawn(3)
    world = rebuild_world(preset, seed, split, index)
    lidar_rng = np.random.default_rng(lidar_seq)
    for frame in range(preset.frames):
        scene = world.scene_at(frame)
        scans = {}
        for agent_id in world.agent_ids:
            points, params = scan_agent(world, agent_id, frame, scene, preset, lidar_rng, kinds)
            scans[agent_id] = (points, params["vehicles"])
        yield world, frame, scans


def generate_scenario(out_dir, preset: Preset, seed: int, split: str, index: int,
                      global_index: int) -> dict:
    """Build, scan and write one scenario; returns its statistics."""
    # A fourth stream for OPV2V-H's LiDARs: spawn(4)'s first three are spawn(3)'s.
    _, lidar_seq, name_seq, hetero_seq = scenario_seed(seed, split, index).spawn(4)
    name_rng = np.random.default_rng(name_seq)
    name = scenario_name(seed, global_index, name_rng)
    first_ts = 2 * int(name_rng.integers(*FIRST_TIMESTAMP))
    world = rebuild_world(preset, seed, split, index)
    lidar_rng = np.random.default_rng(lidar_seq)
    hetero_rng = np.random.default_rng(hetero_seq)
    scenario_dir = Path(out_dir) / split / name
    for agent_id in world.agent_ids:
        (scenario_dir / str(agent_id)).mkdir(parents=True, exist_ok=True)
        hetero_path(scenario_dir / str(agent_id)).mkdir(parents=True, exist_ok=True)
    stats = {"split": split, "name": name, "cavs": len(world.cav_ids),
             "rsus": len(world.rsu_ids), "frames": preset.frames, "points": 0, "gt": 0,
             "invisible": 0, "rsu_only": 0, "in_range": 0, "unseen": 0}
    for frame in range(preset.frames):
        timestamp = f"{first_ts + preset.timestamp_step * frame:06d}"
        scene = world.scene_at(frame)
        visible, written_poses = {}, {}
        for agent_id in world.agent_ids:
            points_lidar, params = scan_agent(world, agent_id, frame, scene, preset, lidar_rng)
            visible[agent_id] = params["vehicles"]
            written_poses[agent_id] = params["lidar_pose"]
            images = () if preset.cameras is None else \
                photograph_agent(world, agent_id, scene, params, preset.cameras)
            write_frame(scenario_dir / str(agent_id), timestamp, points_lidar, params, images,
                        depth=preset.cameras is not None and preset.cameras.depth,
                        hetero_points=scan_hetero_lidars(world, agent_id, frame, scene, preset,
                                                         hetero_rng),
                        visibility=camera_visibility_map(scene, images, params["lidar_pose"])
                        if images else None)
            stats["points"] += len(points_lidar)
        for key, count in sample_visibility(world, frame, visible, written_poses, preset,
                                            kinds=VEHICLE_KIND_NAMES).items():
            stats[key] += count
    return stats


# The file formats the synthetic world writes (tools/generate_synthetic.py --format): those of
# opencood.data.formats with a writer.
FORMATS = tuple(writer_formats())
# This module writes OPV2V's layout; a writer module that writes camera files says so.
WRITES_CAMERAS = True


def format_writer(data_format: str):
    """The module writing ``data_format`` (its ``DataFormat.writer``): ``generate_scenario(
    out_dir, preset, seed, split, index, global_index) -> stats`` and, optionally,
    ``adapt_preset(preset) -> preset``, ``OUTPUT_NAMES`` (what it creates in ``out_dir``) and
    ``finish(out_dir, results)``."""
    if data_format not in FORMATS:
        raise ValueError(f"unknown format {data_format!r}; expected one of {', '.join(FORMATS)}")
    import importlib
    return importlib.import_module(get_format(data_format).writer)


def _scenario_job(job):
    *args, data_format = job
    return format_writer(data_format).generate_scenario(*args)


def _prepare_out_dir(out_dir: Path, overwrite: bool, names=SPLITS):
    """Create ``out_dir``; refuse to mix with an earlier data set (any of ``names`` in it)
    unless ``overwrite``."""
    existing = [out_dir / s for s in names if (out_dir / s).exists()]
    if existing and not overwrite:
        raise OutputDirError(f"{out_dir} already holds generated data ({existing[0].name}/); "
                             "choose another folder or pass overwrite=True (--overwrite)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        for path in existing:
            shutil.rmtree(path)
        probe = out_dir / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise OutputDirError(f"cannot write the synthetic data set to {out_dir}: "
                             f"{exc.strerror or exc}") from exc


def _summarise(preset: Preset, seed: int, results: list) -> dict:
    """Scenario statistics -> the data set summary (plain Python, yaml friendly)."""
    cavs = [r["cavs"] for r in results]
    cav_frames = sum((r["cavs"] + r["rsus"]) * r["frames"] for r in results)
    samples = sum(r["frames"] for r in results)
    total = {k: sum(r[k] for r in results) for k in ("points", "gt", "invisible", "rsu_only",
                                                       "in_range", "unseen")}
    summary = {
        "preset": preset.name,
        "seed": int(seed),
        "scenarios": {s: sum(r["split"] == s for r in results) for s in SPLITS},
        "frames_per_scenario": preset.frames,
        "samples": {s: sum(r["frames"] for r in results if r["split"] == s) for s in SPLITS},
        "cavs_per_scenario": _min_max_mean(cavs),
        "mean_points_per_frame": round(total["points"] / max(cav_frames, 1), 1),
        "eval_range": list(preset.eval_range),
        "gt_per_sample": round(total["gt"] / max(samples, 1), 2),
        "invisible_to_ego_share": round(total["invisible"] / max(total["gt"], 1), 4),
        "unseen_by_all_share": round(total["unseen"] / max(total["in_range"], 1), 4),
    }
    if preset.rsu is not None:      # keys only data sets with RSUs have: the others read as before
        summary["rsus_per_scenario"] = _min_max_mean([r["rsus"] for r in results])
        summary["seen_only_by_rsu_share"] = round(total["rsu_only"] / max(total["gt"], 1), 4)
    return summary


def _min_max_mean(values: list) -> dict:
    return {"min": min(values), "max": max(values), "mean": round(float(np.mean(values)), 3)}


def format_summary(summary: dict) -> str:
    """Human-readable lines of a summary."""
    s = summary
    return "\n".join([
        f"synthetic data set '{s['preset']}' (seed {s['seed']})",
        "  scenarios: " + ", ".join(f"{k} {v}" for k, v in s["scenarios"].items())
        + f"; {s['frames_per_scenario']} frames each",
        f"  CAVs per scenario: {s['cavs_per_scenario']['min']}-{s['cavs_per_scenario']['max']}"
        f" (mean {s['cavs_per_scenario']['mean']})",
        f"  mean points per frame: {s['mean_points_per_frame']:.0f}",
        f"  GT vehicles per sample (eval range {s['eval_range']}): {s['gt_per_sample']}",
        f"  GT invisible to the ego (seen only by other CAVs): "
        f"{100 * s['invisible_to_ego_share']:.1f}%",
        f"  vehicles in range seen by no CAV: {100 * s['unseen_by_all_share']:.1f}%",
    ] + _rsu_summary_lines(s))


def _rsu_summary_lines(summary: dict) -> list:
    if "rsus_per_scenario" not in summary:
        return []
    rsus = summary["rsus_per_scenario"]
    return [f"  RSUs per scenario: {rsus['min']}-{rsus['max']} (mean {rsus['mean']})",
            f"  GT seen only by an RSU (no vehicle CAV): "
            f"{100 * summary['seen_only_by_rsu_share']:.1f}%"]


def generate_dataset(out_dir, preset="small", seed: int = 0, workers: int = 1,
                     progress: bool = True, overwrite: bool = False,
                     data_format: str = "opv2v", splits=SPLITS) -> dict:
    """Generate a whole synthetic data set and return its summary.

    out_dir gets ``train/``, ``validate/``, ``test/`` (OPV2V and V2V4Real; DAIR-V2X-C: its
    ``cooperative-vehicle-infrastructure/`` folder) and ``generation.yaml``. ``preset`` is a
    name (see presets.PRESETS) or a Preset; ``data_format`` one of FORMATS, which may change
    the preset's agents (V2V4Real: two CAVs; DAIR-V2X-C: one vehicle and one roadside unit).
    Same seed -> byte-identical files, for any ``workers``. ``splits`` writes only those
    splits (e.g. ``("test",)`` for a test that needs a few frames), each byte-identical to the
    same split of the whole data set. The returned summary also holds ``seconds`` (not written
    to disk).
    """
    preset = get_preset(preset) if isinstance(preset, str) else preset
    if int(seed) < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    unknown = sorted(set(splits) - set(SPLITS))
    if unknown or not splits:
        raise ValueError(f"splits must be some of {', '.join(SPLITS)}, got {list(splits)}")
    writer = format_writer(data_format)
    if preset.cameras is not None and not getattr(writer, "WRITES_CAMERAS", False):
        with_cameras = [name for name in FORMATS
                        if getattr(format_writer(name), "WRITES_CAMERAS", False)]
        raise ValueError(f"cameras are written in the {' and '.join(with_cameras)} formats "
                         f"only, not {data_format!r} (V2XSet's layout is opv2v's)")
    if preset.hetero_lidars and data_format != "opv2v":
        raise ValueError(f"OPV2V-H's extra sensors (--heter) are written in the opv2v format "
                         f"(its v2x presets too), not {data_format!r}")
    preset = getattr(writer, "adapt_preset", lambda p: p)(preset)
    out_dir = Path(out_dir)
    _prepare_out_dir(out_dir, overwrite, getattr(writer, "OUTPUT_NAMES", SPLITS))
    jobs, global_index = [], 0
    for split in SPLITS:
        for index in range(preset.scenarios.get(split, 0)):
            # global_index counts every split's scenarios, so a split alone is unchanged.
            if split in splits:
                jobs.append((str(out_dir), preset, int(seed), split, index, global_index,
                             data_format))
            global_index += 1
    started = time.perf_counter()
    results = _run_jobs(jobs, workers, progress)
    if hasattr(writer, "finish"):
        writer.finish(out_dir, results)
    if preset.hetero_lidars:
        write_assignments(out_dir, splits)
    summary = _summarise(preset, seed, results)
    # An absent optional section (rsu: None) is left out: records of presets without it read
    # exactly as they did before it existed.
    preset_config = {k: v for k, v in dataclasses.asdict(preset).items() if v is not None}
    record = {"preset": preset.name, "seed": int(seed), "preset_config": _plain(preset_config),
              "summary": summary}
    if data_format != "opv2v":      # OPV2V records read exactly as before formats existed
        record["format"] = data_format
    (out_dir / "generation.yaml").write_text(
        yaml.dump(_plain(record), Dumper=yaml.SafeDumper, default_flow_style=False))
    return {**summary, "seconds": round(time.perf_counter() - started, 2)}


# HEAL's modality assignment of OPV2V-H (opencood/utils/heter_utils.py): where its yamls read
# it (under HEAL's logs/heter_modality_assign; ours under the data set's root), its seed.
ASSIGNMENT_FOLDER = "heter_modality_assign"
ASSIGNMENT_FILES = ("opv2v_4modality.json", "opv2v_4modality_in_order.json")
ASSIGNMENT_SEED = 303
HEAL_MODALITIES = ("m1", "m2", "m3", "m4")


def write_assignments(out_dir, splits=SPLITS) -> list:
    """HEAL's two assignments of the written splits, as its ``assign_modality_4`` and
    ``assign_modality_4_in_order`` compute them from the folders: every scenario of train,
    test, validate (that order) draws a permutation of m1..m4 from one ``RandomState(303)`` and
    its cav folders (string order) take them in turn; the in-order file assigns the test
    split's agents m1, m2, m3, m4, m1, ... (a first folder ``-1`` moved last). Written as HEAL
    dumps them (indent 4, keys sorted). Returns the paths."""
    out_dir = Path(out_dir)
    rng = np.random.RandomState(ASSIGNMENT_SEED)
    random_assignment, in_order = {}, {}
    for split in ("train", "test", "validate"):
        if split not in splits:
            continue
        for scenario in sorted(p.name for p in (out_dir / split).iterdir() if p.is_dir()):
            cav_ids = sorted(p.name for p in (out_dir / split / scenario).iterdir()
                             if p.is_dir())
            permutation = rng.permutation(4) + 1
            random_assignment[scenario] = {cav_id: f"m{permutation[k % 4]}"
                                           for k, cav_id in enumerate(cav_ids)}
            if split == "test":
                in_order[scenario] = in_order_modalities(cav_ids, HEAL_MODALITIES)
    folder = out_dir / ASSIGNMENT_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, assignment in zip(ASSIGNMENT_FILES, (random_assignment, in_order)):
        paths.append(folder / name)
        paths[-1].write_text(json.dumps(assignment, indent=4, sort_keys=True))
    return paths


def _run_jobs(jobs, workers: int, progress: bool) -> list:
    """Run scenario jobs in order, in ``workers`` processes; results keep the job order."""
    if workers <= 1 or len(jobs) <= 1:
        with tqdm(total=len(jobs), unit="scenario", desc="synthetic", disable=not progress) as bar:
            return [_tick(bar, _scenario_job(job)) for job in jobs]
    # fork where possible: workers inherit the imported modules instead of re-importing them.
    # The pool is made before the bar so that no tqdm monitor thread exists at fork time.
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(min(workers, len(jobs)),
                                                  initializer=_one_thread_worker) as pool:
        with tqdm(total=len(jobs), unit="scenario", desc="synthetic", disable=not progress) as bar:
            return [_tick(bar, result)
                    for result in pool.imap(_scenario_job, jobs, chunksize=1)]


def _one_thread_worker() -> None:
    """Pool initializer: torch runs single-threaded in a forked worker. A fork of a process whose
    OpenMP pool has run (the caller's torch ops) hangs in the child's first parallel region
    (GNU libgomp is not fork-safe); one thread never enters one, and the workers are the
    parallelism here anyway."""
    import torch
    torch.set_num_threads(1)


def _tick(bar, result):
    bar.update()
    return result
