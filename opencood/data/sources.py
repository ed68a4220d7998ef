"""The data sets a config can name (``fusion.dataset``, HEAL's key) and the reader of each.

Every reader is a split index with the interface of :class:`opencood.data.opv2v.OPV2VSplit`
(``len``, ``info``, ``scenarios``, ``timestamps``, ``load_cav_frame``, ``load_sample``,
``cav_boxes``), so every fusion strategy, augmentation, pose noise, latency and the visibility
split work on each of them unchanged. The datasets' per-sample path (issue 28) reads a frame by
its key (scenario, cav_id, timestamp) without building its dict: ``lidar_pose``, ``vehicles``,
``load_points`` (own-body returns removed, cached), ``sample_gt`` and ``frame_boxes`` (GT in the
ego's / the agent's own frame); every reader has them.

* ``opv2v``, ``v2xset``: ``<split>/<scenario>/<cav_id>/<ts>.pcd|.yaml``, world-frame boxes,
  6-number poses (V2XSet: roadside units in negative-id folders).
* ``v2v4real``: the same tree, numpy-tagged yaml, 4x4 poses, boxes in each CAV's own frame
  (opencood.data.v2v4real).
* ``dairv2x``: DAIR-V2X-C's ``cooperative-vehicle-infrastructure`` folder; a split is a json list
  of vehicle frame ids in it (opencood.data.dairv2x).
"""
from __future__ import annotations

DATASET_NAMES = ("opv2v", "v2xset", "v2v4real", "dairv2x")


def split_class(dataset: str) -> type:
    """The split index class reading ``dataset``; a ValueError lists the known names."""
    if dataset in ("opv2v", "v2xset"):
        from opencood.data.opv2v import OPV2VSplit
        return OPV2VSplit
    if dataset == "v2v4real":
        from opencood.data.v2v4real import V2V4RealSplit
        return V2V4RealSplit
    if dataset == "dairv2x":
        from opencood.data.dairv2x import DairV2XSplit
        return DairV2XSplit
    raise ValueError(f"unknown data set {dataset!r}; expected one of {', '.join(DATASET_NAMES)}")


def open_split(dataset: str, split_dir, **kwargs):
    """Index of one split of ``dataset`` (keyword arguments as OPV2VSplit's: com_range,
    max_cav, cache_dir, use_point_cache, index_cache)."""
    return split_class(dataset)(split_dir, **kwargs)
