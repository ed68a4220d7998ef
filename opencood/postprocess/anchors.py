"""Anchor boxes on the detection head's BEV feature map (docs/DESIGN.md §2: l=3.9 w=1.6
h=1.56, yaw 0 and 90 deg, z=-1).

Layout: ``(H, W, A, 7)`` with H along y (rows) and W along x (columns), A anchors per cell, boxes
``[x, y, z, <sizes in the box order>, yaw]``. ``anchors.reshape(-1, 7)`` lines up with the head
outputs flattened by :func:`opencood.postprocess.layout.flatten_anchor_maps`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from opencood.config_schema import ANCHOR_HWL, ANCHOR_YAWS_DEG, ANCHOR_Z, FEATURE_STRIDE
from opencood.ops.transforms import size_columns
from opencood.ops.voxelize import grid_size


def generate_anchors(lidar_range: Sequence[float], voxel_size: Sequence[float],
                     feature_stride: int = FEATURE_STRIDE,
                     anchor_hwl: Sequence[float] = ANCHOR_HWL,
                     anchor_z: float = ANCHOR_Z,
                     yaws: Sequence[float] = tuple(math.radians(y) for y in ANCHOR_YAWS_DEG),
                     order: str = "hwl",
                     device: Optional[torch.device] = None,
                     dtype: torch.dtype = torch.float32,
                     placement: str = "cell_centre") -> torch.Tensor:
    """Anchors (H, W, A, 7), ``H = ny // feature_stride``, ``W = nx // feature_stride``,
    ``A = len(yaws)``.

    Anchor ``[i_y, i_x, a]`` sits at the centre of feature cell (i_y, i_x):
    ``x = xmin + (i_x + 0.5) * vx * stride``, ``y = ymin + (i_y + 0.5) * vy * stride``,
    ``z = anchor_z``, sizes ``anchor_hwl`` placed in the columns of ``order``, yaw ``yaws[a]``
    (radians).

    ``placement="reference"``: OpenCOOD's ``VoxelPostprocessor.generate_anchor_box`` instead,
    ``x = linspace(xmin + vx, xmax - vx, int((xmax - xmin) / vx) // stride)`` (y alike): the
    same centres at stride 2, but spread over the range rather than at the cell centres at
    stride 4 (up to 0.4 m off), which is where weights trained there put their boxes.
    """
    if placement == "reference":
        x, y = reference_positions(lidar_range, voxel_size, feature_stride)
    elif placement == "cell_centre":
        x, y = cell_centre_positions(lidar_range, voxel_size, feature_stride)
    else:
        raise ValueError(f"anchor placement must be 'cell_centre' or 'reference', got "
                         f"{placement!r}")
    height, width = y.numel(), x.numel()
    yaw = torch.tensor([float(v) for v in yaws], dtype=torch.float64)
    num_yaws = yaw.numel()

    sizes = [0.0] * 3
    for column, size in zip(size_columns(order), anchor_hwl):
        sizes[column - 3] = size
    constants = [torch.tensor(float(v), dtype=torch.float64).view(1, 1, 1)
                 for v in (anchor_z, *sizes)]
    columns = [x.view(1, width, 1), y.view(height, 1, 1), *constants, yaw.view(1, 1, num_yaws)]
    shape = (height, width, num_yaws)
    anchors = torch.stack([column.expand(shape) for column in columns], dim=-1)
    return anchors.to(device=device, dtype=dtype)


def cell_centre_positions(lidar_range: Sequence[float], voxel_size: Sequence[float],
                          feature_stride: int):
    """(x (W,), y (H,)) float64: the centres of the feature cells."""
    nx, ny, _ = grid_size(lidar_range, voxel_size)
    height, width = ny // feature_stride, nx // feature_stride
    # Centres in float64 then one cast, so x = -140.4 is the nearest float to -140.4.
    step_x = float(voxel_size[0]) * feature_stride
    step_y = float(voxel_size[1]) * feature_stride
    x = float(lidar_range[0]) + (torch.arange(width, dtype=torch.float64) + 0.5) * step_x
    y = float(lidar_range[1]) + (torch.arange(height, dtype=torch.float64) + 0.5) * step_y
    return x, y


def reference_positions(lidar_range: Sequence[float], voxel_size: Sequence[float],
                        feature_stride: int):
    """(x (W,), y (H,)) float64 as OpenCOOD places them (numpy's linspace, its grid size by
    truncation: ``load_point_pillar_params``)."""
    def axis(low: float, high: float, voxel: float) -> torch.Tensor:
        count = int((high - low) / voxel) // feature_stride
        return torch.from_numpy(np.linspace(low + voxel, high - voxel, count))

    return (axis(float(lidar_range[0]), float(lidar_range[3]), float(voxel_size[0])),
            axis(float(lidar_range[1]), float(lidar_range[4]), float(voxel_size[1])))
