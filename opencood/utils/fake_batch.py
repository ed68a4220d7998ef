"""Synthetic inputs for profiling, benchmarks and tests (no data set).

``fake_collated_batch``: points spread over ``pillars_per_agent`` random BEV cells of the
config's pillar grid, so the pillar count (what the encoder and scatter cost depends on) is
controlled directly. ``random_vehicle_boxes`` and ``fake_detection_frames``: vehicle boxes and
per-frame detections around them, the input of IoU and AP.
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence, Tuple

import torch

from opencood.config_schema import ANCHOR_HWL, ANCHOR_Z
from opencood.ops.voxelize import grid_size


def fake_collated_batch(preprocess: Dict, batch_size: int = 2, agents_per_sample: int = 3,
                        pillars_per_agent: int = 16000, points_per_pillar: int = 6,
                        max_gt: int = 20, single_agent: bool = False,
                        seed: int = 0, num_classes: int = 1, heter: Dict | None = None,
                        depth: bool = False) -> Dict:
    """A batch in the layout of ``opencood.data.collate.collate_samples``
    (``opencood.batch_keys.BATCH``: its common and LiDAR keys).

    single_agent: one agent per sample (no/early/late fusion models), else
    ``agents_per_sample`` agents (intermediate fusion).
    num_classes > 1: also ``gt_classes``, GT row g of class ``g % num_classes`` (the boxes stay
    car-sized: each still claims its best anchor of its class).
    heter: a config's resolved ``heter`` section: a heterogeneous batch (:func:`fake_modalities`
    picks each agent's modality); a LiDAR agent's points lie on its modality's own grid (its
    ``preprocess``, else ``preprocess``), a camera agent has none and its images are in
    ``modality_cameras`` at its ``data_aug_conf`` size (``depth``: with depth maps); a fusing
    batch also carries ``agent_gt_boxes`` / ``agent_gt_mask`` (identity poses: the sample's GT).
    """
    generator = torch.Generator().manual_seed(seed)
    lidar_range = preprocess["cav_lidar_range"]
    agents = 1 if single_agent else agents_per_sample
    total_agents = batch_size * agents
    modalities = (fake_modalities(heter, batch_size, agents) if heter is not None
                  else [None] * total_agents)
    clouds, agent_index = [], []
    for agent, modality in enumerate(modalities):
        setting = heter["modality_setting"][modality] if modality is not None else None
        if setting is not None and setting["sensor_type"] == "camera":
            continue                         # a camera agent sends no points
        grid = (setting["preprocess"] if setting is not None else None) or preprocess
        cloud = _agent_cloud(grid["cav_lidar_range"], grid["args"]["voxel_size"],
                             pillars_per_agent, points_per_pillar, generator)
        clouds.append(cloud)
        agent_index.append(torch.full((cloud.shape[0],), agent, dtype=torch.int64))
    gt_boxes = torch.zeros(batch_size, max_gt, 7)
    gt_boxes[..., 0] = torch.empty(batch_size, max_gt).uniform_(lidar_range[0] + 5,
                                                                lidar_range[3] - 5,
                                                                generator=generator)
    gt_boxes[..., 1] = torch.empty(batch_size, max_gt).uniform_(lidar_range[1] + 5,
                                                                lidar_range[4] - 5,
                                                                generator=generator)
    gt_boxes[..., 2:7] = torch.tensor([ANCHOR_Z, *ANCHOR_HWL, 0.0])     # anchor-sized, yaw 0
    classes = {} if num_classes == 1 else {
        "gt_classes": (torch.arange(max_gt) % num_classes).repeat(batch_size, 1)}
    extra = {**classes, **({} if heter is None else fake_heter_keys(
        heter, modalities, gt_boxes, with_agent_gt=not single_agent, seed=seed, depth=depth))}
    return {**extra,
        "points": torch.cat(clouds), "agent_index": torch.cat(agent_index),
        "record_len": torch.full((batch_size,), agents, dtype=torch.int64),
        "agent_types": torch.zeros(total_agents, dtype=torch.int64),      # all vehicles
        "agent_latency": torch.zeros(total_agents, dtype=torch.int64),    # no delays
        "transforms_to_ego": torch.eye(4).repeat(total_agents, 1, 1),
        "transforms_to_ego_clean": torch.eye(4).repeat(total_agents, 1, 1),
        "gt_boxes": gt_boxes, "gt_mask": torch.ones(batch_size, max_gt, dtype=torch.bool),
        "shared_points": torch.zeros(batch_size, dtype=torch.int64),
        "sample_keys": [(f"fake_{i}", "000000") for i in range(batch_size)],
        "gt_ids": [torch.arange(max_gt).numpy() for _ in range(batch_size)],
        "gt_ego_points": [torch.full((max_gt,), -1).numpy() for _ in range(batch_size)],
        "points_in_agent_frame": False,
    }


def _agent_cloud(lidar_range: Sequence[float], voxel: Sequence[float], pillars: int,
                 points_per_pillar: int, generator: torch.Generator) -> torch.Tensor:
    """(N, 4) float32 x, y, z, intensity: ``points_per_pillar`` points in each of ``pillars``
    random cells of the grid (all its cells when it has fewer)."""
    nx, ny, _ = grid_size(lidar_range, voxel)
    flat = torch.randperm(nx * ny, generator=generator)[:min(pillars, nx * ny)]
    cell_x = (flat % nx).repeat_interleave(points_per_pillar).double()
    cell_y = (flat // nx).repeat_interleave(points_per_pillar).double()
    count = cell_x.shape[0]
    # Kept off the cell edges, where float32 rounding could move a point to the next cell.
    jitter = 0.05 + 0.9 * torch.rand(count, 2, generator=generator, dtype=torch.float64)
    x = lidar_range[0] + (cell_x + jitter[:, 0]) * voxel[0]
    y = lidar_range[1] + (cell_y + jitter[:, 1]) * voxel[1]
    z = torch.empty(count, dtype=torch.float64).uniform_(lidar_range[2], lidar_range[5] - 1e-3,
                                                          generator=generator)
    intensity = torch.rand(count, generator=generator, dtype=torch.float64)
    return torch.stack([x, y, z, intensity], dim=1).float()


def fake_modalities(heter: Dict, batch_size: int, agents_per_sample: int) -> List[str]:
    """Each agent's modality, sample after sample: sample s's ego the s-th of ``ego_modality``
    (cycling), its other agents the modalities of ``modality_setting`` in turn, continuing
    from the previous sample's; one agent per sample: every modality in turn (a late model
    trains every type's examples). 2 samples of 3 agents of HEAL's m1 m2 m3 (ego m1&m3):
    m1 m1 m2 | m3 m3 m1."""
    names = list(heter["modality_setting"])
    if agents_per_sample == 1:
        return [names[sample % len(names)] for sample in range(batch_size)]
    egos = heter["ego_modality"].split("&")
    modalities, turn = [], 0
    for sample in range(batch_size):
        modalities.append(egos[sample % len(egos)])
        for _ in range(agents_per_sample - 1):
            modalities.append(names[turn % len(names)])
            turn += 1
    return modalities


def fake_heter_keys(heter: Dict, modalities: List[str], gt_boxes: torch.Tensor,
                    with_agent_gt: bool, seed: int = 0, depth: bool = False) -> Dict:
    """A heterogeneous batch's own keys (``opencood.batch_keys.HETER_KEYS``): ``agent_modality``,
    ``modality_cameras`` (:func:`fake_camera_batch` per camera modality present, at its
    ``data_aug_conf`` final_dim of an H x W camera, seeds ``seed + 1``, ``seed + 2``... in
    ``modality_setting`` order) and, ``with_agent_gt``, each agent's own GT: its sample's rows of
    ``gt_boxes`` (B, G, 7)."""
    cameras = {}
    for offset, (name, setting) in enumerate(heter["modality_setting"].items(), start=1):
        count = modalities.count(name)
        if setting["sensor_type"] != "camera" or count == 0:
            continue
        conf = setting["data_aug_conf"]
        cameras[name] = fake_camera_batch(count, image_size=tuple(conf["final_dim"]),
                                          original_size=(conf["H"], conf["W"]),
                                          seed=seed + offset, depth=depth)
    keys = {"agent_modality": list(modalities), "modality_cameras": cameras}
    if with_agent_gt:
        per_sample = len(modalities) // gt_boxes.shape[0]
        keys["agent_gt_boxes"] = gt_boxes.repeat_interleave(per_sample, dim=0)
        keys["agent_gt_mask"] = torch.ones(keys["agent_gt_boxes"].shape[:2], dtype=torch.bool)
    return keys


def random_vehicle_boxes(count: int, generator: torch.Generator,
                 x_range: Sequence[float] = (-100.0, 100.0),
                 y_range: Sequence[float] = (-40.0, 40.0)) -> torch.Tensor:
    """(count, 7) float64 hwl boxes ``[x, y, z, h, w, l, yaw]``: car- to van-sized (w 1.6-2.4 m,
    l 3.8-6 m), centres uniform in the ranges, any heading."""
    def uniform(low, high):
        return torch.empty(count, dtype=torch.float64).uniform_(low, high, generator=generator)

    return torch.stack([uniform(*x_range), uniform(*y_range),
                        torch.full((count,), -1.0, dtype=torch.float64),
                        torch.full((count,), 1.5, dtype=torch.float64),
                        uniform(1.6, 2.4), uniform(3.8, 6.0), uniform(-math.pi, math.pi)], dim=1)


def fake_detection_frames(num_frames: int, seed: int = 0, num_gt: int = 30, num_det: int = 50,
                          num_true: int = 35) -> List[Tuple[torch.Tensor, ...]]:
    """Frames of (pred (num_det, 7), scores (num_det,), gt (num_gt, 7)), float64, as AP sees them.

    ``num_true`` detections are noisy copies of random GT boxes (some GT twice: duplicates that
    must become false positives), the rest clutter; scores are rounded to 2 decimals so ties
    across frames occur, as with a real detector's quantised scores.
    """
    generator = torch.Generator().manual_seed(seed)
    frames = []
    for _ in range(num_frames):
        gt = random_vehicle_boxes(num_gt, generator)
        near = gt[torch.randint(0, num_gt, (num_true,), generator=generator)].clone()
        near[:, :2] += torch.randn(num_true, 2, generator=generator, dtype=torch.float64) * 0.4
        near[:, 4:6] *= 0.9 + 0.2 * torch.rand(num_true, 2, generator=generator,
                                               dtype=torch.float64)
        near[:, 6] += torch.randn(num_true, generator=generator, dtype=torch.float64) * 0.15
        clutter = random_vehicle_boxes(num_det - num_true, generator)
        scores = torch.cat([0.3 + 0.7 * torch.rand(num_true, generator=generator,
                                                   dtype=torch.float64),
                            0.7 * torch.rand(num_det - num_true, generator=generator,
                                             dtype=torch.float64)])
        frames.append((torch.cat([near, clutter]), torch.round(scores, decimals=2), gt))
    return frames


# OPV2V's camera rig (``camera0..3``: front, right, left, back), yaw in degrees, mounted 1.8 m up
# at the vehicle's centre; UE4 axes (x forward, y right, z up) -> OpenCV's (x right, y down,
# z forward), as the camera-to-agent extrinsics of the batch are (``opencood.batch_keys``).
OPV2V_CAMERA_YAWS = (0.0, 90.0, -90.0, 180.0)
UE4_TO_OPENCV = ((0.0, 0.0, 1.0, 0.0), (1.0, 0.0, 0.0, 0.0), (0.0, -1.0, 0.0, 0.0),
                 (0.0, 0.0, 0.0, 1.0))


def camera_rig_extrinsics(yaws_deg: Sequence[float] = OPV2V_CAMERA_YAWS,
                          height: float = 1.8) -> torch.Tensor:
    """(C, 4, 4) camera (OpenCV axes) -> agent transforms of level cameras at ``height``
    looking along each yaw (from the agent's x axis towards its y axis: OPV2V's camera1, yaw
    90, looks along +y, the right side in its UE4 frame)."""
    rigs = []
    for yaw in yaws_deg:
        c, s = math.cos(math.radians(yaw)), math.sin(math.radians(yaw))
        pose = torch.eye(4, dtype=torch.float64)
        pose[:2, :2] = torch.tensor([[c, -s], [s, c]], dtype=torch.float64)
        pose[2, 3] = height
        rigs.append(pose @ torch.tensor(UE4_TO_OPENCV, dtype=torch.float64))
    return torch.stack(rigs).float()


def fake_camera_batch(num_agents: int, image_size: Tuple[int, int] = (64, 128),
                      original_size: Tuple[int, int] = (600, 800), cameras: int = 4,
                      seed: int = 0, depth: bool = False) -> Dict[str, torch.Tensor]:
    """The camera keys of a batch (``opencood.batch_keys``) for ``num_agents`` agents of
    ``cameras`` cameras each: images (A, C, 3, H, W) standard-normal (already normalised),
    intrinsics (A, C, 3, 3) of an ``original_size`` (H, W) camera with a 90-degree field of
    view (OPV2V's), extrinsics (A, C, 4, 4) camera -> agent (:func:`camera_rig_extrinsics`),
    post_rots (A, C, 3, 3) / post_trans (A, C, 3): the resize of the original image onto
    ``image_size`` (HEAL's ``img_transform`` without crop, flip or rotation); with ``depth``
    also depth_maps (A, C, H, W), uniform in [1, 60) m (drawn last: the other keys stay the
    same).

    Every camera sees the ground around its agent, so a lift-splat encoder's frustum reaches
    the BEV grid in front of each camera."""
    generator = torch.Generator().manual_seed(seed)
    height, width = image_size
    original_h, original_w = original_size
    focal = original_w / 2.0                        # tan(45 deg) = 1: a 90-degree view
    intrinsic = torch.tensor([[focal, 0.0, original_w / 2.0], [0.0, focal, original_h / 2.0],
                              [0.0, 0.0, 1.0]])
    resize = torch.diag(torch.tensor([width / original_w, height / original_h, 1.0]))
    rig = camera_rig_extrinsics(OPV2V_CAMERA_YAWS[:cameras] if cameras <= 4 else
                                [360.0 * k / cameras for k in range(cameras)])
    shape = (num_agents, cameras)
    batch = {"images": torch.randn(*shape, 3, height, width, generator=generator),
             "intrinsics": intrinsic.expand(*shape, 3, 3).clone(),
             "extrinsics": rig.expand(num_agents, -1, -1, -1).clone(),
             "post_rots": resize.expand(*shape, 3, 3).clone(),
             "post_trans": torch.zeros(*shape, 3)}
    if depth:
        batch["depth_maps"] = 1 + 59 * torch.rand(*shape, height, width, generator=generator)
    return batch
