"""Reader for DAIR-V2X-C (``fusion.dataset: dairv2x``): one vehicle and one roadside unit.

Layout (the DAIR-V2X repository's ``data/README.md``; read as HEAL's
``dairv2x_basedataset.py`` and CoAlign's reads it)::

    <root>/                                   cooperative-vehicle-infrastructure
      train.json, val.json, ...               a split: json list of vehicle frame ids
      cooperative/data_info.json              one entry per (vehicle, infrastructure) pair:
          vehicle_pointcloud_path, infrastructure_pointcloud_path (relative to <root>),
          cooperative_label_path, system_error_offset {delta_x, delta_y}, image paths
      cooperative/label_world/<vid>.json      world-frame boxes: type, world_8_points (8 x 3)
      cooperative/label_world_backup/         CoAlign's install: the original labels, whose
                                              label_world it replaced by complemented ones
      vehicle-side/velodyne/<vid>.pcd         binary PCD, x y z intensity (0..255)
      vehicle-side/calib/lidar_to_novatel/<vid>.json   {transform: {rotation, translation}}
      vehicle-side/calib/novatel_to_world/<vid>.json   {rotation, translation}
      vehicle-side/data_info.json             per vehicle frame: batch_id, pointcloud_timestamp
      infrastructure-side/velodyne/<iid>.pcd
      infrastructure-side/calib/virtuallidar_to_world/<iid>.json   {rotation, translation}

A split is named by its json file; the data root is the folder holding it (put HEAL's/CoAlign's
split files into ``cooperative-vehicle-infrastructure``). Agents: the vehicle is the ego (``"0"``)
and the roadside unit ``"-1"`` (a negative id: infrastructure, as V2XSet names it).

* vehicle lidar -> world = novatel_to_world @ lidar_to_novatel;
* infrastructure lidar -> world = virtuallidar_to_world with ``system_error_offset`` added to
  its x and y translation (the offset corrects the roadside unit's calibration error);
* GT, by ``gt_source`` (the config's ``fusion.gt_source``):

  - ``cooperative``: the cooperative labels' world corners moved to the ego frame, turned into
    [x, y, z, h, w, l, yaw] (corners_to_boxes: the same order conventions as the reference's
    ``corner_to_center``), ids = position in the label file (CoAlign's DAIR datasets);
  - ``single_side``: what every HEAL DAIR LiDAR yaml's data set (its heterogeneous intermediate
    dataset over ``DAIRV2XBaseDataset``) trains and evaluates on: the two single-side label sets,
    ``vehicle-side/label/lidar/<vid>.json`` and ``infrastructure-side/label/virtuallidar/
    <iid>.json`` (centre, h w l, yaw in each side's lidar frame), moved to the ego; a roadside
    box is added when its BEV IoU with every vehicle box is at most ``MERGE_IOU`` (0.05); ids
    renumbered 0.. (vehicle boxes first, in file order). On real DAIR-V2X-C these are other
    annotations than the cooperative ones (their own boxes, offsets and misses);

  either way classes Car, Truck, Van, Bus as one vehicle class (with ``postprocess.classes``
  and the cooperative labels: the classes listed, :data:`MERGED_CLASSES`, each box's class id
  from ``object_classes``), kept when all 8 corners lie in
  the range (HEAL's default; HEAL also widens z by 1 m each way, which the hypes_yaml/dairv2x
  configs' gt_range already holds);
* sample order: the split file's, as HEAL's datasets index it (per-frame protocols and a
  latency pair's first sample depend on it); latency takes the frame before in time within
  the same sequence (``batch_id``), wherever the split lists it;
* point clouds: intensity / 256 and rows with NaN dropped (HEAL's ``read_pcd``).

Everything but the clouds (calibs, labels, the index) is parsed once and cached as JSON like the
OPV2V index (``$OPENCOOD_CACHE/dairv2x_index``), keyed by every file's size and mtime.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from opencood.data.opv2v import (SampleInfo, _cache_root, _index_cache_path, _read_index_cache,
                                 _write_index_cache, remove_own_body_points)
from opencood.data.pcd import PcdError, PointCloudCache, read_pcd
from opencood.errors import OpencoodError
from opencood.ops.iou import boxes_bev_iou
from opencood.ops.transforms import boxes_to_corners_3d, corners_in_range_mask, corners_to_boxes

logger = logging.getLogger(__name__)

VEHICLE_ID, INFRASTRUCTURE_ID = "0", "-1"
VEHICLE_CLASSES = ("Car", "Truck", "Van", "Bus")
# Multi-class GT (``postprocess.classes``, cooperative labels): DAIR-V2X's own class merge (its
# KITTI converter writes Truck, Van and Bus as Car); every other type is a class of its name.
MERGED_CLASSES = {"Car": VEHICLE_CLASSES, "Pedestrian": ("Pedestrian",),
                  "Cyclist": ("Cyclist",), "Tricyclist": ("Tricyclist",),
                  "Motorcyclist": ("Motorcyclist",), "Barrowlist": ("Barrowlist",),
                  "TrafficCone": ("TrafficCone",)}
INTENSITY_SCALE = 1.0 / 256.0            # HEAL: raw 0..255 intensity / 256
INDEX_CACHE_VERSION = 1
DATA_INFO = Path("cooperative") / "data_info.json"
VEHICLE_INFO = Path("vehicle-side") / "data_info.json"
LABEL_BACKUP = Path("cooperative") / "label_world_backup"
# Each side's own labels (centre, sizes, yaw in its lidar frame), HEAL's single-side GT.
SIDE_LABELS = {"vehicle": Path("vehicle-side") / "label" / "lidar",
               "infrastructure": Path("infrastructure-side") / "label" / "virtuallidar"}
GT_SOURCES = ("cooperative", "single_side")
MERGE_IOU = 0.05                # HEAL: a roadside box overlapping a vehicle box more is the same
# The split files we look for in a root (HEAL's names), for tools/check_data.py.
SPLIT_FILES = ("train.json", "val.json", "test.json")


class DairFormatError(OpencoodError, ValueError):
    """A DAIR-V2X-C file that cannot be read as the format says; the message starts with it."""


def _error(path, problem: str) -> DairFormatError:
    return DairFormatError(f"{path}: {problem}")


# --------------------------------------------------------------------------------- reading

def read_json(path: Path):
    """Parsed json of ``path``; a missing or unparsable file is one DairFormatError line."""
    try:
        with open(path, "r", encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise _error(path, "file not found") from None
    except OSError as error:
        raise _error(path, f"cannot read file ({error.strerror or error})") from None
    except ValueError as error:                 # JSONDecodeError, or bad utf-8
        where = f" at line {error.lineno}, column {error.colno}" if hasattr(error, "lineno") \
            else ""
        message = getattr(error, "msg", str(error).splitlines()[0])
        raise _error(path, f"invalid json{where}: {message}") from None


def _numbers(value, count: int, path, key: str) -> np.ndarray:
    """``value`` flattened to ``count`` finite float64 numbers, else a DairFormatError."""
    try:
        array = np.asarray(value, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise _error(path, f"'{key}' must hold {count} numbers") from None
    if array.size != count or not np.isfinite(array).all():
        raise _error(path, f"'{key}' must hold {count} finite numbers, got {value!r}")
    return array


def transform_from_calib(calib, path) -> np.ndarray:
    """A DAIR calib json (``{rotation, translation}``, possibly under ``transform``) -> (4, 4)
    float64. The rotation is 3x3 row-major, the translation 3 numbers ([[x], [y], [z]])."""
    if isinstance(calib, dict) and isinstance(calib.get("transform"), dict):
        calib = calib["transform"]
    if not isinstance(calib, dict) or "rotation" not in calib or "translation" not in calib:
        raise _error(path, "expected 'rotation' and 'translation' (or them under 'transform')")
    matrix = np.eye(4)
    matrix[:3, :3] = _numbers(calib["rotation"], 9, path, "rotation").reshape(3, 3)
    matrix[:3, 3] = _numbers(calib["translation"], 3, path, "translation")
    return matrix


def vehicle_pose(root: Path, vehicle_id: str) -> np.ndarray:
    """(4, 4) vehicle lidar -> world: novatel_to_world @ lidar_to_novatel."""
    calib = root / "vehicle-side" / "calib"
    lidar_path = calib / "lidar_to_novatel" / f"{vehicle_id}.json"
    novatel_path = calib / "novatel_to_world" / f"{vehicle_id}.json"
    lidar_to_novatel = transform_from_calib(read_json(lidar_path), lidar_path)
    novatel_to_world = transform_from_calib(read_json(novatel_path), novatel_path)
    return novatel_to_world @ lidar_to_novatel


def infrastructure_pose(root: Path, infrastructure_id: str, offset: dict,
                        info_path) -> np.ndarray:
    """(4, 4) infrastructure lidar -> world: virtuallidar_to_world, its x/y translation shifted
    by ``offset`` = {delta_x, delta_y} (the pair's system_error_offset)."""
    path = root / "infrastructure-side" / "calib" / "virtuallidar_to_world" / \
        f"{infrastructure_id}.json"
    matrix = transform_from_calib(read_json(path), path)
    matrix[:2, 3] += _offset(offset, info_path)
    return matrix


def _offset(offset, info_path) -> np.ndarray:
    """(2,) [delta_x, delta_y]; DAIR writes "" for a pair without an offset (DAIR's own tools
    read it as none)."""
    if offset in ("", None):
        return np.zeros(2)
    if not isinstance(offset, dict) or not {"delta_x", "delta_y"} <= set(offset):
        raise _error(info_path, f"system_error_offset must be {{delta_x, delta_y}}, "
                                f"got {offset!r}")
    return _numbers([offset["delta_x"], offset["delta_y"]], 2, info_path, "system_error_offset")


def read_labels(path: Path, types=VEHICLE_CLASSES) -> list:
    """Cooperative labels -> [{"type": str, "corners": 8x3 list, "position": int}] of the
    ``types`` (default the vehicle classes), in file order (their position is their id)."""
    labels = read_json(path)
    if not isinstance(labels, list):
        raise _error(path, f"expected a json list of labels, got {type(labels).__name__}")
    kept = []
    for position, label in enumerate(labels):
        if not isinstance(label, dict) or "world_8_points" not in label:
            raise _error(path, f"label {position} has no 'world_8_points'")
        corners = _numbers(label["world_8_points"], 24, path, f"{position}.world_8_points")
        kept.append({"type": str(label.get("type", "")), "corners": corners.reshape(8, 3).tolist(),
                     "position": position})
    return [label for label in kept if label["type"] in types]


def class_types(classes) -> tuple:
    """The DAIR label types of a class list (names of :data:`MERGED_CLASSES`), in list order;
    None: the vehicle classes. Raises ValueError naming an unknown class."""
    if classes is None:
        return VEHICLE_CLASSES
    unknown = [name for name in classes if name not in MERGED_CLASSES]
    if unknown:
        raise ValueError(f"postprocess.classes: {', '.join(map(repr, unknown))} not a DAIR-V2X "
                         f"class (expected some of {', '.join(MERGED_CLASSES)})")
    return tuple(t for name in classes for t in MERGED_CLASSES[name])


def read_side_labels(path: Path) -> list:
    """One side's own labels -> [{"box": [x, y, z, h, w, l, yaw] in its lidar frame,
    "position": int}] of the vehicle classes, in file order. A label with a zero size is skipped
    and takes no position (HEAL's ``load_single_objects_dairv2x_hetero`` counts only the others,
    whatever their class)."""
    labels = read_json(path)
    if not isinstance(labels, list):
        raise _error(path, f"expected a json list of labels, got {type(labels).__name__}")
    kept, position = [], 0
    for number, label in enumerate(labels):
        if not isinstance(label, dict) or not {"3d_location", "3d_dimensions", "rotation"} \
                <= set(label):
            raise _error(path, f"label {number} needs '3d_location', '3d_dimensions' and "
                               f"'rotation'")
        location, size = label["3d_location"], label["3d_dimensions"]
        if not isinstance(location, dict) or not isinstance(size, dict):
            raise _error(path, f"label {number}: '3d_location' and '3d_dimensions' must be "
                               f"mappings")
        try:
            centre = [location[k] for k in "xyz"]
            hwl = [size[k] for k in "hwl"]
        except KeyError as missing:
            raise _error(path, f"label {number} has no {missing.args[0]!r}") from None
        box = _numbers(centre + hwl + [label["rotation"]], 7, path, f"{number}")
        if not box[3:6].all():
            continue
        if str(label.get("type", "")) in VEHICLE_CLASSES:
            kept.append({"box": box.tolist(), "position": position})
        position += 1
    return kept


def read_cloud(path: Path, point_cache=None) -> np.ndarray:
    """(N, 4) float32 [x, y, z, intensity / 256] without NaN rows (HEAL's read_pcd)."""
    points = point_cache.load(path) if point_cache is not None else read_pcd(path)
    points = points[~np.isnan(points).any(axis=1)]
    points[:, 3] *= np.float32(INTENSITY_SCALE)
    return points


class BodyFreeDairCache(PointCloudCache):
    """Point cache of the clouds the datasets consume: :func:`read_cloud`'s (NaN rows dropped,
    intensity / 256) less the own-body box (the datasets remove it from every format's agents,
    the roadside unit's too). A hit is memory-mapped read-only: the datasets only read it."""

    mmap_mode = "r"

    def parse(self, path):
        return remove_own_body_points(read_cloud(path))


# ------------------------------------------------------------------------------ the index

def frame_id_of(relative_path, info_path) -> str:
    """``vehicle-side/velodyne/015344.pcd`` -> ``015344``."""
    if not isinstance(relative_path, str) or not relative_path:
        raise _error(info_path, f"bad path entry {relative_path!r}")
    return Path(relative_path).stem


def read_split(split_path: Path) -> list:
    """The vehicle frame ids (strings) of a split json list."""
    ids = read_json(split_path)
    if not isinstance(ids, list) or not all(isinstance(i, (str, int)) for i in ids):
        raise _error(split_path, "expected a json list of vehicle frame ids")
    if not ids:
        raise _error(split_path, "the split lists no frames")
    return [str(i) for i in ids]


def read_pairs(root: Path) -> dict:
    """{vehicle frame id: cooperative/data_info.json entry}."""
    info_path = root / DATA_INFO
    entries = read_json(info_path)
    if not isinstance(entries, list):
        raise _error(info_path, "expected a json list of pairs")
    pairs = {}
    for entry in entries:
        if not isinstance(entry, dict) or "vehicle_pointcloud_path" not in entry:
            raise _error(info_path, f"pair without 'vehicle_pointcloud_path': {entry!r}"[:200])
        pairs[frame_id_of(entry["vehicle_pointcloud_path"], info_path)] = entry
    return pairs


def read_sequences(root: Path) -> dict:
    """{vehicle frame id: (batch id, pointcloud timestamp)} from vehicle-side/data_info.json;
    {} when it is absent (every frame is then its own sequence: no latency)."""
    path = root / VEHICLE_INFO
    if not path.is_file():
        return {}
    sequences = {}
    for entry in read_json(path):
        if isinstance(entry, dict) and "pointcloud_path" in entry:
            frame = frame_id_of(entry["pointcloud_path"], path)
            sequences[frame] = (str(entry.get("batch_id", "")),
                                int(entry.get("pointcloud_timestamp", 0) or 0))
    return sequences


def _pair_entry(pairs: dict, vehicle_id: str, root: Path, split_path: Path) -> dict:
    if vehicle_id not in pairs:
        raise _error(root / DATA_INFO, f"no pair for vehicle frame {vehicle_id} "
                                       f"(listed in {split_path})")
    return pairs[vehicle_id]


def side_label_paths(root: Path, vehicle_id: str, infrastructure_id: str) -> dict:
    """{side: path of its own label file} of one pair."""
    return {"vehicle": root / SIDE_LABELS["vehicle"] / f"{vehicle_id}.json",
            "infrastructure": root / SIDE_LABELS["infrastructure"] / f"{infrastructure_id}.json"}


def parse_frame(root: Path, vehicle_id: str, entry: dict, side_labels: bool = False,
                types=VEHICLE_CLASSES) -> dict:
    """Everything of one pair but the clouds, JSON-able: poses (4x4 lists), cloud paths,
    labels of the ``types`` (with ``side_labels``, each side's own too: ``vehicle_labels``,
    ``infrastructure_labels``). Raises DairFormatError naming the file at fault."""
    info_path = root / DATA_INFO
    for key in ("infrastructure_pointcloud_path", "cooperative_label_path"):
        if key not in entry:
            raise _error(info_path, f"pair of vehicle frame {vehicle_id} has no {key!r}")
    infrastructure_id = frame_id_of(entry["infrastructure_pointcloud_path"], info_path)
    own = {f"{side}_labels": read_side_labels(path) for side, path in
           side_label_paths(root, vehicle_id, infrastructure_id).items()} if side_labels else {}
    return {
        **own,
        "vehicle_id": vehicle_id,
        "infrastructure_id": infrastructure_id,
        "vehicle_cloud": entry["vehicle_pointcloud_path"],
        "infrastructure_cloud": entry["infrastructure_pointcloud_path"],
        "vehicle_pose": vehicle_pose(root, vehicle_id).tolist(),
        "infrastructure_pose": infrastructure_pose(
            root, infrastructure_id, entry.get("system_error_offset"), info_path).tolist(),
        "labels": read_labels(root / entry["cooperative_label_path"], types),
        "label_path": entry["cooperative_label_path"],
    }


def _files_of(root: Path, vehicle_id: str, entry: dict, side_labels: bool = False) -> list:
    """Files a parsed frame depends on (for the cache fingerprint)."""
    infrastructure_id = Path(str(entry.get("infrastructure_pointcloud_path", ""))).stem
    calib = root / "vehicle-side" / "calib"
    own = list(side_label_paths(root, vehicle_id, infrastructure_id).values()) \
        if side_labels else []
    return [calib / "lidar_to_novatel" / f"{vehicle_id}.json",
            calib / "novatel_to_world" / f"{vehicle_id}.json",
            root / "infrastructure-side" / "calib" / "virtuallidar_to_world" /
            f"{infrastructure_id}.json",
            root / str(entry.get("cooperative_label_path", ""))] + own


def _fingerprint(paths: list) -> str:
    digest = hashlib.sha1()
    for path in paths:
        try:
            stat = os.stat(path)
            digest.update(f"{path} {stat.st_size} {stat.st_mtime_ns}\n".encode())
        except OSError:
            digest.update(f"{path} missing\n".encode())
    return digest.hexdigest()


# ------------------------------------------------------------------------------ the split

def label_arrays(labels: list):
    """Cooperative labels as arrays: (ids (M,) int64 = positions in the label file, world
    corners (M, 8, 3) float64)."""
    return (np.asarray([label["position"] for label in labels], dtype=np.int64),
            np.asarray([label["corners"] for label in labels], dtype=np.float64).reshape(-1, 8, 3))


def world_corners_to_frame(ids: np.ndarray, corners: np.ndarray, lidar_to_world: np.ndarray,
                           limit_range, order: str = "hwl"):
    """:func:`label_arrays`' arrays seen from a lidar frame (lidar_to_world (4, 4)) -> (ids (M,),
    boxes (M, 7) float64), boxes with all 8 corners of the rebuilt box in ``limit_range``."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    world_to_lidar = np.linalg.inv(lidar_to_world)
    corners = corners @ world_to_lidar[:3, :3].T + world_to_lidar[:3, 3]
    boxes = corners_to_boxes(corners, order)
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), limit_range, min_corners=8)
    return ids[keep], boxes[keep]


def world_boxes_to_frame(labels: list, lidar_to_world: np.ndarray, limit_range,
                         order: str = "hwl"):
    """Cooperative labels (world corners) seen from a lidar frame.

    labels: [{"corners": (8, 3), "position": int}]; lidar_to_world: (4, 4). Returns (ids (M,)
    int64 = positions in the label file, boxes (M, 7) float64), boxes with all 8 corners of
    the rebuilt box in ``limit_range``.
    """
    return world_corners_to_frame(*label_arrays(labels), lidar_to_world, limit_range, order)


def side_boxes_to_frame(labels: list, side_to_target: np.ndarray, limit_range,
                        order: str = "hwl"):
    """One side's own labels (:func:`read_side_labels`) seen from a target lidar frame.

    side_to_target: (4, 4). Returns (ids (M,) int64 = the labels' positions, boxes (M, 7)
    float64 in ``order``), boxes whose 8 corners (of the rebuilt box) lie in ``limit_range``.
    """
    if not labels:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    ids = np.asarray([label["position"] for label in labels], dtype=np.int64)
    boxes = np.asarray([label["box"] for label in labels], dtype=np.float64)
    if order == "lwh":
        boxes = boxes[:, [0, 1, 2, 5, 4, 3, 6]]
    corners = boxes_to_corners_3d(boxes, order)
    corners = corners @ side_to_target[:3, :3].T + side_to_target[:3, 3]
    moved = corners_to_boxes(corners, order)
    keep = corners_in_range_mask(boxes_to_corners_3d(moved, order), limit_range, min_corners=8)
    return ids[keep], moved[keep]


def merge_sides(vehicle_boxes: np.ndarray, infrastructure_boxes: np.ndarray,
                order: str = "hwl"):
    """HEAL's DAIR GT of a pair: the vehicle's boxes (V, 7), then each roadside box (R, 7) whose
    BEV IoU with every vehicle box is <= MERGE_IOU, all in the ego frame -> (ids (M,) int64
    renumbered 0.., boxes (M, 7))."""
    extra = infrastructure_boxes
    if len(vehicle_boxes) and len(infrastructure_boxes):
        overlap = boxes_bev_iou(infrastructure_boxes, vehicle_boxes, order)     # (R, V)
        extra = infrastructure_boxes[~(np.asarray(overlap) > MERGE_IOU).any(axis=1)]
    boxes = np.concatenate([vehicle_boxes.reshape(-1, 7), extra.reshape(-1, 7)])
    return np.arange(len(boxes), dtype=np.int64), boxes


@dataclass
class _Sequence:
    name: str
    vehicle_ids: list = field(default_factory=list)     # in time order


class DairV2XSplit:
    """Index of one DAIR-V2X-C split, with the interface of OPV2VSplit (opencood.data.formats).

    Args:
        split_path: the split json (``<root>/train.json``); its folder is the data root.
        com_range: the roadside unit is dropped when farther than this (m, 2-D) from the vehicle.
        max_cav: 1 keeps the vehicle alone, 2 (HEAL's default) both agents.
        cache_dir, use_point_cache, index_cache: as OPV2VSplit's.
        gt_source: "cooperative" or "single_side" (module doc; the config's
            ``fusion.gt_source``).
        classes: the class names of a multi-class config (``postprocess.classes``; names of
            :data:`MERGED_CLASSES`), with the cooperative labels only; None: the vehicle
            classes as one class, no class ids.
        require_points: OPV2VSplit's option; nothing to do here (clouds are read on use only).

    A sample's scenario is the vehicle frame's ``batch_id`` (a recorded sequence), its timestamp
    the vehicle frame id; samples come in the split file's order; latency takes an earlier frame
    of the same sequence in this split.
    """

    index_name = "dairv2x"

    def __init__(self, split_path, com_range: float = 100.0, max_cav: int = 2, cache_dir=None,
                 use_point_cache: bool = True, index_cache: bool = True,
                 gt_source: str = "cooperative", require_points: bool = True, classes=None):
        if max_cav < 1:
            raise ValueError(f"max_cav must be >= 1, got {max_cav}")
        if gt_source not in GT_SOURCES:
            raise ValueError(f"gt_source must be one of {', '.join(GT_SOURCES)}, "
                             f"got {gt_source!r}")
        if classes is not None and gt_source != "cooperative":
            raise ValueError(f"postprocess.classes: the dairv2x reader labels classes from the "
                             f"cooperative labels only (fusion.gt_source: cooperative), not "
                             f"{gt_source!r}")
        self.gt_source = gt_source
        self.classes = None if classes is None else tuple(classes)
        self._types = class_types(self.classes)
        # its own index cache: the parsed pairs then hold each side's labels, or other classes
        self.index_name = "dairv2x" if gt_source == "cooperative" else "dairv2x_single_side"
        if self.classes is not None:
            self.index_name = "dairv2x_" + "_".join(self.classes)
        self.split_path = Path(split_path)
        self.split_dir = self.split_path               # what datasets and tools call the split
        self.root = self.split_path.parent
        self.com_range, self.max_cav = float(com_range), int(max_cav)
        vehicle_ids = read_split(self.split_path)
        self._frames = self._load_frames(vehicle_ids, cache_dir, index_cache)
        self.label_set = "complemented (CoAlign)" if (self.root / LABEL_BACKUP).is_dir() \
            else "original"
        self._sequences = self._group(vehicle_ids)
        sequence_of = {vehicle_id: sequence for sequence in self._sequences.values()
                       for vehicle_id in sequence.vehicle_ids}
        self._samples = [self._sample(vehicle_id, sequence_of[vehicle_id])
                         for vehicle_id in vehicle_ids]
        self._point_cache = (PointCloudCache(_cache_root(cache_dir) / "pcd")
                             if use_point_cache else None)
        # vehicle frame id -> label_arrays of its pair, built on the pair's first use.
        self._label_arrays = {}
        # Its own folder: its entries differ from OPV2V's body-free ones (intensity scaled).
        self._body_free_cache = (BodyFreeDairCache(_cache_root(cache_dir) / "pcd_body_free_dair")
                                 if use_point_cache else None)
        logger.info("DAIR-V2X-C %s: %d pairs, GT: %s (cooperative labels: %s)",
                    self.split_path, len(self._samples), gt_source, self.label_set)

    @staticmethod
    def reader_options(cfg: dict) -> dict:
        """The constructor's options a resolved config sets: the GT source, the class list."""
        classes = cfg["postprocess"].get("classes")
        return {"gt_source": cfg["fusion"]["gt_source"],
                "classes": tuple(c["name"] for c in classes) if classes else None}

    def _load_frames(self, vehicle_ids: list, cache_dir, index_cache: bool) -> dict:
        pairs = read_pairs(self.root)
        entries = {v: _pair_entry(pairs, v, self.root, self.split_path) for v in vehicle_ids}
        sides = self.gt_source == "single_side"
        if not index_cache:
            return {v: parse_frame(self.root, v, entries[v], sides, self._types)
                    for v in vehicle_ids}
        files = [self.split_path, self.root / DATA_INFO] + \
            [path for v in vehicle_ids for path in _files_of(self.root, v, entries[v], sides)]
        fingerprint = _fingerprint(files)
        cache_path = _index_cache_path(cache_dir, self.split_path, self.index_name)
        cached = _read_index_cache(cache_path, fingerprint)
        if cached is not None:
            return cached
        frames = {v: parse_frame(self.root, v, entries[v], sides, self._types)
                  for v in vehicle_ids}
        _write_index_cache(cache_path, fingerprint, frames)
        return frames

    def _group(self, vehicle_ids: list) -> dict:
        """{sequence name: _Sequence}, frames in time order; the split's order otherwise."""
        known = read_sequences(self.root)
        sequences = {}
        for position, vehicle_id in enumerate(vehicle_ids):
            name, _ = known.get(vehicle_id, (f"frame_{vehicle_id}", 0))
            sequences.setdefault(name, _Sequence(name)).vehicle_ids.append(vehicle_id)
        for sequence in sequences.values():
            sequence.vehicle_ids.sort(key=lambda v: (known.get(v, ("", 0))[1], v))
        return sequences

    def _sample(self, vehicle_id: str, sequence: _Sequence) -> SampleInfo:
        frame = self._frames[vehicle_id]
        vehicle_xy = np.asarray(frame["vehicle_pose"])[:2, 3]
        infrastructure_xy = np.asarray(frame["infrastructure_pose"])[:2, 3]
        in_range = math.dist(vehicle_xy, infrastructure_xy) <= self.com_range
        cav_ids = [VEHICLE_ID] + ([INFRASTRUCTURE_ID] if in_range and self.max_cav > 1 else [])
        return SampleInfo(self.split_path, sequence.name, vehicle_id, VEHICLE_ID, cav_ids)

    # -- the OPV2VSplit interface -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._samples)

    def info(self, index: int) -> SampleInfo:
        return self._samples[index]

    @property
    def scenarios(self) -> list:
        return list(self._sequences)

    def timestamps(self, scenario: str) -> list:
        """Vehicle frame ids of the sequence ``scenario`` in this split, in time order."""
        return list(self._sequences[scenario].vehicle_ids)

    def load_cav_frame(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        """One agent (``"0"`` vehicle, ``"-1"`` roadside unit) of the pair of vehicle frame
        ``timestamp``: {"points": (N, 4) float32 in its lidar frame, "lidar_pose": (4, 4)
        float64 lidar -> world, "vehicles": the cooperative labels (world corners), "params":
        the parsed pair, "cav_id"}."""
        frame = self._frames[timestamp]
        side = "vehicle" if cav_id == VEHICLE_ID else "infrastructure"
        points = read_cloud(self.root / frame[f"{side}_cloud"], self._point_cache)
        # params["vehicles"]: where the datasets look for an agent's own GT (cav_boxes).
        return {"points": points,
                "lidar_pose": np.asarray(frame[f"{side}_pose"], dtype=np.float64),
                "vehicles": frame["labels"], "params": {**frame, "vehicles": frame["labels"]},
                "cav_id": cav_id}

    # -- what the datasets read (OPV2VSplit's names), no frame dict built -------------------
    def _side(self, cav_id: str) -> str:
        return "vehicle" if cav_id == VEHICLE_ID else "infrastructure"

    def lidar_pose(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """(4, 4) float64 lidar -> world of one agent of the pair of vehicle frame ``timestamp``."""
        return np.asarray(self._frames[timestamp][f"{self._side(cav_id)}_pose"], dtype=np.float64)

    def load_cameras(self, scenario: str, cav_id: str, timestamp: str):
        """The agent's one camera (``<side>/image/<frame>.jpg``, its intrinsic and (virtual)lidar
        -> camera calib), read as HEAL reads them (opencood.data.cameras.read_dair_cameras)."""
        from opencood.data.cameras import read_dair_cameras    # PIL only for camera inputs
        frame = self._frames[timestamp]
        side = self._side(cav_id)
        return read_dair_cameras(self.root, f"{side}-side", frame[f"{side}_id"])

    def camera_visibility(self, scenario: str, cav_id: str, timestamp: str):
        """None: DAIR-V2X-C has no bev_visibility maps (HEAL filters its camera GT by range)."""
        return None

    def object_classes(self, scenario: str, timestamp: str, ids):
        """(M,) int64 class id (position in ``classes``) of each cooperative label id
        (its position in the label file) of the pair of vehicle frame ``timestamp``; None
        without a class list (the vehicle types are one class)."""
        if self.classes is None:
            return None
        class_of_type = {t: k for k, name in enumerate(self.classes)
                         for t in MERGED_CLASSES[name]}
        class_of = {label["position"]: class_of_type[label["type"]]
                    for label in self._frames[timestamp]["labels"]}
        return np.asarray([class_of[int(i)] for i in ids], dtype=np.int64)

    def vehicles(self, scenario: str, cav_id: str, timestamp: str) -> list:
        """The pair's cooperative labels (world corners), shared with the index: read only."""
        return self._frames[timestamp]["labels"]

    def vehicle_arrays(self, scenario: str, cav_id: str, timestamp: str):
        """:func:`label_arrays` of the pair's cooperative labels (world corners), kept."""
        arrays = self._label_arrays.get(timestamp)
        if arrays is None:
            arrays = label_arrays(self.vehicles(scenario, cav_id, timestamp))
            self._label_arrays[timestamp] = arrays
        return arrays

    def load_points(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """(N, 4) float32 of one agent in its lidar frame as :meth:`load_cav_frame` gives it,
        less the own-body box; from the cache read-only (never write to it) when enabled."""
        path = self.root / self._frames[timestamp][f"{self._side(cav_id)}_cloud"]
        if self._body_free_cache is not None:
            return self._body_free_cache.load(path)
        return remove_own_body_points(read_cloud(path))

    def sample_gt(self, index: int, gt_range, order: str = "hwl"):
        """GT of sample ``index`` in the vehicle's lidar frame, from ``gt_source``: the
        cooperative labels, or the sides' own labels merged (:func:`merge_sides`; the roadside
        unit's only when it is one of the sample's agents, as HEAL drops it beyond comm_range)."""
        info = self._samples[index]
        if self.gt_source == "cooperative":
            return self.frame_boxes(info.scenario, VEHICLE_ID, info.timestamp, gt_range, order)
        frame = self._frames[info.timestamp]
        ego_pose = self.lidar_pose(info.scenario, VEHICLE_ID, info.timestamp)
        per_side = [side_boxes_to_frame(
            frame[f"{self._side(cav_id)}_labels"],
            np.linalg.inv(ego_pose) @ self.lidar_pose(info.scenario, cav_id, info.timestamp),
            gt_range, order)[1] for cav_id in info.cav_ids]
        return merge_sides(per_side[0], per_side[1] if len(per_side) > 1 else np.zeros((0, 7)),
                           order)

    def frame_boxes(self, scenario: str, cav_id: str, timestamp: str, gt_range,
                    order: str = "hwl"):
        """:meth:`cav_boxes` of one agent by its key (the datasets' late-fusion path): the
        cooperative labels, or (single_side) the agent's own labels, in its own frame."""
        if self.gt_source == "single_side":
            return side_boxes_to_frame(self._frames[timestamp][f"{self._side(cav_id)}_labels"],
                                       np.eye(4), gt_range, order)
        return world_corners_to_frame(*self.vehicle_arrays(scenario, cav_id, timestamp),
                                      self.lidar_pose(scenario, cav_id, timestamp), gt_range,
                                      order)

    def load_sample(self, index: int, gt_range, order: str = "hwl") -> dict:
        """As OPV2VSplit's: {"info", "cavs" (with "T_to_ego"), "gt_ids", "gt_boxes"}; GT as
        :meth:`sample_gt`, in the vehicle's lidar frame."""
        info = self._samples[index]
        cavs = {cav_id: self.load_cav_frame(info.scenario, cav_id, info.timestamp)
                for cav_id in info.cav_ids}
        ego_pose = cavs[VEHICLE_ID]["lidar_pose"]
        for cav in cavs.values():
            cav["T_to_ego"] = np.linalg.inv(ego_pose) @ cav["lidar_pose"]
        gt_ids, gt_boxes = self.sample_gt(index, gt_range, order)
        return {"info": info, "cavs": cavs, "gt_ids": gt_ids, "gt_boxes": gt_boxes}

    def cav_boxes(self, cav: dict, gt_range, order: str = "hwl"):
        """One agent's GT in its own frame (late fusion's per-agent GT), as :meth:`frame_boxes`."""
        return self.frame_boxes(None, cav["cav_id"], cav["params"]["vehicle_id"], gt_range,
                                order)


# ----------------------------------------------------------------------- tools/check_data.py

def check_root(root, report):
    """Every problem of a DAIR-V2X-C root (its split files, pairs, calibs, labels and clouds),
    one line each, added to ``report`` (an opencood.data.check.CheckReport, passed in so this
    reader does not import the checker that imports it); returns it. A missing root raises."""
    root = Path(root)
    if not root.is_dir():
        raise DairFormatError(f"{root}: folder not found")
    try:
        pairs = read_pairs(root)
    except DairFormatError as error:
        report.problems.append(str(error))
        return report
    for name in SPLIT_FILES:
        if (root / name).is_file():
            report.splits.append(name)
            _check_split(root, root / name, pairs, report)
    if not report.splits:
        report.problems.append(f"{root}: no split file ({', '.join(SPLIT_FILES)})")
    return report


def _check_split(root: Path, split_path: Path, pairs: dict, report) -> None:
    try:
        vehicle_ids = read_split(split_path)
    except DairFormatError as error:
        report.problems.append(str(error))
        return
    report.scenarios += 1
    for vehicle_id in vehicle_ids:
        report.frames += 1
        try:
            frame = parse_frame(root, vehicle_id,
                                _pair_entry(pairs, vehicle_id, root, split_path))
        except DairFormatError as error:
            report.problems.append(str(error))
            continue
        for side in ("vehicle", "infrastructure"):
            try:
                report.points += len(read_pcd(root / frame[f"{side}_cloud"]))
            except PcdError as error:
                report.problems.append(str(error).splitlines()[0])
