#!/usr/bin/env python
"""One frame's 4 camera images with the yaml's GT boxes drawn in, read as a camera reader reads
the files: a check of the written pictures and camera parameters by eye.

    python tools/generate_synthetic.py --preset tiny --out /tmp/syn --cameras --splits test
    python tools/synthetic_camera_picture.py --agent /tmp/syn/test/<scenario>/<cav_id> \\
        --out docs/synthetic_cameras.png [--timestamp 000068] [--scale 0.5]

Boxes come from the frame's ``vehicles`` (world frame), are moved into the lidar frame with
``lidar_pose`` and into each camera as HEAL does it (camera -> lidar from ``cords`` and
``lidar_pose``, then UE4 -> OpenCV axes), projected with ``intrinsic``; edges are clipped at
0.1 m in front of the camera. Cameras in a 2 x 2 grid: front, right / left, back.
"""
import argparse
import sys
from pathlib import Path

import cv2
import numpy as np
import yaml

from opencood.ops.transforms import pose_to_matrix

UE4_TO_OPENCV = np.array([[0, 0, 1, 0], [1, 0, 0, 0], [0, -1, 0, 0], [0, 0, 0, 1]],
                         dtype=np.float64)
# Box corners (unit half extents) and the 12 edges between them.
CORNERS = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], dtype=float)
EDGES = [(a, b) for a in range(8) for b in range(a + 1, 8)
         if np.abs(CORNERS[a] - CORNERS[b]).sum() == 2]
NEAR = 0.1


def box_corners_world(entry) -> np.ndarray:
    """(8, 3) world corners of an OPV2V ``vehicles`` entry."""
    center = np.add(entry["location"], entry["center"])
    box_to_world = pose_to_matrix(list(center) + list(entry["angle"]))
    local = CORNERS * np.asarray(entry["extent"])
    return local @ box_to_world[:3, :3].T + box_to_world[:3, 3]


def draw_boxes(image, params, index, colour=(0, 230, 255)):
    """Draw every box of ``params['vehicles']`` into camera ``index``'s image (BGR, in place)."""
    camera = params[f"camera{index}"]
    camera_to_lidar = np.linalg.inv(pose_to_matrix(params["lidar_pose"])) @ \
        pose_to_matrix(camera["cords"]) @ UE4_TO_OPENCV
    world_to_camera = np.linalg.inv(camera_to_lidar) @ \
        np.linalg.inv(pose_to_matrix(params["lidar_pose"]))
    intrinsic = np.asarray(camera["intrinsic"])
    for entry in params.get("vehicles", {}).values():
        corners = box_corners_world(entry) @ world_to_camera[:3, :3].T + world_to_camera[:3, 3]
        for a, b in EDGES:
            start, end = corners[a], corners[b]
            if max(start[2], end[2]) < NEAR:
                continue
            if start[2] < NEAR or end[2] < NEAR:   # clip the part behind the camera
                cut = start + (end - start) * (NEAR - start[2]) / (end[2] - start[2])
                start, end = (cut, end) if start[2] < NEAR else (start, cut)
            pixels = [intrinsic @ p for p in (start, end)]
            points = [tuple(int(round(c)) for c in (p[:2] / p[2]) * 16) for p in pixels]
            cv2.line(image, points[0], points[1], colour, 1, cv2.LINE_AA, shift=4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", required=True, help="an agent folder of a generated scenario")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--timestamp", help="frame (default: the first)")
    parser.add_argument("--scale", type=float, default=0.5, help="image scale (default 0.5)")
    args = parser.parse_args(argv)
    agent = Path(args.agent)
    stamps = sorted(p.stem for p in agent.glob("*.yaml"))
    timestamp = args.timestamp or (stamps[0] if stamps else None)
    if timestamp is None or not (agent / f"{timestamp}_camera0.png").exists():
        print(f"error: {agent} has no camera images (generate with --cameras)", file=sys.stderr)
        return 2
    params = yaml.safe_load((agent / f"{timestamp}.yaml").read_text())
    tiles = []
    for index in range(4):
        image = cv2.imread(str(agent / f"{timestamp}_camera{index}.png"))
        draw_boxes(image, params, index)
        tiles.append(cv2.resize(image, None, fx=args.scale, fy=args.scale,
                                interpolation=cv2.INTER_AREA))
    grid = np.vstack([np.hstack(tiles[:2]), np.hstack(tiles[2:])])
    cv2.imwrite(args.out, grid, [cv2.IMWRITE_PNG_COMPRESSION, 9])
    return 0


if __name__ == "__main__":
    sys.exit(main())
