"""Constructed pose-graph scenes with known answers, for ``tests/test_pose_graph.py`` and the
``pose_graph_solve_ms`` figure of ``tools/bench.py``."""
from __future__ import annotations

import math
from typing import List, Tuple

import torch

from opencood.ops.pose_graph import to_local

F64 = torch.float64


def make_pose_graph_scene(num_agents: int = 4, num_objects: int = 12, pose_noise: float = 0.5,
                          box_noise: float = 0.0, seed: int = 0, spacing: float = 6.0
                          ) -> Tuple[torch.Tensor, torch.Tensor, List[torch.Tensor]]:
    """Objects on a ``spacing`` m grid (never within 1.5 m of each other), every agent sees every
    object; agents within 15 m of the ego.

    -> true poses (A, 3), noisy poses (A, 3) (the ego exact; x, y and yaw (deg) off by up to
    ``pose_noise``, uniform, so that every box stays within 1.5 m of its object's other boxes
    when the scene is small), boxes: per agent (K, 3) (x, y, yaw) in its own frame, Gaussian
    noise ``box_noise`` on each number.
    """
    gen = torch.Generator().manual_seed(seed)
    true = torch.zeros(num_agents, 3, dtype=F64)
    true[1:, :2] = torch.rand(num_agents - 1, 2, generator=gen, dtype=F64) * 30 - 15
    true[1:, 2] = torch.rand(num_agents - 1, generator=gen, dtype=F64) * 6 - 3
    side = math.ceil(math.sqrt(num_objects * 1.5))          # a grid with free cells
    cells = torch.randperm(side * side, generator=gen)[:num_objects]
    offset = spacing * (side - 1) / 2
    objects = torch.stack([(cells % side).to(F64) * spacing - offset,
                           (cells // side).to(F64) * spacing - offset,
                           torch.rand(num_objects, generator=gen, dtype=F64) * 6 - 3], dim=1)
    boxes = [to_local(objects, true[a].expand(num_objects, 3))
             + box_noise * torch.randn(num_objects, 3, generator=gen, dtype=F64)
             for a in range(num_agents)]
    noisy = true.clone()
    offsets = torch.rand(num_agents - 1, 3, generator=gen, dtype=F64) * 2 - 1
    noisy[1:] += offsets * torch.tensor([pose_noise, pose_noise, math.radians(pose_noise)],
                                        dtype=F64)
    return true, noisy, boxes
