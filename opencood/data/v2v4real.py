"""Reader for V2V4Real (``fusion.dataset: v2v4real``), two real vehicles driving together.

Layout: OPV2V's tree, ``<split>/<scenario>/<cav_id>/<ts>.pcd|.yaml`` with two CAV folders per
scenario (the ego is the first in sort order). What differs from OPV2V, as the reference reader
(the V2V4Real repository: ``data_utils/datasets/basedataset.py``, ``utils/box_utils.py``
``project_world_objects``) reads it:

* the yaml holds numpy objects: ``lidar_pose`` is a 4x4 float64 matrix (lidar -> map origin),
  ``gps`` a list of float64 scalars. We read them with :class:`NumpyYamlLoader`, never with the
  unsafe loader the reference uses (opencood.data.numpy_yaml);
* each object of ``vehicles`` is in the CAV's **own lidar frame**: pose ``location + center``
  (no rotation of ``center``), ``angle`` [roll, yaw, pitch] in degrees, half sizes ``extent``,
  ``ass_id`` (the id of the same object in the other CAV's labels, -1 when none) and
  ``obj_type`` (``Pedestrian`` is skipped: one vehicle class);
* GT of a sample: every used CAV's objects projected to the ego with its CAV -> ego matrix, an
  object's id being its ``ass_id``, or ``key + 100 * cav_id`` when that is -1 (the reference's
  rule), the first CAV listing an id winning (ego first); a box is kept when at least 2 of its
  corners lie in the range (the reference's ``mask_boxes_outside_range_numpy`` default, where
  OPV2V's reader asks for 8);
* the crop filter (``crop_range``, the config's ``preprocess.cav_lidar_range``): the reference's
  fusion datasets filter each CAV's ego-frame boxes a second time, at least 2 corners inside
  ``cav_lidar_range`` (x, y and z), in test mode too (``get_item_single_car`` of its
  intermediate dataset). With the published crop [-140.8, -38.4, ...] this drops the boxes
  whose corners lie only in the band 38.4 < |y| <= 40 m of GT_RANGE. Done per CAV before the
  union, as the intermediate dataset does (its early-fusion dataset filters the union instead:
  the two differ only for an id whose ego box fails the crop and whose other box passes).
"""
from __future__ import annotations

import numpy as np
import yaml

from opencood.config import yaml_error_line
from opencood.data.numpy_yaml import NumpyYamlLoader
from opencood.data.opv2v import OPV2VFormatError, OPV2VSplit, _normalise_vehicles
from opencood.ops.transforms import (boxes_to_corners_3d, corners_in_range_mask, corners_to_boxes,
                                     extent_corners, pose_to_matrix, relative_transform)

GT_MIN_CORNERS = 2                 # corners of a box that must lie in the range (reference)
SKIPPED_TYPES = ("Pedestrian",)    # not a vehicle: left out of the GT (reference)
ID_STRIDE = 100                    # reference: an object without ass_id is key + 100 * cav_id


def _format_error(path, problem: str) -> OPV2VFormatError:
    return OPV2VFormatError(f"{path}: {problem}")


# --------------------------------------------------------------------------------------- yaml

def _plain(value):
    """numpy arrays and scalars -> lists and Python numbers, recursively (JSON-able params)."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _yaml_problem(error: yaml.YAMLError) -> str:
    """One line; a python tag we do not build is named as refused (it was never run)."""
    problem = getattr(error, "problem", "") or ""
    if problem.startswith("could not determine a constructor for the tag"):
        mark = error.problem_mark
        tag = problem.split("'")[1] if "'" in problem else problem
        return (f"refused yaml tag {tag.replace('tag:yaml.org,2002:', '!!')} at line "
                f"{mark.line + 1} (only numpy arrays and scalars are read; nothing was run)")
    return yaml_error_line(error)


def _check_pose_matrix(value, path) -> list:
    matrix = np.asarray(value, dtype=object)
    if matrix.shape != (4, 4):
        raise _format_error(path, f"'lidar_pose' must be a 4x4 matrix, got shape {matrix.shape}")
    try:
        matrix = matrix.astype(np.float64)
    except (TypeError, ValueError):
        raise _format_error(path, "'lidar_pose' must hold numbers") from None
    if not np.isfinite(matrix).all():
        raise _format_error(path, "'lidar_pose' must hold finite numbers")
    return matrix.tolist()


def _check_object_labels(vehicles: dict, path) -> None:
    """``ass_id`` an integer and ``obj_type`` a string, where present."""
    for key, vehicle in vehicles.items():
        ass_id = vehicle.get("ass_id", -1)
        if isinstance(ass_id, bool) or not isinstance(ass_id, int):
            raise _format_error(path, f"'vehicles.{key}.ass_id' must be an integer, "
                                      f"got {ass_id!r}")
        if not isinstance(vehicle.get("obj_type", "Car"), str):
            raise _format_error(path, f"'vehicles.{key}.obj_type' must be a string")


def load_v2v4real_yaml(path) -> dict:
    """Parse and validate one V2V4Real frame yaml -> plain params (lists and Python numbers):
    ``lidar_pose`` a 4x4 nested list, ``vehicles`` {int key: object} (empty when missing).
    Raises OPV2VFormatError naming ``path`` (one line) on bad yaml, a refused tag or bad keys."""
    with open(path, "rb") as handle:
        text = handle.read()
    try:
        params = yaml.load(text, Loader=NumpyYamlLoader)
    except yaml.YAMLError as error:
        raise _format_error(path, _yaml_problem(error)) from None
    if not isinstance(params, dict):
        raise _format_error(path, f"top level must be a mapping, got {type(params).__name__}")
    params = _plain(params)
    if "lidar_pose" not in params:
        raise _format_error(path, "'lidar_pose' is missing")
    params["lidar_pose"] = _check_pose_matrix(params["lidar_pose"], path)
    params["vehicles"] = _normalise_vehicles(params.get("vehicles"), path)
    _check_object_labels(params["vehicles"], path)
    return params


# ----------------------------------------------------------------------------------- geometry

def object_id(key: int, vehicle: dict, cav_id: str) -> int:
    """The id an object has across CAVs: its ``ass_id``, else ``key + 100 * cav_id``."""
    ass_id = int(vehicle.get("ass_id", -1))
    return ass_id if ass_id != -1 else int(key) + ID_STRIDE * int(cav_id)


def object_corners(vehicle: dict) -> np.ndarray:
    """(8, 3) corners of one object in the frame its pose is given in (the CAV's lidar)."""
    pose = [float(vehicle["location"][i]) + float(vehicle.get("center", (0, 0, 0))[i])
            for i in range(3)] + [float(a) for a in vehicle["angle"]]
    object_to_cav = pose_to_matrix(pose)
    corners = extent_corners(vehicle["extent"])
    return corners @ object_to_cav[:3, :3].T + object_to_cav[:3, 3]


def own_frame_objects(vehicles: dict, cav_id: str):
    """One CAV's objects as arrays in its own lidar frame, pedestrians left out, in key order:
    (ids (V,) int64 across CAVs (:func:`object_id`), corners (V, 8, 3) float64)."""
    keys = [key for key in sorted(vehicles) if vehicles[key].get("obj_type") not in SKIPPED_TYPES]
    if not keys:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 8, 3), dtype=np.float64)
    return (np.asarray([object_id(key, vehicles[key], cav_id) for key in keys], dtype=np.int64),
            np.stack([object_corners(vehicles[key]) for key in keys]))


def objects_to_boxes(ids: np.ndarray, corners: np.ndarray, cav_to_target: np.ndarray,
                     limit_range, order: str = "hwl"):
    """:func:`own_frame_objects`' arrays seen from a target frame (cav_to_target (4, 4)) ->
    (ids (M,) int64, boxes (M, 7) float64 in ``order``), boxes with >= 2 corners in range."""
    if not len(ids):
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    corners = corners @ cav_to_target[:3, :3].T + cav_to_target[:3, 3]
    boxes = corners_to_boxes(corners, order)
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), limit_range,
                                 min_corners=GT_MIN_CORNERS)
    return ids[keep], boxes[keep]


def own_frame_boxes(vehicles: dict, cav_id: str, cav_to_target: np.ndarray, limit_range,
                    order: str = "hwl"):
    """One CAV's objects (own lidar frame) seen from a target frame.

    vehicles: {key: object}; cav_to_target: (4, 4). Returns (ids (M,) int64, boxes (M, 7)
    float64 in ``order``), pedestrians left out, boxes with >= 2 corners in ``limit_range``,
    in key order.
    """
    ids, corners = own_frame_objects(vehicles, cav_id)
    return objects_to_boxes(ids, corners, cav_to_target, limit_range, order)


def crop_filter(ids: np.ndarray, boxes: np.ndarray, crop_range, order: str = "hwl"):
    """The reference datasets' second filter: ids (M,), boxes (M, 7) -> those with at least 2
    corners inside ``crop_range`` [x0, y0, z0, x1, y1, z1]; everything when it is None."""
    if crop_range is None or not len(ids):
        return ids, boxes
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), crop_range,
                                 min_corners=GT_MIN_CORNERS)
    return ids[keep], boxes[keep]


def union_by_id(per_cav: list):
    """[(ids, boxes), ...] ego first -> (ids (M,), boxes (M, 7)) sorted by id, first wins."""
    boxes_by_id = {}
    for ids, boxes in per_cav:
        for box_id, box in zip(ids.tolist(), boxes):
            boxes_by_id.setdefault(box_id, box)
    if not boxes_by_id:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    sorted_ids = sorted(boxes_by_id)
    return (np.asarray(sorted_ids, dtype=np.int64),
            np.stack([boxes_by_id[box_id] for box_id in sorted_ids]))


# ------------------------------------------------------------------------------------ split

class V2V4RealSplit(OPV2VSplit):
    """Index of one V2V4Real split folder: OPV2VSplit's layout, index cache and CAV selection
    (communication range and ``max_cav`` on the 4x4 poses' translations), V2V4Real's frames."""

    index_name = "v2v4real"
    reads_heter = False             # HEAL's heter section reads OPV2V and V2XSet, not V2V4Real
    load_frame = staticmethod(load_v2v4real_yaml)

    def __init__(self, split_dir, *, crop_range=None, **kwargs):
        """OPV2VSplit's arguments, and ``crop_range``: the model's crop (``cav_lidar_range``)
        each CAV's GT must also keep 2 corners in (module doc); None: no second filter."""
        super().__init__(split_dir, **kwargs)
        self.crop_range = None if crop_range is None else [float(v) for v in crop_range]

    @staticmethod
    def reader_options(cfg: dict) -> dict:
        """The constructor's options a resolved config sets: the crop filter's range."""
        return {"crop_range": cfg["preprocess"]["cav_lidar_range"]}

    def load_cav_frame(self, scenario: str, cav_id: str, timestamp: str) -> dict:
        """As OPV2VSplit's, with ``lidar_pose`` (4, 4) float64 lidar -> map, ``vehicles`` in the
        CAV's own frame and ``cav_id``."""
        frame = super().load_cav_frame(scenario, cav_id, timestamp)
        frame["lidar_pose"] = np.asarray(frame["params"]["lidar_pose"], dtype=np.float64)
        frame["cav_id"] = cav_id
        return frame

    def load_cameras(self, scenario: str, cav_id: str, timestamp: str):
        """V2V4Real's release has no camera files: a one-line error naming the frame."""
        from opencood.data.cameras import CameraFileError
        raise CameraFileError(f"{self.split_dir / scenario / cav_id / timestamp}: V2V4Real has "
                              f"no camera files (its inputs are LiDAR only)")

    def vehicle_arrays(self, scenario: str, cav_id: str, timestamp: str):
        """(ids (V,), corners (V, 8, 3)) of the frame's objects in the CAV's own frame
        (:func:`own_frame_objects`), built on the frame's first use and kept: what OPV2V's
        VehicleArrays (world poses) are to its GT."""
        key = (scenario, cav_id, timestamp)
        arrays = self._vehicle_arrays.get(key)
        if arrays is None:
            arrays = own_frame_objects(self.vehicles(scenario, cav_id, timestamp), cav_id)
            self._vehicle_arrays[key] = arrays
        return arrays

    def sample_gt(self, index: int, gt_range, order: str = "hwl"):
        """GT of sample ``index`` in the ego frame: the union of the used CAVs' own-frame objects
        projected with their true CAV -> ego matrices, each CAV's boxes crop-filtered (module
        doc); OPV2VSplit.load_sample and the datasets take it from here."""
        info = self.info(index)
        ego_pose = self.lidar_pose(info.scenario, info.ego_id, info.timestamp)
        return union_by_id([
            crop_filter(*objects_to_boxes(
                *self.vehicle_arrays(info.scenario, cav_id, info.timestamp),
                relative_transform(self.lidar_pose(info.scenario, cav_id, info.timestamp),
                                   ego_pose), gt_range, order), self.crop_range, order)
            for cav_id in info.cav_ids])

    def frame_boxes(self, scenario: str, cav_id: str, timestamp: str, gt_range,
                    order: str = "hwl"):
        """:meth:`cav_boxes` of one CAV frame by its key (the datasets' late-fusion path)."""
        return objects_to_boxes(*self.vehicle_arrays(scenario, cav_id, timestamp), np.eye(4),
                                gt_range, order)

    def cav_boxes(self, cav: dict, gt_range, order: str = "hwl"):
        """The CAV's own objects in its own frame (late fusion's per-CAV GT)."""
        return own_frame_boxes(cav["vehicles"], cav["cav_id"], np.eye(4), gt_range, order)

