"""Camera inputs: a frame's images and calibration read as HEAL reads them, and its image
augmentation (HEAL's ``data_aug_conf``), for the lift-splat encoder (docs/DESIGN.md §4.2).

**Reading.** OPV2V / V2XSet (:func:`read_opv2v_cameras`): ``<ts>_camera0..3.png`` and the yaml's
``camera<i>: {cords, intrinsic}``; camera -> LiDAR is ``inv(T_world_lidar) @ T_world_camera``
from the camera's ``cords`` and the frame's ``lidar_pose`` (the yaml's ``extrinsic`` is not
read, as HEAL does not), then the UE4 camera axes become OpenCV's (``UE4_FROM_OPENCV``: x right,
y down, z forward). HEAL holds ``cords`` in float32, so its trigonometry runs in float32; so does
ours (:func:`camera_pose_matrix`), which keeps the matrices equal to HEAL's to the last bit
(tools/reference/make_camera_reader_fixture.py). DAIR-V2X-C (:func:`read_dair_cameras`): one
camera per side, ``<side>/image/<frame>.jpg``, ``calib/camera_intrinsic`` (``cam_K``) and
``calib/lidar_to_camera`` (vehicle) or ``calib/virtuallidar_to_camera`` (roadside unit), already
in OpenCV axes: camera -> LiDAR is the float32 inverse of the latter.

**Augmentation** (:func:`draw_image_augmentation`, :func:`transform_image`): per camera, as
lift-splat-shoot and HEAL: resize by ``resize`` (bicubic), crop ``final_dim`` (the bottom
``bot_pct`` of the resized image left out), optional horizontal flip, rotation by ``rotate``
degrees about the crop's centre (nearest neighbour, corners filled black). Its effect on pixel
coordinates is ``p' = post_rot @ p + post_tran`` (3x3 and 3-vector, the 2-D part filled): the
encoder undoes it before lifting. Training draws resize, the crop's bottom cut and column, the
flip and the angle from the sample's generator; evaluation resizes to cover ``final_dim``, keeps
the bottom ``mean(bot_pct_lim)`` cut and centres the crop. Then ImageNet normalisation.

The BEV augmentation (opencood.data.augment) is not an image operation: it moves the frame the
camera is mounted in. The dataset composes it into the extrinsics (``camera -> agent`` is
``augmentation @ to_output @ camera -> lidar``), so a camera point lands where the agent's
augmented points and GT boxes are.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import List, NamedTuple, Sequence

import numpy as np
import torch
from PIL import Image

from opencood.batch_keys import CAMERA_TENSORS
from opencood.errors import OpencoodError

OPV2V_CAMERAS = 4                     # camera0..3: front, right, left, back
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# p_ue4 = UE4_FROM_OPENCV @ p_opencv (the synthetic writer's constant, in float32 as HEAL's)
UE4_FROM_OPENCV = np.array([[0, 0, 1, 0], [1, 0, 0, 0], [0, -1, 0, 0], [0, 0, 0, 1]],
                           dtype=np.float32)


class CameraFileError(OpencoodError, ValueError):
    """A missing or malformed camera file or yaml entry; the message names it."""


@dataclass
class CameraFrame:
    """One agent's cameras at one frame, as read.

    images: C RGB ``PIL.Image``s; intrinsics (C, 3, 3) float32; camera_to_lidar (C, 4, 4)
    float32 (OpenCV camera axes -> the agent's LiDAR frame); paths: the C image files.
    """

    images: List[Image.Image]
    intrinsics: np.ndarray
    camera_to_lidar: np.ndarray
    paths: List[Path]


# -- reading -------------------------------------------------------------------------------------

def camera_pose_matrix(cords) -> np.ndarray:
    """CARLA pose ``[x, y, z, roll, yaw, pitch]`` -> (4, 4) float64 camera -> world, computed
    from the float32 numbers (angles, cosines and sines in float32: HEAL's rounding)."""
    x, y, z, roll, yaw, pitch = np.asarray(cords, dtype=np.float32).reshape(6)
    cos_yaw, sin_yaw = np.cos(np.radians(yaw)), np.sin(np.radians(yaw))
    cos_roll, sin_roll = np.cos(np.radians(roll)), np.sin(np.radians(roll))
    cos_pitch, sin_pitch = np.cos(np.radians(pitch)), np.sin(np.radians(pitch))
    matrix = np.identity(4)
    matrix[:3, 3] = x, y, z
    matrix[0, :3] = (cos_pitch * cos_yaw, cos_yaw * sin_pitch * sin_roll - sin_yaw * cos_roll,
                     -cos_yaw * sin_pitch * cos_roll - sin_yaw * sin_roll)
    matrix[1, :3] = (sin_yaw * cos_pitch, sin_yaw * sin_pitch * sin_roll + cos_yaw * cos_roll,
                     -sin_yaw * sin_pitch * cos_roll + cos_yaw * sin_roll)
    matrix[2, :3] = (sin_pitch, -cos_pitch * sin_roll, cos_pitch * cos_roll)
    return matrix


def opv2v_camera_to_lidar(cords, lidar_pose) -> np.ndarray:
    """(4, 4) float32 OpenCV camera axes -> LiDAR frame, from the camera's ``cords`` and the
    frame's 6-number ``lidar_pose`` (float64)."""
    from opencood.ops.transforms import pose_to_matrix
    camera_to_lidar = np.linalg.inv(pose_to_matrix(lidar_pose)) @ camera_pose_matrix(cords)
    return camera_to_lidar.astype(np.float32) @ UE4_FROM_OPENCV


def load_rgb(path: Path) -> Image.Image:
    """An image file as a loaded RGB PIL image; CameraFileError when missing or unreadable."""
    try:
        with Image.open(path) as image:
            image.load()
            return image.convert("RGB") if image.mode != "RGB" else image.copy()
    except FileNotFoundError:
        raise CameraFileError(f"{path}: camera image missing") from None
    except OSError as exc:
        raise CameraFileError(f"{path}: unreadable image ({exc})") from None


def _matrix(value, shape, where: str) -> np.ndarray:
    try:
        matrix = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError):
        matrix = None
    if matrix is None or matrix.size != int(np.prod(shape)):
        raise CameraFileError(f"{where}: expected {shape[0]}x{shape[1]} numbers")
    return matrix.reshape(shape)


def read_opv2v_cameras(cav_dir: Path, timestamp: str, params: dict,
                       lidar_pose) -> CameraFrame:
    """The 4 cameras of one OPV2V / V2XSet frame: ``<cav_dir>/<timestamp>_camera<i>.png`` and
    ``params`` (the frame's yaml mapping) ``camera<i>.cords`` / ``.intrinsic``."""
    images, intrinsics, to_lidar, paths = [], [], [], []
    for index in range(OPV2V_CAMERAS):
        where = f"{cav_dir / timestamp}.yaml: camera{index}"
        entry = params.get(f"camera{index}")
        if not isinstance(entry, dict) or "cords" not in entry or "intrinsic" not in entry:
            raise CameraFileError(f"{where}: missing (or without cords / intrinsic)")
        cords = _matrix(entry["cords"], (1, 6), f"{where}.cords")[0]
        intrinsics.append(_matrix(entry["intrinsic"], (3, 3), f"{where}.intrinsic"))
        to_lidar.append(opv2v_camera_to_lidar(cords, lidar_pose))
        paths.append(cav_dir / f"{timestamp}_camera{index}.png")
        images.append(load_rgb(paths[-1]))
    return CameraFrame(images, np.stack(intrinsics).astype(np.float32), np.stack(to_lidar),
                       paths)


def _read_json(path: Path):
    try:
        with open(path) as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise CameraFileError(f"{path}: calibration file missing") from None
    except json.JSONDecodeError as exc:
        raise CameraFileError(f"{path}: bad json ({exc.msg}, line {exc.lineno})") from None


def read_dair_cameras(root: Path, side: str, frame_id: str) -> CameraFrame:
    """DAIR-V2X-C's one camera of ``side`` ("vehicle-side" or "infrastructure-side") at
    ``frame_id``: its jpg, ``cam_K`` and the inverse of (virtual)lidar -> camera."""
    side_dir = Path(root) / side
    calib_name = "lidar_to_camera" if side == "vehicle-side" else "virtuallidar_to_camera"
    intrinsic_path = side_dir / "calib" / "camera_intrinsic" / f"{frame_id}.json"
    extrinsic_path = side_dir / "calib" / calib_name / f"{frame_id}.json"
    intrinsic = _read_json(intrinsic_path)
    extrinsic = _read_json(extrinsic_path)
    if not isinstance(intrinsic, dict) or "cam_K" not in intrinsic:
        raise CameraFileError(f"{intrinsic_path}: no 'cam_K'")
    if not isinstance(extrinsic, dict) or "rotation" not in extrinsic \
            or "translation" not in extrinsic:
        raise CameraFileError(f"{extrinsic_path}: expected 'rotation' and 'translation'")
    lidar_to_camera = np.identity(4)
    lidar_to_camera[:3, :3] = _matrix(extrinsic["rotation"], (3, 3), f"{extrinsic_path}: rotation")
    lidar_to_camera[:3, 3] = _matrix(extrinsic["translation"], (3, 1),
                                     f"{extrinsic_path}: translation")[:, 0]
    camera_to_lidar = np.linalg.inv(lidar_to_camera.astype(np.float32))
    intrinsics = _matrix(intrinsic["cam_K"], (3, 3), f"{intrinsic_path}: cam_K")
    path = side_dir / "image" / f"{frame_id}.jpg"
    return CameraFrame([load_rgb(path)], intrinsics[None].astype(np.float32),
                       camera_to_lidar[None], [path])


# -- augmentation --------------------------------------------------------------------------------

class ImageAugmentation(NamedTuple):
    """One camera's draws: resize factor, the resized size (W, H), the crop box (x0, y0, x1, y1)
    in the resized image, horizontal flip, rotation (degrees, counter-clockwise)."""
    resize: float
    resize_dims: tuple
    crop: tuple
    flip: bool
    rotate: float


def draw_image_augmentation(conf: dict, rng: np.random.Generator | None) -> ImageAugmentation:
    """One camera's augmentation from ``conf`` (``data_aug_conf``: H, W, final_dim [fH, fW],
    resize_lim, bot_pct_lim, rot_lim, rand_flip). ``rng`` None: the evaluation's fixed one.
    Draws in HEAL's order: resize, bottom cut, crop column, flip (only when rand_flip), angle."""
    height, width = conf["H"], conf["W"]
    final_h, final_w = conf["final_dim"]
    if rng is None:
        resize = max(final_h / height, final_w / width)
        bottom_cut = float(np.mean(conf["bot_pct_lim"]))
    else:
        resize = rng.uniform(*conf["resize_lim"])
        bottom_cut = rng.uniform(*conf["bot_pct_lim"])
    new_w, new_h = int(width * resize), int(height * resize)
    top = int((1 - bottom_cut) * new_h) - final_h
    left = int(rng.uniform(0, max(0, new_w - final_w))) if rng is not None else \
        int(max(0, new_w - final_w) / 2)
    flip = bool(rng is not None and conf["rand_flip"] and rng.choice([0, 1]))
    rotate = rng.uniform(*conf["rot_lim"]) if rng is not None else 0
    return ImageAugmentation(resize, (new_w, new_h), (left, top, left + final_w, top + final_h),
                             flip, rotate)


def _rotation_2d(degrees: float) -> torch.Tensor:
    """(2, 2) float32 of a counter-clockwise image rotation, in pixel axes (v down)."""
    radians = degrees / 180 * np.pi
    return torch.tensor([[np.cos(radians), np.sin(radians)],
                         [-np.sin(radians), np.cos(radians)]], dtype=torch.float32)


def image_augmentation_matrices(aug: ImageAugmentation):
    """post_rot (3, 3), post_tran (3,) float32: pixel p of the original image lands at
    ``post_rot @ p + post_tran`` (z row/entry untouched). float32 in HEAL's operation order."""
    rotation = torch.eye(2) * aug.resize
    translation = -torch.tensor(aug.crop[:2], dtype=torch.float32)
    crop_w, crop_h = aug.crop[2] - aug.crop[0], aug.crop[3] - aug.crop[1]
    if aug.flip:
        mirror = torch.tensor([[-1.0, 0.0], [0.0, 1.0]])
        rotation = mirror.matmul(rotation)
        translation = mirror.matmul(translation) + torch.tensor([float(crop_w), 0.0])
    turn = _rotation_2d(aug.rotate)
    centre = torch.tensor([float(crop_w), float(crop_h)]) / 2
    rotation = turn.matmul(rotation)
    translation = turn.matmul(translation) + (turn.matmul(-centre) + centre)
    post_rot, post_tran = torch.eye(3), torch.zeros(3)
    post_rot[:2, :2], post_tran[:2] = rotation, translation
    return post_rot, post_tran


def transform_image(image: Image.Image, aug: ImageAugmentation) -> Image.Image:
    """The augmented image: bicubic resize, crop (black outside), flip, rotate (nearest)."""
    image = image.resize(aug.resize_dims, Image.Resampling.BICUBIC).crop(aug.crop)
    if aug.flip:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return image.rotate(aug.rotate)


def normalize_image(image: Image.Image) -> torch.Tensor:
    """RGB image -> (3, H, W) float32, [0, 1] then ImageNet mean / std: HEAL's normalize_img
    (torchvision's to_tensor and normalize), the same float32 operations."""
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1).contiguous()
    scaled = pixels.to(torch.float32).div(255)
    mean = torch.tensor(IMAGENET_MEAN, dtype=torch.float32).view(-1, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=torch.float32).view(-1, 1, 1)
    return scaled.sub_(mean).div_(std)


def read_depth_images(paths: Sequence[Path]) -> List[Image.Image]:
    """OPV2V-H's depth images (8-bit grey, metres), loaded as stored (HEAL's
    ``load_camera_data``: no conversion); CameraFileError naming a missing or unreadable one."""
    images = []
    for path in paths:
        try:
            with Image.open(path) as image:
                image.load()
                images.append(image.copy())
        except FileNotFoundError:
            raise CameraFileError(f"{path}: depth image missing (input_source has 'depth')") \
                from None
        except OSError as exc:
            raise CameraFileError(f"{path}: unreadable image ({exc})") from None
    return images


def depth_tensor(image: Image.Image) -> torch.Tensor:
    """An augmented depth image -> (H, W) float32 metres, in HEAL's operations (torchvision's
    ``ToTensor``, [0, 1], then ``* 255``)."""
    pixels = torch.from_numpy(np.array(image, dtype=np.uint8))
    return pixels.to(torch.float32).div(255).mul(255)


def camera_inputs(frame: CameraFrame, conf: dict, rng: np.random.Generator | None,
                  lidar_to_output: np.ndarray | None = None, depths=None) -> dict:
    """One agent's model inputs: camera by camera, draw (``rng`` None: the fixed evaluation
    augmentation), transform and normalise its image.

    lidar_to_output: (4, 4) from the agent's LiDAR frame to the frame its points are given in
    (BEV augmentation @ to the ego or identity); None: the identity, the extrinsics are
    ``camera_to_lidar`` as read. Returns numpy arrays: images (C, 3, fH, fW), intrinsics
    (C, 3, 3), extrinsics (C, 4, 4) camera -> output frame, post_rots (C, 3, 3), post_trans
    (C, 3), all float32, and ``augmentations`` (the C draws, for tests and pictures).
    ``depths``: the C depth images (:func:`read_depth_images`), augmented with their camera's
    draw as HEAL does (the same resize, crop, flip and rotation) -> ``depth_maps`` (C, fH, fW).
    """
    images, post_rots, post_trans, draws, depth_maps = [], [], [], [], []
    for camera, (image, path) in enumerate(zip(frame.images, frame.paths)):
        if image.size != (conf["W"], conf["H"]):
            # The augmentation's resize and crop are computed from W, H: a mismatch would
            # silently scale the image and its intrinsics apart.
            raise CameraFileError(f"{path}: image is {image.size[0]} x {image.size[1]}, "
                                  f"camera.data_aug_conf says W x H = {conf['W']} x {conf['H']}")
        aug = draw_image_augmentation(conf, rng)
        post_rot, post_tran = image_augmentation_matrices(aug)
        images.append(normalize_image(transform_image(image, aug)))
        if depths is not None:
            depth_maps.append(depth_tensor(transform_image(depths[camera], aug)))
        post_rots.append(post_rot)
        post_trans.append(post_tran)
        draws.append(aug)
    extrinsics = frame.camera_to_lidar
    if lidar_to_output is not None:
        extrinsics = (np.asarray(lidar_to_output, np.float64) @ extrinsics).astype(np.float32)
    inputs = {"images": torch.stack(images).numpy(), "intrinsics": frame.intrinsics,
              "extrinsics": extrinsics, "post_rots": torch.stack(post_rots).numpy(),
              "post_trans": torch.stack(post_trans).numpy(), "augmentations": draws}
    if depths is not None:
        inputs["depth_maps"] = torch.stack(depth_maps).numpy()
    return inputs


CAMERA_KEYS = CAMERA_TENSORS           # the per-agent camera tensors (opencood.batch_keys)


def stack_agents(per_agent: Sequence[dict]) -> dict:
    """Per-agent :func:`camera_inputs` -> the sample's camera keys, (n, C, ...) float32
    (``depth_maps`` when the agents have them)."""
    return {key: np.stack([agent[key] for agent in per_agent]) for key in CAMERA_KEYS
            if key in per_agent[0]}
