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
    def from_config(cls, cfg: dict | None) -> "WildSetting":
        cfg = dict(cfg or {})
        known = {"seed", "loc_err", "xyz_std", "yaw_std", "latency_frames"}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"wild_setting: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        setting = cls(**cfg)
        if setting.xyz_std < 0 or setting.yaw_std < 0 or setting.latency_frames < 0:
            raise ValueError("wild_setting: xyz_std, yaw_std and latency_frames must be >= 0")
        return setting

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
