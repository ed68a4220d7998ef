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

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class WildSetting:
    seed: int = 25
    loc_err: bool = False
    xyz_std: float = 0.0
    yaw_std: float = 0.0
    latency_frames: int = 0

    @classmethod
    def from_config(cls, section: dict | None) -> "WildSetting":
        """From a ``wild_setting`` section; missing keys take the defaults above, unknown keys
        and negative spreads are refused (opencood.config_schema)."""
        from opencood.config_schema import parse
        return parse(cls, section, "wild_setting")

    def problems(self):
        """What the config schema refuses, as (key, what is wrong)."""
        for key in ("xyz_std", "yaw_std", "latency_frames"):
            if getattr(self, key) < 0:
                yield key, f"must be >= 0, got {getattr(self, key)}"

    @property
    def has_pose_noise(self) -> bool:
        return self.loc_err and (self.xyz_std > 0 or self.yaw_std > 0)


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
