"""The synthetic cooperative world: a town, traffic, CAVs with ray-cast LiDARs, OPV2V files.

Entry points: :func:`generate_dataset` (what ``tools/generate_synthetic.py`` runs), the presets,
and the building blocks for hand-made scenes (``Scene``, ``Building``, ``Vehicle``,
``cast_lidar``, ``visible_vehicles``); ``RsuConfig`` adds roadside units (the ``v2x`` presets),
``RoadUserConfig`` pedestrians and cyclists (the ``*_multiclass`` presets), whose class names
in each labelled format ``OBJECT_CLASSES`` gives.
"""
from opencood.data.synthetic.lidar import GROUND_ID, LidarConfig, cast_lidar
from opencood.data.synthetic.presets import PRESETS, Preset, get_preset
from opencood.data.synthetic.world import (OBJECT_CLASSES, Building, RoadUserConfig, RsuConfig,
                                           Scene, TownConfig, Vehicle, World, build_world)
from opencood.data.synthetic.writer import (OutputDirError, format_summary, generate_dataset,
                                            visible_vehicles)

__all__ = ["GROUND_ID", "LidarConfig", "cast_lidar", "PRESETS", "Preset", "get_preset",
           "OBJECT_CLASSES", "Building", "RoadUserConfig", "RsuConfig", "Scene", "TownConfig",
           "Vehicle", "World", "build_world",
           "OutputDirError", "format_summary", "generate_dataset", "visible_vehicles"]
