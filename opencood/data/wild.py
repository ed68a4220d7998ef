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
    """Perturbed copy of a pose ``[x, y, z, roll, yaw, pitch]`` (yaw in degrees)."""
    pose = np.asarray(lidar_pose, dtype=np.float64).copy()
    if not setting.has_pose_noise:
        return pose
    pose[0:2] += rng.normal(0.0, setting.xyz_std, size=2)
    pose[4] += rng.normal(0.0, setting.yaw_std)
    return pose


def delayed_timestamp(timestamps: list, current: str, latency_frames: int) -> str:
    """The timestamp ``latency_frames`` before ``current`` in the sorted list (clamped at 0)."""
    position = timestamps.index(current)
    return timestamps[max(0, position - latency_frames)]
