#!/usr/bin/env python
"""Write HEAL's camera visibility labels where a copy of OPV2V lacks them (issue 36)::

    python tools/bev_visibility.py DATA [--overwrite] [--min-pixels N] [--tolerance M]

DATA is an OPV2V-layout root (train/ validate/ test/) or one split folder. For every agent frame
without ``<ts>_bev_visibility.png`` (all frames with ``--overwrite``) the map is recomputed from
the files: the GT of the timestamp (every agent's ``vehicles`` but the agent itself, in the frame's
LiDAR frame) is rasterised into the agent's 4 cameras (the yaml's ``camera<i>`` cords and
intrinsic), and a vehicle is visible when at least ``--min-pixels`` of its pixels agree with the
frame's depth image ``<ts>_depth<i>.png`` (OPV2V-H's, where HEAL reads it: the path with ``OPV2V``
replaced by ``OPV2V_Hetero``, beside the frame when it has none) within ``--tolerance`` metres:
nothing nearer covers them. The map is HEAL's (256 x 256, 0.39 m per pixel, heading up, 255 on the
visible vehicles' footprints: opencood.data.camera_visibility). The synthetic world writes the maps
itself while generating with ``--cameras`` (from its exact per-pixel object ids); a frame without
depth images is reported, not guessed. Prints one line per split; exit status 1 when a frame could
not be labelled.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from opencood.data.camera_visibility import (DEPTH_TOLERANCE, MIN_VISIBLE_PIXELS, map_path,
                                             unoccluded_pixels, visibility_map,
                                             write_visibility_map)
from opencood.data.cameras import OPV2V_CAMERAS, opv2v_camera_to_lidar
from opencood.data.heter import depth_files
from opencood.data.opv2v import load_frame_yaml, vehicles_to_boxes
from opencood.errors import OpencoodError, run_cli

SPLITS = ("train", "validate", "test")
UNBOUNDED = (-1e9, -1e9, -1e9, 1e9, 1e9, 1e9)


class VisibilityToolError(OpencoodError):
    """A folder that is not OPV2V's layout: one line naming it."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Write HEAL's bev_visibility maps a copy lacks.")
    parser.add_argument("data", help="OPV2V-layout root or split folder")
    parser.add_argument("--overwrite", action="store_true",
                        help="recompute every frame's map, not only the missing ones")
    parser.add_argument("--min-pixels", type=int, default=MIN_VISIBLE_PIXELS,
                        help="unoccluded pixels that make a vehicle visible (default %(default)s)")
    parser.add_argument("--tolerance", type=float, default=DEPTH_TOLERANCE,
                        help="metres the depth image may lie before a box's surface "
                             "(default %(default)s: the images hold whole metres)")
    return parser.parse_args(argv)


def split_folders(data: Path):
    """The split folders of ``data`` (a root with train/ ... or one split)."""
    if not data.is_dir():
        raise VisibilityToolError(f"{data}: no such folder")
    splits = [data / name for name in SPLITS if (data / name).is_dir()]
    return splits or [data]


def depth_image_paths(frame_dir: Path, timestamp: str):
    """The frame's 4 depth images where HEAL reads them (opencood.data.heter.depth_files:
    beside the frame unless its path says OPV2V); None when one is missing."""
    paths = depth_files(frame_dir, timestamp, OPV2V_CAMERAS)
    return paths if all(path.is_file() for path in paths) else None


def frame_cameras(params: dict, where: str):
    """(camera_to_lidar (C, 4, 4), intrinsics (C, 3, 3)) from a frame's yaml mapping."""
    try:
        entries = [params[f"camera{index}"] for index in range(OPV2V_CAMERAS)]
        to_lidar = np.stack([opv2v_camera_to_lidar(e["cords"], params["lidar_pose"])
                             for e in entries]).astype(np.float64)
        intrinsics = np.stack([np.asarray(e["intrinsic"], np.float64) for e in entries])
    except (KeyError, TypeError, ValueError) as error:
        raise VisibilityToolError(f"{where}: camera0..3 cords / intrinsic unreadable "
                                  f"({error})") from None
    return to_lidar, intrinsics


def label_frame(frame_dir: Path, timestamp: str, params: dict, scene_vehicles: dict,
                min_pixels: int, tolerance: float) -> int | None:
    """Write one frame's map; returns the vehicles painted, None without depth images."""
    depth_paths = depth_image_paths(frame_dir, timestamp)
    if depth_paths is None:
        return None
    depth = np.stack([np.asarray(Image.open(path).convert("L"), np.float32)
                      for path in depth_paths])
    to_lidar, intrinsics = frame_cameras(params, f"{frame_dir / timestamp}.yaml")
    ids, boxes = vehicles_to_boxes(scene_vehicles, params["lidar_pose"], UNBOUNDED)
    pixels = unoccluded_pixels(boxes, to_lidar, intrinsics, depth.shape[:0:-1], depth,
                               tolerance=tolerance)
    visible = pixels >= min_pixels
    write_visibility_map(map_path(frame_dir, timestamp), visibility_map(boxes[visible]))
    return int(visible.sum())


def label_split(split: Path, overwrite: bool, min_pixels: int, tolerance: float) -> dict:
    """Label every frame of one split folder that needs it; returns the counts."""
    counts = {"frames": 0, "written": 0, "kept": 0, "no_depth": 0}
    missing_depth = []
    for scenario in sorted(p for p in split.iterdir() if p.is_dir()):
        agents = sorted(p for p in scenario.iterdir() if p.is_dir())
        stamps = sorted({p.stem for agent in agents for p in agent.glob("*.yaml")})
        for stamp in stamps:
            frames = {agent: load_frame_yaml(agent / f"{stamp}.yaml") for agent in agents
                      if (agent / f"{stamp}.yaml").is_file()}
            scene_vehicles = {}
            for params in frames.values():
                scene_vehicles.update(params["vehicles"])
            for agent, params in frames.items():
                counts["frames"] += 1
                if map_path(agent, stamp).is_file() and not overwrite:
                    counts["kept"] += 1
                    continue
                # its own body is not in the view of the cameras mounted on it
                others = {actor: entry for actor, entry in scene_vehicles.items()
                          if str(actor) != agent.name}
                if label_frame(agent, stamp, params, others, min_pixels, tolerance) is None:
                    counts["no_depth"] += 1
                    missing_depth.append(agent / stamp)
                    continue
                counts["written"] += 1
    if missing_depth:
        counts["first_without_depth"] = str(missing_depth[0])
    return counts


def run(args: argparse.Namespace) -> dict:
    totals = {}
    for split in split_folders(Path(args.data)):
        counts = label_split(split, args.overwrite, args.min_pixels, args.tolerance)
        totals[str(split)] = counts
        line = (f"{split}: {counts['frames']} agent frames, {counts['written']} maps written, "
                f"{counts['kept']} kept")
        if counts["no_depth"]:
            line += (f", {counts['no_depth']} without depth images (first: "
                     f"{counts['first_without_depth']}_depth0..3.png)")
        print(line, flush=True)
    return totals


def main(argv=None):
    totals = run_cli(lambda argv: run(parse_args(argv)), argv)
    if any(counts["no_depth"] for counts in totals.values()):
        raise SystemExit(1)
    return totals


if __name__ == "__main__":
    main()
