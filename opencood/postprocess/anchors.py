"""Anchor boxes on the detection head's BEV feature map (DESIGN §2: l=3.9 w=1.6 h=1.56, yaw 0
and 90 deg, z=-1).

Layout: ``(H, W, A, 7)`` with H along y (rows) and W along x (columns), A anchors per cell, boxes
``[x, y, z, h, w, l, yaw]``. ``anchors.reshape(-1, 7)`` lines up with the head outputs flattened
by :func:`opencood.ops.target_assigner.flatten_predictions`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from opencood.ops.voxelize import grid_size


def generate_anchors(lidar_range: Sequence[float], voxel_size: Sequence[float],
                     feature_stride: int = 2,
                     anchor_hwl: Sequence[float] = (1.56, 1.6, 3.9),
                     anchor_z: float = -1.0,
                     yaws: Sequence[float] = (0.0, math.pi / 2),
                     device: Optional[torch.device] = None,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Anchors (H, W, A, 7), ``H = ny // feature_stride``, ``W = nx // feature_stride``,
    ``A = len(yaws)``.

    Anchor ``[i_y, i_x, a]`` sits at the centre of feature cell (i_y, i_x):
    ``x = xmin + (i_x + 0.5) * vx * stride``, ``y = ymin + (i_y + 0.5) * vy * stride``,
    ``z = anchor_z``, sizes ``anchor_hwl``, yaw ``yaws[a]`` (radians).
    """
    nx, ny, _ = grid_size(lidar_range, voxel_size)
    height, width = ny // feature_stride, nx // feature_stride
    # Centres in float64 then one cast, so x = -140.4 is the nearest float to -140.4.
    step_x = float(voxel_size[0]) * feature_stride
    step_y = float(voxel_size[1]) * feature_stride
    x = float(lidar_range[0]) + (torch.arange(width, dtype=torch.float64) + 0.5) * step_x
    y = float(lidar_range[1]) + (torch.arange(height, dtype=torch.float64) + 0.5) * step_y
    yaw = torch.tensor([float(v) for v in yaws], dtype=torch.float64)
    num_yaws = yaw.numel()

    constants = [torch.tensor(float(v), dtype=torch.float64).view(1, 1, 1)
                 for v in (anchor_z, *anchor_hwl)]
    columns = [x.view(1, width, 1), y.view(height, 1, 1), *constants, yaw.view(1, 1, num_yaws)]
    shape = (height, width, num_yaws)
    anchors = torch.stack([column.expand(shape) for column in columns], dim=-1)
    return anchors.to(device=device, dtype=dtype)


def anchors_from_config(anchor_args: dict, voxel_size: Sequence[float],
                        device: Optional[torch.device] = None) -> torch.Tensor:
    """Anchors from an OpenCOOD ``postprocess.anchor_args`` section: ``cav_lidar_range``, ``h``,
    ``w``, ``l``, ``r`` (yaws in degrees), ``feature_stride`` and optionally ``z`` (default -1).
    Its ``W``/``H``/``D`` entries are ignored: the grid is derived from the range (DESIGN §5)."""
    return generate_anchors(
        lidar_range=anchor_args["cav_lidar_range"], voxel_size=voxel_size,
        feature_stride=int(anchor_args.get("feature_stride", 2)),
        anchor_hwl=(anchor_args["h"], anchor_args["w"], anchor_args["l"]),
        anchor_z=float(anchor_args.get("z", -1.0)),
        yaws=[math.radians(float(r)) for r in anchor_args.get("r", (0, 90))],
        device=device)
