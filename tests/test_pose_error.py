"""Relative pose error (opencood/eval/pose_error.py) by hand, and the pose helpers between the
detector's CARLA poses and the pose graph (planar poses, pairwise transforms)."""
import math

import numpy as np
import torch

from opencood.eval.pose_error import relative_pose_errors, summarise_pose_errors
from opencood.ops.pose_graph import planar_pairwise, planar_poses, with_planar
from opencood.ops.transforms import relative_transform

F64 = torch.float64


def test_relative_pose_error_by_hand():
    # Sample 1: the ego at (10, 0) heading +y; its agent truly 5 m ahead (world (10, 5)), believed
    # at world (10, 6) and turned 1 deg more: 1 m and 1 deg off relative to the ego.
    # Sample 2: ego and agent shifted alike by 3 m: a common error is no relative error.
    true = torch.tensor([[10, 0, math.pi / 2], [10, 5, math.pi / 2],
                         [0, 0, 0], [4, 0, 0.2]], dtype=F64)
    estimated = torch.tensor([[10, 0, math.pi / 2], [10, 6, math.pi / 2 + math.radians(1)],
                              [3, 0, 0], [7, 0, 0.2]], dtype=F64)
    translation, yaw = relative_pose_errors(estimated, true, [2, 2])
    torch.testing.assert_close(translation, torch.tensor([1.0, 0.0], dtype=F64))
    torch.testing.assert_close(yaw, torch.tensor([1.0, 0.0], dtype=F64))


def test_an_ego_yaw_error_moves_far_agents_more():
    # The ego believed turned by 1 deg: an agent 50 m away is off by 50 * 2 sin(0.5 deg) m.
    true = torch.tensor([[0, 0, 0], [50, 0, 0]], dtype=F64)
    estimated = torch.tensor([[0, 0, math.radians(1)], [50, 0, 0]], dtype=F64)
    translation, yaw = relative_pose_errors(estimated, true, [2])
    assert abs(translation.item() - 100 * math.sin(math.radians(0.5))) < 1e-12
    assert abs(yaw.item() - 1.0) < 1e-12


def test_summary_has_median_and_mean():
    summary = summarise_pose_errors(torch.tensor([0.1, 0.2, 0.9]), torch.tensor([1.0, 2.0, 6.0]))
    assert summary["median_translation_m"] == torch.tensor(0.2).item()
    assert abs(summary["mean_translation_m"] - 0.4) < 1e-6 and summary["mean_yaw_deg"] == 3.0
    assert summary["median_yaw_deg"] == 2.0 and summary["pairs"] == 3
    assert math.isnan(summarise_pose_errors(torch.zeros(0), torch.zeros(0))["median_yaw_deg"])


def test_pairwise_from_planar_poses_matches_the_carla_transforms():
    lidar = torch.tensor([[1.0, 2.0, 0.0, 0.0, 30.0, 0.0], [-4.0, 7.0, 0.0, 0.0, -100.0, 0.0],
                          [5.0, 5.0, 0.0, 0.0, 170.0, 0.0]], dtype=F64)
    planar = planar_poses(lidar)
    pairwise = planar_pairwise(planar, [2, 1], max_agents=2)
    # [b, i, j] takes agent j's frame into agent i's: relative_transform(pose_j, pose_i)
    expected = relative_transform(lidar[1].numpy(), lidar[0].numpy())
    np.testing.assert_allclose(pairwise[0, 0, 1].numpy(), expected, atol=1e-12)
    np.testing.assert_allclose(pairwise[0, 1, 1].numpy(), np.eye(4), atol=1e-12)
    np.testing.assert_allclose(pairwise[1, 0, 1].numpy(), np.eye(4))       # padding
    torch.testing.assert_close(with_planar(lidar, planar), lidar)


def test_correction_cuts_the_median_relative_pose_error():
    # The target at the library level: 0.6 m / 0.6 deg pose noise, boxes 10 cm / 0.6 deg
    # off, 8 samples of 4 agents: the pose graph cuts the median error by more than half.
    from opencood.ops.pose_graph import align_poses
    from opencood.testing.pose_graph_scene import make_pose_graph_scene
    scenes = [make_pose_graph_scene(4, 20, pose_noise=0.6, box_noise=0.1, seed=s, spacing=8.0)
              for s in range(8)]
    true = torch.cat([t for t, _, _ in scenes])
    noisy = torch.cat([n for _, n, _ in scenes])
    boxes = [b for _, _, scene_boxes in scenes for b in scene_boxes]
    corrected = align_poses(boxes, None, noisy, [4] * 8).poses
    before = summarise_pose_errors(*relative_pose_errors(noisy, true, [4] * 8))
    after = summarise_pose_errors(*relative_pose_errors(corrected, true, [4] * 8))
    assert after["median_translation_m"] < 0.5 * before["median_translation_m"]
    assert after["median_yaw_deg"] < 0.5 * before["median_yaw_deg"]
