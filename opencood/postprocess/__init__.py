"""The detection contract in one home: stage "head -> targets / loss, boxes -> NMS -> AP".

* ``layout``: the head's channel layout (box code size, direction bins) and its one flatten;
* ``anchors``, ``box_coder``, ``target_assigner``: anchors on the head grid, residual coding,
  anchor labels and regression targets;
* ``voxel_postprocessor``: ``VoxelPostprocessor``, which owns all of the above plus decoding,
  rotated NMS and the late-fusion merge.

Importing this package registers the postprocessors in ``POSTPROCESSORS``; the yaml picks one
with ``postprocess.core_method`` (OpenCOOD's name ``VoxelPostprocessor``).
"""
from __future__ import annotations

from opencood.errors import ConfigError
from opencood.postprocess import voxel_postprocessor  # noqa: F401  (registration)
from opencood.postprocess.voxel_postprocessor import VoxelPostprocessor  # noqa: F401
from opencood.registry import POSTPROCESSORS, RegistryError

def build_postprocessor(cfg: dict, device):
    """yaml ``postprocess.core_method`` -> that postprocessor built from the config (it reads
    ``postprocess``, the pillar grid of ``preprocess`` and ``loss.args.dir_offset``). An unknown
    name is a one-line ConfigError naming the key and the registered names."""
    name = cfg["postprocess"]["core_method"]
    try:
        postprocessor_cls = POSTPROCESSORS.get(name)
    except RegistryError as error:
        raise ConfigError(f"postprocess.core_method: {error}") from None
    return postprocessor_cls.from_config(cfg, device)
