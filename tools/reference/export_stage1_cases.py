#!/usr/bin/env python
"""Real stage-1 cases for the pose-graph parity fixture (``make_pose_graph_fixture.py --real``):
evaluate a stage-1 run (late fusion with a ``box_align`` section) at one pose-noise level with
``tools/eval.py``'s machinery and keep the first samples' inputs to the pose graph.

    PYTHONPATH=. python tools/reference/export_stage1_cases.py --model_dir runs/stage1 \\
        --pose_noise 0.6 --samples 6 --out /tmp/real_cases.json

Each case: per agent ``boxes`` (K, 7) ``[x, y, z, l, w, h, yaw]`` in its own frame and their
``log_vars`` (K, 3); ``lidar_poses`` (N, 6) CARLA poses of the agents in the ego frame (the noisy
ones; the ego at the origin). Headings are folded so that every box's heading in the ego frame
lies in [-pi/2, pi/2): no half turns inside a cluster and none across +-pi, where the authors'
heading rule and ours differ by design (``opencood/ops/pose_graph.py``). Run here, with our
package (the evaluation also writes its records into the run's ``evals/``); CI never runs it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

import opencood.eval.pose_correction as pose_correction
from opencood.config import load_config
from opencood.engine import evaluator
from opencood.ops.pose_graph import planar_of_transforms, wrap_angle


def folded_lwh(boxes: torch.Tensor, order: str, pose_yaw: float) -> torch.Tensor:
    """(K, 7) boxes ``[x, y, z, *sizes, yaw]`` in ``order`` -> (K, 7) ``[x, y, z, l, w, h, yaw]``
    with the yaw folded as the module docstring says."""
    sizes = {name: boxes[:, 3 + i] for i, name in enumerate(order)}
    world = wrap_angle(boxes[:, 6] + pose_yaw)
    folded = torch.remainder(world + math.pi / 2, math.pi) - math.pi / 2
    return torch.stack([boxes[:, 0], boxes[:, 1], boxes[:, 2], sizes["l"], sizes["w"],
                        sizes["h"], folded - pose_yaw], dim=1)


def cases_of(graph_inputs: list, order: str, count: int) -> list:
    cases = []
    for transforms, boxes, log_vars, record_len in graph_inputs:
        planar = planar_of_transforms(transforms)
        start = 0
        for agents in record_len:
            rows = range(start, start + agents)
            cases.append({
                "agents": [{"boxes": folded_lwh(boxes[a].double(), order,
                                                float(planar[a, 2])).tolist(),
                            "log_vars": log_vars[a].double().tolist()} for a in rows],
                "lidar_poses": [[float(planar[a, 0]), float(planar[a, 1]), 0.0, 0.0,
                                 math.degrees(float(planar[a, 2])), 0.0] for a in rows]})
            start += agents
    return cases[:count]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", required=True, help="a stage-1 run with box_align")
    parser.add_argument("--pose_noise", type=float, default=0.6)
    parser.add_argument("--samples", type=int, default=6)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    seen = []
    solve = pose_correction.box_align_transforms_to_ego

    def recording(transforms, boxes, log_vars, record_len, box_args):
        if log_vars is None:
            sys.exit("error: the stage-1 run has no uncertainty head (model.args.uncertainty_dim)")
        seen.append((transforms.cpu(), [b.cpu() for b in boxes], [v.cpu() for v in log_vars],
                     [int(n) for n in record_len]))
        return solve(transforms, boxes, log_vars, record_len, box_args)

    pose_correction.box_align_transforms_to_ego = recording
    evaluator.main(["--model_dir", args.model_dir, "--pose_noise", str(args.pose_noise),
                    "--fusion_method", "late_box_align", "--num_workers", "0"])
    # The evaluation runs the clean setting, then the noisy one, batch for batch the same
    # samples: the second half of the pose-graph calls is the noisy one.
    noisy = seen[len(seen) // 2:]
    order = load_config(Path(args.model_dir) / "config.yaml")["postprocess"]["order"]
    cases = cases_of(noisy, order, args.samples)
    args.out.write_text(json.dumps(cases))
    print(f"wrote {args.out}: {len(cases)} samples")


if __name__ == "__main__":
    main()
