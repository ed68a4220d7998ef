"""The encoder slot: what turns each agent's sensor data into its BEV map.

A detector owns one encoder (``model.args.encoder: {core_method, args}``, registered in
``ENCODERS``) and calls ``encoder(batch) -> (N_agents, C, H, W)``, reading ``out_channels`` for
the backbone's input width. Everything after the map (backbone, fusion, warp, heads,
postprocessor, loss, AP) does not know the sensor.

An encoder is built from its parsed args and the model's geometry::

    ENCODERS.build(name, args, "model.args.encoder.args", geometry=EncoderGeometry(...))

* ``pillar`` (:class:`PillarEncoder`): PointPillars' pillar VFE + scatter on the pillar grid of
  ``preprocess`` (``lidar_range``, ``voxel_size``), which must coincide with the BEV grid. A
  config in OpenCOOD's form (``model.args.pillar_vfe`` and ``point_pillar_scatter``, no
  ``encoder``) builds this encoder from those two keys.

State dicts: the encoder's parameters sit under ``encoder.`` (``encoder.vfe.layers.0...``);
checkpoints written before the slot existed (``vfe.``, ``scatter.``) load through
:data:`LEGACY_PREFIXES` (one prefix rule, applied by the detectors' load hook).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import torch
from torch import nn

from opencood.config_schema import section, spec
from opencood.models.pillar_vfe import PillarVFE, PillarVFEArgs
from opencood.models.scatter import PointPillarScatter, ScatterArgs
from opencood.models.warp import BevGrid
from opencood.registry import ENCODERS

# Checkpoint keys of the detectors before the encoder slot -> where they live now.
LEGACY_PREFIXES = (("vfe.", "encoder.vfe."), ("scatter.", "encoder.scatter."))


@section
class ModelEncoder:
    """``model.args.encoder``: an ENCODERS entry and its arguments."""

    core_method: str = spec(registered="encoder")
    args: Any = spec(args_of=("core_method", "encoder"))


class EncoderGeometry(NamedTuple):
    """What an encoder needs of the config's data sections (derived into ``model.args``).

    bev: the BEV map the encoder must write (range and cell size: ``bev_grid``).
    lidar_range, voxel_size: the pillar grid of ``preprocess`` (LiDAR encoders).
    """

    bev: BevGrid
    lidar_range: Optional[Tuple[float, ...]] = None
    voxel_size: Optional[Tuple[float, float, float]] = None


def encoder_outputs(encoder: nn.Module) -> dict:
    """What the encoder's last forward leaves for the loss besides its map: the lift-splat
    encoder's ``depth_logits`` (M, D, h, w), ``depth_target`` (M, h, w) int64 and ``depth_valid``
    (M, h, w) bool with depth supervision (its ``depth_outputs``; M = agents x cameras); {}
    otherwise, so a model without them returns what it always did."""
    return dict(getattr(encoder, "depth_outputs", None) or {})


def has_static_pillars(batch: dict) -> bool:
    """The batch comes from ``pillarize_static`` (``voxel_valid`` (A, K)): the model then runs
    without data-dependent sizes or host syncs where it can (``performance.static_pillars``)."""
    return batch.get("voxel_valid") is not None


@section
class PillarEncoderArgs:
    """``model.args.encoder.args`` of ``pillar``."""

    pillar_vfe: PillarVFEArgs
    point_pillar_scatter: ScatterArgs


@ENCODERS.register("pillar", args=PillarEncoderArgs)
class PillarEncoder(nn.Module):
    """Pillars of every agent -> (N_agents, C, ny, nx) BEV canvases (PointPillars).

    Batch keys read (model inputs, ``opencood.batch_keys``): voxel_features (P, M, 4),
    voxel_num_points (P,), voxel_coords (P, 4) [agent, z, y, x], record_len (B,), and
    voxel_valid (A, K) on the static-pillar path.
    """

    def __init__(self, args: PillarEncoderArgs, geometry: EncoderGeometry):
        super().__init__()
        from opencood.ops.voxelize import grid_size

        nx, ny, _ = grid_size(geometry.lidar_range, geometry.voxel_size)
        if (nx, ny) != (geometry.bev.nx, geometry.bev.ny):
            raise ValueError(f"the pillar grid ({nx} x {ny} cells of preprocess) must be the BEV "
                             f"grid ({geometry.bev.nx} x {geometry.bev.ny} of bev_grid)")
        self.vfe = PillarVFE(args.pillar_vfe, geometry.voxel_size, geometry.lidar_range)
        self.scatter = PointPillarScatter(args.point_pillar_scatter.num_features, nx=nx, ny=ny)
        if self.scatter.num_features != self.vfe.out_channels:
            raise ValueError(f"point_pillar_scatter.num_features ({self.scatter.num_features}) "
                             f"must equal the last pillar_vfe filter ({self.vfe.out_channels})")
        self.out_channels = self.scatter.num_features

    def forward(self, batch: dict) -> torch.Tensor:
        static = has_static_pillars(batch)
        pillar_features = self.vfe(batch["voxel_features"], batch["voxel_num_points"],
                                   batch["voxel_coords"], static_shapes=static)
        return self.scatter(pillar_features, batch["voxel_coords"], batch["record_len"],
                            batch["voxel_valid"] if static else None)


def rename_legacy_keys(state_dict: dict, prefix: str) -> None:
    """In place: a pre-slot checkpoint's ``<prefix>vfe.*`` / ``scatter.*`` keys under
    ``<prefix>encoder.`` (a ``load_state_dict`` pre-hook of the detectors)."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        local = key[len(prefix):]
        for old, new in LEGACY_PREFIXES:
            if local.startswith(old) and prefix + new + local[len(old):] not in state_dict:
                state_dict[prefix + new + local[len(old):]] = state_dict.pop(key)
                break
