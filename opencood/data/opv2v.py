"""Reader for OPV2V-format data (docs/DESIGN.md §2).

Layout: ``<split_dir>/<scenario>/<cav_id>/<ts>.pcd|.yaml``. One sample is one (scenario, timestamp);
the ego is the first CAV folder of the scenario (string sort, negative ids = infrastructure last).

Every frame's yaml is parsed exactly once, while the index is built (the CAV poses are needed for
the communication-range test anyway), and kept in memory; the parsed frames are also persisted as
JSON in the cache folder so the next start skips yaml parsing entirely. Point clouds are read
lazily per sample, through :class:`~opencood.data.pcd.PointCloudCache` when enabled; the
datasets read them through :class:`BodyFreeCloudCache`, whose entries hold exactly what they
consume (the cloud less the CAV's own-body returns), memory-mapped, and each frame's vehicles as
arrays (:class:`VehicleArrays`, built once per frame), so a sample's GT is a few vector ops.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml
from tqdm import tqdm

from opencood.config import YamlLoader, yaml_error_line
from opencood.config_schema import DEFAULT_COMM_RANGE
from opencood.data.heter import lidar_file
from opencood.data.pcd import PointCloudCache, default_cache_dir, read_pcd
from opencood.errors import OpencoodError
from opencood.ops.transforms import (
    boxes_to_corners_3d,
    corners_in_range_mask,
    corners_to_boxes,
    extent_corners,
    pose_to_matrix,
    poses_to_matrices,
    relative_transform,
)
from opencood.utils.atomic import atomic_write
from opencood.utils.collectives import get_rank

if TYPE_CHECKING:   # PIL is imported only where camera inputs are read
    from opencood.data.cameras import CameraFrame

logger = logging.getLogger(__name__)

# The split folders of a data set (a "data root").
SPLITS = ("train", "validate", "test")

# Own-body box of a CAV in its lidar frame (reference values), bounds inclusive.
OWN_BODY_X = (-1.95, 2.95)
OWN_BODY_Y = (-1.1, 1.1)
DEFAULT_GT_RANGE = (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0)
PROGRESS_MIN_FRAMES = 200
INDEX_CACHE_VERSION = 1
_VEHICLE_VECTOR_KEYS = ("location", "extent", "angle")


class OPV2VFormatError(OpencoodError, ValueError):
    """A file or folder that does not follow the OPV2V format; the message starts with its path."""


def _format_error(path, problem: str) -> OPV2VFormatError:
    return OPV2VFormatError(f"{path}: {problem}")


# --------------------------------------------------------------------------------------- yaml

def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_vector(value, length: int, path, key: str) -> None:
    if not isinstance(value, (list, tuple)) or len(value) != length \
            or not all(_is_number(v) for v in value):
        raise _format_error(path, f"'{key}' must be a list of {length} finite numbers, "
                                  f"got {value!r}")


def _normalise_vehicles(vehicles, path) -> dict:
    """Validate ``vehicles`` and return it with int actor ids as keys."""
    if vehicles is None:
        return {}
    if not isinstance(vehicles, dict):
        raise _format_error(path, f"'vehicles' must be a mapping, got {type(vehicles).__name__}")
    normalised = {}
    for actor_id, vehicle in vehicles.items():
        try:
            actor_int = int(actor_id)
        except (TypeError, ValueError):
            problem = f"vehicles: actor id {actor_id!r} is not an integer"
            raise _format_error(path, problem) from None
        if not isinstance(vehicle, dict):
            raise _format_error(path, f"'vehicles.{actor_id}' must be a mapping")
        for key in _VEHICLE_VECTOR_KEYS:
            if key not in vehicle:
                raise _format_error(path, f"'vehicles.{actor_id}.{key}' is missing")
            _check_vector(vehicle[key], 3, path, f"vehicles.{actor_id}.{key}")
        if "center" in vehicle:
            _check_vector(vehicle["center"], 3, path, f"vehicles.{actor_id}.center")
        normalised[actor_int] = vehicle
    return normalised


def _validate_frame(params, path) -> dict:
    """Check the keys the reader relies on; every other key is kept untouched."""
    if not isinstance(params, dict):
        raise _format_error(path, f"top level must be a mapping, got {type(params).__name__}")
    if "lidar_pose" not in params:
        raise _format_error(path, "'lidar_pose' is missing")
    _check_vector(params["lidar_pose"], 6, path, "lidar_pose")
    params["vehicles"] = _normalise_vehicles(params.get("vehicles"), path)
    return params


def load_frame_yaml(path) -> dict:
    """Parse and validate one per-timestamp OPV2V yaml.

    Returns the full mapping (cameras, plan_trajectory, ... kept); ``lidar_pose`` is checked to be
    6 numbers, ``vehicles`` is always a dict keyed by int actor id (empty when missing or null).
    Raises OPV2VFormatError (message starts with ``path``) on bad yaml or bad required keys.
    """
    with open(path, "rb") as handle:
        text = handle.read()
    try:
        params = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as exc:
        raise _format_error(path, yaml_error_line(exc)) from None
    return _validate_frame(params, path)


# ----------------------------------------------------------------------------------- geometry

def remove_own_body_points(points: np.ndarray) -> np.ndarray:
    """Drop the returns from the CAV's own body: points (N, 3+) in its lidar frame -> (K, 3+)."""
    on_body = ((points[:, 0] >= OWN_BODY_X[0]) & (points[:, 0] <= OWN_BODY_X[1])
               & (points[:, 1] >= OWN_BODY_Y[0]) & (points[:, 1] <= OWN_BODY_Y[1]))
    return points[~on_body]


class BodyFreeCloudCache(PointCloudCache):
    """Point cache whose entries hold each cloud without its CAV's own-body returns: the array
    the datasets consume. A hit is memory-mapped read-only: the datasets only read it (their
    first pass moves it into the sample's buffer), so nothing is copied on load."""

    mmap_mode = "r"

    def parse(self, path):
        return remove_own_body_points(read_pcd(path))


def _vehicle_pose(vehicle: dict) -> list:
    """World pose [x, y, z, roll, yaw, pitch] of a vehicle's box centre.

    ``center`` is an offset added to ``location`` without rotation (as the reference does).
    """
    center = vehicle.get("center", (0.0, 0.0, 0.0))
    location = vehicle["location"]
    return [float(location[i]) + float(center[i]) for i in range(3)] \
        + [float(a) for a in vehicle["angle"]]


@dataclass(frozen=True)
class VehicleArrays:
    """A ``vehicles`` mapping as arrays, sorted by actor id (V vehicles).

    ids (V,) int64; poses (V, 6) float64 world pose of each box centre [x, y, z, roll, yaw,
    pitch] (degrees); extents (V, 3) float64 half sizes [l, w, h].
    """
    ids: np.ndarray
    poses: np.ndarray
    extents: np.ndarray

    @classmethod
    def from_vehicles(cls, vehicles: dict) -> "VehicleArrays":
        actor_ids = sorted(vehicles, key=int)
        return cls(np.asarray([int(a) for a in actor_ids], dtype=np.int64),
                   np.asarray([_vehicle_pose(vehicles[a]) for a in actor_ids],
                              dtype=np.float64).reshape(-1, 6),
                   np.asarray([vehicles[a]["extent"] for a in actor_ids],
                              dtype=np.float64).reshape(-1, 3))

    @classmethod
    def concatenate(cls, parts: list) -> "VehicleArrays":
        """The vehicles of several frames one after the other (ids may repeat)."""
        return cls(np.concatenate([part.ids for part in parts]),
                   np.concatenate([part.poses for part in parts]),
                   np.concatenate([part.extents for part in parts]))


def vehicles_to_boxes(vehicles: dict, lidar_pose, limit_range, order: str = "hwl"):
    """Project world-frame vehicles into the frame of ``lidar_pose`` and keep boxes in range.

    Returns ``(ids, boxes)``: ids (M,) int64 sorted ascending, boxes (M, 7) float64 in
    ``order`` (``[x, y, z, h, w, l, yaw]`` for 'hwl'). A box is kept when all 8 corners of the
    box rebuilt from its 7 numbers lie inside ``limit_range`` (inclusive, z too), which is what the
    reference checks.
    """
    return vehicle_boxes(VehicleArrays.from_vehicles(vehicles), lidar_pose, limit_range, order)


def vehicle_boxes(vehicles: VehicleArrays, lidar_pose, limit_range, order: str = "hwl"):
    """:func:`vehicles_to_boxes` of arrays, all vehicles at once: (ids (M,), boxes (M, 7)) in
    the input's order, the vehicles whose box lies in ``limit_range``."""
    if vehicles.ids.shape[0] == 0:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    # relative_transform(object_pose, lidar_pose) = inv(T_lidar) @ T_object; invert once.
    object_to_lidar = np.linalg.inv(pose_to_matrix(lidar_pose)) @ poses_to_matrices(vehicles.poses)
    corners_lidar = (extent_corners(vehicles.extents) @ object_to_lidar[:, :3, :3].transpose(0, 2, 1)
                     + object_to_lidar[:, None, :3, 3])                          # (V, 8, 3)
    boxes = corners_to_boxes(corners_lidar, order)
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), limit_range, min_corners=8)
    return vehicles.ids[keep], boxes[keep]


def _gt_union(vehicle_arrays: list, ego_pose, exclude_ids: set, gt_range, order: str):
    """Union of the boxes of several CAVs' vehicles, all projected with the ego pose, at once.

    An actor listed in range by several CAVs takes the box of the first (ego first); returns
    (ids (M,), boxes (M, 7)) sorted by id.
    """
    ids, boxes = vehicle_boxes(VehicleArrays.concatenate(vehicle_arrays), ego_pose, gt_range,
                               order)
    wanted = ~np.isin(ids, np.asarray(sorted(exclude_ids), dtype=np.int64))
    # np.unique gives each id's first position: the first CAV listing it, as CAVs come in order.
    unique_ids, first = np.unique(ids[wanted], return_index=True)
    return unique_ids.astype(np.int64), boxes[wanted][first].reshape(-1, 7)


# ------------------------------------------------------------------------------------ layout

def is_infrastructure(cav_id: str) -> bool:
    """A negative folder id marks a roadside unit (V2XSet); every other folder is a vehicle."""
    return cav_id.startswith("-") and cav_id[1:].isdigit()


def _cav_sort_key(cav_id: str):
    """String sort, except negative ids (infrastructure units) go last."""
    return (is_infrastructure(cav_id), cav_id)


def _timestamp_sort_key(timestamp: str):
    # Numeric first so that unpadded names ("99", "100") still come in frame order.
    return (int(timestamp), timestamp)


def _sorted_subfolders(folder: Path) -> list[str]:
    with os.scandir(folder) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


@dataclass
class _CavFolder:
    """Files of one CAV folder: name -> (size, mtime_ns) for yaml, names only for pcd."""
    path: Path
    yaml_stats: dict
    cloud_names: set         # timestamps with a point cloud file (``.pcd``; V2X-Real ``.bin``)

    @classmethod
    def scan(cls, path: Path, cloud_suffix: str = "pcd") -> "_CavFolder":
        yaml_stats, cloud_names = {}, set()
        with os.scandir(path) as entries:
            for entry in entries:
                stem, _, suffix = entry.name.rpartition(".")
                if not stem.isdigit() or not entry.is_file():
                    continue
                if suffix == "yaml":
                    stat = entry.stat()
                    yaml_stats[stem] = (stat.st_size, stat.st_mtime_ns)
                elif suffix == cloud_suffix:
                    cloud_names.add(stem)
        return cls(path, yaml_stats, cloud_names)

    def require(self, timestamps: list, ego_path: Path, points: bool = True) -> None:
        """Raise naming this folder when it lacks a yaml or (``points``) pcd of one of
        ``timestamps``."""
        for timestamp in timestamps:
            if timestamp not in self.yaml_stats:
                raise _format_error(self.path, f"missing {timestamp}.yaml "
                                               f"(the ego folder {ego_path} has it)")
            if points and timestamp not in self.cloud_names:
                raise _format_error(self.path, f"missing {timestamp}.pcd")


@dataclass
class _ScenarioLayout:
    name: str
    cav_ids: list            # ego first, infrastructure last
    timestamps: list         # the ego's, sorted
    cav_folders: dict        # cav_id -> _CavFolder


def _scan_cav_folders(scenario_dir: Path) -> dict:
    """{cav_id: _CavFolder}, ego first, infrastructure last; raises when there is none."""
    cav_ids = sorted(_sorted_subfolders(scenario_dir), key=_cav_sort_key)
    if not cav_ids:
        raise _format_error(scenario_dir, "scenario folder has no CAV folders")
    if is_infrastructure(cav_ids[0]):
        # The ego is a vehicle; a scenario of roadside units alone has none to be it.
        raise _format_error(scenario_dir, f"only infrastructure folders ({', '.join(cav_ids)}: "
                                          "negative ids), no vehicle to be the ego")
    return {cav_id: _CavFolder.scan(scenario_dir / cav_id) for cav_id in cav_ids}


def scenario_timestamps(scenario_dir) -> dict:
    """{cav_id: {"yaml": set of timestamps, "pcd": set of timestamps}}, ego first (the order of
    the reader), for checks that want every problem rather than the first."""
    return {cav_id: {"yaml": set(folder.yaml_stats), "pcd": set(folder.cloud_names)}
            for cav_id, folder in _scan_cav_folders(Path(scenario_dir)).items()}


def _scan_scenario(scenario_dir: Path, points: bool = True) -> _ScenarioLayout:
    cav_folders = _scan_cav_folders(scenario_dir)
    cav_ids = list(cav_folders)
    ego_folder = cav_folders[cav_ids[0]]
    timestamps = sorted(ego_folder.yaml_stats, key=_timestamp_sort_key)
    if not timestamps:
        raise _format_error(ego_folder.path, "ego folder has no <timestamp>.yaml files")
    for cav_id in cav_ids:
        cav_folders[cav_id].require(timestamps, ego_folder.path, points)
    return _ScenarioLayout(scenario_dir.name, cav_ids, timestamps, cav_folders)


def _missing_split_problem(split_dir: Path) -> str:
    """"split folder not found", saying where a relative path was looked for: the current
    directory of the command, not the config's folder."""
    if split_dir.is_absolute():
        return "split folder not found"
    return (f"split folder not found (a relative path, resolved against the current directory "
            f"{Path.cwd()}: {Path.cwd() / split_dir})")


def _scan_split(split_dir: Path, points: bool = True) -> list[_ScenarioLayout]:
    if not split_dir.is_dir():
        raise _format_error(split_dir, _missing_split_problem(split_dir))
    scenario_names = _sorted_subfolders(split_dir)
    if not scenario_names:
        raise _format_error(split_dir, "split folder contains no scenario folders")
    splits_inside = [name for name in SPLITS if name in scenario_names]
    if splits_inside:
        # A data root instead of a split: its splits would each fail as a scenario folder.
        raise _format_error(split_dir, f"a data root (it holds {', '.join(splits_inside)}), "
                                       f"not a split folder: give one split, e.g. "
                                       f"{split_dir / splits_inside[0]}")
    layouts, problems = [], []
    for name in scenario_names:
        try:
            layouts.append(_scan_scenario(split_dir / name, points))
        except OPV2VFormatError as error:
            problems.append(str(error))
    raise_all(split_dir, problems)
    return layouts


def raise_all(split_dir: Path, problems: list) -> None:
    """One error listing every problem found (a user fixes them in one go, not one per run)."""
    if len(problems) == 1:
        raise OPV2VFormatError(problems[0])
    if problems:
        raise OPV2VFormatError(f"{split_dir}: {len(problems)} problems: " + "; ".join(problems)
                               + " (python tools/check_data.py DIR checks every file)")


def _layout_fingerprint(layouts: list[_ScenarioLayout]) -> str:
    """Hash of every yaml the index uses (relative path, size, mtime): changes invalidate it."""
    digest = hashlib.sha1()
    for layout in layouts:
        for cav_id in layout.cav_ids:
            stats = layout.cav_folders[cav_id].yaml_stats
            for timestamp in layout.timestamps:
                size, mtime_ns = stats[timestamp]
                digest.update(f"{layout.name}/{cav_id}/{timestamp} {size} {mtime_ns}\n".encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------- index cache

def _cache_root(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _index_cache_path(cache_dir, split_dir: Path, index_name: str = "opv2v") -> Path:
    """One file per split folder (keyed by its absolute path) and reader (``index_name``: each
    format parses the same yaml differently); its content says if it is fresh."""
    key = hashlib.sha1(str(split_dir.resolve()).encode()).hexdigest()[:20]
    return _cache_root(cache_dir) / f"{index_name}_index" / f"{split_dir.name}_{key}.json"


_PAIRS_TAG = "__pairs__"


def _to_json_safe(value):
    """Encode yaml data for JSON without losing key types: dicts whose keys are not all strings
    (actor ids are ints) become ``{"__pairs__": [[key, value], ...]}``."""
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _PAIRS_TAG not in value:
            return {k: _to_json_safe(v) for k, v in value.items()}
        return {_PAIRS_TAG: [[k, _to_json_safe(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [_to_json_safe(v) for v in value]
    return value


def _from_json_object(obj: dict):
    if len(obj) == 1 and _PAIRS_TAG in obj:
        return {key: value for key, value in obj[_PAIRS_TAG]}
    return obj


def _read_index_cache(cache_path: Path, fingerprint: str):
    """Frames ``{scenario: {cav_id: [params per timestamp]}}`` or None when absent/stale."""
    try:
        with open(cache_path, "r", encoding="utf-8") as handle:
            cached = json.load(handle, object_hook=_from_json_object)
    except (OSError, ValueError):
        return None
    if cached.get("version") != INDEX_CACHE_VERSION or cached.get("fingerprint") != fingerprint:
        return None
    return cached["frames"]


def _write_index_cache(cache_path: Path, fingerprint: str, frames: dict) -> None:
    """Write atomically (temp file + rename) so concurrent readers never see half a file."""
    payload = {"version": INDEX_CACHE_VERSION, "fingerprint": fingerprint,
               "frames": _to_json_safe(frames)}
    try:
        text = json.dumps(payload, separators=(",", ":"))
        with atomic_write(cache_path) as stream:
            stream.write(text)
    except (OSError, TypeError, ValueError) as exc:
        # A cache is an optimisation: an unwritable folder or a yaml value JSON cannot hold
        # (e.g. a date) must not stop training.
        logger.warning("OPV2V index cache not written to %s: %s", cache_path, exc)


def _parse_frames(split_dir: Path, layouts: list[_ScenarioLayout], load_frame=None) -> dict:
    """Parse every (scenario, cav, timestamp) yaml once with ``load_frame`` (path -> params;
    default :func:`load_frame_yaml`): {scenario: {cav_id: [params, ...]}}."""
    load_frame = load_frame or load_frame_yaml
    total = sum(len(layout.cav_ids) * len(layout.timestamps) for layout in layouts)
    frames, problems = {}, []
    with tqdm(total=total, desc=f"indexing {split_dir.name}", unit="frame",
              disable=total <= PROGRESS_MIN_FRAMES or get_rank() != 0,
              leave=False) as progress:
        for layout in layouts:
            frames[layout.name] = {}
            for cav_id in layout.cav_ids:
                folder = split_dir / layout.name / cav_id
                frames[layout.name][cav_id] = [_load_or_note(folder / f"{timestamp}.yaml",
                                                             problems, load_frame)
                                               for timestamp in layout.timestamps]
                progress.update(len(layout.timestamps))
    raise_all(split_dir, problems)
    return frames


def _load_or_note(path: Path, problems: list, load_frame):
    """``load_frame(path)``, or None with the problem appended to ``problems``."""
    try:
        return load_frame(path)
    except OPV2VFormatError as error:
        problems.append(str(error))
        return None


def _copy_tree(value):
    """Copy of parsed yaml (dicts/lists; leaves are immutable) so callers may mutate freely."""
    if isinstance(value, dict):
        return {k: _copy_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy_tree(v) for v in value]
    return value


# ------------------------------------------------------------------------------------ split

@dataclass
class SampleInfo:
    """One sample: a (scenario, timestamp) and the CAVs used, ego first."""
    split_dir: Path
    scenario: str
    timestamp: str
    ego_id: str
    cav_ids: list = field(default_factory=list)


class OPV2VSplit:
    """Index of one split folder (``train``, ``validate`` or ``test``) of OPV2V-format data.

    Args:
        split_dir: folder holding the scenario folders.
        com_range: CAVs whose lidar is farther than this (m, 2-D) from the ego's are dropped.
        max_cav: at most this many CAVs per sample (ego included), after the range test: the
            ego and the CAVs nearest to it (2-D distance, ties in folder order).
        cache_dir: cache folder (None: ``default_cache_dir()``); clouds go to ``<cache_dir>/pcd``,
            the index to ``<cache_dir>/opv2v_index``. Never the data folder.
        use_point_cache: load clouds through PointCloudCache (.npy) instead of parsing the PCD.
        index_cache: persist the parsed yaml of the split as JSON and reuse it when unchanged.
        require_points: False for camera-only inputs: a frame then needs its yaml only (no
            ``.pcd``; its cameras are checked when read, :meth:`load_cameras`).
        agent_order: (scenario, cav ids in folder order) -> the cav ids taking part, ego
            first, before the range and ``max_cav`` selection (heterogeneous agents:
            ``opencood.data.heter.ModalityPlan.agent_order``); None: folder order.
    """

    # What a subclass for another format of the same tree (V2V4Real) changes: its cache folder
    # name and its per-frame yaml parser (path -> validated params, JSON-able for the cache;
    # None: this module's load_frame_yaml).
    index_name = "opv2v"
    load_frame = None
    # Reads HEAL's modality assignment (``agent_order``) and OPV2V-H's LiDARs (``channels``).
    reads_heter = True

    @staticmethod
    def reader_options(cfg: dict) -> dict:
        """Constructor options a resolved config sets for this format (none for OPV2V; the
        V2V4Real and DAIR-V2X-C readers have theirs): the datasets pass them on."""
        return {}

    def __init__(self, split_dir, com_range: float = DEFAULT_COMM_RANGE, max_cav: int = 5,
                 cache_dir=None, use_point_cache: bool = True, index_cache: bool = True,
                 require_points: bool = True, agent_order=None):
        if max_cav < 1:
            raise ValueError(f"max_cav must be >= 1, got {max_cav}")
        self.split_dir = Path(split_dir)
        self.com_range = float(com_range)
        self.max_cav = int(max_cav)
        self.agent_order = agent_order
        layouts = _scan_split(self.split_dir, points=require_points)
        self._frames = self._load_frames(layouts, cache_dir, index_cache)
        self._cav_order = {layout.name: layout.cav_ids for layout in layouts}
        self._timestamps = {layout.name: layout.timestamps for layout in layouts}
        self._timestamp_pos = {layout.name: {ts: i for i, ts in enumerate(layout.timestamps)}
                               for layout in layouts}
        self._samples = [info for layout in layouts for info in self._scenario_samples(layout)]
        self._point_cache = (PointCloudCache(_cache_root(cache_dir) / "pcd")
                             if use_point_cache else None)
        # The datasets' clouds (own body removed) have their own entries; the raw ones above
        # are made only for load_cav_frame's callers (tools, tests).
        self._body_free_cache = (BodyFreeCloudCache(_cache_root(cache_dir) / "pcd_body_free")
                                 if use_point_cache else None)
        # (scenario, cav_id, timestamp) -> VehicleArrays, built on a frame's first use.
        self._vehicle_arrays = {}

    def _load_frames(self, layouts, cache_dir, index_cache: bool) -> dict:
        if not index_cache:
            return _parse_frames(self.split_dir, layouts, self.load_frame)
        fingerprint = _layout_fingerprint(layouts)
        cache_path = _index_cache_path(cache_dir, self.split_dir, self.index_name)
        frames = _read_index_cache(cache_path, fingerprint)
        if frames is None:
            frames = _parse_frames(self.split_dir, layouts, self.load_frame)
            _write_index_cache(cache_path, fingerprint, frames)
        return frames

    def _scenario_samples(self, layout: _ScenarioLayout) -> list[SampleInfo]:
        frames = self._frames[layout.name]
        cav_ids = layout.cav_ids if self.agent_order is None else \
            self.agent_order(layout.name, list(layout.cav_ids))
        if not cav_ids:             # nobody of the scenario takes part (agent_order)
            return []
        samples = []
        for position, timestamp in enumerate(layout.timestamps):
            ego_pose = frames[cav_ids[0]][position]["lidar_pose"]
            distance = {cav_id: _planar_distance(frames[cav_id][position]["lidar_pose"], ego_pose)
                        for cav_id in cav_ids}
            in_range = [cav_id for cav_id in cav_ids if distance[cav_id] <= self.com_range]
            # More than max_cav in range: the ego and the nearest others, kept in folder order.
            nearest = set(sorted(in_range[1:], key=distance.get)[:self.max_cav - 1])
            samples.append(SampleInfo(self.split_dir, layout.name, timestamp, cav_ids[0],
                                      in_range[:1] + [c for c in in_range[1:] if c in nearest]))
        return samples

    def __len__(self) -> int:
        return len(self._samples)

    def info(self, index: int) -> SampleInfo:
        return self._samples[index]

    @property
    def scenarios(self) -> list[str]:
        return list(self._cav_order)

    def timestamps(self, scenario: str) -> list[str]:
        """Sorted timestamps of ``scenario`` (those of its ego folder)."""
        return list(self._timestamps[scenario])

    def load_cav_frame(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        """One CAV at one timestamp.

        Returns {"points": (N, 4) float32 [x, y, z, intensity] in its lidar frame (own-body points
        still present), "lidar_pose": (6,) float64, "vehicles": {actor_id: ...},
        "params": the full yaml mapping (a private copy)}.
        """
        params = _copy_tree(self._frame_params(scenario, cav_id, timestamp))
        pcd_path = self.split_dir / scenario / cav_id / f"{timestamp}.pcd"
        points = self._point_cache.load(pcd_path) if self._point_cache else read_pcd(pcd_path)
        return {"points": points,
                "lidar_pose": np.asarray(params["lidar_pose"], dtype=np.float64),
                "vehicles": params["vehicles"],
                "params": params}

    def _frame_params(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        try:
            position = self._timestamp_pos[scenario][timestamp]
            return self._frames[scenario][cav_id][position]
        except KeyError:
            where = f"{scenario}/{cav_id}/{timestamp}"
            raise KeyError(f"no frame {where} in {self.split_dir}") from None

    def lidar_pose(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """Lidar pose of one CAV frame, float64, as the format stores it: (6,) here, (4, 4)
        for V2V4Real (no copy of the frame's yaml)."""
        return np.asarray(self._frame_params(scenario, cav_id, timestamp)["lidar_pose"],
                          dtype=np.float64)

    def load_cameras(self, scenario: str, cav_id: str, timestamp: str) -> CameraFrame:
        """The frame's 4 cameras: images, intrinsics, camera -> LiDAR (opencood.data.cameras,
        HEAL's conversion of the yaml's ``camera<i>.cords``)."""
        from opencood.data.cameras import read_opv2v_cameras    # PIL only for camera inputs
        params = self._frame_params(scenario, cav_id, timestamp)
        return read_opv2v_cameras(self.split_dir / scenario / cav_id, timestamp, params,
                                  params["lidar_pose"])

    def camera_visibility(self, scenario: str, cav_id: str, timestamp: str):
        """The frame's ``<ts>_bev_visibility.png`` as HEAL reads it ((256, 256) uint8,
        opencood.data.camera_visibility): beside the frame's files, else where HEAL looks next
        (``<root>/additional/<split>/<scenario>/<cav_id>/``); None when neither has it."""
        from opencood.data.camera_visibility import map_path, read_visibility_map
        for folder in (self.split_dir, self.split_dir.parent / "additional" / self.split_dir.name):
            path = map_path(folder / scenario / cav_id, timestamp)
            if path.is_file():
                return read_visibility_map(path)
        return None

    def object_classes(self, scenario: str, timestamp: str, ids):
        """None: OPV2V's labels carry no object classes (one class, vehicles)."""
        return None

    def vehicles(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        """The frame's ``vehicles`` mapping itself, shared with the index: read, never modify."""
        return self._frame_params(scenario, cav_id, timestamp)["vehicles"]

    def vehicle_arrays(self, scenario: str, cav_id: str, timestamp: str) -> VehicleArrays:
        """The frame's ``vehicles`` as arrays, converted once per frame and kept."""
        key = (scenario, cav_id, timestamp)
        arrays = self._vehicle_arrays.get(key)
        if arrays is None:
            arrays = VehicleArrays.from_vehicles(self.vehicles(scenario, cav_id, timestamp))
            self._vehicle_arrays[key] = arrays
        return arrays

    def load_points(self, scenario: str, cav_id: str, timestamp: str,
                    channels: int | None = None) -> np.ndarray:
        """(N, 4) float32 [x, y, z, intensity] of one CAV frame in its lidar frame, without the
        returns from its own body: what the datasets consume, from the cache when fresh (then
        read-only, mapped from the cache file: read it, never write to it). ``channels``: 32
        or 16 read OPV2V-H's LiDAR of that many beams (``opencood.data.heter.lidar_file``)."""
        pcd_path = lidar_file(self.split_dir / scenario / cav_id, timestamp, channels)
        if self._body_free_cache is not None:
            return self._body_free_cache.load(pcd_path)
        return remove_own_body_points(read_pcd(pcd_path))

    def sample_gt(self, index: int, gt_range=DEFAULT_GT_RANGE, order: str = "hwl"):
        """GT of sample ``index`` in the ego lidar frame: (ids (M,) int64 sorted, boxes (M, 7)
        float64), the union over the used CAVs' ``vehicles`` at the sample's timestamp projected
        with the ego pose, deduplicated by actor id (the first CAV listing one in range wins)."""
        info = self._samples[index]
        # A CAV is never its own GT, and should another CAV's yaml list it, it is not a target.
        cav_actor_ids = {int(cav_id) for cav_id in info.cav_ids if _is_int_text(cav_id)}
        return _gt_union([self.vehicle_arrays(info.scenario, cav_id, info.timestamp)
                          for cav_id in info.cav_ids],
                         self.lidar_pose(info.scenario, info.ego_id, info.timestamp),
                         cav_actor_ids, gt_range, order)

    def load_sample(self, index: int, gt_range=DEFAULT_GT_RANGE, order: str = "hwl") -> dict:
        """Everything of sample ``index`` before any fusion-specific processing.

        Returns {"info": SampleInfo, "cavs": {cav_id: {"points", "lidar_pose", "vehicles",
        "params", "T_to_ego": (4, 4) float64 cav-lidar -> ego-lidar}}, "gt_ids": (M,) int64,
        "gt_boxes": (M, 7) float64 in the ego lidar frame}. GT is the union over the used CAVs'
        ``vehicles`` projected with the ego pose, deduplicated by actor id, sorted by id.
        """
        info = self._samples[index]
        cavs = {cav_id: self.load_cav_frame(info.scenario, cav_id, info.timestamp)
                for cav_id in info.cav_ids}
        ego_pose = cavs[info.ego_id]["lidar_pose"]
        for cav in cavs.values():
            cav["T_to_ego"] = relative_transform(cav["lidar_pose"], ego_pose)
        gt_ids, gt_boxes = self.sample_gt(index, gt_range, order)
        return {"info": info, "cavs": cavs, "gt_ids": gt_ids, "gt_boxes": gt_boxes}

    def cav_boxes(self, cav: dict, gt_range, order: str = "hwl"):
        """The GT one CAV sees itself, in its own frame: ``cav`` as :meth:`load_cav_frame`
        returns it -> (ids (M,) int64, boxes (M, 7) float64). OPV2V: its ``vehicles``."""
        return vehicles_to_boxes(cav["vehicles"], cav["lidar_pose"], gt_range, order)

    def frame_boxes(self, scenario: str, cav_id: str, timestamp: str, gt_range,
                    order: str = "hwl"):
        """:meth:`cav_boxes` of one CAV frame by its key, from the frame's kept arrays (late
        fusion's per-CAV GT on the datasets' path, which never builds the frame dict)."""
        return vehicle_boxes(self.vehicle_arrays(scenario, cav_id, timestamp),
                             self.lidar_pose(scenario, cav_id, timestamp), gt_range, order)


def _pose_xy(pose) -> tuple:
    """(x, y) of a 6-number pose or of a (4, 4) frame->world matrix."""
    array = np.asarray(pose, dtype=np.float64)
    return (array[0, 3], array[1, 3]) if array.shape == (4, 4) else (array[0], array[1])


def _planar_distance(pose_a, pose_b) -> float:
    (xa, ya), (xb, yb) = _pose_xy(pose_a), _pose_xy(pose_b)
    return math.hypot(float(xa) - float(xb), float(ya) - float(yb))


def _is_int_text(text: str) -> bool:
    return text.lstrip("-").isdigit()
