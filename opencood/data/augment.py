"""Data augmentation applied as ONE transform to every agent of a sample (docs/DESIGN.md §4).

All agents' points (already in the ego frame for early/intermediate fusion) and the GT boxes go
through the same flip, rotation and scaling, so boxes keep the points that were inside them and
per-agent BEV features stay aligned for feature-level fusion.

Config (OpenCOOD/OpenPCDet names)::

    data_augment:
      - {NAME: random_world_flip, ALONG_AXIS_LIST: [x]}
      - {NAME: random_world_rotation, WORLD_ROT_ANGLE: [-0.7854, 0.7854]}
      - {NAME: random_world_scaling, WORLD_SCALE_RANGE: [0.95, 1.05]}

The entries' keys and defaults are in the config schema (opencood.config_schema): a resolved
config gives every key of every entry.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from opencood.ops.transforms import limit_period

AUGMENTATIONS = ("random_world_flip", "random_world_rotation", "random_world_scaling")


def _flip(points_list, boxes, axis: str):
    """Mirror across the x axis (y -> -y) or the y axis (x -> -x). Boxes (M, 7) hwl."""
    column = 1 if axis == "x" else 0
    for points in points_list:
        points[:, column] = -points[:, column]
    boxes[:, column] = -boxes[:, column]
    # Mirroring negates yaw across x; across y the heading becomes pi - yaw.
    boxes[:, 6] = -boxes[:, 6] if axis == "x" else np.pi - boxes[:, 6]


def _rotate(points_list, boxes, angle: float):
    cos, sin = np.cos(angle), np.sin(angle)
    rotation = np.array([[cos, -sin], [sin, cos]], dtype=np.float64)
    for points in points_list:
        points[:, :2] = (points[:, :2].astype(np.float64) @ rotation.T).astype(points.dtype)
    boxes[:, :2] = boxes[:, :2] @ rotation.T
    boxes[:, 6] += angle


def _scale(points_list, boxes, factor: float):
    for points in points_list:
        points[:, :3] *= factor
    boxes[:, :6] *= factor


def check_augment_config(augment_cfg: Sequence[dict], source: str = "data_augment") -> None:
    """Raise ValueError naming the bad entry of the ``data_augment`` list."""
    for position, entry in enumerate(augment_cfg or []):
        name = entry.get("NAME") if isinstance(entry, dict) else None
        if name not in AUGMENTATIONS:
            raise ValueError(f"{source}[{position}]: unknown augmentation {name!r}; "
                             f"known: {', '.join(AUGMENTATIONS)}")


def augment_sample(points_list: List[np.ndarray], boxes: np.ndarray, augment_cfg: Sequence[dict],
                   rng: np.random.Generator):
    """Apply the configured augmentations with draws from ``rng``.

    points_list: per-agent (N_i, 4+) arrays (modified copies are returned); boxes (M, 7) hwl.
    Returns (points_list, boxes, params) where params records the draws (for tests/debugging).
    """
    points_list = [points.copy() for points in points_list]
    boxes = boxes.astype(np.float64, copy=True)
    params = {}
    for entry in augment_cfg or []:
        name = entry["NAME"]
        if name == "random_world_flip":
            for axis in entry["ALONG_AXIS_LIST"]:
                flip = bool(rng.random() < 0.5)
                params[f"flip_{axis}"] = flip
                if flip:
                    _flip(points_list, boxes, axis)
        elif name == "random_world_rotation":
            low, high = entry["WORLD_ROT_ANGLE"]
            angle = float(rng.uniform(low, high))
            params["rotation"] = angle
            _rotate(points_list, boxes, angle)
        elif name == "random_world_scaling":
            low, high = entry["WORLD_SCALE_RANGE"]
            factor = float(rng.uniform(low, high))
            params["scale"] = factor
            _scale(points_list, boxes, factor)
        else:
            raise ValueError(f"unknown augmentation {name!r}; known: {', '.join(AUGMENTATIONS)}")
    if len(boxes):
        boxes[:, 6] = limit_period(boxes[:, 6])
    return points_list, boxes, params
