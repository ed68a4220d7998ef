"""Relative pose error, CoAlign's measure of how wrong the agents' poses are (and how much the
pose graph corrects them): for every non-ego agent, its pose in the ego's frame as estimated
against the truth, as a translation error (m) and a yaw error (deg). An error common to the ego
and an agent (a shift of the whole sample) is no error: fusion only sees relative poses.

Poses are planar ``(x, y, yaw)`` in metres and radians (``opencood.ops.pose_graph``).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from opencood.ops.pose_graph import (BoxAlignArgs, planar_of_transforms, to_local, to_world,
                                     wrap_angle)

# Stage-1 boxes of the ego and another agent within this distance (m) of each other under the true
# poses are the same object: the pose graph's default cluster radius.
MATCH_RADIUS_M = BoxAlignArgs().cluster_radius


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
    return planar_errors(relative_poses(poses, record_len),
                         relative_poses(true_poses.to(poses), record_len))


def planar_errors(estimated: torch.Tensor, true: torch.Tensor
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(K, 3) estimated and true planar poses in one frame -> translation error (K,) in metres
    and absolute yaw error (K,) in degrees (wrapped to at most 180)."""
    translation = (estimated[:, :2] - true[:, :2]).norm(dim=1)
    return translation, torch.rad2deg(wrap_angle(estimated[:, 2] - true[:, 2]).abs())


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


def transform_pose_errors(estimated: torch.Tensor, true: torch.Tensor,
                          record_len: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(N, 4, 4) estimated and true agent -> ego transforms, agents per sample (the ego first)
    -> per non-ego agent the translation error (K,) in metres and the absolute yaw error (K,)
    in degrees of its pose relative to the ego (the ego's own rows, identities, are skipped)."""
    non_ego = torch.ones(len(estimated), dtype=torch.bool)
    non_ego[torch.cumsum(torch.tensor([0] + [int(n) for n in record_len][:-1]), 0)] = False
    return planar_errors(planar_of_transforms(estimated.cpu())[non_ego],
                         planar_of_transforms(true.cpu())[non_ego])


def stage1_box_offsets(boxes: Sequence[torch.Tensor], true_transforms: torch.Tensor,
                       record_len: Sequence[int], radius: float = MATCH_RADIUS_M
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """How well two agents' stage-1 boxes agree once the poses are right: the floor of what the
    pose graph can correct. Per agent (K_a, 7) own-frame boxes ``[x, y, z, *sizes, yaw]``, the
    (N, 4, 4) true agent -> ego transforms, agents per sample -> for every non-ego box whose
    nearest ego box (both in the ego frame through the true transforms) is within ``radius``:
    the distance between the two centres (M,) in metres and their heading difference (M,) in
    degrees, half turns folded (at most 90: the pose graph turns opposite headings)."""
    frames = planar_of_transforms(true_transforms.cpu())
    distances, headings = [], []
    start = 0
    for count in (int(n) for n in record_len):
        ego = boxes[start][:, [0, 1, 6]].detach().cpu().double()
        for agent in range(start + 1, start + count):
            local = boxes[agent][:, [0, 1, 6]].detach().cpu().double()
            if not len(local) or not len(ego):
                continue
            seen = to_world(local, frames[agent].expand(len(local), 3))
            nearest, index = torch.cdist(seen[:, :2], ego[:, :2]).min(dim=1)
            matched = nearest < radius
            turn = wrap_angle(seen[matched, 2] - ego[index[matched], 2]).abs()
            distances.append(nearest[matched])
            headings.append(torch.rad2deg(torch.minimum(turn, torch.pi - turn)))
        start += count
    empty = torch.zeros(0, dtype=torch.float64)
    return (torch.cat(distances) if distances else empty,
            torch.cat(headings) if headings else empty)


def summarise_box_offsets(distance_m: torch.Tensor, heading_deg: torch.Tensor) -> Dict[str, float]:
    """Pooled :func:`stage1_box_offsets` -> their medians and the number of matched pairs."""
    return {"median_offset_m": float(torch.median(distance_m)),
            "median_heading_deg": float(torch.median(heading_deg)),
            "pairs": len(distance_m)}


class PoseErrorTally:
    """Relative pose errors of a split, before and (when a correction ran) after correction.

    ``add(record_len, true, reported, corrected=None)`` per batch; ``summary()`` ->
    ``{"before": summarise_pose_errors(...), "after": ...}``; ``state_dict`` /
    ``merge`` carry a rank's tally to rank 0. ``add_stage1_boxes`` adds how well the stage-1
    boxes of two agents agree under the true poses (summary key ``stage1_boxes``).
    """

    def __init__(self):
        self.errors: Dict[str, List[torch.Tensor]] = {"before": [], "after": [],
                                                      "stage1_boxes": []}

    def add(self, record_len: Sequence[int], true: torch.Tensor, reported: torch.Tensor,
            corrected: torch.Tensor | None = None) -> None:
        for stage, transforms in (("before", reported), ("after", corrected)):
            if transforms is not None:
                self.errors[stage].append(torch.stack(
                    transform_pose_errors(transforms, true, record_len), dim=1).float())

    def add_stage1_boxes(self, record_len: Sequence[int], true: torch.Tensor,
                         boxes: Sequence[torch.Tensor]) -> None:
        self.errors["stage1_boxes"].append(torch.stack(
            stage1_box_offsets(boxes, true, record_len), dim=1).float())

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {stage: torch.cat(rows) if rows else torch.zeros(0, 2)
                for stage, rows in self.errors.items()}

    def merge(self, state: Dict[str, torch.Tensor]) -> None:
        for stage, rows in state.items():
            if len(rows):
                self.errors[stage].append(rows)

    def summary(self) -> Dict[str, Dict[str, float]]:
        """{stage: summarise_pose_errors(...)} for the stages with at least one agent pair ({}
        when no sample had a second agent, or the batches carried no true transforms), and
        ``stage1_boxes``: summarise_box_offsets(...) where stage-1 boxes were matched."""
        summarise = {"before": summarise_pose_errors, "after": summarise_pose_errors,
                     "stage1_boxes": summarise_box_offsets}
        return {stage: summarise[stage](rows[:, 0], rows[:, 1])
                for stage, rows in self.state_dict().items() if len(rows)}
