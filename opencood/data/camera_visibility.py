"""What an agent's cameras see: unoccluded pixels per GT box, and HEAL's ``bev_visibility`` labels.

**The rule** (issue 36, the camera ego's AP visibility split): a GT box is visible to an agent's
cameras when at least ``MIN_VISIBLE_PIXELS`` of its pixels are unoccluded in one of them. The
synthetic world knows it exactly (its rasteriser's per-pixel object ids, written as below while
generating). For a real copy the files give it through OPV2V-H's depth images
(:func:`unoccluded_pixels`): the GT boxes are rasterised into each camera (the synthetic world's
z-buffer, ``opencood.data.synthetic.camera.rasterise``), and a pixel a box is the nearest box at
counts when the depth image there is not nearer than the box by more than ``DEPTH_TOLERANCE``
(the image holds whole metres: HEAL's ``<ts>_depth<i>.png``).

**HEAL's labels.** HEAL's camera configs read ``<cav>/<ts>_bev_visibility.png`` for every agent
(``add_data_extension``; OPV2V's camera release ships them, the files users report incomplete):
``cv2.imread`` then ``COLOR_BGR2GRAY``, a 256 x 256 uint8 map of the agent's LiDAR frame,
0.39 m per pixel, heading up: a point (x, y) is pixel ``(row, col) = (127 - int(x / 0.39),
127 + int(y / 0.39))`` (``int`` truncates towards zero, so row 127 and column 127 are two cells
wide). Non-zero is visible; HEAL keeps a GT box for a camera agent when the pixel of its centre
is non-zero (``box_utils.box_is_visible``; off the map: not visible). The files paint the
footprints of the vehicles the agent's cameras see; ours (:func:`visibility_map`) paint, in
255, every pixel whose cell centre lies in such a footprint, plus the pixel of each such box's
centre by HEAL's own formula, so HEAL's lookup and :func:`boxes_visible` agree on every box
painted, and a box not painted reads 0 unless another's footprint covers its centre.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import cv2
import numpy as np

from opencood.errors import OpencoodError

MAP_SIZE = 256                  # pixels a side
MAP_RESOLUTION = 0.39           # metres per pixel
MAP_CENTRE = 127                # the pixel of the agent's LiDAR
VISIBLE, HIDDEN = 255, 0
FILE_SUFFIX = "_bev_visibility.png"      # <ts>_bev_visibility.png beside the frame's files
MIN_VISIBLE_PIXELS = 1
DEPTH_TOLERANCE = 1.0           # metres: the depth image's whole metres, and half a metre more


class VisibilityFileError(OpencoodError, ValueError):
    """A bev_visibility map that is not HEAL's 256 x 256 image; the message names the file."""


def map_pixels(x: np.ndarray, y: np.ndarray):
    """(rows, cols) int64 of LiDAR-frame points (x, y) (any shape): HEAL's rasterisation."""
    rows = MAP_CENTRE - np.trunc(np.asarray(x, np.float64) / MAP_RESOLUTION).astype(np.int64)
    cols = MAP_CENTRE + np.trunc(np.asarray(y, np.float64) / MAP_RESOLUTION).astype(np.int64)
    return rows, cols


def _cell_centres(k: np.ndarray) -> np.ndarray:
    """The centre (metres) of the cell HEAL's ``int(v / 0.39) = k`` stands for: [k, k + 1)
    * 0.39 for k > 0, (k - 1, k] * 0.39 for k < 0, (-0.39, 0.39) for k = 0."""
    return np.sign(k) * (np.abs(k) + 0.5) * MAP_RESOLUTION


def visibility_map(boxes: np.ndarray, order: str = "hwl") -> np.ndarray:
    """(256, 256) uint8 HEAL map painting ``boxes`` (M, 7) (LiDAR frame, the visible ones):
    255 on every pixel whose cell centre lies in a box's footprint and on the pixel of each
    box's centre, 0 elsewhere."""
    boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
    length, width = (boxes[:, 5], boxes[:, 4]) if order == "hwl" else (boxes[:, 3], boxes[:, 4])
    pixels = np.arange(MAP_SIZE, dtype=np.float64)
    x = _cell_centres(MAP_CENTRE - pixels)[:, None]          # (256, 1): row r, x up
    y = _cell_centres(pixels - MAP_CENTRE)[None, :]          # (1, 256): column c, y right
    painted = np.zeros((MAP_SIZE, MAP_SIZE), dtype=bool)
    for (cx, cy), half_l, half_w, yaw in zip(boxes[:, :2], length / 2, width / 2, boxes[:, 6]):
        along = (x - cx) * np.cos(yaw) + (y - cy) * np.sin(yaw)
        across = -(x - cx) * np.sin(yaw) + (y - cy) * np.cos(yaw)
        painted |= (np.abs(along) <= half_l) & (np.abs(across) <= half_w)
    rows, cols = map_pixels(boxes[:, 0], boxes[:, 1])
    on_map = (rows >= 0) & (rows < MAP_SIZE) & (cols >= 0) & (cols < MAP_SIZE)
    painted[rows[on_map], cols[on_map]] = True
    return np.where(painted, VISIBLE, HIDDEN).astype(np.uint8)


def boxes_visible(visibility: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """(M,) bool: HEAL's rule on a (256, 256) map: the pixel of each box centre (M, 7+, LiDAR
    frame) is non-zero; a centre off the map is not visible."""
    boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
    rows, cols = map_pixels(boxes[:, 0], boxes[:, 1])
    on_map = (rows >= 0) & (rows < MAP_SIZE) & (cols >= 0) & (cols < MAP_SIZE)
    visible = np.zeros(len(boxes), dtype=bool)
    visible[on_map] = visibility[rows[on_map], cols[on_map]] > 0
    return visible


def map_path(frame_dir: Path, timestamp: str) -> Path:
    return Path(frame_dir) / f"{timestamp}{FILE_SUFFIX}"


def write_visibility_map(path: Path, visibility: np.ndarray) -> None:
    """A single-channel 8-bit PNG (HEAL's ``cv2.imread`` gives it 3 equal channels, its
    ``COLOR_BGR2GRAY`` the values back)."""
    ok, encoded = cv2.imencode(".png", np.ascontiguousarray(visibility, dtype=np.uint8))
    if not ok:
        raise VisibilityFileError(f"{path}: cannot encode the map as PNG")
    Path(path).write_bytes(encoded.tobytes())


def read_visibility_map(path: Path) -> np.ndarray:
    """(256, 256) uint8 as HEAL reads the file (colour, then BGR -> grey)."""
    image = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if image is None:
        raise VisibilityFileError(f"{path}: missing or not an image")
    grey = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
    if grey.shape != (MAP_SIZE, MAP_SIZE):
        raise VisibilityFileError(f"{path}: {grey.shape[1]} x {grey.shape[0]} pixels, HEAL's "
                                  f"bev_visibility maps are {MAP_SIZE} x {MAP_SIZE}")
    return grey


# -- unoccluded pixels from the files ------------------------------------------------------------

class BoxScene(NamedTuple):
    """GT boxes as the rasteriser's scene (``box_arrays``), box k with object id k."""
    centers: np.ndarray             # (M, 3)
    half_sizes: np.ndarray          # (M, 3) half length, half width, half height
    yaws: np.ndarray                # (M,) radians

    @classmethod
    def from_boxes(cls, boxes: np.ndarray, order: str = "hwl") -> "BoxScene":
        boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
        sizes = boxes[:, [5, 4, 3]] if order == "hwl" else boxes[:, [3, 4, 5]]
        return cls(boxes[:, :3], sizes / 2.0, boxes[:, 6])

    def box_arrays(self):
        count = len(self.yaws)
        return (self.centers, self.half_sizes, self.yaws, np.arange(count, dtype=np.int64),
                np.zeros(count))


def unoccluded_pixels(boxes: np.ndarray, camera_to_lidar: np.ndarray, intrinsics: np.ndarray,
                      image_size, depth_images: np.ndarray | None = None,
                      order: str = "hwl", tolerance: float = DEPTH_TOLERANCE) -> np.ndarray:
    """(M,) int64 pixels of each box (M, 7), LiDAR frame, that its agent's cameras see.

    camera_to_lidar (C, 4, 4) OpenCV camera axes -> LiDAR frame; intrinsics (C, 3, 3) (fx =
    fy); image_size (W, H); depth_images (C, H, W) metres along the optical axis (255 and
    beyond: nothing): a pixel counts where its box is the nearest box and the image is not
    nearer than the box by more than ``tolerance``. None: boxes occlude each other only.
    """
    from opencood.data.synthetic.camera import CameraConfig, rasterise
    boxes = np.asarray(boxes, np.float64).reshape(-1, 7)
    counts = np.zeros(len(boxes), dtype=np.int64)
    if not len(boxes):
        return counts
    scene = BoxScene.from_boxes(boxes, order)
    width, height = (int(v) for v in image_size)
    cfg = CameraConfig(width=width, height=height)
    for index, (to_lidar, intrinsic) in enumerate(zip(camera_to_lidar, intrinsics)):
        intrinsic = np.asarray(intrinsic, np.float64)
        if abs(intrinsic[0, 0] - intrinsic[1, 1]) > 1e-6 * intrinsic[0, 0]:
            raise ValueError(f"camera {index}: fx {intrinsic[0, 0]} != fy {intrinsic[1, 1]}; "
                             "the rasteriser takes square pixels")
        depth = np.full((height, width), np.inf, dtype=np.float32)
        face_buffer, _, face_ids = rasterise(scene, np.asarray(to_lidar, np.float64), intrinsic,
                                             cfg, depth)
        seen = face_buffer >= 0
        if depth_images is not None:
            seen &= np.asarray(depth_images[index], np.float32) >= depth - tolerance
        counts += np.bincount(face_ids[face_buffer[seen]], minlength=len(boxes))
    return counts
