"""The batch layout, declared once: every key a dataset sample, a collated batch and a model
input may carry, grouped by modality (docs/DESIGN.md §4.1).

Three stages, one table each:

* ``SAMPLE``: what a fusion dataset's ``__getitem__`` returns (numpy, one sample);
* ``BATCH``: what ``opencood.data.collate.collate_samples`` makes of a list of samples (CPU
  tensors; also ``opencood.utils.fake_batch``'s layout);
* ``MODEL_INPUT``: what ``opencood.data.pipeline.BatchPreparer`` hands the model on the device
  (and what pose correction adds before the model runs).

Modalities: ``lidar`` (points and the pillars made of them), ``camera`` (images and their
geometry), ``common`` (agents, transforms, GT). A sample or batch carries the keys of the
sensors it has: a camera-only sample has no points.

Heterogeneous agents (a ``heter`` config, opencood.data.heter): every agent has a modality
(``agent_modality``, the model's name such as ``m1``); LiDAR agents' clouds are in
``agent_points`` / ``points`` as always (a camera agent's cloud is empty), the camera agents'
inputs are grouped by modality in ``modality_cameras`` (each modality has its own image size),
and the preparer pillarises each LiDAR modality on its own grid (``modality_pillars``). Within
a modality the agents keep their batch order: the k-th agent of modality m in
``agent_modality`` is row k of m's group. A key that no table declares is a bug that
``check_keys`` (and tests/test_batch_keys.py) reports, so adding a key means adding a line here.

Shapes: B samples, A agents in the batch (sum of record_len), N points, P pillars, M points per
pillar (slots), G GT boxes per sample (padded to G_max in a batch), C cameras per agent, H x W
image pixels.
"""
from __future__ import annotations

from typing import Dict, Iterable, NamedTuple, Tuple

LIDAR, CAMERA, COMMON = "lidar", "camera", "common"
MODALITIES = (LIDAR, CAMERA, COMMON)


class Key(NamedTuple):
    name: str
    modality: str
    shape: str          # with its dtype, as the docstrings show it
    meaning: str


def _table(*keys: Key) -> Dict[str, Key]:
    return {key.name: key for key in keys}


# -- what travels in every stage ---------------------------------------------------------------

_CAMERA_KEYS = (
    Key("images", CAMERA, "(A, C, 3, H, W) float32", "camera images, normalised as the encoder "
        "expects, after the image augmentation"),
    Key("intrinsics", CAMERA, "(A, C, 3, 3) float32", "pinhole intrinsics of each camera"),
    Key("extrinsics", CAMERA, "(A, C, 4, 4) float32", "camera (OpenCV axes) -> the frame of "
        "the agent's points: its own (augmented) LiDAR frame, the ego's with proj_first"),
    Key("post_rots", CAMERA, "(A, C, 3, 3) float32", "the image augmentation's rotation and "
        "resize (pixels of the original image -> the augmented one)"),
    Key("post_trans", CAMERA, "(A, C, 3) float32", "the image augmentation's translation"),
    Key("depth_maps", CAMERA, "(A, C, H, W) float32", "metres per pixel of the augmented image "
        "(0: no measurement), for lift-splat's depth supervision (lift_splat.lidar_depth_maps)"),
)
# The per-agent camera tensors (a modality group of ``modality_cameras`` holds the same keys).
CAMERA_TENSORS = tuple(key.name for key in _CAMERA_KEYS)
# Keys only a heterogeneous (``heter``) sample, batch or model input carries (the agents' own
# GT: with HEAL's pyramid loss).
HETER_KEYS = ("agent_modality", "modality_cameras", "modality_pillars", "agent_gt_boxes",
              "agent_gt_mask")
_MODALITY_KEY = Key("agent_modality", COMMON, "list of A str", "heter: each agent's modality "
                    "(the model's name, after heter.mapping_dict), ego first per sample")
_MODALITY_CAMERAS = Key("modality_cameras", CAMERA, "{modality: {camera key: (A_m, C, ...)}}",
                        "heter: the camera tensors of each camera modality's agents, in agent "
                        "order (image sizes differ per modality; depth_maps with 'depth')")

SAMPLE = _table(
    Key("sample_key", COMMON, "(scenario, timestamp[, cav])", "the sample's identity"),
    Key("agent_ids", COMMON, "list of n cav ids", "ego first"),
    Key("agent_types", COMMON, "(n,) int64", "0 vehicle, 1 infrastructure (negative cav id)"),
    Key("agent_latency", COMMON, "(n,) int64", "frames each agent's data is older than the "
        "ego's (wild_setting.latency_frames; 0 for the ego)"),
    Key("transforms_to_ego", COMMON, "(n, 4, 4) float32", "agent -> ego as used (noisy for "
        "non-ego agents)"),
    Key("transforms_to_ego_clean", COMMON, "(n, 4, 4) float32", "the same from the true poses"),
    Key("gt_boxes", COMMON, "(G, 7) float32", "[x, y, z, h, w, l, yaw] (lwh per "
        "postprocess.order)"),
    Key("gt_ids", COMMON, "(G,) int64", "object ids"),
    Key("gt_classes", COMMON, "(G,) int64", "class id of each GT box (index into "
        "postprocess.classes); only with a class list"),
    Key("gt_ego_points", COMMON, "(G,) int64", "ego LiDAR returns inside each GT box (0: "
        "occluded for the ego; -1: not counted)"),
    Key("shared_points", COMMON, "int", "points each non-ego agent sent (early fusion; else 0)"),
    Key("points_in_agent_frame", COMMON, "bool", "clouds in their own agent's frame (late, "
        "own-frame intermediate) rather than the ego's"),
    Key("agent_points", LIDAR, "list of n (N_i, 4) float32", "each agent's cropped cloud"),
    Key("agent_gt_boxes", COMMON, "list of n (G_i, 7) float32", "each agent's own GT (the "
        "boxes its frame lists) in its own augmented frame: the pyramid loss's per-agent "
        "occupancy labels (HEAL's label_dict_single; own-frame intermediate only)"),
    Key("early_fusion_points", LIDAR, "(N, 4) float32", "the merged early-fusion cloud of the "
        "same sample (DiscoNet's teacher input)"),
    *_CAMERA_KEYS,
    _MODALITY_KEY._replace(shape="list of n str"),
    _MODALITY_CAMERAS,
)

BATCH = _table(
    Key("record_len", COMMON, "(B,) int64", "agents per sample, ego first within each"),
    Key("agent_types", COMMON, "(A,) int64", "0 vehicle, 1 infrastructure"),
    Key("agent_latency", COMMON, "(A,) int64", "frames each agent lags the ego"),
    Key("transforms_to_ego", COMMON, "(A, 4, 4) float32", "agent -> ego as reported; own-frame "
        "batches: what the model warps features with"),
    Key("transforms_to_ego_clean", COMMON, "(A, 4, 4) float32", "the same from the true poses"),
    Key("gt_boxes", COMMON, "(B, G_max, 7) float32", "zero padded"),
    Key("gt_mask", COMMON, "(B, G_max) bool", "real GT rows"),
    Key("agent_gt_boxes", COMMON, "(A, G_max, 7) float32", "each agent's own GT in its own "
        "frame, zero padded (the pyramid loss)"),
    Key("agent_gt_mask", COMMON, "(A, G_max) bool", "real rows of agent_gt_boxes"),
    Key("gt_classes", COMMON, "(B, G_max) int64", "class id of each GT row (0 padded); only "
        "when the samples carry gt_classes (multi-class)"),
    Key("shared_points", COMMON, "(B,) int64", "points each non-ego agent sent (early fusion)"),
    Key("sample_keys", COMMON, "list of B keys", "(scenario, timestamp[, cav])"),
    Key("gt_ids", COMMON, "list of B (G,) int64 arrays", "object ids"),
    Key("gt_ego_points", COMMON, "list of B (G,) int64 arrays", "ego points in each GT box "
        "(-1: not counted)"),
    Key("points_in_agent_frame", COMMON, "bool", "clouds in their agent's own frame"),
    Key("points", LIDAR, "(N, 4) float32", "every agent's points, agent after agent"),
    Key("agent_index", LIDAR, "(N,) int64", "batch agent index of each point"),
    Key("early_fusion", LIDAR, "dict", "DiscoNet's teacher input: a batch of one merged cloud "
        "per sample with points, agent_index, record_len of ones, agent_types, shared_points "
        "and the transforms"),
    *_CAMERA_KEYS,
    _MODALITY_KEY,
    _MODALITY_CAMERAS,
)

MODEL_INPUT = _table(
    Key("record_len", COMMON, "(B,) int64", "agents per sample"),
    Key("agent_types", COMMON, "(A,) int64", "0 vehicle, 1 infrastructure (V2X-ViT)"),
    Key("agent_latency", COMMON, "(A,) int64", "frames of delay (V2X-ViT's delay encoding)"),
    Key("transforms_to_ego", COMMON, "(A, 4, 4) float32", "what own-frame models warp with "
        "(pose correction replaces it)"),
    Key("shared_points", COMMON, "(B,) int64", "early fusion's byte count"),
    Key("num_agents_sent", COMMON, "(B,) int64", "senders per sample (early fusion's bytes "
        "split over them)"),
    Key("points_in_agent_frame", COMMON, "bool", "own-frame data: the detector warps"),
    Key("spatial_correction_matrix", COMMON, "(B, L, 4, 4) float32", "V2X-ViT's STTF per "
        "sample slot (absent: identity)"),
    Key("transforms_to_ego_reported", COMMON, "(A, 4, 4) float32", "after pose correction: "
        "the reported transforms it replaced"),
    Key("stage1_boxes", COMMON, "list", "after pose correction: the stage-1 boxes per agent"),
    Key("voxel_features", LIDAR, "(P, M, 4) float32", "points of each pillar, zero padded"),
    Key("voxel_num_points", LIDAR, "(P,) int32", "real points per pillar"),
    Key("voxel_coords", LIDAR, "(P, 4) int64", "[agent, z, y, x] cell of each pillar"),
    Key("voxel_valid", LIDAR, "(A, K) bool", "static pillars: which of each agent's K slots "
        "are real (performance.static_pillars)"),
    Key("modality_pillars", LIDAR, "{modality: {voxel_features, voxel_num_points, "
        "voxel_coords}}", "heter: each LiDAR modality's pillars on its own grid (its "
        "preprocess), voxel_coords[:, 0] the agent's index among that modality's agents"),
    *_CAMERA_KEYS,
    _MODALITY_KEY,
    _MODALITY_CAMERAS,
)

STAGES = {"sample": SAMPLE, "batch": BATCH, "model input": MODEL_INPUT}


def keys_of(table: Dict[str, Key], modality: str) -> Tuple[str, ...]:
    """The names of ``table`` of one modality, in declaration order."""
    return tuple(name for name, key in table.items() if key.modality == modality)


def undeclared(stage: str, names: Iterable[str]) -> Tuple[str, ...]:
    """The names not declared for ``stage`` ("sample", "batch", "model input"), sorted."""
    table = STAGES[stage]
    return tuple(sorted(name for name in names if name not in table))


def check_keys(stage: str, names: Iterable[str], where: str) -> None:
    """KeyError naming ``where`` and every key of ``names`` not declared for ``stage``."""
    unknown = undeclared(stage, names)
    if unknown:
        raise KeyError(f"{where} emits {stage} keys not declared in opencood/batch_keys.py: "
                       f"{', '.join(unknown)}")


def describe(stage: str) -> str:
    """The stage's table as docstring text, grouped by modality."""
    lines = []
    for modality in MODALITIES:
        keys = [STAGES[stage][name] for name in keys_of(STAGES[stage], modality)]
        if keys:
            lines.append(f"{modality}:")
            lines += [f"    {k.name:<26} {k.shape:<30} {k.meaning}" for k in keys]
    return "\n".join(lines)
