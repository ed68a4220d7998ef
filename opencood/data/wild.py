"""Pose noise and latency for non-ego agents ("wild setting"), reproducible from a seed.

Config::

    wild_setting:
      seed: 25            # noise/latency draws are a pure function of (seed, sample index[, epoch])
      loc_err: false      # enable pose noise
      xyz_std: 0.2        # metres, gaussian, added to the x and y of a non-ego lidar pose
      yaw_std: 0.2        # degrees, gaussian, added to the yaw of a non-ego lidar pose
      latency_frames: 0   # non-ego agents report the frame this many timestamps earlier

The ego is never perturbed and the GT (built from the true ego pose) never changes: only what the
other agents report (their pose, and with latency their points and pose) is affected.
"""
from __future__ import annotations

import numpy as np

# The section's schema (keys, defaults, checks) is the config's (opencood.config_schema).
from opencood.config_schema import WildSetting


def noisy_pose(lidar_pose: np.ndarray, setting: WildSetting, rng: np.random.Generator) -> np.ndarray:
    """Perturbed copy of a pose: ``[x, y, z, roll, yaw, pitch]`` (yaw in degrees) or a (4, 4)
    frame->world matrix (V2V4Real, DAIR-V2X), which gets the same perturbation: x and y shifted,
    the frame turned about the world z axis (adding to the yaw of a CARLA pose is exactly that)."""
    pose = np.asarray(lidar_pose, dtype=np.float64).copy()
    if not setting.has_pose_noise:
        return pose
    xy_noise = rng.normal(0.0, setting.xyz_std, size=2)
    yaw_noise = rng.normal(0.0, setting.yaw_std)
    if pose.shape == (4, 4):
        return _perturbed_matrix(pose, xy_noise, yaw_noise)
    pose[0:2] += xy_noise
    pose[4] += yaw_noise
    return pose


def _perturbed_matrix(matrix: np.ndarray, xy_noise: np.ndarray, yaw_noise_deg: float):
    """(4, 4) frame->world with its rotation turned by ``yaw_noise_deg`` about world z (the
    frame's origin stays put) and its origin moved by ``xy_noise`` (2,) metres."""
    cos, sin = np.cos(np.radians(yaw_noise_deg)), np.sin(np.radians(yaw_noise_deg))
    turn = np.array([[cos, -sin, 0.0], [sin, cos, 0.0], [0.0, 0.0, 1.0]])
    matrix[:3, :3] = turn @ matrix[:3, :3]
    matrix[0:2, 3] += xy_noise
    return matrix


def delayed_timestamp(timestamps: list, current: str, latency_frames: int) -> str:
    """The timestamp ``latency_frames`` before ``current`` in the sorted list (clamped at 0)."""
    position = timestamps.index(current)
    return timestamps[max(0, position - latency_frames)]
