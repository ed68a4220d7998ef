"""Relative pose error, CoAlign's measure of how wrong the agents' poses are (and how much the
pose graph corrects them): for every non-ego agent, its pose in the ego's frame as estimated
against the truth, as a translation error (m) and a yaw error (deg). An error common to the ego
and an agent (a shift of the whole sample) is no error: fusion only sees relative poses.

Poses are planar ``(x, y, yaw)`` in metres and radians (``opencood.ops.pose_graph``).
"""
from __future__ import annotations

import math
from typing import Dict, Sequence, Tuple

import torch

from opencood.ops.pose_graph import to_local


def relative_poses(poses: torch.Tensor, record_len: Sequence[int]) -> torch.Tensor:
    """(N, 3) world poses, the samples' agents consecutive and the ego first -> (N - B, 3) every
    non-ego agent's pose in its ego's frame, in agent order."""
    rows = []
    start = 0
    for count in (int(n) for n in record_len):
        ego = poses[start].expand(count - 1, 3)
        rows.append(to_local(poses[start + 1:start + count], ego))
        start += count
    return torch.cat(rows) if rows else poses.new_zeros(0, 3)


def relative_pose_errors(poses: torch.Tensor, true_poses: torch.Tensor,
                         record_len: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N, 3) estimated and (N, 3) true world poses -> per non-ego agent the translation error
    (K,) in metres and the absolute yaw error (K,) in degrees of its pose relative to the ego."""
    estimated = relative_poses(poses, record_len)
    true = relative_poses(true_poses.to(poses), record_len)
    translation = (estimated[:, :2] - true[:, :2]).norm(dim=1)
    yaw = torch.remainder(estimated[:, 2] - true[:, 2] + math.pi, 2 * math.pi) - math.pi
    return translation, torch.rad2deg(yaw.abs())


def summarise_pose_errors(translation_m: torch.Tensor, yaw_deg: torch.Tensor) -> Dict[str, float]:
    """Errors pooled over a split -> median and mean of each (CoAlign reports the median), and
    the number of agent pairs; NaN for none."""
    def stat(values, how):
        return float(how(values)) if len(values) else float("nan")

    return {"median_translation_m": stat(translation_m, torch.median),
            "mean_translation_m": stat(translation_m, torch.mean),
            "median_yaw_deg": stat(yaw_deg, torch.median),
            "mean_yaw_deg": stat(yaw_deg, torch.mean),
            "pairs": len(translation_m)}
