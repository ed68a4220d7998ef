#!/usr/bin/env python
"""Bird's-eye view of one OPV2V-format sample: every CAV's points in the ego frame, GT boxes.

    python tools/visualize.py --data DIR/<split> --index K --out FILE.png
                              [--range XMIN YMIN XMAX YMAX] [--ppm 8]

Each CAV's cloud (own-body points removed) is projected to the ego lidar frame and drawn in its
own colour; GT boxes (union over the CAVs, as the reader builds them) in green, or lavender when
the ego has no LiDAR return inside (only other CAVs see them); CAV positions are marked. x grows to the right, y downwards (the unmirrored top view of CARLA's frame).
"""
import argparse
import sys
from pathlib import Path


from opencood.config_schema import DEFAULT_COMM_RANGE
from opencood.data.datasets import ego_points_per_box
from opencood.data.opv2v import OPV2VSplit, is_infrastructure, remove_own_body_points
from opencood.ops.transforms import apply_transform
from opencood.utils.vis_bev import bev_range_2d, render_bev, save_image

DEFAULT_RANGE = (-64.0, -40.0, 64.0, 40.0)
GT_Z_RANGE = (-10.0, 10.0)     # a picture shows every box in the x/y window, whatever its height


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a split folder, e.g. DATA/train")
    parser.add_argument("--index", type=int, default=0, help="sample index in the split")
    parser.add_argument("--out", required=True, help="image file to write (.png, .jpg)")
    parser.add_argument("--range", type=float, nargs="+", default=list(DEFAULT_RANGE),
                        help="xmin ymin [zmin] xmax ymax [zmax] in metres, ego frame")
    parser.add_argument("--ppm", type=float, default=8.0, help="pixels per metre")
    parser.add_argument("--com_range", type=float, default=DEFAULT_COMM_RANGE)
    parser.add_argument("--max_cav", type=int, default=5)
    return parser.parse_args(argv)


def agent_kind(cav_id: str, ego_id: str) -> str:
    """How the picture names an agent: "ego", "RSU" (negative folder ids are roadside units)
    or "cav"."""
    if cav_id == ego_id:
        return "ego"
    return "RSU" if is_infrastructure(cav_id) else "cav"


def sample_layers(split: OPV2VSplit, index: int, bev_range):
    """Points per agent (ego frame), GT boxes (M, 7), (M,) bool GT occluded for the ego, and
    agent positions of one sample."""
    xmin, ymin, xmax, ymax = bev_range
    sample = split.load_sample(index, gt_range=[xmin, ymin, GT_Z_RANGE[0],
                                                xmax, ymax, GT_Z_RANGE[1]])
    ego_id = sample["info"].ego_id
    points_by_agent, positions = {}, {}
    for cav_id, cav in sample["cavs"].items():
        name = f"{agent_kind(cav_id, ego_id)} {cav_id}"
        points_lidar = remove_own_body_points(cav["points"])
        points_by_agent[name] = apply_transform(points_lidar, cav["T_to_ego"])
        positions[name] = cav["T_to_ego"][:2, 3]
    # The ego's transform to itself is the identity: its entry is its own cloud.
    occluded = ego_points_per_box(points_by_agent[f"ego {ego_id}"], sample["gt_boxes"]) == 0
    return points_by_agent, sample["gt_boxes"], occluded, positions


def main(argv=None) -> int:
    args = parse_args(argv)
    data = Path(args.data)
    try:        # a missing folder, or a data root given for a split: one line from the reader
        bev_range = bev_range_2d(args.range)
        split = OPV2VSplit(data, com_range=args.com_range, max_cav=args.max_cav)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.index < len(split):
        print(f"error: index {args.index} out of range: {data} has {len(split)} samples "
              f"(0..{len(split) - 1})", file=sys.stderr)
        return 2
    points_by_agent, gt_boxes, occluded, positions = sample_layers(split, args.index, bev_range)
    info = split.info(args.index)
    image = render_bev(points_by_agent, bev_range, gt_boxes=gt_boxes[~occluded],
                       occluded_gt_boxes=gt_boxes[occluded], agent_positions=positions,
                       pixels_per_meter=args.ppm, title=f"{info.scenario} {info.timestamp}")
    try:
        save_image(args.out, image)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.out}: {info.scenario} ts {info.timestamp}, {len(points_by_agent)} CAVs, "
          f"{len(gt_boxes)} GT boxes ({int(occluded.sum())} occluded for the ego), {sum(len(p) for p in points_by_agent.values())} points, "
          f"{image.shape[1]}x{image.shape[0]} px")
    return 0


if __name__ == "__main__":
    sys.exit(main())
