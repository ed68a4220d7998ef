"""Data set formats, declared once: the ``DATA_FORMATS`` registry (``fusion.dataset``, HEAL's key)
and the ``SplitReader`` protocol every format's reader implements (docs/DESIGN.md §2.3).

A format is one :class:`DataFormat`: its reader (a split index), its checker (``tools/
check_data.py``), where its three splits lie under a data set root, the GT range its published
results were scored in, and the synthetic writer that writes it (``tools/generate_synthetic.py
--format``). The config schema, the datasets, the checker, the generator and the benchmark ask
this registry; adding a format is one reader file, one ``register_format`` call here, and yamls.

* ``opv2v``, ``v2xset``: ``<split>/<scenario>/<cav_id>/<ts>.pcd|.yaml``, world-frame boxes,
  6-number poses (V2XSet: roadside units in negative-id folders).
* ``v2v4real``: the same tree, numpy-tagged yaml, 4x4 poses, boxes in each CAV's own frame
  (opencood.data.v2v4real).
* ``v2xreal``: the same tree with ``.bin`` clouds, vehicles and roadside units, classed objects
  (opencood.data.v2xreal).
* ``dairv2x``: DAIR-V2X-C's ``cooperative-vehicle-infrastructure`` folder; a split is a json list
  of vehicle frame ids in it (opencood.data.dairv2x).

Readers are imported when a format is first used (importing this module stays cheap).
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import (Any, Dict, List, NamedTuple, Optional, Protocol, Sequence, Tuple,
                    runtime_checkable)

import numpy as np

from opencood.registry import DATA_FORMATS


@runtime_checkable
class SplitReader(Protocol):
    """Exactly what the fusion datasets (``opencood.data.datasets``) call on a split index.

    A frame is addressed by its key (scenario, cav_id, timestamp); ``cav_id`` is the agent's
    folder name (str). Poses are (6,) [x, y, z, roll, yaw, pitch] (OPV2V) or (4, 4) world
    matrices; ``opencood.ops.transforms.relative_transform`` takes both.
    """

    def __len__(self) -> int:
        """Samples in the split."""

    def info(self, index: int) -> Any:
        """Sample ``index``: an object with ``scenario``, ``timestamp``, ``ego_id`` and
        ``cav_ids`` (the agents used, ego first; ``opencood.data.opv2v.SampleInfo``)."""

    def timestamps(self, scenario: str) -> List[str]:
        """The scenario's timestamps in time order (latency counts frames along it)."""

    def lidar_pose(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """The frame's LiDAR pose in the world."""

    def vehicles(self, scenario: str, cav_id: str, timestamp: str) -> Any:
        """The frame's labels as the reader keeps them (read only; passed back to it)."""

    def load_points(self, scenario: str, cav_id: str, timestamp: str) -> np.ndarray:
        """(N, 4) float32 [x, y, z, intensity] in the frame's LiDAR frame, own-body returns
        removed."""

    def sample_gt(self, index: int, gt_range: Sequence[float],
                  order: str = "hwl") -> Tuple[np.ndarray, np.ndarray]:
        """(ids (M,) int64, boxes (M, 7)) of sample ``index`` in the ego's LiDAR frame."""

    def load_cameras(self, scenario: str, cav_id: str, timestamp: str) -> Any:
        """The frame's cameras (``opencood.data.cameras.CameraFrame``: images, intrinsics,
        camera -> LiDAR extrinsics), for configs whose ``input_source`` has "camera"."""

    def camera_visibility(self, scenario: str, cav_id: str, timestamp: str) -> Any:
        """The frame's HEAL ``bev_visibility`` map ((256, 256) uint8, what the agent's cameras
        see: opencood.data.camera_visibility), or None where the copy has none."""

    def object_classes(self, scenario: str, timestamp: str, ids: Sequence[int]) -> Any:
        """(M,) int64 class id of each object id of a (scenario, timestamp): its position in
        the config's ``postprocess.classes`` (the reader's ``classes`` option); None for a
        format whose labels carry no classes (the datasets then emit no ``gt_classes``)."""

    def frame_boxes(self, scenario: str, cav_id: str, timestamp: str,
                    gt_range: Sequence[float],
                    order: str = "hwl") -> Tuple[np.ndarray, np.ndarray]:
        """(ids, boxes) one agent's own labels in its own LiDAR frame (late fusion training)."""


# What a reader class must also offer (a static method, used before any split is opened).
READER_CLASS_METHODS = ("reader_options",)


class DataFormat(NamedTuple):
    """One data set format.

    name: the ``fusion.dataset`` value.
    reader: "module:Class" of its split index (a :class:`SplitReader`), opened as
        ``Class(split_path, **options)`` with options ``com_range``, ``max_cav``, ``cache_dir``
        (+ ``use_point_cache``, ``index_cache``, and ``Class.reader_options(cfg)``).
    checker: "module:function" ``(base, progress) -> CheckReport`` (``tools/check_data.py``;
        ``base``: the folder holding the splits).
    splits: the train, validate and test paths relative to a data set root.
    subfolder: where the splits lie under the root a user passes ("" for the root itself).
    gt_range: the GT range its published results were scored in.
    writer: "module" of the synthetic writer (``generate_scenario``), or None.
    """

    name: str
    reader: str
    checker: str
    splits: Tuple[str, str, str]
    subfolder: str
    gt_range: Tuple[float, ...]
    writer: Optional[str]

    def reader_class(self) -> type:
        return _resolve(self.reader)

    def open_split(self, split_path, **options) -> SplitReader:
        return self.reader_class()(split_path, **options)

    def check(self, root, progress: bool = True):
        return _resolve(self.checker)(root, progress)

    def base(self, root) -> Path:
        """The folder holding the splits (and what ``check`` takes) of a data set at ``root``."""
        return Path(root) / self.subfolder if self.subfolder else Path(root)

    def split_paths(self, root) -> List[Path]:
        """The train, validate and test paths of a data set under ``root``."""
        return [self.base(root) / split for split in self.splits]


def _resolve(dotted: str):
    module, _, name = dotted.partition(":")
    return getattr(importlib.import_module(module), name)


def register_format(data_format: DataFormat) -> None:
    DATA_FORMATS.add(data_format.name, data_format)


OPV2V_SPLITS = ("train", "validate", "test")
register_format(DataFormat(
    "opv2v", "opencood.data.opv2v:OPV2VSplit", "opencood.data.check:check_opv2v_tree",
    OPV2V_SPLITS, "", (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0), "opencood.data.synthetic.writer"))
# V2XSet is OPV2V's layout with roadside units; the synthetic v2x presets write it as opv2v.
register_format(DataFormat(
    "v2xset", "opencood.data.opv2v:OPV2VSplit", "opencood.data.check:check_opv2v_tree",
    OPV2V_SPLITS, "", (-140.0, -40.0, -3.0, 140.0, 40.0, 1.0), None))
register_format(DataFormat(
    "v2v4real", "opencood.data.v2v4real:V2V4RealSplit",
    "opencood.data.check:check_v2v4real_tree", OPV2V_SPLITS, "",
    (-100.0, -40.0, -5.0, 100.0, 40.0, 3.0), "opencood.data.synthetic.writer_v2v4real"))
register_format(DataFormat(
    "dairv2x", "opencood.data.dairv2x:DairV2XSplit", "opencood.data.check:check_dairv2x_root",
    ("train.json", "val.json", "test.json"), "cooperative-vehicle-infrastructure",
    (-102.4, -51.2, -4.5, 102.4, 51.2, 2.5), "opencood.data.synthetic.writer_dairv2x"))
register_format(DataFormat(
    "v2xreal", "opencood.data.v2xreal:V2XRealSplit", "opencood.data.check:check_v2xreal_tree",
    OPV2V_SPLITS, "", (-100.0, -40.0, -15.0, 100.0, 40.0, 15.0),
    "opencood.data.synthetic.writer_v2xreal"))


def get_format(name: str) -> DataFormat:
    """The format ``name`` (an unknown name: a RegistryError listing the registered ones)."""
    return DATA_FORMATS.get(name)


def format_names() -> List[str]:
    """Every registered format, in registration order."""
    DATA_FORMATS.discover()
    return list(DATA_FORMATS.schemas())


def writer_formats() -> List[str]:
    """The formats the synthetic world writes."""
    return [name for name in format_names() if get_format(name).writer is not None]


def split_class(dataset: str) -> type:
    """The split index class reading ``dataset``."""
    return get_format(dataset).reader_class()


def open_split(dataset: str, split_path, **options) -> SplitReader:
    """Index of one split of ``dataset`` (options as :class:`DataFormat`'s ``reader``)."""
    return get_format(dataset).open_split(split_path, **options)


def reader_problems(reader_class: type, reader: Any) -> Dict[str, str]:
    """What a reader lacks of the contract: {method: problem} (empty when it conforms)."""
    problems = {}
    for name in [m for m in dir(SplitReader) if not m.startswith("_")] + ["__len__"]:
        if not callable(getattr(reader, name, None)):
            problems[name] = "missing"
    for name in READER_CLASS_METHODS:
        if not callable(getattr(reader_class, name, None)):
            problems[name] = "missing (a static method of the reader class)"
    return problems
