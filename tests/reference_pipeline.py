"""The per-sample input pipeline as it was before issue 28, kept as the reference it is checked by.

``reference_sample(dataset, index)`` builds ``dataset[index]`` the old way: one pass over every
agent's points per step (own-body removal, projection to the ego in float64, flip, rotation in
float64, scaling, range crop, float32 cast), a copy of the frame's yaml tree, and the GT boxes
one vehicle at a time. It reads only the dataset's settings (ranges, augmentation list, wild
setting, seeds, epoch) and its split's ``load_cav_frame`` (V2V4Real and DAIR-V2X: their
GT as their readers made it before the datasets read frames by key, object by object); every draw is made here from
(seed, stream, epoch, index), so a change of the draws in the dataset shows as a difference.

``tests/test_pipeline_equivalence.py`` compares the datasets with it and ``tools/bench.py``
(``loader_cpu_ms``) times both in one run; it loads this file by path, so it imports nothing from
the tests. The helpers imported from opencood below were not changed by issue 28; the constants
the readers define are stated here, not imported, so that a change of one in the code under test
shows as a difference instead of moving the reference with it (issue 39).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

from opencood.data.datasets import ego_points_per_box
from opencood.data.opv2v import is_infrastructure
from opencood.data.v2v4real import object_corners, union_by_id
from opencood.data.wild import delayed_timestamp, noisy_pose
from opencood.ops.transforms import (boxes_to_corners_3d, corners_in_range_mask, corners_to_boxes,
                                     extent_corners, limit_period, pose_to_matrix,
                                     relative_transform)

AUGMENT_STREAM, NOISE_STREAM = 1, 2

# The readers' rules, from the reference codebases (not imported from the code under test):
OWN_BODY_X, OWN_BODY_Y = (-1.95, 2.95), (-1.1, 1.1)   # OpenCOOD: the ego's own body, dropped
VEHICLE, INFRASTRUCTURE = 0, 1                        # V2X-ViT's agent "infra" flag
V2V4REAL_MIN_CORNERS = 2          # V2V4Real: mask_boxes_outside_range_numpy's default
V2V4REAL_SKIPPED_TYPES = ("Pedestrian",)              # V2V4Real: one vehicle class
V2V4REAL_ID_STRIDE = 100          # V2V4Real: an object without ass_id is key + 100 * cav_id


def object_id(key: int, vehicle: dict, cav_id: str) -> int:
    ass_id = int(vehicle.get("ass_id", -1))
    return ass_id if ass_id != -1 else int(key) + V2V4REAL_ID_STRIDE * int(cav_id)


def reference_sample(dataset, index: int) -> Dict:
    """``dataset[index]`` computed the pre-issue-28 way, for any of the four fusion datasets."""
    method = dataset.fusion_method
    if method == "late" and dataset.per_cav:
        return _late_per_cav(dataset, index)
    loaded = _load_agents(dataset, index)
    info = loaded["info"]
    key = (info.scenario, info.timestamp)
    build = {"no": _build_no, "early": _build_early, "intermediate": _build_intermediate,
             "late": _build_late}[method]
    return build(dataset, index, key, loaded)


# ---- randomness --------------------------------------------------------------------------

def _rng(dataset, index: int, stream: int) -> np.random.Generator:
    epoch = dataset.epoch if dataset.train else 0
    seed = dataset.seed if stream == AUGMENT_STREAM else dataset.wild.seed
    return np.random.default_rng([seed, stream, epoch, index])


# ---- geometry (old copies) ---------------------------------------------------------------

def apply_transform(points: np.ndarray, transform: np.ndarray) -> np.ndarray:
    out = points.copy()
    out[:, :3] = (points[:, :3].astype(np.float64) @ transform[:3, :3].T
                  + transform[:3, 3]).astype(points.dtype)
    return out


def remove_own_body_points(points: np.ndarray) -> np.ndarray:
    on_body = ((points[:, 0] >= OWN_BODY_X[0]) & (points[:, 0] <= OWN_BODY_X[1])
               & (points[:, 1] >= OWN_BODY_Y[0]) & (points[:, 1] <= OWN_BODY_Y[1]))
    return points[~on_body]


def points_in_range_mask(points: np.ndarray, limit_range) -> np.ndarray:
    mask = np.ones(points.shape[0], dtype=bool)
    for axis in range(3):
        mask &= (points[:, axis] > limit_range[axis]) & (points[:, axis] < limit_range[axis + 3])
    return mask


def boxes_center_in_range(boxes: np.ndarray, limit_range) -> np.ndarray:
    return ((boxes[:, 0] >= limit_range[0]) & (boxes[:, 0] <= limit_range[3])
            & (boxes[:, 1] >= limit_range[1]) & (boxes[:, 1] <= limit_range[4]))


# ---- ground truth, one vehicle at a time ---------------------------------------------------

def _vehicle_pose(vehicle: dict) -> list:
    center = vehicle.get("center", (0.0, 0.0, 0.0))
    location = vehicle["location"]
    return [float(location[i]) + float(center[i]) for i in range(3)] \
        + [float(a) for a in vehicle["angle"]]


def vehicles_to_boxes(vehicles: dict, lidar_pose, limit_range, order: str = "hwl"):
    if not vehicles:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    actor_ids = sorted(vehicles, key=int)
    world_to_lidar = np.linalg.inv(pose_to_matrix(lidar_pose))
    corners = []
    for actor_id in actor_ids:
        object_to_lidar = world_to_lidar @ pose_to_matrix(_vehicle_pose(vehicles[actor_id]))
        corners.append(extent_corners(vehicles[actor_id]["extent"]) @ object_to_lidar[:3, :3].T
                       + object_to_lidar[:3, 3])
    boxes = corners_to_boxes(np.stack(corners), order)
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), limit_range, min_corners=8)
    return np.asarray([int(a) for a in actor_ids], dtype=np.int64)[keep], boxes[keep]


def _gt_union(vehicle_dicts: list, ego_pose, exclude_ids: set, gt_range, order: str):
    boxes_by_id = {}
    for vehicles in vehicle_dicts:
        ids, boxes = vehicles_to_boxes(vehicles, ego_pose, gt_range, order)
        for actor_id, box in zip(ids.tolist(), boxes):
            if actor_id not in exclude_ids and actor_id not in boxes_by_id:
                boxes_by_id[actor_id] = box
    sorted_ids = sorted(boxes_by_id)
    if not sorted_ids:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    return (np.asarray(sorted_ids, dtype=np.int64),
            np.stack([boxes_by_id[actor_id] for actor_id in sorted_ids]))


def _load_sample(split, index: int, gt_range, order: str) -> Dict:
    info = split.info(index)
    cavs = {cav_id: split.load_cav_frame(info.scenario, cav_id, info.timestamp)
            for cav_id in info.cav_ids}
    gt_ids, gt_boxes = _sample_gt(split, info, cavs, gt_range, order)
    return {"info": info, "cavs": cavs, "gt_ids": gt_ids, "gt_boxes": gt_boxes}


def _sample_gt(split, info, cavs: Dict, gt_range, order: str):
    """GT in the ego frame from the frame dicts, per format as its reader's load_sample made it
    before the datasets read frames by key (old copies below)."""
    ego_pose = cavs[info.ego_id]["lidar_pose"]
    if split.index_name == "v2v4real":
        return union_by_id([own_frame_boxes(cav["vehicles"], cav_id,
                                            relative_transform(cav["lidar_pose"], ego_pose),
                                            gt_range, order)
                            for cav_id, cav in cavs.items()])
    if split.index_name == "dairv2x":
        return world_boxes_to_frame(cavs[info.ego_id]["vehicles"], ego_pose, gt_range, order)
    cav_actor_ids = {int(cav_id) for cav_id in info.cav_ids if cav_id.lstrip("-").isdigit()}
    return _gt_union([cav["vehicles"] for cav in cavs.values()], ego_pose, cav_actor_ids,
                     gt_range, order)


def _cav_boxes(split, agent: Dict, gt_range, order: str):
    """Late fusion's per-CAV GT from the agent dict (old copies), as each reader's
    ``cav_boxes`` made it."""
    if split.index_name == "v2v4real":
        return own_frame_boxes(agent["vehicles"], agent["cav_id"], np.eye(4), gt_range, order)
    if split.index_name == "dairv2x":
        return world_boxes_to_frame(agent["vehicles"], agent["lidar_pose"], gt_range, order)
    return vehicles_to_boxes(agent["vehicles"], agent["lidar_pose"], gt_range, order=order)


# ---- V2V4Real's and DAIR-V2X's GT as their readers made it, object by object (old copies) ----

def own_frame_boxes(vehicles: dict, cav_id: str, cav_to_target: np.ndarray, limit_range,
                    order: str):
    keys = [key for key in sorted(vehicles)
            if vehicles[key].get("obj_type") not in V2V4REAL_SKIPPED_TYPES]
    if not keys:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    corners = np.stack([object_corners(vehicles[key]) for key in keys])
    corners = corners @ cav_to_target[:3, :3].T + cav_to_target[:3, 3]
    boxes = corners_to_boxes(corners, order)
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), limit_range,
                                 min_corners=V2V4REAL_MIN_CORNERS)
    ids = np.asarray([object_id(key, vehicles[key], cav_id) for key in keys], dtype=np.int64)
    return ids[keep], boxes[keep]


def world_boxes_to_frame(labels: list, lidar_to_world: np.ndarray, limit_range, order: str):
    if not labels:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 7), dtype=np.float64)
    world_to_lidar = np.linalg.inv(lidar_to_world)
    corners = np.asarray([label["corners"] for label in labels], dtype=np.float64)
    corners = corners @ world_to_lidar[:3, :3].T + world_to_lidar[:3, 3]
    boxes = corners_to_boxes(corners, order)
    keep = corners_in_range_mask(boxes_to_corners_3d(boxes, order), limit_range, min_corners=8)
    ids = np.asarray([label["position"] for label in labels], dtype=np.int64)
    return ids[keep], boxes[keep]


# ---- augmentation, one pass per step -------------------------------------------------------

def augment_sample(points_list: List[np.ndarray], boxes: np.ndarray, augment_cfg, rng):
    points_list = [points.copy() for points in points_list]
    boxes = boxes.astype(np.float64, copy=True)
    for entry in augment_cfg or []:
        name = entry["NAME"]
        if name == "random_world_flip":
            for axis in entry["ALONG_AXIS_LIST"]:
                if bool(rng.random() < 0.5):
                    column = 1 if axis == "x" else 0
                    for points in points_list:
                        points[:, column] = -points[:, column]
                    boxes[:, column] = -boxes[:, column]
                    boxes[:, 6] = -boxes[:, 6] if axis == "x" else np.pi - boxes[:, 6]
        elif name == "random_world_rotation":
            angle = float(rng.uniform(*entry["WORLD_ROT_ANGLE"]))
            cos, sin = np.cos(angle), np.sin(angle)
            rotation = np.array([[cos, -sin], [sin, cos]], dtype=np.float64)
            for points in points_list:
                points[:, :2] = (points[:, :2].astype(np.float64) @ rotation.T
                                 ).astype(points.dtype)
            boxes[:, :2] = boxes[:, :2] @ rotation.T
            boxes[:, 6] += angle
        elif name == "random_world_scaling":
            factor = float(rng.uniform(*entry["WORLD_SCALE_RANGE"]))
            for points in points_list:
                points[:, :3] *= factor
            boxes[:, :6] *= factor
    if len(boxes):
        boxes[:, 6] = limit_period(boxes[:, 6])
    return points_list, boxes


# ---- the dataset steps ---------------------------------------------------------------------

def _points_per_box(dataset, points: np.ndarray, boxes) -> np.ndarray:
    boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
    if dataset.visibility_rule != "lidar":
        return np.full(boxes.shape[0], -1, dtype=np.int64)
    return ego_points_per_box(points, boxes, dataset.order)


def _load_agents(dataset, index: int) -> Dict:
    split, wild = dataset.split, dataset.wild
    sample = _load_sample(split, index, dataset.gt_range, dataset.order)
    info = sample["info"]
    ego_pose = sample["cavs"][info.ego_id]["lidar_pose"]
    noise_rng = _rng(dataset, index, NOISE_STREAM)
    agents = []
    for cav_id in info.cav_ids:
        cav = sample["cavs"][cav_id]
        is_ego = cav_id == info.ego_id
        latency = 0
        if not is_ego and wild.latency_frames > 0:
            stamps = split.timestamps(info.scenario)
            stamp = delayed_timestamp(stamps, info.timestamp, wild.latency_frames)
            cav = split.load_cav_frame(info.scenario, cav_id, stamp)
            latency = stamps.index(info.timestamp) - stamps.index(stamp)
        reported_pose = cav["lidar_pose"] if is_ego else noisy_pose(cav["lidar_pose"], wild,
                                                                    noise_rng)
        agents.append({
            "cav_id": cav_id,
            "points": remove_own_body_points(cav["points"]),
            "lidar_pose": np.asarray(cav["lidar_pose"], dtype=np.float64),
            "vehicles": cav.get("params", {}).get("vehicles", {}),
            "T_to_ego": relative_transform(reported_pose, ego_pose),
            "T_to_ego_clean": relative_transform(cav["lidar_pose"], ego_pose),
            "latency": latency,
        })
    return {"info": info, "agents": agents, "gt_boxes": sample["gt_boxes"],
            "gt_ids": sample["gt_ids"],
            "gt_ego_points": _points_per_box(dataset, agents[0]["points"], sample["gt_boxes"])}


def _finish(dataset, index, key, agent_ids, points_list, transforms, gt_boxes, gt_ids,
            shared_points: int, gt_ego_points, agent_latency=None, clean=None) -> Dict:
    clean = transforms if clean is None else clean
    if agent_latency is None:
        agent_latency = [0] * len(agent_ids)
    points_list, gt_boxes = augment_sample(points_list, np.asarray(gt_boxes, np.float64),
                                           dataset.augment_cfg,
                                           _rng(dataset, index, AUGMENT_STREAM))
    points_list = [p[points_in_range_mask(p, dataset.lidar_range)].astype(np.float32)
                   for p in points_list]
    # Test time: the gt_range's GT alone (OpenCOOD's test set); training: centre on the crop.
    keep = (boxes_center_in_range(gt_boxes, dataset.lidar_range) if dataset.train
            else np.ones(gt_boxes.shape[0], dtype=bool))
    return {
        "sample_key": key,
        "agent_ids": list(agent_ids),
        "agent_types": np.asarray([INFRASTRUCTURE if is_infrastructure(str(a)) else VEHICLE
                                   for a in agent_ids], dtype=np.int64),
        "agent_latency": np.asarray(agent_latency, dtype=np.int64),
        "agent_points": points_list,
        "transforms_to_ego": np.asarray(transforms, dtype=np.float32).reshape(-1, 4, 4),
        "transforms_to_ego_clean": np.asarray(clean, dtype=np.float32).reshape(-1, 4, 4),
        "gt_boxes": gt_boxes[keep].astype(np.float32).reshape(-1, 7),
        "gt_ids": np.asarray(gt_ids, dtype=np.int64)[keep],
        "gt_ego_points": np.asarray(gt_ego_points, dtype=np.int64)[keep],
        "shared_points": int(shared_points),
        "points_in_agent_frame": dataset.points_in_agent_frame,
    }


def _build_no(dataset, index, key, loaded):
    ego = loaded["agents"][0]
    return _finish(dataset, index, key, [ego["cav_id"]], [ego["points"]], [np.eye(4)],
                   loaded["gt_boxes"], loaded["gt_ids"], 0, loaded["gt_ego_points"])


def _build_early(dataset, index, key, loaded):
    agents = loaded["agents"]
    clouds = [apply_transform(agent["points"], agent["T_to_ego"]) for agent in agents]
    merged = np.concatenate(clouds, axis=0)
    shared = int(round(sum(len(c) for c in clouds[1:]) / max(1, len(clouds) - 1)))
    return _finish(dataset, index, key, [agents[0]["cav_id"]], [merged], [np.eye(4)],
                   loaded["gt_boxes"], loaded["gt_ids"], shared, loaded["gt_ego_points"])


def _build_intermediate(dataset, index, key, loaded):
    agents = loaded["agents"]
    sample = _finish(dataset, index, key, [a["cav_id"] for a in agents],
                     [apply_transform(a["points"], a["T_to_ego"]) for a in agents],
                     [a["T_to_ego"] for a in agents], loaded["gt_boxes"], loaded["gt_ids"], 0,
                     loaded["gt_ego_points"], [a["latency"] for a in agents],
                     [a["T_to_ego_clean"] for a in agents])
    if dataset.with_early_fusion:
        merged = np.concatenate([apply_transform(a["points"], a["T_to_ego_clean"])
                                 for a in agents], axis=0)
        (merged,), _ = augment_sample([merged], np.zeros((0, 7)), dataset.augment_cfg,
                                      _rng(dataset, index, AUGMENT_STREAM))
        sample["early_fusion_points"] = merged[
            points_in_range_mask(merged, dataset.lidar_range)].astype(np.float32)
    return sample


def _build_late(dataset, index, key, loaded):
    agents = loaded["agents"]
    return _finish(dataset, index, key, [a["cav_id"] for a in agents],
                   [a["points"] for a in agents], [a["T_to_ego"] for a in agents],
                   loaded["gt_boxes"], loaded["gt_ids"], 0, loaded["gt_ego_points"],
                   [a["latency"] for a in agents], [a["T_to_ego_clean"] for a in agents])


def _late_per_cav(dataset, index: int) -> Dict:
    sample_index, position = dataset.pairs[index]
    loaded = _load_agents(dataset, sample_index)
    info = loaded["info"]
    agent = loaded["agents"][position]
    gt_ids, gt_boxes = _cav_boxes(dataset.split, agent, dataset.gt_range, dataset.order)
    key = (info.scenario, info.timestamp, agent["cav_id"])
    return _finish(dataset, index, key, [agent["cav_id"]], [agent["points"]], [np.eye(4)],
                   gt_boxes, gt_ids, 0, _points_per_box(dataset, agent["points"], gt_boxes))
