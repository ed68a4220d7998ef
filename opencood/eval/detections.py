"""``tools/eval.py --save_detections``: every frame's detections in one ``.npz`` file (issue 24),
so results can be compared across codebases and fed to a tracker.

``RUN/detections_<split>_<fusion>[_<setting>][_<protocol>].npz`` (``np.load(path)``, no pickle):

* ``boxes`` (K, 7) float32: every frame's boxes after NMS, in the ego frame of the frame's
  sample: ``[x, y, z, <sizes in box_order>, yaw]`` (metres, radians);
* ``scores`` (K,) float32;
* ``frame_offsets`` (F + 1,) int64: frame i's boxes are ``boxes[frame_offsets[i]:
  frame_offsets[i + 1]]`` (a frame without detections has two equal offsets);
* ``sample_keys`` (F, P) str: each frame's sample key (scenario, timestamp, ... as the data
  set names its samples), frames in key order (the same on 1 or N ranks);
* ``box_order`` () str: "hwl" or "lwh", the config's ``postprocess.order``;
* only for a detector of several classes (``postprocess.classes``): ``classes`` (K,) int64, each
  box's class id, an index into ``class_names`` (C,) str.

The detections are those the AP is computed from (before the protocol's range filter).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np

from opencood.utils import dist as dist_utils
from opencood.utils.atomic import atomic_write

# key, boxes (K, 7), scores (K,), class ids (K,) (None: one class)
Frame = Tuple[Tuple[str, ...], np.ndarray, np.ndarray, Optional[np.ndarray]]


def detections_name(split: str, fusion: str, tag: str, protocol_suffix: str) -> str:
    return f"detections_{split}_{fusion}" + (f"_{tag}" if tag else "") + \
        protocol_suffix + ".npz"


class DetectionCollector:
    """An ``on_sample`` hook keeping this rank's frames (chained to another hook, if any);
    ``classes``: the class ids of a multi-class run's boxes."""

    def __init__(self, then: Optional[Callable] = None):
        self.frames: List[Frame] = []
        self.then = then

    def __call__(self, key, batch, row, boxes, scores, **classes) -> None:
        ids = classes.get("classes")
        self.frames.append((tuple(str(part) for part in key),
                            boxes.float().numpy().astype(np.float32),
                            scores.float().numpy().astype(np.float32),
                            None if ids is None else ids.numpy().astype(np.int64)))
        if self.then is not None:
            self.then(key, batch, row, boxes, scores, **classes)

    def gather(self) -> Optional[List[Frame]]:
        """Every rank's frames on rank 0, in key order; None elsewhere. All ranks call it."""
        gathered = dist_utils.gather_object_to_main(self.frames)
        if gathered is None:
            return None
        return sorted((frame for frames in gathered for frame in frames), key=lambda f: f[0])


def write_detections(path: Path, frames: List[Frame], box_order: str,
                     class_names: Optional[List[str]] = None) -> Path:
    """The file of the module docstring, written atomically; ``class_names`` (several
    classes) adds ``classes`` and ``class_names``."""
    counts = [len(frame[2]) for frame in frames]
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    boxes = np.concatenate([frame[1].reshape(-1, 7) for frame in frames]) if frames else \
        np.zeros((0, 7), np.float32)
    scores = np.concatenate([frame[2] for frame in frames]) if frames else \
        np.zeros(0, np.float32)
    keys = np.array([frame[0] for frame in frames], dtype=str)
    arrays = {"boxes": boxes.astype(np.float32), "scores": scores.astype(np.float32),
              "frame_offsets": offsets, "sample_keys": keys, "box_order": np.array(box_order)}
    if class_names:
        arrays["classes"] = np.concatenate([frame[3] for frame in frames]
                                           + [np.zeros(0, np.int64)]).astype(np.int64)
        arrays["class_names"] = np.array(class_names, dtype=str)
    with atomic_write(path, "wb") as stream:
        np.savez(stream, **arrays)
    return path
