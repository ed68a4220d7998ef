"""Data augmentation applied as ONE transform to every agent of a sample (docs/DESIGN.md §4).

All agents' points (already in the ego frame for early/intermediate fusion) and the GT boxes go
through the same flip, rotation and scaling, so boxes keep the points that were inside them and
per-agent BEV features stay aligned for feature-level fusion. The draws
(:func:`draw_augmentation`) become one 4x4 (:func:`augmentation_matrix`) that the datasets compose
with each agent's transform to the ego, so every point is moved once, in float32
(``opencood.ops.transforms.project_and_crop``); the few GT boxes follow the steps one by one
(:func:`augment_boxes`), which keeps the yaw and size rules explicit.

Config (OpenCOOD/OpenPCDet names)::

    data_augment:
      - {NAME: random_world_flip, ALONG_AXIS_LIST: [x]}
      - {NAME: random_world_rotation, WORLD_ROT_ANGLE: [-0.7854, 0.7854]}
      - {NAME: random_world_scaling, WORLD_SCALE_RANGE: [0.95, 1.05]}

The entries' keys and defaults are in the config schema (opencood.config_schema): a resolved
config gives every key of every entry.
"""
from __future__ import annotations

from typing import List, Mapping, NamedTuple, Sequence

import numpy as np

from opencood.ops.transforms import apply_transform, limit_period

AUGMENTATIONS = ("random_world_flip", "random_world_rotation", "random_world_scaling")


class Augmentation(NamedTuple):
    """The draws of one sample.

    steps: the transforms in the order they apply, ``("flip", "x" | "y")`` (only the flips drawn),
        ``("rotation", radians)``, ``("scale", factor)``.
    params: what was drawn (``flip_<axis>`` bools, ``rotation``, ``scale``), for tests and logs.
    """
    steps: tuple
    params: dict


def draw_augmentation(augment_cfg: Sequence[dict], rng: np.random.Generator) -> Augmentation:
    """Draw the configured augmentations from ``rng``: one uniform per flip axis, one per
    rotation, one per scaling, in the order of the config (the draws are the same function of
    the generator as they always were, so (seed, epoch, index) give the same sample)."""
    steps, params = [], {}
    for entry in augment_cfg or []:
        name = entry["NAME"]
        if name == "random_world_flip":
            for axis in entry["ALONG_AXIS_LIST"]:
                flip = bool(rng.random() < 0.5)
                params[f"flip_{axis}"] = flip
                if flip:
                    steps.append(("flip", axis))
        elif name == "random_world_rotation":
            low, high = entry["WORLD_ROT_ANGLE"]
            params["rotation"] = float(rng.uniform(low, high))
            steps.append(("rotation", params["rotation"]))
        elif name == "random_world_scaling":
            low, high = entry["WORLD_SCALE_RANGE"]
            params["scale"] = float(rng.uniform(low, high))
            steps.append(("scale", params["scale"]))
        else:
            raise ValueError(f"unknown augmentation {name!r}; known: {', '.join(AUGMENTATIONS)}")
    return Augmentation(tuple(steps), params)


def augmentation_matrix(steps) -> np.ndarray:
    """(4, 4) float64: the steps composed (the last applied leftmost), for points.

    A flip across x is y -> -y, across y is x -> -x; the rotation turns x/y by the angle about z
    (counter-clockwise); the scaling multiplies x, y and z.
    """
    matrix = np.identity(4)
    for kind, value in steps:
        step = np.identity(4)
        if kind == "flip":
            mirrored = 1 if value == "x" else 0        # across x: y -> -y; across y: x -> -x
            step[mirrored, mirrored] = -1.0
        elif kind == "rotation":
            cos, sin = np.cos(value), np.sin(value)
            step[:2, :2] = [[cos, -sin], [sin, cos]]
        else:
            step[:3, :3] *= value
        matrix = step @ matrix
    return matrix


def augment_boxes(boxes: np.ndarray, steps) -> np.ndarray:
    """(M, 7) hwl boxes -> (M, 7) float64 copy through the steps, yaw wrapped to [-pi, pi).

    Box by box as the points move: a flip mirrors the centre and negates yaw across x (pi - yaw
    across y), a rotation turns the centre and adds the angle, a scaling multiplies the centre
    and the sizes.
    """
    boxes = np.array(boxes, dtype=np.float64).reshape(-1, 7)
    for kind, value in steps:
        if kind == "flip":
            column = 1 if value == "x" else 0
            boxes[:, column] = -boxes[:, column]
            boxes[:, 6] = -boxes[:, 6] if value == "x" else np.pi - boxes[:, 6]
        elif kind == "rotation":
            cos, sin = np.cos(value), np.sin(value)
            boxes[:, :2] = boxes[:, :2] @ np.array([[cos, -sin], [sin, cos]]).T
            boxes[:, 6] += value
        else:
            boxes[:, :6] *= value
    if len(boxes):
        boxes[:, 6] = limit_period(boxes[:, 6])
    return boxes


def check_augment_config(augment_cfg: Sequence[dict], source: str = "data_augment") -> None:
    """Raise ValueError naming the bad entry of the ``data_augment`` list."""
    for position, entry in enumerate(augment_cfg or []):
        name = entry.get("NAME") if isinstance(entry, Mapping) else None
        if name not in AUGMENTATIONS:
            raise ValueError(f"{source}[{position}]: unknown augmentation {name!r}; "
                             f"known: {', '.join(AUGMENTATIONS)}")


def augment_sample(points_list: List[np.ndarray], boxes: np.ndarray, augment_cfg: Sequence[dict],
                   rng: np.random.Generator):
    """Apply the configured augmentations with draws from ``rng``.

    points_list: per-agent (N_i, 3+) arrays (new arrays are returned, same dtype); boxes (M, 7)
    hwl. Returns (points_list, boxes, params) where params records the draws. The datasets use
    the parts (draw, compose with the agent's pose, one pass); this is the whole for one-off use.
    """
    augmentation = draw_augmentation(augment_cfg, rng)
    matrix = augmentation_matrix(augmentation.steps)
    return ([apply_transform(points, matrix) for points in points_list],
            augment_boxes(boxes, augmentation.steps), augmentation.params)
