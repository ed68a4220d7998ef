#!/usr/bin/env python
"""How good must stage 1 be? CoAlign's pose graph on constructed scenes, by stage-1 box accuracy.

    python tools/pose_graph_study.py [--pose_noise 0.6] [--box_noise 0.3 0.2 0.1 0.05]
        [--heading_noise 3] [--objects 10] [--spread 40] [--scenes 200]

Each scene: an ego and ``--agents - 1`` other agents (placed uniformly within ``--spread`` / 2 m
of the ego, any heading), ``--objects`` objects seen by every agent (uniform within ``--spread``
/ 2 m of the ego, at least 3 m apart), Gaussian pose noise of the non-ego agents (``--pose_noise``
m on x / y, the same number in degrees on yaw, as ``tools/eval.py --pose_noise``), and every
box off by Gaussian noise (``--box_noise`` m on x / y, ``--heading_noise`` deg on heading).
Printed per box-noise level: the median relative pose error (translation m, yaw deg) before and
after the pose graph (``opencood.ops.pose_graph.align_poses``, the authors' settings) and the
median distance of two agents' boxes of one object (what ``tools/eval.py`` reports as
``pose_error.stage1_boxes`` for a real stage 1, to read a real stage 1 against this table).
"""
from __future__ import annotations

import argparse
import math
from typing import Dict, List

import torch

from opencood.errors import run_cli
from opencood.eval.pose_error import relative_pose_errors
from opencood.ops.pose_graph import BoxAlignArgs, align_poses, to_local, wrap_angle

F64 = torch.float64


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pose_noise", type=float, default=0.6, help="m and deg (std)")
    parser.add_argument("--box_noise", type=float, nargs="+", default=[0.3, 0.2, 0.1, 0.05],
                        help="std of every box's x and y (m), one table row each")
    parser.add_argument("--heading_noise", type=float, default=3.0, help="deg (std)")
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--objects", type=int, default=10, help="objects every agent sees")
    parser.add_argument("--spread", type=float, default=40.0, help="m: scene diameter")
    parser.add_argument("--scenes", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.agents < 2 or args.objects < 1 or args.scenes < 1:
        parser.error("--agents >= 2, --objects >= 1 and --scenes >= 1")
    return args


def uniform_disc(gen: torch.Generator, count: int, radius: float) -> torch.Tensor:
    """(count, 2) points uniform in a disc of ``radius`` m around the origin."""
    angle = torch.rand(count, generator=gen, dtype=F64) * 2 * math.pi
    distance = radius * torch.rand(count, generator=gen, dtype=F64).sqrt()
    return torch.stack([distance * torch.cos(angle), distance * torch.sin(angle)], dim=1)


def spaced_objects(gen: torch.Generator, count: int, radius: float, gap: float = 3.0):
    """(count, 3) object poses (x, y, heading) at least ``gap`` m apart (rejection sampling:
    no two objects of one scene fall into one 1.5 m cluster)."""
    kept: List[torch.Tensor] = []
    while len(kept) < count:
        candidate = uniform_disc(gen, 1, radius)[0]
        if all((candidate - other).norm() >= gap for other in kept):
            kept.append(candidate)
    headings = (torch.rand(count, generator=gen, dtype=F64) * 2 - 1) * math.pi
    return torch.cat([torch.stack(kept), headings[:, None]], dim=1)


def study_scene(gen: torch.Generator, args: argparse.Namespace, box_noise: float):
    """-> true (A, 3) and noisy (A, 3) world poses (the ego first, exact), per agent (K, 3) boxes
    (x, y, heading) in its own frame."""
    true = torch.zeros(args.agents, 3, dtype=F64)
    true[1:, :2] = uniform_disc(gen, args.agents - 1, args.spread / 2)
    true[1:, 2] = (torch.rand(args.agents - 1, generator=gen, dtype=F64) * 2 - 1) * math.pi
    objects = spaced_objects(gen, args.objects, args.spread / 2)
    sigma = torch.tensor([box_noise, box_noise, math.radians(args.heading_noise)], dtype=F64)
    boxes = [to_local(objects, true[a].expand(args.objects, 3))
             + sigma * torch.randn(args.objects, 3, generator=gen, dtype=F64)
             for a in range(args.agents)]
    noisy = true.clone()
    pose_sigma = torch.tensor([args.pose_noise, args.pose_noise, math.radians(args.pose_noise)],
                              dtype=F64)
    noisy[1:] += pose_sigma * torch.randn(args.agents - 1, 3, generator=gen, dtype=F64)
    noisy[:, 2] = wrap_angle(noisy[:, 2])
    return true, noisy, boxes


def study_row(args: argparse.Namespace, box_noise: float) -> Dict[str, float]:
    """Median errors over ``args.scenes`` scenes at one box-noise level."""
    gen = torch.Generator().manual_seed(args.seed)
    before, after = [], []
    for _ in range(args.scenes):
        true, noisy, boxes = study_scene(gen, args, box_noise)
        corrected = align_poses(boxes, None, noisy, [args.agents], BoxAlignArgs()).poses
        before.append(torch.stack(relative_pose_errors(noisy, true, [args.agents]), dim=1))
        after.append(torch.stack(relative_pose_errors(corrected, true, [args.agents]), dim=1))
    before, after = torch.cat(before), torch.cat(after)
    return {"box_noise_m": box_noise,
            "box_pair_distance_m": box_noise * math.sqrt(2) * math.sqrt(2 * math.log(2)),
            "before_m": float(before[:, 0].median()), "before_deg": float(before[:, 1].median()),
            "after_m": float(after[:, 0].median()), "after_deg": float(after[:, 1].median())}


def format_rows(rows: List[Dict[str, float]]) -> str:
    lines = [f"{'box noise':>10} {'boxes apart':>12} {'before':>18} {'after':>18}",
             f"{'(m, std)':>10} {'(m, median)':>12} {'(m / deg, median)':>18} "
             f"{'(m / deg, median)':>18}"]
    for row in rows:
        lines.append(f"{row['box_noise_m']:10.3f} {row['box_pair_distance_m']:12.3f} "
                     f"{row['before_m']:9.3f} / {row['before_deg']:5.2f} "
                     f"{row['after_m']:9.3f} / {row['after_deg']:5.2f}")
    return "\n".join(lines)


def main(argv=None) -> List[Dict[str, float]]:
    args = parse_args(argv)
    rows = [study_row(args, noise) for noise in args.box_noise]
    print(f"{args.agents} agents, {args.objects} shared objects within {args.spread / 2:g} m, "
          f"pose noise {args.pose_noise:g} m / {args.pose_noise:g} deg, heading noise "
          f"{args.heading_noise:g} deg, {args.scenes} scenes per row")
    print(format_rows(rows))
    return rows


if __name__ == "__main__":
    run_cli(main)
