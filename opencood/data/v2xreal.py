"""Reader for V2X-Real (``fusion.dataset: v2xreal``): two vehicles and two roadside units,
many object classes grouped into meta-classes.

Layout (the V2X-Real repository's ``data_utils/datasets/basedataset.py`` reads it)::

    <split>/<scenario>/<agent>/<ts>.bin|.yaml     agent: 1, 2 (vehicles), -1, -2 (roadside)

``<ts>.bin``: float32 rows [x, y, z, intensity] in the agent's LiDAR frame (V2X-Real reads the
intensity as 0: its loader zeroes the column, and so does ours). ``<ts>.yaml``: ``lidar_pose``
[x, y, z, roll, yaw, pitch] (world, degrees: the calibration), ``vehicles`` {object id: world
box as OPV2V's (``location``, ``center``, ``extent``, ``angle``) + ``obj_type``}: the labels.

What the reference defines and we keep:

* **Collaboration modes** (``fusion.dataset_mode``, V2X-Real's ``dataset_mode``): which folders
  take part and which is the ego, from the scenario's folders in string order: ``vc`` vehicles
  then roadside units (a vehicle is the ego), ``ic`` roadside units then vehicles, ``v2v``
  vehicles only, ``i2i`` roadside units only. A scenario with no agent of the mode has no
  sample. At most ``max_cav`` agents per scenario, the first in that order (before the range
  test), then those within ``comm_range`` of the ego per sample.
* **Meta-classes**: each raw ``obj_type`` maps to one of :data:`SUPER_CLASS_MAP`'s classes;
  an unmapped name is kept only when its lower case is a meta-class name (the reference maps,
  then keeps names whose lower case is a class: ``Vehicle`` passes, ``Bicycle`` does not).
  The class id of a box is its meta-class's position in the config's class list
  (``postprocess.classes``; single-class configs keep the meta-class ``vehicle``).
* **GT of a sample**: every used agent's labels moved to the ego, kept with >= 2 corners in the
  GT range, then >= 2 corners in the crop (``cav_lidar_range``), the union by object id, the
  first agent listing an id winning (ego first).
* **Evaluation days**: outside training, every mode but ``v2v`` skips scenarios recorded on
  :data:`V2V_ONLY_DAYS` (the reference's test set drops them, without saying why).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from opencood.config_schema import DEFAULT_COMM_RANGE
from opencood.data.opv2v import (SPLITS, OPV2VFormatError, OPV2VSplit, SampleInfo,
                                 VehicleArrays, _CavFolder, _ScenarioLayout, _cache_root,
                                 _copy_tree, _index_cache_path, _layout_fingerprint,
                                 _parse_frames, _planar_distance, _read_index_cache,
                                 _sorted_subfolders, _write_index_cache, load_frame_yaml,
                                 raise_all, remove_own_body_points)
from opencood.data.pcd import PointCloudCache
from opencood.errors import ConfigError
from opencood.ops.transforms import (boxes_to_corners_3d, corners_in_range_mask, corners_to_boxes,
                                     extent_corners, pose_to_matrix, poses_to_matrices)

MODES = ("vc", "ic", "v2v", "i2i")
# V2X-Real's meta-classes and the raw names each groups (its data_utils/__init__.py; the order
# of the keys is its class ids 1, 2, 3; "MotorcyleRider" is its spelling).
SUPER_CLASS_MAP = {
    "vehicle": ("LongVehicle", "Car", "PoliceCar"),
    "pedestrian": ("Child", "RoadWorker", "Pedestrian", "Scooter", "ScooterRider", "Motorcycle",
                   "MotorcyleRider", "BicycleRider"),
    "truck": ("Truck", "Van", "TrashCan", "ConcreteTruck", "Bus"),
}
META_CLASSES = tuple(SUPER_CLASS_MAP)
SINGLE_CLASS = ("vehicle",)        # what a config without a class list detects
_META_OF = {name: meta for meta, names in SUPER_CLASS_MAP.items() for name in names}
V2V_ONLY_DAYS = ("2023-04-07",)
GT_MIN_CORNERS = 2                 # corners of a box that must lie in a range (reference)
ALL_AGENTS = 1 << 30               # max_cav of the checker: every agent folder


def _format_error(path, problem: str) -> OPV2VFormatError:
    return OPV2VFormatError(f"{path}: {problem}")


def meta_class(obj_type: str):
    """The meta-class of a raw V2X-Real class name, or None when the reference drops it."""
    if obj_type in _META_OF:
        return _META_OF[obj_type]
    return obj_type.lower() if obj_type.lower() in SUPER_CLASS_MAP else None


def check_classes(classes) -> tuple:
    """The class names a config detects, each a meta-class (a one-line error otherwise)."""
    unknown = [name for name in classes if name not in SUPER_CLASS_MAP]
    if unknown:
        raise ConfigError(f"postprocess.classes: {', '.join(map(repr, unknown))} not a V2X-Real "
                         f"meta-class (expected some of {', '.join(META_CLASSES)})")
    return tuple(classes)


def mode_agents(folders, mode: str) -> list:
    """The agents taking part in ``mode``, ego first: ``folders`` (names of integer ids) in
    string order, split into vehicles (id >= 0) and roadside units (id < 0)."""
    if mode not in MODES:
        raise ConfigError(f"fusion.dataset_mode {mode!r}: expected one of {', '.join(MODES)}")
    ordered = sorted(folders)
    vehicles = [name for name in ordered if int(name) >= 0]
    roadside = [name for name in ordered if int(name) < 0]
    return {"vc": vehicles + roadside, "ic": roadside + vehicles, "v2v": vehicles,
            "i2i": roadside}[mode]


def load_v2xreal_yaml(path) -> dict:
    """One frame's yaml: OPV2V's checks (6-number ``lidar_pose``, world boxes) and every
    object's ``obj_type`` a string. Raises OPV2VFormatError naming ``path``."""
    params = load_frame_yaml(path)
    for key, vehicle in params["vehicles"].items():
        if not isinstance(vehicle.get("obj_type"), str):
            raise _format_error(path, f"'vehicles.{key}.obj_type' must be a class name, got "
                                      f"{vehicle.get('obj_type')!r}")
    return params


def read_bin(path) -> np.ndarray:
    """A V2X-Real ``.bin`` -> (N, 4) float32 [x, y, z, 0]: rows with a NaN coordinate dropped,
    intensity zeroed (as its ``load_lidar_bin(..., zero_intensity=True)``)."""
    raw = np.fromfile(path, dtype=np.float32)
    if raw.size % 4:
        raise _format_error(path, f"{raw.size} float32 values: not rows of 4 (x, y, z, "
                                  f"intensity)")
    points = raw.reshape(-1, 4)
    points = points[~np.isnan(points[:, :3]).any(axis=1)]
    points[:, 3] = 0.0
    return points


class _BodyFreeBinCache(PointCloudCache):
    """Cache entries of ``.bin`` clouds less their agent's own-body returns (read-only hits)."""

    mmap_mode = "r"

    def parse(self, path):
        return remove_own_body_points(read_bin(path))


def _scan_scenario(scenario_dir: Path, mode: str, max_cav: int, points: bool):
    """The scenario's agents of ``mode`` (at most ``max_cav``) and the ego's timestamps, each
    agent checked to have every one of them; None when no agent takes part."""
    folders = _sorted_subfolders(scenario_dir)
    bad = [name for name in folders if not name.lstrip("-").isdigit()]
    if bad:
        raise _format_error(scenario_dir / bad[0], "agent folder name is not an integer id")
    agents = mode_agents(folders, mode)[:max_cav]
    if not agents:
        return None
    records = {agent: _CavFolder.scan(scenario_dir / agent, cloud_suffix="bin") for agent in agents}
    ego = records[agents[0]]
    timestamps = sorted(ego.yaml_stats)
    if not timestamps:
        raise _format_error(ego.path, "ego folder has no <timestamp>.yaml files")
    for agent in agents:
        for timestamp in timestamps:
            if timestamp not in records[agent].yaml_stats:
                raise _format_error(records[agent].path, f"missing {timestamp}.yaml (labels "
                                                         f"and calibration)")
            if points and timestamp not in records[agent].cloud_names:
                raise _format_error(records[agent].path, f"missing {timestamp}.bin")
    return _ScenarioLayout(scenario_dir.name, agents, timestamps, records)


def scan_split(split_dir: Path, mode: str, max_cav: int, train: bool, points: bool = True):
    """Every scenario of a split taking part in ``mode`` (module doc), all problems at once."""
    if not split_dir.is_dir():
        raise _format_error(split_dir, "split folder not found")
    layouts, problems = [], []
    for name in _sorted_subfolders(split_dir):
        if not train and mode != "v2v" and any(day in name for day in V2V_ONLY_DAYS):
            continue
        try:
            layout = _scan_scenario(split_dir / name, mode, max_cav, points)
        except OPV2VFormatError as error:
            problems.append(str(error))
            continue
        if layout is not None:
            layouts.append(layout)
    raise_all(split_dir, problems)
    if not layouts and not problems:
        raise _format_error(split_dir, f"no scenario has an agent of mode {mode!r}")
    return layouts


class ObjectArrays:
    """One frame's labels of the kept classes, sorted by id: VehicleArrays (world boxes) and
    ``classes`` (V,) int64, each object's position in the reader's class list."""

    def __init__(self, vehicles: dict, classes: tuple):
        kept = {}
        for key, vehicle in vehicles.items():
            meta = meta_class(vehicle["obj_type"])
            if meta in classes:
                kept[key] = vehicle
        self.boxes = VehicleArrays.from_vehicles(kept)
        self.classes = np.asarray([classes.index(meta_class(kept[int(i)]["obj_type"]))
                                   for i in self.boxes.ids], dtype=np.int64)


def project_objects(objects: ObjectArrays, target_pose, ranges, order: str = "hwl"):
    """World boxes seen from ``target_pose`` -> (ids (M,), boxes (M, 7), classes (M,)), the
    boxes with >= 2 corners in every range of ``ranges`` (None entries skipped)."""
    arrays = objects.boxes
    if not len(arrays.ids):
        return (np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64),
                np.zeros(0, dtype=np.int64))
    object_to_target = np.linalg.inv(pose_to_matrix(target_pose)) @ poses_to_matrices(arrays.poses)
    corners = (extent_corners(arrays.extents) @ object_to_target[:, :3, :3].transpose(0, 2, 1)
               + object_to_target[:, None, :3, 3])
    boxes = corners_to_boxes(corners, order)
    rebuilt = boxes_to_corners_3d(boxes, order)
    keep = np.ones(len(boxes), dtype=bool)
    for limit in ranges:
        if limit is not None:
            keep &= corners_in_range_mask(rebuilt, limit, min_corners=GT_MIN_CORNERS)
    return arrays.ids[keep], boxes[keep], objects.classes[keep]


class V2XRealSplit:
    """Index of one V2X-Real split folder (the SplitReader protocol, opencood.data.formats).

    Args: OPV2VSplit's (``com_range``, ``max_cav``, ``cache_dir``, ``use_point_cache``,
    ``index_cache``, ``require_points``), and ``mode`` (vc, ic, v2v, i2i), ``crop_range`` (the
    crop filter: ``cav_lidar_range``; None: none), ``classes`` (the meta-classes detected, in
    class-id order), ``train`` (False applies the evaluation-day rule).
    """

    index_name = "v2xreal"
    reads_heter = False
    reads_train_flag = True        # the datasets pass ``train`` (the evaluation-day rule)

    @staticmethod
    def reader_options(cfg: dict) -> dict:
        """Mode, crop filter and class list of a resolved config."""
        classes = cfg["postprocess"].get("classes")
        return {"mode": cfg["fusion"]["dataset_mode"],
                "crop_range": cfg["preprocess"]["cav_lidar_range"],
                "classes": tuple(c["name"] for c in classes) if classes else SINGLE_CLASS}

    def __init__(self, split_dir, com_range: float = DEFAULT_COMM_RANGE, max_cav: int = 4,
                 cache_dir=None, use_point_cache: bool = True, index_cache: bool = True,
                 require_points: bool = True, agent_order=None, mode: str = "vc",
                 crop_range=None, classes=SINGLE_CLASS, train: bool = False):
        if agent_order is not None:
            raise ValueError("the v2xreal reader has no modality assignment (heter)")
        if max_cav < 1:
            raise ValueError(f"max_cav must be >= 1, got {max_cav}")
        self.split_dir = Path(split_dir)
        self.com_range = float(com_range)
        self.mode = mode
        self.classes = check_classes(classes)
        self.crop_range = None if crop_range is None else [float(v) for v in crop_range]
        layouts = scan_split(self.split_dir, mode, int(max_cav), train, require_points)
        self._frames = self._load_frames(layouts, cache_dir, index_cache)
        self._agents = {layout.name: layout.cav_ids for layout in layouts}
        self._timestamps = {layout.name: layout.timestamps for layout in layouts}
        self._position = {layout.name: {ts: i for i, ts in enumerate(layout.timestamps)}
                          for layout in layouts}
        self._samples = [info for layout in layouts for info in self._scenario_samples(layout)]
        self._point_cache = (_BodyFreeBinCache(_cache_root(cache_dir) / "bin_body_free")
                             if use_point_cache else None)
        self._objects = {}

    def _load_frames(self, layouts, cache_dir, index_cache: bool) -> dict:
        if not index_cache:
            return _parse_frames(self.split_dir, layouts, load_v2xreal_yaml)
        fingerprint = _layout_fingerprint(layouts)
        # one index per mode (each holds its own agents' frames): modes used in turn do not
        # rewrite each other's
        cache_path = _index_cache_path(cache_dir, self.split_dir, f"{self.index_name}_{self.mode}")
        frames = _read_index_cache(cache_path, fingerprint)
        if frames is None:
            frames = _parse_frames(self.split_dir, layouts, load_v2xreal_yaml)
            _write_index_cache(cache_path, fingerprint, frames)
        return frames

    def _scenario_samples(self, layout) -> list:
        frames = self._frames[layout.name]
        samples = []
        for position, timestamp in enumerate(layout.timestamps):
            ego_pose = frames[layout.cav_ids[0]][position]["lidar_pose"]
            used = [agent for agent in layout.cav_ids
                    if _planar_distance(frames[agent][position]["lidar_pose"], ego_pose)
                    <= self.com_range]
            samples.append(SampleInfo(self.split_dir, layout.name, timestamp, used[0], used))
        return samples

    # -- the SplitReader protocol ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._samples)

    def info(self, index: int) -> SampleInfo:
        return self._samples[index]

    @property
    def scenarios(self) -> list:
        return list(self._agents)

    def timestamps(self, scenario: str) -> list:
        return list(self._timestamps[scenario])

    def _frame_params(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        try:
            return self._frames[scenario][cav_id][self._position[scenario][timestamp]]
        except KeyError:
            raise KeyError(f"no frame {scenario}/{cav_id}/{timestamp} in "
                           f"{self.split_dir}") from None

    def lidar_pose(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """(6,) float64 [x, y, z, roll, yaw, pitch] of the agent's LiDAR in the world."""
        return np.asarray(self._frame_params(scenario, cav_id, timestamp)["lidar_pose"],
                          dtype=np.float64)

    def vehicles(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        """The frame's labels as the yaml holds them (shared with the index: read only)."""
        return self._frame_params(scenario, cav_id, timestamp)["vehicles"]

    def objects(self, scenario: str, cav_id: str, timestamp: str) -> ObjectArrays:
        """The frame's labels of the kept classes as arrays, built once per frame."""
        key = (scenario, cav_id, timestamp)
        if key not in self._objects:
            self._objects[key] = ObjectArrays(self.vehicles(*key), self.classes)
        return self._objects[key]

    def _bin_path(self, scenario: str, cav_id: str, timestamp: str) -> Path:
        return self.split_dir / scenario / cav_id / f"{timestamp}.bin"

    def load_points(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """(N, 4) float32 [x, y, z, 0] in the agent's LiDAR frame, own-body returns removed
        (the reference's ``mask_ego_points``, roadside units too)."""
        path = self._bin_path(scenario, cav_id, timestamp)
        if self._point_cache is not None:
            return self._point_cache.load(path)
        return remove_own_body_points(read_bin(path))

    def load_cav_frame(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        """{"points" (own body kept), "lidar_pose" (6,), "vehicles", "params", "cav_id"}."""
        params = _copy_tree(self._frame_params(scenario, cav_id, timestamp))
        return {"points": read_bin(self._bin_path(scenario, cav_id, timestamp)),
                "lidar_pose": np.asarray(params["lidar_pose"], dtype=np.float64),
                "vehicles": params["vehicles"], "params": params, "cav_id": cav_id}

    def _sample_objects(self, index: int, gt_range, order: str):
        """(ids, boxes, classes) of sample ``index`` in the ego frame, sorted by id."""
        info = self._samples[index]
        ego_pose = self.lidar_pose(info.scenario, info.ego_id, info.timestamp)
        first = {}
        for cav_id in info.cav_ids:
            ids, boxes, classes = project_objects(
                self.objects(info.scenario, cav_id, info.timestamp), ego_pose,
                (gt_range, self.crop_range), order)
            for box_id, box, class_id in zip(ids.tolist(), boxes, classes.tolist()):
                first.setdefault(box_id, (box, class_id))
        ids = sorted(first)
        return (np.asarray(ids, dtype=np.int64),
                np.asarray([first[i][0] for i in ids], dtype=np.float64).reshape(-1, 7),
                np.asarray([first[i][1] for i in ids], dtype=np.int64))

    def sample_gt(self, index: int, gt_range, order: str = "hwl"):
        """(ids (M,) int64 sorted, boxes (M, 7) float64) of sample ``index`` (module doc)."""
        ids, boxes, _ = self._sample_objects(index, gt_range, order)
        return ids, boxes

    # OPV2V's: {"info", "cavs": {agent: load_cav_frame + "T_to_ego"}, "gt_ids", "gt_boxes"};
    # it asks only _samples, load_cav_frame and sample_gt, which this class has (tools/bench.py)
    load_sample = OPV2VSplit.load_sample

    def object_classes(self, scenario: str, timestamp: str, ids) -> np.ndarray:
        """(M,) int64 class id (position in ``classes``) of each object id of a (scenario,
        timestamp), from the first agent (in mode order) labelling it."""
        class_of = {}
        for cav_id in self._agents[scenario]:
            objects = self.objects(scenario, cav_id, timestamp)
            for box_id, class_id in zip(objects.boxes.ids.tolist(), objects.classes.tolist()):
                class_of.setdefault(box_id, class_id)
        return np.asarray([class_of[int(i)] for i in ids], dtype=np.int64)

    def frame_boxes(self, scenario: str, cav_id: str, timestamp: str, gt_range,
                    order: str = "hwl"):
        """One agent's own labels in its own frame (late fusion): (ids, boxes), >= 2 corners
        in ``gt_range``."""
        ids, boxes, _ = project_objects(self.objects(scenario, cav_id, timestamp),
                                        self.lidar_pose(scenario, cav_id, timestamp),
                                        (gt_range,), order)
        return ids, boxes

    def load_cameras(self, scenario: str, cav_id: str, timestamp: str):
        from opencood.data.cameras import CameraFileError
        raise CameraFileError(f"{self.split_dir / scenario / cav_id / timestamp}: the v2xreal "
                              f"reader reads LiDAR only (camera inputs not supported)")

    def camera_visibility(self, scenario: str, cav_id: str, timestamp: str):
        return None


def check_tree(root, report, progress: bool = True):
    """Every problem of a V2X-Real folder (a data set root or one split) into ``report``
    (opencood.data.check.CheckReport): each scenario's agents in every mode, every agent
    folder holding a yaml and a ``.bin`` of each of the first folder's timestamps, every yaml
    parsed by :func:`load_v2xreal_yaml`, every ``.bin`` read."""
    root = Path(root)
    if not root.is_dir():
        raise _format_error(root, "folder not found")
    # the splits under a data set root, else the root itself is one split
    for split_dir in [root / name for name in SPLITS if (root / name).is_dir()] or [root]:
        report.splits.append(split_dir.name)
        for name in _sorted_subfolders(split_dir):
            report.scenarios += 1
            for mode in MODES:
                try:
                    _scan_scenario(split_dir / name, mode, ALL_AGENTS, points=True)
                except OPV2VFormatError as error:
                    report.problems.append(str(error))
                    break
            else:
                _check_frames(split_dir / name, report)
    return report


def _check_frames(scenario_dir: Path, report) -> None:
    for agent in _sorted_subfolders(scenario_dir):
        report.cav_folders += 1
        folder = _CavFolder.scan(scenario_dir / agent, cloud_suffix="bin")
        for timestamp in sorted(folder.yaml_stats):
            report.frames += 1
            try:
                load_v2xreal_yaml(folder.path / f"{timestamp}.yaml")
                report.points += len(read_bin(folder.path / f"{timestamp}.bin"))
            except OPV2VFormatError as error:
                report.problems.append(str(error))
            except OSError as error:
                report.problems.append(f"{error.filename}: cannot read ({error.strerror})")
