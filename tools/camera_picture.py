#!/usr/bin/env python
"""One sample's camera inputs as the model receives them, with the GT boxes projected through
the sample's own matrices: a check that images, intrinsics, extrinsics and the augmentation's
post_rots / post_trans agree (docs/datasets.md, "Cameras").

    python tools/camera_picture.py --config CFG --out FILE.png [--split validate] [--index K]
                                   [--train] [--epoch E] [--set key=value ...]

The config must read cameras (``input_source`` with camera, a ``camera`` section). One row per
agent (ego first), one tile per camera: the augmented image (normalisation undone), the GT boxes
in green, each corner taken from the ego's GT to the agent's frame (``transforms_to_ego``
inverted when the sample's points are in each agent's frame), then ``K @ inv(extrinsic)``, the
division by depth and ``post_rot @ p + post_trans``. ``--train`` draws the training
augmentations (BEV and image) of ``--epoch``.
"""
from __future__ import annotations

import argparse
import sys

import cv2
import numpy as np

from opencood.config import load_config
from opencood.data.cameras import IMAGENET_MEAN, IMAGENET_STD
from opencood.data.datasets import build_dataset
from opencood.ops.transforms import boxes_to_corners_3d
from opencood.strategies import choose_strategy
from opencood.utils.vis_bev import save_image

EDGES = ((0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4),
         (0, 4), (1, 5), (2, 6), (3, 7))
MIN_DEPTH = 0.5               # m: an edge with a corner nearer than this (or behind) is not drawn
GT_COLOUR = (60, 220, 60)     # RGB
SCALE = 2                     # tiles are drawn this many times larger (small model inputs)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a config reading cameras")
    parser.add_argument("--out", required=True, help="image file to write (.png, .jpg)")
    parser.add_argument("--split", default="validate", choices=("train", "validate", "test"))
    parser.add_argument("--index", type=int, default=0, help="sample index in the split")
    parser.add_argument("--train", action="store_true", help="training augmentations")
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable)")
    return parser.parse_args(argv)


def project(corners_agent: np.ndarray, intrinsic, extrinsic, post_rot, post_tran):
    """(M, 8, 3) corners in the agent's frame -> (M, 8, 2) pixels of the augmented image and
    (M, 8) depths, through one camera's matrices."""
    to_camera = np.linalg.inv(extrinsic.astype(np.float64))
    camera = corners_agent @ to_camera[:3, :3].T + to_camera[:3, 3]
    image = camera @ intrinsic.astype(np.float64).T
    depth = image[..., 2]
    pixel = np.concatenate([image[..., :2] / np.where(np.abs(depth) < 1e-9, 1e-9, depth)[..., None],
                            np.ones_like(depth)[..., None]], axis=-1)
    moved = pixel @ post_rot.astype(np.float64).T + post_tran.astype(np.float64)
    return moved[..., :2], depth


def tile(image_chw: np.ndarray) -> np.ndarray:
    """(3, H, W) normalised float32 -> (SCALE H, SCALE W, 3) uint8 RGB."""
    rgb = image_chw.transpose(1, 2, 0) * np.asarray(IMAGENET_STD) + np.asarray(IMAGENET_MEAN)
    rgb = np.clip(rgb * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return cv2.resize(rgb, (rgb.shape[1] * SCALE, rgb.shape[0] * SCALE),
                      interpolation=cv2.INTER_NEAREST)


def draw_sample(sample: dict) -> np.ndarray:
    """The picture (H, W, 3) uint8 RGB of one dataset sample carrying the camera keys."""
    corners_ego = boxes_to_corners_3d(sample["gt_boxes"].astype(np.float64))
    rows = []
    for agent in range(sample["images"].shape[0]):
        to_ego = sample["transforms_to_ego"][agent].astype(np.float64)
        to_agent = np.linalg.inv(to_ego) if sample["points_in_agent_frame"] else np.eye(4)
        corners = corners_ego @ to_agent[:3, :3].T + to_agent[:3, 3]
        tiles = []
        for camera in range(sample["images"].shape[1]):
            picture = np.ascontiguousarray(tile(sample["images"][agent, camera]))
            pixels, depth = project(corners, sample["intrinsics"][agent, camera],
                                    sample["extrinsics"][agent, camera],
                                    sample["post_rots"][agent, camera],
                                    sample["post_trans"][agent, camera])
            for box_pixels, box_depth in zip(pixels * SCALE, depth):
                for start, end in EDGES:
                    if min(box_depth[start], box_depth[end]) < MIN_DEPTH:
                        continue
                    cv2.line(picture, tuple(int(round(v)) for v in box_pixels[start]),
                             tuple(int(round(v)) for v in box_pixels[end]), GT_COLOUR, 1,
                             cv2.LINE_AA)
            cv2.putText(picture, f"{sample['agent_ids'][agent]} cam{camera}", (3, 12),
                        cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1, cv2.LINE_AA)
            tiles.append(picture)
        rows.append(np.concatenate(tiles, axis=1))
    return np.concatenate(rows, axis=0)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.set)
    if "camera" not in cfg["input_source"]:
        print(f"error: {args.config}: input_source {cfg['input_source']} has no camera "
              f"(--set input_source=[lidar,camera] and a camera section)", file=sys.stderr)
        return 2
    dataset = build_dataset(cfg, args.split, train=args.train, strategy=choose_strategy(cfg))
    dataset.set_epoch(args.epoch)
    if not 0 <= args.index < len(dataset):
        print(f"error: --index {args.index}: the split has {len(dataset)} samples",
              file=sys.stderr)
        return 2
    save_image(args.out, cv2.cvtColor(draw_sample(dataset[args.index]), cv2.COLOR_RGB2BGR))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
