"""Fusion datasets: OPV2V-format files -> per-sample numpy arrays for each fusion strategy.

One sample = one (scenario, timestamp); GT always in the ego frame (late fusion training is the
exception: one CAV's own view, see below). Workers only read, project, augment and crop; the
pillarisation and target assignment run on the training device (``opencood.data.pipeline``).
Each agent's cloud (own-body returns already removed in the split's cache) is moved once, in
float32, by one 4x4 (augmentation @ agent->ego) and cropped in the same pass, straight into the
sample's buffer (``opencood.ops.transforms.project_and_crop``): ~4x less CPU per sample than a
pass per step (issue 28; ``tools/bench.py --figures loader_cpu_ms``).

A sample is a dict::

    sample_key        (scenario, timestamp)
    agent_ids         [cav_id, ...]                  ego first
    agent_types       (n,) int64                     per agent of the model input: 0 vehicle,
                                                     1 infrastructure (negative cav id, V2XSet)
    agent_latency     (n,) int64                     per agent: frames its data is older than the
                                                     ego's (wild_setting.latency_frames, fewer at
                                                     a scenario's start; 0 for the ego)
    agent_points      [(N_i, 4) float32, ...]        one entry per agent of the model input
                                                     (LiDAR inputs only)
    images, intrinsics, extrinsics, post_rots, post_trans   camera inputs only, (n, C, ...):
                                                     opencood.data.cameras, ``_camera_keys``
                                                     (``depth_maps`` too with input_source depth)
    agent_modality    [str, ...]                     heter only: each agent's modality (the
                                                     model's name), opencood.data.heter
    modality_cameras  {modality: {camera key: (n_m, C, ...)}}   heter only: the camera agents'
                                                     inputs by modality (``depth_maps`` too
                                                     with input_source depth)
    transforms_to_ego (n, 4, 4) float32              agent -> ego as used (noisy for non-ego)
    transforms_to_ego_clean (n, 4, 4) float32        the same from the true poses (pose-error
                                                     metrics; equal to the above without noise)
    gt_boxes          (M, 7) float32 [x, y, z, h, w, l, yaw]
    gt_ids            (M,) int64
    gt_classes        (M,) int64                     multi-class configs only: each GT box's
                                                     class id (its position in
                                                     ``postprocess.classes``; the reader's
                                                     ``object_classes``)
    agent_gt_boxes    [(G_i, 7) float32, ...]        intermediate with the pyramid loss only:
                                                     each agent's own GT in its own frame
    gt_ego_points     (M,) int64                     the ego's evidence of each GT box, 0 =
                                                     occluded for the ego (``visibility_rule``):
                                                     its LiDAR returns inside the box, or for a
                                                     camera-only ego 1 / 0 from its cameras'
                                                     bev_visibility map; -1 when not counted
                                                     (training, loss-only, no map)
    shared_points     int                            points each non-ego agent sent, averaged
                                                     over them (early fusion; else 0)
    points_in_agent_frame bool                       True when clouds are in their own agent's
                                                     frame (late fusion, intermediate with
                                                     ``proj_first: false``), else the ego frame

Strategies (``fusion.core_method``):
* ``no``: the ego's points only.
* ``early``: all agents' points projected to the ego frame and concatenated into one cloud.
* ``intermediate``: per-agent clouds projected to the ego frame ("proj_first"), kept apart so the
  model computes per-agent BEV features and fuses them. With ``fusion.args.proj_first: false``
  each cloud stays in its own (augmented) LiDAR frame and ``transforms_to_ego`` is what the model
  warps its features with (the "own-frame" path, docs/DESIGN.md).
* ``late``: training: each (sample, CAV) pair is its own example in the CAV's frame, with the GT
  that CAV itself sees (its ``vehicles``); testing: every agent's cloud in its own frame plus its
  transform to the ego, for per-agent detection, projection and NMS.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import torch

from opencood.config_schema import DEFAULT_COMM_RANGE, DEFAULT_LIDAR_RANGE
from opencood.data.augment import (augment_boxes, augmentation_matrix, check_augment_config,
                                   draw_augmentation)
from opencood.data.camera_visibility import boxes_visible, map_path
from opencood.data.cameras import (CameraFileError, camera_inputs, read_depth_images,
                                   stack_agents)
from opencood.data.heter import ModalityPlan, depth_files
from opencood.data.opv2v import DEFAULT_GT_RANGE, is_infrastructure
from opencood.data.formats import open_split, split_class
from opencood.data.wild import WildSetting, delayed_timestamp, noisy_pose
from opencood.errors import ConfigError, alike_on_every_rank
from opencood.ops.transforms import count_points_in_boxes, project_and_crop, relative_transform
from opencood.registry import DATASETS
from opencood.utils.collectives import get_rank

VEHICLE, INFRASTRUCTURE = 0, 1             # agent types (V2X-ViT's "infra" flag)
# HEAL's inf_filter_range: a camera agent's labels are all its boxes before the visibility test
UNBOUNDED_RANGE = (-1e5, -1e5, -1e5, 1e5, 1e5, 1e5)

# Purpose codes keep the augmentation, the noise and the image augmentation streams independent
# of each other (the image draws are HEAL's, camera after camera: opencood.data.cameras).
_AUGMENT_STREAM, _NOISE_STREAM, _CAMERA_STREAM, _MODALITY_STREAM = 1, 2, 3, 4
# Ego points in a GT box (its visibility to the ego): 0.1 m around the box takes in surface returns
# that range noise put just outside; the bottom 0.25 m is left out, where ground returns beside
# the wheels would make a car hidden from the ego look seen.
VISIBILITY_MARGIN, GROUND_CLEARANCE = 0.1, 0.25   # metres
VISIBILITY_CHOICES = ("auto", "lidar", "camera")
# HEAL's label_type: which boxes an agent contributes to the GT (BaseFusionDataset._camera_labelled)
LABEL_TYPES = ("lidar", "camera")
# What the GT is made of under label_type camera: said in the evaluation record
CAMERA_LABELS = "camera: the objects some agent's bev_visibility map shows (label_type camera)"
# What "ego-visible" means, by the dataset's visibility_rule: said in every evaluation record.
VISIBILITY_RULES = {
    "lidar": "lidar: ego LiDAR returns inside the box",
    "camera": "camera: the ego's cameras see the box (its bev_visibility map at the box centre)"}


def ego_points_per_box(points: np.ndarray, boxes: np.ndarray, order: str = "hwl") -> np.ndarray:
    """(N, 3+) an agent's own points, (M, 7) boxes in its frame -> (M,) int64 returns inside each
    box, with the visibility margins above; 0 means the agent does not see the box."""
    return count_points_in_boxes(points, boxes, order, margin=VISIBILITY_MARGIN,
                                 ground_clearance=GROUND_CLEARANCE)


def agent_types(agent_ids) -> np.ndarray:
    """(n,) int64 type of each cav id: ``INFRASTRUCTURE`` for negative ids, else ``VEHICLE``."""
    return np.asarray([INFRASTRUCTURE if is_infrastructure(str(a)) else VEHICLE
                       for a in agent_ids], dtype=np.int64)


def boxes_center_in_range(boxes: np.ndarray, limit_range) -> np.ndarray:
    """(M, 7) -> (M,) bool: box centre inside the BEV part of ``limit_range`` (after augmenting)."""
    return ((boxes[:, 0] >= limit_range[0]) & (boxes[:, 0] <= limit_range[3])
            & (boxes[:, 1] >= limit_range[1]) & (boxes[:, 1] <= limit_range[4]))


class BaseFusionDataset(torch.utils.data.Dataset):
    """Shared reading, noise, augmentation and cropping; subclasses choose what agents return.

    Args:
        split_dir: ``<root>/<split>`` folder in the OPV2V layout (a split json for DAIR-V2X).
        lidar_range: crop range [xmin, ymin, zmin, xmax, ymax, zmax] of the model input.
        gt_range: range GT boxes must lie in (all 8 corners before augmentation); in training
            their centre must also lie in ``lidar_range`` (after augmentation).
        train: enables augmentation; noise draws then also depend on the epoch.
        augment_cfg: the ``data_augment`` list.
        wild: pose-noise / latency setting.
        seed: base seed of the augmentation draws.
        count_ego_points: fill ``gt_ego_points`` (the AP visibility split); default: not in
            training. A loss-only loader turns it off: nothing reads the counts there. The rule
            (``visibility_rule``): "lidar" with LiDAR inputs (the ego's returns in each box),
            "camera" for camera-only inputs (the ego's cameras see the box: HEAL's
            ``<ts>_bev_visibility.png`` of the ego looked up at the box centre,
            opencood.data.camera_visibility; -1 where the copy has no map).
        visibility: that rule: "auto" (as just said), "lidar" (needs LiDAR inputs) or "camera"
            (the ego's cameras' map whatever the inputs; ``tools/eval.py --visibility``).
        dataset: the format of ``split_dir`` (``fusion.dataset``: opv2v, v2xset, v2v4real,
            v2xreal, dairv2x; opencood.data.formats).
        reader_options: the format's own reader options (its split class's
            ``reader_options(cfg)``: V2V4Real's crop filter, DAIR-V2X-C's GT source, V2X-Real's
            mode, crop filter and classes).
        input_source: the inputs read, HEAL's key: ("lidar",), ("camera",) or both. Without
            "lidar" no point cloud is read: samples carry no ``agent_points``, ``gt_ego_points``
            is -1; with "camera" each sample carries the camera keys (:meth:`_camera_keys`).
        data_aug_conf: the image augmentation (``camera.data_aug_conf``), with "camera".
        heter: the resolved ``heter`` section: a modality per agent (opencood.data.heter); each
            agent reads what its modality's sensor needs (LiDAR agents their cloud, of the
            beams ``lidar_channels_dict`` says; camera agents their images, and depth images
            with "depth" in ``input_source``), samples carry ``agent_modality`` and
            ``modality_cameras``.
        use_cav: evaluation only: the first ``use_cav`` agents of a sample (ego first, in the
            split's order) take part, while the GT stays the union over all its agents, as
            HEAL's ``IntermediateheterinferFusionDataset`` (``tools/eval.py --heter_in_order``);
            None: every agent.
        label_type: HEAL's key, which boxes an agent contributes to the GT: "lidar" (its
            ``vehicles``; a heter camera agent in training: what its map shows) or "camera"
            (what its ``<ts>_bev_visibility.png`` shows, :meth:`_camera_labelled`; the OPV2V
            layout's maps).
        with_classes: samples carry ``gt_classes`` (a multi-class config: the reader's
            ``object_classes`` of each GT id; a reader without classes is a ConfigError).
    """

    fusion_method = "base"
    points_in_agent_frame = False
    # False: only the ego's cloud is read (the others' would be loaded for nothing).
    uses_other_agents_points = True
    # True: a heter config labels per agent whatever label_type says (_camera_labelled)
    heter_ignores_label_type = False

    def __init__(self, split_dir, lidar_range=DEFAULT_LIDAR_RANGE, gt_range=DEFAULT_GT_RANGE,
                 train: bool = False, augment_cfg=None, wild: WildSetting | None = None,
                 seed: int = 0, max_cav: int = 5, com_range: float = DEFAULT_COMM_RANGE,
                 order: str = "hwl", cache_dir=None, count_ego_points: bool | None = None,
                 dataset: str = "opv2v", reader_options: dict | None = None,
                 input_source=("lidar",), data_aug_conf: dict | None = None,
                 heter: dict | None = None, visibility: str = "auto",
                 use_cav: int | None = None, with_classes: bool = False,
                 label_type: str = "lidar"):
        check_augment_config(augment_cfg)
        if label_type not in LABEL_TYPES:
            raise ConfigError(f"label_type {label_type!r}: expected one of "
                              f"{', '.join(LABEL_TYPES)}")
        if label_type == "camera" and not getattr(split_class(dataset), "reads_heter", False):
            raise ConfigError(f"label_type camera: the {dataset} reader has no bev_visibility "
                              f"maps (HEAL's camera labels read the OPV2V layout's: opv2v, "
                              f"v2xset)")
        self.label_type = label_type
        if use_cav is not None and (train or use_cav < 1):
            raise ValueError(f"use_cav {use_cav}: evaluation keeps the first use_cav >= 1 agents")
        self.use_cav = use_cav
        if heter is not None and not getattr(split_class(dataset), "reads_heter", False):
            raise ConfigError(f"heter: the {dataset} reader has no modality assignment (HEAL's "
                              f"heter section reads the OPV2V layout: opv2v, v2xset)")
        self.plan = ModalityPlan(heter, train, is_infrastructure) if heter is not None else None
        self.uses_lidar = "lidar" in input_source
        self.uses_depth = "depth" in input_source
        if self.plan is not None:
            # A frame's files are checked when its agent reads them: which ones depends on the
            # agent's modality. The plan orders (and checks) each scenario's agents.
            reader_options = {**(reader_options or {}), "require_points": False,
                              "agent_order": self.plan.agent_order}
            input_source = tuple(name for name in input_source if name != "camera")
            self.uses_lidar = any(self.plan.sensor_type(name) == "lidar"
                                  for name in self.plan.settings)
        elif not self.uses_lidar:                 # camera-only: a frame needs no .pcd
            reader_options = {**(reader_options or {}), "require_points": False}
        self.data_aug_conf = dict(data_aug_conf) if "camera" in input_source else None
        if "camera" in input_source and data_aug_conf is None:
            raise ConfigError("input_source has 'camera': the camera section (its "
                              "data_aug_conf) is missing")
        if getattr(split_class(dataset), "reads_train_flag", False):
            reader_options = {**(reader_options or {}), "train": bool(train)}
        self.split = open_split(dataset, split_dir, com_range=com_range, max_cav=max_cav,
                                cache_dir=cache_dir, **(reader_options or {}))
        self.split_dir = Path(split_dir)
        self.lidar_range = list(lidar_range)
        self.gt_range = list(gt_range)
        self.train = train
        counting = not train if count_ego_points is None else bool(count_ego_points)
        self.visibility_rule = self._visibility_rule(visibility) if counting else None
        self.augment_cfg = list(augment_cfg or []) if train else []
        self.wild = wild or WildSetting()
        self.seed = int(seed)
        self.order = order
        self.dataset = dataset
        self.with_classes = bool(with_classes)
        self.epoch = 0

    def _visibility_rule(self, visibility: str) -> str:
        """The AP visibility split's rule (``visibility``: auto, lidar or camera)."""
        if visibility not in VISIBILITY_CHOICES:
            raise ConfigError(f"visibility {visibility!r}: expected one of "
                              f"{', '.join(VISIBILITY_CHOICES)}")
        if visibility == "auto":
            return "lidar" if self.uses_lidar else "camera"
        if visibility == "lidar" and not self.uses_lidar:
            raise ConfigError("visibility 'lidar': the inputs have no LiDAR (input_source); "
                              "a camera ego's split is 'camera'")
        return visibility

    @classmethod
    def from_config(cls, cfg: dict, split_dir, train: bool, cache_dir=None, **extra):
        """From a resolved config (opencood.config.load_config)."""
        postprocess = cfg["postprocess"]
        return cls(split_dir,
                   lidar_range=cfg["preprocess"]["cav_lidar_range"],
                   gt_range=postprocess["gt_range"],
                   train=train,
                   augment_cfg=cfg["data_augment"],
                   wild=WildSetting.from_config(cfg["wild_setting"]),
                   seed=int(cfg["seed"]),
                   max_cav=cfg["train_params"]["max_cav"],
                   com_range=float(cfg["comm_range"]),
                   order=postprocess["order"],
                   dataset=cfg["fusion"]["dataset"],
                   reader_options=split_class(cfg["fusion"]["dataset"]).reader_options(cfg),
                   input_source=tuple(cfg["input_source"]),
                   data_aug_conf=(cfg["camera"] or {}).get("data_aug_conf"),
                   heter=cfg["heter"], with_classes=bool(postprocess.get("classes")),
                   label_type=cfg["label_type"],
                   cache_dir=cache_dir, **extra)

    # -- reproducible randomness -------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Augmentation (and, in training, noise) draws depend on the epoch: call every epoch."""
        self.epoch = int(epoch)

    def _rng(self, index: int, stream: int) -> np.random.Generator:
        epoch = self.epoch if self.train else 0
        # the noise follows the wild setting's seed; the data augmentations, the run's
        return np.random.default_rng([self.wild.seed if stream == _NOISE_STREAM else self.seed,
                                      stream, epoch, index])

    # -- reading -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.split)

    def _agents(self, index: int):
        """The sample's info and its agents, ego first, without their points.

        Each agent: {"cav_id", "frame": (scenario, cav_id, timestamp) of the data it sends (an
        earlier frame with latency), "lidar_pose" of that frame ((6,), or (4, 4) for V2V4Real and
        DAIR-V2X), "vehicles" (that frame's labels as the split keeps them, shared: read only),
        "T_to_ego" (4, 4) float64 from its reported (noisy) pose, "T_to_ego_clean" from its true
        pose, "latency" (frames)}. Non-ego agents get latency and pose noise from the wild
        setting; the noise draws go agent after agent. The split gives every piece by the
        frame's key (the SplitReader protocol of opencood.data.formats).
        """
        info = self.split.info(index)
        ego_pose = self.split.lidar_pose(info.scenario, info.ego_id, info.timestamp)
        noise_rng = self._rng(index, _NOISE_STREAM)
        stamps = self.split.timestamps(info.scenario)
        agents = []
        for cav_id in info.cav_ids:
            is_ego = cav_id == info.ego_id
            stamp = info.timestamp
            if not is_ego and self.wild.latency_frames > 0:
                stamp = delayed_timestamp(stamps, info.timestamp, self.wild.latency_frames)
            lidar_pose = self.split.lidar_pose(info.scenario, cav_id, stamp)
            reported_pose = lidar_pose if is_ego else noisy_pose(lidar_pose, self.wild, noise_rng)
            to_ego = relative_transform(reported_pose, ego_pose)
            agents.append({
                "cav_id": cav_id,
                "frame": (info.scenario, cav_id, stamp),
                "lidar_pose": lidar_pose,
                "vehicles": self.split.vehicles(info.scenario, cav_id, stamp),
                "T_to_ego": to_ego,
                # The true alignment, for the view of DiscoNet's early-fusion teacher (the
                # reported one when there is no noise: noisy_pose then returns the pose).
                "T_to_ego_clean": (relative_transform(lidar_pose, ego_pose)
                                   if self.wild.has_pose_noise and not is_ego else to_ego),
                # The delay actually applied (clamped at the scenario's first frame).
                "latency": stamps.index(info.timestamp) - stamps.index(stamp),
            })
        return info, agents

    def _load_agents(self, index: int) -> Dict:
        """:meth:`_agents` with each agent's "points" (N_i, 4) float32 in its own frame, own-body
        returns removed (the split's cache holds them so; the ego's alone when the strategy
        uses no other cloud), and the sample's GT in the ego frame.

        The own-body crop applies to roadside units too, as in OpenCOOD/V2X-ViT: an RSU has no
        body there, and our synthetic RSUs stand where the crop box holds no returns.
        """
        info, every_agent = self._agents(index)
        for agent, modality in zip(every_agent, self._modalities(index, info, every_agent)):
            agent["modality"] = modality
        agents = every_agent
        if self.use_cav is not None:        # the GT below still comes from every agent
            agents = agents[:self.use_cav]
        for agent in agents if self.uses_other_agents_points else agents[:1]:
            agent["points"] = self._load_points(agent["frame"], agent["modality"])
        gt_ids, gt_boxes = self.split.sample_gt(index, gt_range=self.gt_range, order=self.order)
        if any(self._camera_labelled(agent["modality"]) for agent in every_agent):
            gt_ids, gt_boxes = self._camera_agent_labels(info, every_agent, gt_ids, gt_boxes)
        ego_points = agents[0]["points"] if self._has_lidar(agents[0]["modality"]) else None
        return {"info": info, "agents": agents, "gt_boxes": gt_boxes, "gt_ids": gt_ids,
                "gt_classes": self._gt_classes(info.scenario, info.timestamp, gt_ids),
                "gt_ego_points": self._ego_visibility(agents[0]["frame"], ego_points, gt_boxes)}

    def _gt_classes(self, scenario: str, timestamp: str, gt_ids):
        """(M,) int64 class ids of ``gt_ids`` for a multi-class config, else None."""
        if not self.with_classes:
            return None
        classes = self.split.object_classes(scenario, timestamp, gt_ids)
        if classes is None:
            raise ConfigError(f"postprocess.classes: the {self.dataset} reader's labels carry "
                              f"no object classes (fusion.dataset v2xreal and dairv2x do)")
        return classes

    @property
    def camera_labels(self) -> bool:
        """``label_type: camera`` labels every agent of this data set by its map (not so in a
        heter config's intermediate fusion, which ignores the key)."""
        return self.label_type == "camera" and not (self.plan is not None
                                                    and self.heter_ignores_label_type)

    def _camera_labelled(self, modality, training: bool | None = None) -> bool:
        """Whether an agent of ``modality`` (None: not heter) contributes to the GT only the
        boxes its ``bev_visibility`` map shows (HEAL's ``generate_object_center_camera``).

        ``label_type: camera``: every agent, in training and evaluation (HEAL's datasets pick
        the generator from the key once), except in a heter config's intermediate fusion: HEAL's
        ``intermediateheter`` data set ignores the key and picks per agent, as without it.
        Otherwise a heter config's camera agents in training (``training``, default
        ``self.train``; HEAL's heter data sets outside ``visualize``), nobody in evaluation."""
        if self.camera_labels:
            return True
        training = self.train if training is None else training
        return self.plan is not None and training and not self._has_lidar(modality)

    def _camera_agent_labels(self, info, agents, gt_ids, gt_boxes):
        """HEAL's camera labels of a sample (:meth:`_camera_labelled`): an agent labelled by
        its LiDAR contributes its ``vehicles``, one labelled by its cameras those its
        ``bev_visibility`` map shows (the pixel of the box centre in its own frame non-zero,
        opencood.data.camera_visibility); GT rows no agent contributes leave. ``agents``: all
        the sample's (HEAL's union over ``cav_id_list``). -> (ids (M',), boxes (M', 7))."""
        contributed = set()
        for agent in agents:
            frame = (info.scenario, agent["cav_id"], info.timestamp)
            if not self._camera_labelled(agent["modality"]):
                contributed.update(int(actor) for actor in self.split.vehicles(*frame))
                continue
            ids, boxes = self.split.frame_boxes(*frame, UNBOUNDED_RANGE, order=self.order)
            contributed.update(self._camera_visible(frame, ids, boxes)[0].tolist())
        keep = np.isin(gt_ids, np.fromiter(contributed, dtype=np.int64, count=len(contributed)))
        return gt_ids[keep], gt_boxes[keep]

    def _camera_visible(self, frame, ids, boxes):
        """(ids, boxes) of one agent frame's own boxes (its frame) kept to those its
        bev_visibility map shows (HEAL's camera labels); one line naming a frame without a
        map."""
        seen = self.split.camera_visibility(*frame)
        if seen is None:
            scenario, cav_id, timestamp = frame
            raise CameraFileError(f"{map_path(self.split_dir / scenario / cav_id, timestamp)}: "
                                  f"missing (camera labels of agent {cav_id}: label_type camera, "
                                  f"or a heter camera agent in training; tools/bev_visibility.py "
                                  f"writes the maps)")
        visible = boxes_visible(seen, boxes)
        return ids[visible], boxes[visible]

    def _modalities(self, index: int, info, agents) -> List:
        """Each agent's modality (heter; None for every agent without): evaluation maps the
        assignment, training draws from the sample's modality stream (seed, epoch, index)."""
        if self.plan is None:
            return [None] * len(agents)
        rng = self._rng(index, _MODALITY_STREAM) if self.train else None
        return self.plan.modalities(info.scenario, [a["cav_id"] for a in agents], rng)

    def _has_lidar(self, modality) -> bool:
        """Whether an agent of ``modality`` (None: not heter) reads a point cloud."""
        if self.plan is None:
            return self.uses_lidar
        return self.plan.sensor_type(modality) == "lidar"

    def _load_points(self, frame, modality=None) -> np.ndarray:
        """(N, 4) float32 of one agent frame (scenario, cav_id, timestamp); (0, 4) without
        LiDAR inputs (camera-only, or a camera agent: no .pcd is read). A heter LiDAR agent
        reads its modality's sensor (``heter.lidar_channels_dict``: OPV2V-H's 32 / 16 beams)."""
        if not self._has_lidar(modality):
            return np.zeros((0, 4), dtype=np.float32)
        if self.plan is None:
            return self.split.load_points(*frame)
        return self.split.load_points(*frame, channels=self.plan.channels(modality))

    def _camera_keys(self, index: int, frames, lidar_to_output) -> Dict:
        """The camera keys of the sample's agents (opencood.data.cameras.camera_inputs).

        frames: per output agent its (scenario, cav_id, timestamp); lidar_to_output: per agent
        the (4, 4) its points went through (augmentation @ to the output frame), which the
        camera -> LiDAR extrinsics are composed with. The image draws come from the sample's
        camera stream (seed, epoch, index), agent after agent, camera after camera; evaluation
        draws nothing (the fixed resize and centre crop). Returns images (n, C, 3, fH, fW),
        intrinsics (n, C, 3, 3), extrinsics (n, C, 4, 4) camera -> output frame, post_rots (n,
        C, 3, 3), post_trans (n, C, 3), float32.
        """
        rng = self._rng(index, _CAMERA_STREAM) if self.train else None
        per_agent = [self._agent_cameras(frame, self.data_aug_conf, rng, matrix)
                     for frame, matrix in zip(frames, lidar_to_output)]
        return stack_agents(per_agent)

    def _agent_cameras(self, frame, conf: dict, rng, lidar_to_output) -> Dict:
        """One agent frame's camera inputs (opencood.data.cameras.camera_inputs) augmented by
        ``conf``; with "depth" in ``input_source`` also ``depth_maps`` from OPV2V-H's depth
        images (HEAL's files: opencood.data.heter.depth_files), through the same draws."""
        cameras = self.split.load_cameras(*frame)
        depths = read_depth_images(depth_files(cameras.paths[0].parent, frame[2],
                                               len(cameras.paths))) if self.uses_depth else None
        return camera_inputs(cameras, conf, rng, lidar_to_output, depths)

    def _modality_cameras(self, index: int, frames, lidar_to_output, modalities) -> Dict:
        """heter: the camera agents' inputs grouped by modality, {modality: camera keys (n_m, C,
        ...)}, each agent augmented by its modality's ``data_aug_conf``; with "depth" in
        ``input_source`` also ``depth_maps`` from OPV2V-H's depth images. The image draws go
        camera agent after camera agent, from the sample's camera stream (evaluation: none)."""
        rng = self._rng(index, _CAMERA_STREAM) if self.train else None
        groups: Dict[str, list] = {}
        for frame, matrix, modality in zip(frames, lidar_to_output, modalities):
            if self.plan.sensor_type(modality) != "camera":
                continue
            groups.setdefault(modality, []).append(self._agent_cameras(
                frame, self.plan.settings[modality]["data_aug_conf"], rng, matrix))
        return {modality: stack_agents(per_agent) for modality, per_agent in groups.items()}

    def _ego_visibility(self, frame, points: np.ndarray | None, boxes) -> np.ndarray:
        """(M,) int64 the viewing agent's evidence of each GT box (same frame), for the
        ego-visible / ego-occluded AP split, by ``visibility_rule``: its own points inside
        each box, or, for a camera agent (camera-only inputs, or a heter agent without a LiDAR:
        ``points`` None), 1 / 0 from the bev_visibility map of its ``frame`` (scenario,
        cav_id, timestamp); -1 when not counted or the copy has no map."""
        boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
        unknown = np.full(boxes.shape[0], -1, dtype=np.int64)
        if self.visibility_rule is None:
            return unknown
        if self.visibility_rule == "lidar" and points is not None:
            return ego_points_per_box(points, boxes, self.order)
        seen = self.split.camera_visibility(*frame)
        return unknown if seen is None else boxes_visible(seen, boxes).astype(np.int64)

    def _augmentation_matrix(self, index: int) -> Tuple[np.ndarray, tuple]:
        """(4, 4) float64 of the sample's augmentation (identity without one), and its steps
        (``opencood.data.augment.Augmentation.steps``), drawn from (seed, epoch, index)."""
        augmentation = draw_augmentation(self.augment_cfg, self._rng(index, _AUGMENT_STREAM))
        return augmentation_matrix(augmentation.steps), augmentation.steps

    def _finish(self, index: int, key, agent_ids, clouds, to_output, transforms, gt_boxes,
                gt_ids, shared_points: int, gt_ego_points: np.ndarray, agent_latency=None,
                merge: bool = False, clean_transforms=None, frames=None,
                modalities=None, gt_classes=None) -> Dict:
        """Move, augment and crop every cloud in one pass, augment and crop the boxes, cast.

        clouds: per agent (N_i, 4) float32 in its own frame (only read); to_output: per cloud
        the (4, 4) to the sample's frame before augmentation (to the ego, or the identity); each
        cloud moves once through augmentation @ to_output. ``merge``: one cloud of them all
        (early fusion). transforms: what ``transforms_to_ego`` reports, one per output cloud;
        clean_transforms: ``transforms_to_ego_clean``, the true ones (default: ``transforms``).
        ``agent_latency``: frames of delay per agent, default 0 (one merged or own cloud).
        ``frames``: per output agent its (scenario, cav_id, timestamp), whose cameras the
        sample carries when the inputs have cameras (not with ``merge``). ``modalities``: per
        output agent its modality (heter). ``gt_classes``: (M,) class ids of the GT boxes
        (multi-class configs; None: the sample carries none).
        """
        if clean_transforms is None:
            clean_transforms = transforms
        if agent_latency is None:
            agent_latency = [0] * len(agent_ids)
        augment, steps = self._augmentation_matrix(index)
        to_sample = [augment @ to_frame for to_frame in to_output]
        points, counts = project_and_crop(clouds, to_sample, self.lidar_range)
        # Views into the one buffer: the collate copies each once into the batch.
        agent_points = [points] if merge else np.split(points, np.cumsum(counts)[:-1])
        gt_boxes = augment_boxes(gt_boxes, steps)
        # Training targets need the box centre on the anchor grid. At test time the GT is the
        # gt_range's alone, as OpenCOOD's test set (its GT_RANGE whatever cav_lidar_range is):
        # a protocol's range wider than the LiDAR crop (--protocol opencood on a small grid)
        # then counts the boxes the model cannot see as misses instead of dropping them.
        keep = (boxes_center_in_range(gt_boxes, self.lidar_range) if self.train
                else np.ones(gt_boxes.shape[0], dtype=bool))
        cameras = self._camera_keys(index, frames, to_sample) \
            if self.data_aug_conf is not None else {}
        if self.plan is not None:
            cameras = {"agent_modality": list(modalities),
                       "modality_cameras": self._modality_cameras(index, frames, to_sample,
                                                                  modalities)}
        return {
            "sample_key": key,
            "agent_ids": list(agent_ids),
            "agent_types": agent_types(agent_ids),
            "agent_latency": np.asarray(agent_latency, dtype=np.int64),
            # camera-only samples carry no points (opencood.batch_keys: a sample has the keys of
            # its sensors)
            **({"agent_points": agent_points} if self.uses_lidar else {}),
            "transforms_to_ego": np.asarray(transforms, dtype=np.float32).reshape(-1, 4, 4),
            "transforms_to_ego_clean": np.asarray(clean_transforms,
                                                  dtype=np.float32).reshape(-1, 4, 4),
            "gt_boxes": gt_boxes[keep].astype(np.float32).reshape(-1, 7),
            "gt_ids": np.asarray(gt_ids, dtype=np.int64)[keep],
            "gt_ego_points": np.asarray(gt_ego_points, dtype=np.int64)[keep],
            **({} if gt_classes is None
               else {"gt_classes": np.asarray(gt_classes, dtype=np.int64)[keep]}),
            "shared_points": int(shared_points),
            "points_in_agent_frame": self.points_in_agent_frame,
            **cameras,
        }

    def _transforms(self, index: int, agents: List[Dict], own_frame: bool):
        """-> (to_output, transforms_to_ego, transforms_to_ego_clean), one (4, 4) per agent.

        proj_first (``own_frame`` False): every cloud goes to the ego frame through its reported
        transform; the transforms are reported as they are. Own frame: every cloud stays in its
        frame and gets the sample's augmentation A there, so the transforms reported are
        A @ T @ A^-1, which map an agent's augmented frame into the augmented ego frame:
        A T A^-1 (A p) = A (T p), the proj_first point. A is a rotation, flips and one scale,
        so the conjugate is rigid (the scale cancels in its rotation, and scales its translation).
        """
        reported = [a["T_to_ego"] for a in agents]
        clean = [a["T_to_ego_clean"] for a in agents]
        if not own_frame:
            return reported, reported, clean
        augment, _ = self._augmentation_matrix(index)
        inverse = np.linalg.inv(augment)
        return ([np.eye(4)] * len(agents), [augment @ t @ inverse for t in reported],
                [augment @ t @ inverse for t in clean])

    def __getitem__(self, index: int) -> Dict:
        loaded = self._load_agents(index)
        info = loaded["info"]
        return self._build(index, (info.scenario, info.timestamp), loaded)

    def _build(self, index, key, loaded) -> Dict:
        raise NotImplementedError


@DATASETS.register("no")
class NoFusionDataset(BaseFusionDataset):
    """The ego's own cloud only; GT is still the cooperative union (what the ego should find)."""

    fusion_method = "no"
    uses_other_agents_points = False

    def _build(self, index, key, loaded):
        ego = loaded["agents"][0]
        return self._finish(index, key, [ego["cav_id"]], [ego["points"]], [np.eye(4)],
                            [np.eye(4)], loaded["gt_boxes"], loaded["gt_ids"], shared_points=0,
                            gt_ego_points=loaded["gt_ego_points"], frames=[ego["frame"]],
                            modalities=[ego["modality"]], gt_classes=loaded["gt_classes"])


@DATASETS.register("early")
class EarlyFusionDataset(BaseFusionDataset):
    """Every agent's raw points projected to the ego frame and merged into one cloud."""

    fusion_method = "early"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.data_aug_conf is not None:
            raise ConfigError("input_source has 'camera': camera inputs are per agent (no, "
                              "late or intermediate fusion); early fusion merges point clouds")
        if self.plan is not None:
            raise ConfigError("heter: a modality per agent needs per-agent inputs (no, late or "
                              "intermediate fusion); early fusion merges point clouds")

    def _build(self, index, key, loaded):
        agents = loaded["agents"]
        clouds = [agent["points"] for agent in agents]
        # Bytes are reported per sending agent (all it has, before the crop), so average over
        # the non-ego agents.
        shared = int(round(sum(len(c) for c in clouds[1:]) / max(1, len(clouds) - 1)))
        return self._finish(index, key, [agents[0]["cav_id"]], clouds,
                            [agent["T_to_ego"] for agent in agents], [np.eye(4)],
                            loaded["gt_boxes"], loaded["gt_ids"], shared_points=shared,
                            gt_ego_points=loaded["gt_ego_points"], merge=True,
                            gt_classes=loaded["gt_classes"])


@DATASETS.register("intermediate")
class IntermediateFusionDataset(BaseFusionDataset):
    """Per-agent clouds projected to the ego frame, kept apart for feature-level fusion.

    ``with_early_fusion``: each sample also carries ``early_fusion_points`` (N, 4) float32, the
    early-fusion cloud of the same index (every agent's points merged in the ego frame, the same
    augmentation and crop), the input of DiscoNet's teacher. It uses the true poses: the
    teacher stands for the ideal shared view (as HEAL's), so pose noise perturbs the student
    only; without noise it equals ``EarlyFusionDataset``'s cloud.
    """

    fusion_method = "intermediate"
    heter_ignores_label_type = True         # as HEAL's intermediateheter data set

    def __init__(self, *args, with_early_fusion: bool = False, proj_first: bool = True,
                 with_agent_gt: bool = False, **kwargs):
        """``proj_first`` False: the own-frame path (clouds in their agents' frames).
        ``with_agent_gt``: samples also carry ``agent_gt_boxes``, each agent's own GT in its own
        frame (HEAL's ``label_dict_single``, the pyramid loss's occupancy labels; own frame
        only)."""
        super().__init__(*args, **kwargs)
        self.with_early_fusion = bool(with_early_fusion)
        self.proj_first = bool(proj_first)
        if with_agent_gt and self.proj_first:
            raise ValueError("each agent's own GT (the pyramid loss) needs own-frame data: "
                             "fusion.args.proj_first: false")
        self.with_agent_gt = bool(with_agent_gt)
        # The instance's, read by _finish: what vis and the model see in the batch.
        self.points_in_agent_frame = not self.proj_first

    @classmethod
    def from_config(cls, cfg: dict, split_dir, train: bool, cache_dir=None, **extra):
        extra.setdefault("proj_first", cfg["fusion"]["args"]["proj_first"])
        # the pyramid loss supervises every agent's occupancy maps with its own labels
        extra.setdefault("with_agent_gt",
                         cfg["loss"]["core_method"] == "point_pillar_pyramid_loss")
        return super().from_config(cfg, split_dir, train, cache_dir=cache_dir, **extra)

    def _build(self, index, key, loaded):
        agents = loaded["agents"]
        to_output, transforms, clean = self._transforms(index, agents,
                                                        own_frame=not self.proj_first)
        sample = self._finish(index, key, [a["cav_id"] for a in agents],
                              [a["points"] for a in agents], to_output, transforms,
                              loaded["gt_boxes"], loaded["gt_ids"], shared_points=0,
                              gt_ego_points=loaded["gt_ego_points"],
                              agent_latency=[a["latency"] for a in agents],
                              clean_transforms=clean, frames=[a["frame"] for a in agents],
                              modalities=[a["modality"] for a in agents],
                              gt_classes=loaded["gt_classes"])
        if self.with_early_fusion:
            sample["early_fusion_points"] = self._early_fusion_points(index, agents)
        if self.with_agent_gt:
            sample["agent_gt_boxes"] = [self._own_gt(index, agent) for agent in agents]
        return sample

    def _own_gt(self, index: int, agent: Dict) -> np.ndarray:
        """(G, 7) float32: the boxes the agent's own frame lists, in its frame with the
        sample's augmentation (as its cloud on the own-frame path), kept as ``_finish`` keeps
        the sample's."""
        ids, boxes = self.split.frame_boxes(*agent["frame"], self.gt_range, order=self.order)
        if self._camera_labelled(agent["modality"]):
            _, boxes = self._camera_visible(agent["frame"], ids, boxes)     # HEAL's single label
        boxes = augment_boxes(boxes, self._augmentation_matrix(index)[1])
        if self.train:
            boxes = boxes[boxes_center_in_range(boxes, self.lidar_range)]
        return boxes.astype(np.float32).reshape(-1, 7)

    def _early_fusion_points(self, index: int, agents: List[Dict]) -> np.ndarray:
        """Every agent's cloud through its true transform, merged, augmented and cropped ->
        (N, 4) float32. The augmentation generator is re-created from (seed, epoch, index) and
        its draws do not depend on the clouds, so the transform is the one ``_finish`` drew."""
        augment, _ = self._augmentation_matrix(index)
        merged, _ = project_and_crop([a["points"] for a in agents],
                                     [augment @ a["T_to_ego_clean"] for a in agents],
                                     self.lidar_range)
        return merged


@DATASETS.register("late")
class LateFusionDataset(BaseFusionDataset):
    """Training: one example per (sample, CAV) in the CAV's own frame with the CAV's own GT.

    Testing: all agents of a sample, each cloud in its own frame, with transforms to the ego;
    the post-processor projects each agent's detections to the ego and runs NMS.
    """

    fusion_method = "late"
    points_in_agent_frame = True

    def __init__(self, *args, per_cav: bool | None = None, **kwargs):
        """``per_cav`` (default: ``train``) selects the per-CAV examples; validation loss uses
        them without augmentation, AP uses the whole-sample view."""
        super().__init__(*args, **kwargs)
        self.per_cav = self.train if per_cav is None else bool(per_cav)
        # Per-CAV examples: (sample index, position of the CAV in that sample's CAV list).
        self.pairs = [(i, k) for i in range(len(self.split))
                      for k in range(len(self.split.info(i).cav_ids))] if self.per_cav else None

    def __len__(self) -> int:
        return len(self.pairs) if self.per_cav else len(self.split)

    def __getitem__(self, index: int) -> Dict:
        if not self.per_cav:
            return super().__getitem__(index)
        sample_index, position = self.pairs[index]
        info, agents = self._agents(sample_index)
        agent = agents[position]              # only its own cloud is read
        modality = self._modalities(sample_index, info, agents)[position]
        points = self._load_points(agent["frame"], modality)
        gt_ids, gt_boxes = self.split.frame_boxes(*agent["frame"], self.gt_range,
                                                  order=self.order)
        # per-CAV examples are the training view, validation loss included
        if self._camera_labelled(modality, training=True):
            gt_ids, gt_boxes = self._camera_visible(agent["frame"], gt_ids, gt_boxes)
        key = (info.scenario, info.timestamp, agent["cav_id"])
        return self._finish(index, key, [agent["cav_id"]], [points], [np.eye(4)], [np.eye(4)],
                            gt_boxes, gt_ids, shared_points=0,
                            gt_ego_points=self._ego_visibility(
                                agent["frame"], points if self._has_lidar(modality) else None,
                                gt_boxes),
                            frames=[agent["frame"]], modalities=[modality],
                            gt_classes=self._gt_classes(agent["frame"][0], agent["frame"][2],
                                                        gt_ids))

    def _build(self, index, key, loaded):
        agents = loaded["agents"]
        return self._finish(index, key, [a["cav_id"] for a in agents],
                            [a["points"] for a in agents], [np.eye(4)] * len(agents),
                            [a["T_to_ego"] for a in agents], loaded["gt_boxes"],
                            loaded["gt_ids"], shared_points=0,
                            gt_ego_points=loaded["gt_ego_points"],
                            agent_latency=[a["latency"] for a in agents],
                            clean_transforms=[a["T_to_ego_clean"] for a in agents],
                            frames=[a["frame"] for a in agents],
                            modalities=[a["modality"] for a in agents],
                            gt_classes=loaded["gt_classes"])


# The config key naming each split's folder.
SPLIT_KEYS = {"train": "root_dir", "validate": "validate_dir", "test": "test_dir"}


def build_dataset(cfg: dict, split: str, train: bool, strategy,
                  cache_dir=None, **extra) -> BaseFusionDataset:
    """The dataset ``strategy`` reads (``strategy.dataset_name`` in ``DATASETS``; the engine's
    ``opencood.strategies.choose_strategy``) for a split.

    ``split`` is "train", "validate" or "test", mapped to ``root_dir``, ``validate_dir`` and
    ``test_dir`` of the config.
    """
    if split not in SPLIT_KEYS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLIT_KEYS)}")
    split_dir = cfg[SPLIT_KEYS[split]]
    if not split_dir:
        raise ValueError(f"config key {SPLIT_KEYS[split]!r} (the {split} folder) is not set")
    dataset_cls = DATASETS.get(strategy.dataset_name)
    # Every rank indexes the same split: a layout or yaml error is printed by rank 0 alone.
    with alike_on_every_rank(get_rank()):
        return dataset_cls.from_config(cfg, split_dir, train=train, cache_dir=cache_dir, **extra)
