"""Size presets of the synthetic world: how big the town, how many scenarios, which LiDAR.

``tiny`` is for tests (a whole data set in seconds), ``small`` is the CPU demo that the lite
detector trains on, ``opv2v`` mimics the real data set's sensor and scale for GPU training.
Frames are 0.1 s apart and timestamps step by 2, as in OPV2V (simulated at 20 Hz, every second
tick saved).

Measured (one 2-core machine): ``tiny`` ~2 s of CPU; ``small`` ~45-55 s of CPU (under 30 s wall
with ``--workers 2`` on idle cores), ~21k points per frame, ~420 MB, 26% of the GT in the lite
detector's range [-48, -24, 48, 24] invisible to the ego (seed 0; 25.8% with seed 1). ``opv2v``:
~0.35 s of CPU and ~3.7 MB of ascii PCD per CAV frame (~105k points), so ~40 CPU-minutes and
~26 GB in all: use ``--workers`` = the number of cores.

``v2x_small`` and ``v2x`` are ``small`` and ``opv2v`` plus one roadside unit (RSU) per scenario,
as V2XSet adds infrastructure to OPV2V's format: a LiDAR 4-5 m up on a pole at a corner of the
focus intersection, the vehicles' sensor with a vertical FOV of -40..0 degrees (it looks down).
At most 4 vehicle CAVs, so that the RSU, listed last, always fits in ``max_cav`` = 5. One RSU,
not two: every V2XSet reader derived from OpenCOOD moves only the first negative-id folder behind
the vehicles, so a second RSU would become their ego. ``v2x_small`` (seed 0): ~66 s of CPU,
~564 MB, 10.4% of the GT seen by the RSU alone (no vehicle CAV sees it).

``tiny_multiclass`` and ``small_multiclass`` (``with_road_users``; any preset with
``generate_synthetic.py --multiclass``) add pedestrians and cyclists to the same world: the
formats with classes (DAIR-V2X-C, V2X-Real) label them, the vehicle-only ones (OPV2V, V2XSet,
V2V4Real) leave them unlabelled, as objects in the clouds.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from opencood.config_schema import DEFAULT_COMM_RANGE
from opencood.data.synthetic.camera import CameraConfig
from opencood.data.synthetic.lidar import LidarConfig
from opencood.data.synthetic.world import RoadUserConfig, RsuConfig, TownConfig


@dataclass(frozen=True)
class Preset:
    """Everything ``generate_dataset`` needs besides the seed."""

    name: str
    scenarios: dict                        # split -> number of scenarios
    frames: int                            # frames per scenario
    town: TownConfig
    lidar: LidarConfig
    eval_range: tuple                      # ego-frame range used by the summary's visibility stats
    frame_dt: float = 0.1                  # seconds between saved frames
    timestamp_step: int = 2                # OPV2V numbering: 000068, 000070, ...
    com_range: float = DEFAULT_COMM_RANGE  # for the summary (what the reader will use)
    rsu: RsuConfig | None = None           # roadside units (None: vehicles only)
    cameras: CameraConfig | None = None    # OPV2V's 4 cameras per agent (None: LiDAR only)
    # OPV2V-H's extra LiDARs, their beams (e.g. (32, 16): <ts>_32.pcd, <ts>_16.pcd), the
    # preset's LiDAR otherwise; with them the modality assignment json (None: OPV2V only)
    hetero_lidars: tuple | None = None
    # pedestrians and cyclists (None: vehicles only, the default presets' world)
    road_users: RoadUserConfig | None = None


PRESETS = {
    "tiny": Preset(
        name="tiny",
        scenarios={"train": 1, "validate": 1, "test": 1},
        frames=3,
        town=TownConfig(blocks_x=3, blocks_y=3, moving_vehicles=12, traffic_radius=60.0,
                        cavs=(2, 3), cav_radius=30.0),
        lidar=LidarConfig(beams=16, fov_deg=(-25.0, 2.0), azimuth_steps=360, max_range=60.0),
        eval_range=(-48.0, -24.0, -3.0, 48.0, 24.0, 1.0),
    ),
    "small": Preset(
        name="small",
        scenarios={"train": 14, "validate": 4, "test": 4},
        frames=8,
        town=TownConfig(blocks_x=4, blocks_y=4, moving_vehicles=55, traffic_radius=60.0,
                        cavs=(2, 4), cav_radius=40.0),
        lidar=LidarConfig(beams=32, fov_deg=(-25.0, 2.0), azimuth_steps=720, max_range=70.0),
        eval_range=(-48.0, -24.0, -3.0, 48.0, 24.0, 1.0),
    ),
    "opv2v": Preset(
        name="opv2v",
        scenarios={"train": 43, "validate": 9, "test": 16},
        frames=30,
        town=TownConfig(blocks_x=6, blocks_y=6, lanes_per_direction=2, moving_vehicles=70,
                        traffic_radius=140.0, cavs=(2, 5), cav_radius=60.0),
        lidar=LidarConfig(beams=64, fov_deg=(-25.0, 2.0), azimuth_steps=1800, max_range=120.0),
        eval_range=(-140.0, -40.0, -3.0, 140.0, 40.0, 1.0),
    ),
}


RSU_FOV_DEG = (-40.0, 0.0)                 # a LiDAR 4-5 m up looks down, not up


def with_rsu(base: Preset, name: str) -> Preset:
    """``base`` plus one RSU per scenario whose LiDAR is the vehicles' with ``RSU_FOV_DEG``;
    at most 4 vehicle CAVs, so that the RSU (listed last) fits in max_cav = 5."""
    town = dataclasses.replace(base.town, cavs=(base.town.cavs[0], min(base.town.cavs[1], 4)))
    rsu = RsuConfig(lidar=dataclasses.replace(base.lidar, fov_deg=RSU_FOV_DEG))
    return dataclasses.replace(base, name=name, town=town, rsu=rsu)


PRESETS["v2x_small"] = with_rsu(PRESETS["small"], "v2x_small")
PRESETS["v2x"] = with_rsu(PRESETS["opv2v"], "v2x")

# Road users per moving vehicle of a multi-class world (``with_road_users``).
PEDESTRIANS_PER_VEHICLE = 0.6
CYCLISTS_PER_VEHICLE = 0.25


def with_road_users(base: Preset, name: str | None = None) -> Preset:
    """``base`` plus pedestrians and cyclists (``RoadUserConfig``), as many as
    ``PEDESTRIANS_PER_VEHICLE`` / ``CYCLISTS_PER_VEHICLE`` times its moving vehicles; the
    rest of its world is drawn as ``base`` draws it. ``name`` defaults to ``base``'s plus
    ``_multiclass``."""
    moving = base.town.moving_vehicles
    users = RoadUserConfig(pedestrians=round(PEDESTRIANS_PER_VEHICLE * moving),
                           cyclists=round(CYCLISTS_PER_VEHICLE * moving))
    return dataclasses.replace(base, name=name or f"{base.name}_multiclass", road_users=users)


PRESETS["tiny_multiclass"] = with_road_users(PRESETS["tiny"])
PRESETS["small_multiclass"] = with_road_users(PRESETS["small"])


def get_preset(name: str) -> Preset:
    """The preset called ``name``; a ValueError lists the known ones on a miss."""
    if name not in PRESETS:
        raise ValueError(f"unknown synthetic preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[name]
