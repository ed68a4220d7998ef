"""Pinhole cameras for the synthetic world, mounted and written as OPV2V mounts and writes them.

**Conventions (the real data's, read as HEAL's and OpenCOOD's camera readers read them).**
A camera's ``cords`` is its world pose ``[x, y, z, roll, yaw, pitch]`` (m, deg; the pose
convention of ``ops.transforms.pose_to_matrix``, UE4/CARLA axes: x forward, y right, z up). Its
``extrinsic`` is lidar -> camera in those UE4 axes, ``inv(T_world_camera) @ T_world_lidar``
(OpenCDA's data dumper); readers derive camera -> lidar from ``cords`` and ``lidar_pose`` and then
turn the UE4 camera axes into OpenCV's (x right, y down, z forward) with ``UE4_FROM_OPENCV``:
``p_ue4 = UE4_FROM_OPENCV @ p_opencv``. ``intrinsic`` is CARLA's pinhole: ``fx = fy = W / (2
tan(fov / 2))`` (horizontal fov), principal point ``(W / 2, H / 2)``; pixel (u, v) has its centre
at u, v (OpenCV's convention). OPV2V mounts 4 cameras of 800 x 600 and fov 100 deg on every
vehicle, in this order: front, right, left, back (``VEHICLE_MOUNTS``, relative to the vehicle
origin on the ground). Since the world's numbers are read in UE4's left-handed axes (+y is to
the right of +x), the pictures are what a CARLA camera would take of the world: the traffic that
the world's docstring puts "right of its heading" shows up on the left of the lane in them.

**Rendering** (:func:`render_camera`): the ground plane z = 0 is solved per pixel, each box face
(buildings and vehicles: what the LiDAR sees) that faces the camera is clipped at the near plane
and rasterised with exact edge tests at pixel centres into a z-buffer; a pixel keeps the nearest
surface. Colours: each vehicle its own (from its id), buildings in stone tints, every face shaded
by a fixed sun, the ground an asphalt checker that fades into haze, a sky gradient. A pure
function of the scene and the pose: no random draws, so files stay byte-identical per seed and
the LiDAR's draws do not depend on whether cameras are written.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import cv2
import numpy as np

from opencood.data.synthetic.lidar import GROUND_ID
from opencood.ops.transforms import matrix_to_pose, pose_to_matrix

SKY_ID = -(2 ** 31)                    # object id of a pixel that sees nothing (the sky)

# (name, location [x, y, z] relative to the vehicle origin, yaw deg): OpenCDA's camera mounts
# for OPV2V, in the order of camera0..3.
VEHICLE_MOUNTS = (("front", (2.5, 0.0, 1.0), 0.0), ("right", (0.0, 0.3, 1.8), 100.0),
                  ("left", (0.0, -0.3, 1.8), -100.0), ("back", (-2.0, 0.0, 1.5), 180.0))
RSU_CAMERA_DROP = 0.3                  # RSU cameras sit this far below the pole's LiDAR (m)
RSU_CAMERA_PITCH_DEG = -35.0           # ... and look down, as V2XSet's roadside cameras do

# p_ue4 = UE4_FROM_OPENCV @ p_opencv: OpenCV's (right, down, forward) in UE4's (forward, right, up)
UE4_FROM_OPENCV = np.array([[0.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0],
                            [0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])

_SUN = np.array([0.35, -0.45, 0.82]) / np.linalg.norm([0.35, -0.45, 0.82])
# Colours (RGB, float32: the image is composed in float32, 3x faster than float64 here)
_SKY_TOP = np.array([110.0, 160.0, 225.0], dtype=np.float32)
_SKY_HORIZON = np.array([205.0, 222.0, 238.0], dtype=np.float32)
_HAZE = np.array([190.0, 198.0, 205.0], dtype=np.float32)
_HAZE_DISTANCE = 250.0                 # m: the ground's colour is half haze at this distance
_ASPHALT = np.array([[88.0, 90.0, 96.0], [100.0, 102.0, 107.0]], dtype=np.float32)  # checker
_CHECKER = 2.0                         # m: side of a checker square on the ground


@dataclass(frozen=True)
class CameraConfig:
    """The cameras of every agent: image size in pixels, horizontal field of view in degrees."""

    width: int = 800
    height: int = 600
    fov_deg: float = 100.0
    depth: bool = False                    # also write <ts>_depth0..3.png (OPV2V-H's)
    near: float = 0.05                     # near clipping plane (m)


@dataclass
class CameraImage:
    """One rendered camera: rgb (H, W, 3) uint8, depth (H, W) float32 (z along the optical axis,
    m; inf where the sky is seen) and, on demand, ids (H, W) int64 (object id per pixel: an
    actor id, a building id, ``GROUND_ID`` or ``SKY_ID``)."""

    rgb: np.ndarray
    depth: np.ndarray
    face_buffer: np.ndarray                # (H, W) index into face_ids, -1: ground or sky
    face_ids: np.ndarray                   # (F,) object id of each face

    @cached_property
    def ids(self) -> np.ndarray:
        background = np.where(np.isfinite(self.depth), GROUND_ID, SKY_ID).astype(np.int64)
        if not len(self.face_ids):
            return background
        return np.where(self.face_buffer >= 0, self.face_ids[self.face_buffer], background)


def intrinsic_matrix(cfg: CameraConfig) -> np.ndarray:
    """(3, 3) CARLA pinhole intrinsics of ``cfg``."""
    focal = cfg.width / (2.0 * np.tan(np.radians(cfg.fov_deg) / 2.0))
    return np.array([[focal, 0.0, cfg.width / 2.0], [0.0, focal, cfg.height / 2.0],
                     [0.0, 0.0, 1.0]])


# ---------------------------------------------------------------------------------------------
# Where the cameras are

def vehicle_camera_cords(lidar_pose, lidar_mount_x: float) -> np.ndarray:
    """(4, 6) world poses of a vehicle's cameras (``VEHICLE_MOUNTS`` order).

    The cameras are rigid with the LiDAR (which sits ``lidar_mount_x`` ahead of the vehicle
    origin, ``lidar_pose[2]`` above the ground): they share its roll and pitch.
    """
    lidar_to_world = pose_to_matrix(lidar_pose)
    cords = []
    for _, (x, y, z), yaw in VEHICLE_MOUNTS:
        camera_to_lidar = pose_to_matrix([x - lidar_mount_x, y, z - lidar_pose[2], 0.0, yaw, 0.0])
        cords.append(matrix_to_pose(lidar_to_world @ camera_to_lidar))
    return np.asarray(cords)


def rsu_camera_cords(lidar_pose) -> np.ndarray:
    """(4, 6) world poses of a roadside unit's cameras: on its pole just below the LiDAR,
    looking front, right, left and back of the unit's heading (``VEHICLE_MOUNTS``' yaws),
    pitched down by ``RSU_CAMERA_PITCH_DEG``."""
    x, y, z, _, yaw, _ = (float(v) for v in lidar_pose)
    return np.asarray([[x, y, z - RSU_CAMERA_DROP, 0.0, yaw + mount_yaw, RSU_CAMERA_PITCH_DEG]
                       for _, _, mount_yaw in VEHICLE_MOUNTS])


def camera_entry(cords, lidar_pose, cfg: CameraConfig) -> dict:
    """The yaml ``camera<i>`` mapping: cords, extrinsic (lidar -> camera, UE4 axes), intrinsic;
    ``cords`` and ``lidar_pose`` as written (rounded), so the extrinsic is the one a reader
    recomputes from them."""
    extrinsic = np.linalg.inv(pose_to_matrix(cords)) @ pose_to_matrix(lidar_pose)
    return {"cords": [float(v) for v in cords],
            "extrinsic": [[round(float(v), 8) + 0.0 for v in row] for row in extrinsic],  # no -0.0
            "intrinsic": [[round(float(v), 6) for v in row] for row in intrinsic_matrix(cfg)]}


def world_to_opencv(cords) -> np.ndarray:
    """(4, 4) world -> OpenCV camera frame of a camera at ``cords``."""
    return np.linalg.inv(pose_to_matrix(cords) @ UE4_FROM_OPENCV)


def project_points(points_world, cords, cfg: CameraConfig):
    """Pixels (N, 2) [u, v] and depths (N,) (z along the optical axis) of world points (N, 3)."""
    points = np.asarray(points_world, dtype=np.float64)
    camera = points @ world_to_opencv(cords)[:3, :3].T + world_to_opencv(cords)[:3, 3]
    pixels = camera @ intrinsic_matrix(cfg).T
    return pixels[:, :2] / pixels[:, 2:3], camera[:, 2]


# ---------------------------------------------------------------------------------------------
# Rasteriser

def _object_colour(object_id: int) -> np.ndarray:
    """Base RGB (3,) of an object, a fixed function of its id: vehicles spread over hues by the
    golden ratio, buildings in muted stone tints."""
    if object_id >= 0:
        hue = (object_id * 0.6180339887) % 1.0
        saturation = 0.45 + 0.4 * ((object_id * 0.41421356) % 1.0)
        value = 0.55 + 0.4 * ((object_id * 0.73205081) % 1.0)
    else:
        hue = 0.08 + 0.06 * ((-object_id * 0.6180339887) % 1.0)
        saturation = 0.12 + 0.15 * ((-object_id * 0.41421356) % 1.0)
        value = 0.55 + 0.3 * ((-object_id * 0.73205081) % 1.0)
    return 255.0 * _hsv_to_rgb(hue, saturation, value)


def _hsv_to_rgb(hue, saturation, value) -> np.ndarray:
    sector = int(hue * 6.0) % 6
    frac = hue * 6.0 - int(hue * 6.0)
    p, q, t = value * (1 - saturation), value * (1 - frac * saturation), \
        value * (1 - (1 - frac) * saturation)
    return np.array([(value, t, p), (q, value, p), (p, value, t), (p, q, value),
                     (t, p, value), (value, p, q)][sector])


# Faces of a unit box as corner indices into _BOX_CORNERS, counter-clockwise seen from outside,
# with their outward normals (the bottom face lies on the ground and is never seen).
_BOX_CORNERS = np.array([[1, 1, 1], [1, -1, 1], [-1, -1, 1], [-1, 1, 1],
                         [1, 1, -1], [1, -1, -1], [-1, -1, -1], [-1, 1, -1]], dtype=np.float64)
_BOX_FACES = ((0, 3, 2, 1), (0, 1, 5, 4), (1, 2, 6, 5), (2, 3, 7, 6), (3, 0, 4, 7))
_FACE_NORMALS = np.array([[0, 0, 1], [1, 0, 0], [0, -1, 0], [-1, 0, 0], [0, 1, 0]],
                         dtype=np.float64)


def _visible_faces(scene, camera_center, exclude_ids):
    """Faces turned towards the camera: corners (F, 4, 3) world, normals (F, 3), ids (F,)."""
    centers, half_sizes, yaws, ids, _ = scene.box_arrays()
    keep = ~np.isin(ids, np.asarray(list(exclude_ids), dtype=np.int64))
    centers, half_sizes, yaws, ids = centers[keep], half_sizes[keep], yaws[keep], ids[keep]
    cos, sin = np.cos(yaws), np.sin(yaws)
    rotation = np.zeros((len(yaws), 3, 3))
    rotation[:, 0, 0], rotation[:, 0, 1], rotation[:, 1, 0], rotation[:, 1, 1] = cos, -sin, sin, cos
    rotation[:, 2, 2] = 1.0
    corners = centers[:, None] + np.einsum("kij,kcj->kci", rotation,
                                           _BOX_CORNERS[None] * half_sizes[:, None])   # K, 8, 3
    normals = np.einsum("kij,fj->kfi", rotation, _FACE_NORMALS)                        # K, 5, 3
    face_corners = corners[:, np.asarray(_BOX_FACES)]                                  # K, 5, 4, 3
    facing = np.einsum("kfi,kfi->kf", camera_center - face_corners[:, :, 0], normals) > 1e-9
    face_ids = np.broadcast_to(ids[:, None], facing.shape)
    return face_corners[facing], normals[facing], face_ids[facing]


def _ground_depth(world_from_ray, camera_center, xn, yn) -> np.ndarray:
    """Depth (H, W) of the ground per pixel, inf where the pixel's ray misses it; xn (W,), yn
    (H,) the pixel centres on the plane z = 1 of the camera (OpenCV axes)."""
    # The ray of pixel (u, v) is (xn[u], yn[v], 1): its world z component is linear in both.
    a, b, c = world_from_ray[2]
    down = a * xn[None, :] + b * yn[:, None] + c                                   # (H, W)
    if camera_center[2] <= 0:
        return np.full(down.shape, np.inf)
    with np.errstate(divide="ignore"):
        return np.where(down < 0, -camera_center[2] / down, np.inf)


_HAZE_LEVELS = 256                    # the ground's haze is drawn from this many steps


def _ground_palette() -> np.ndarray:
    """(2 * _HAZE_LEVELS,) packed colours of the ground: [checker square (dark, light), haze
    step], so the ground is one table lookup per pixel (the steps are finer than uint8)."""
    haze = np.arange(_HAZE_LEVELS) / (_HAZE_LEVELS - 1)                    # (L,)
    asphalt = _ASPHALT[:, None, :]                                         # (2, 1, 3)
    colours = asphalt + haze[None, :, None] * (_HAZE - asphalt)            # (2, L, 3)
    return _packed(colours.reshape(-1, 3).T)


def _background(depth, world_from_ray, camera_center, xn, yn) -> np.ndarray:
    """Packed colours (H, W) (:func:`_packed`) of what the boxes leave: the ground (an asphalt
    checker fading into haze with distance) where ``depth`` is finite, else the sky (horizon
    colour near the horizon, deeper blue overhead, by the ray's elevation)."""
    hit = np.isfinite(depth)
    distance = np.where(hit, depth, np.float32(0.0))
    square = np.zeros(depth.shape, dtype=np.int32)
    for axis in (0, 1):
        a, b, c = (float(v) for v in world_from_ray[axis])
        ground = float(camera_center[axis]) + distance * (a * xn[None, :] + b * yn[:, None] + c)
        square += np.floor(ground * np.float32(1.0 / _CHECKER)).astype(np.int32)
    haze = distance / (distance + np.float32(_HAZE_DISTANCE))                # [0, 1)
    step = np.rint(haze * np.float32(_HAZE_LEVELS - 1)).astype(np.int32)
    ground_colours = _GROUND_PALETTE[(square & 1) * _HAZE_LEVELS + step]
    up = np.clip(float(world_from_ray[2, 1]) * yn + float(world_from_ray[2, 2]), 0.0, 1.0)
    sky = _packed((_SKY_HORIZON + up[:, None] * (_SKY_TOP - _SKY_HORIZON)).T)   # (H,)
    return np.where(hit, ground_colours, sky[:, None])


def _clip_near(polygon: np.ndarray, near: float) -> np.ndarray:
    """The part (M, 3) of a convex polygon (P, 3) (camera frame) with z >= near."""
    out = []
    for start, end in zip(polygon, np.roll(polygon, -1, axis=0)):
        if start[2] >= near:
            out.append(start)
        if (start[2] >= near) != (end[2] >= near):
            out.append(start + (end - start) * (near - start[2]) / (end[2] - start[2]))
    return np.asarray(out).reshape(-1, 3)


def _in_view(corners_camera, cfg: CameraConfig, focal, center) -> np.ndarray:
    """(F,) bool: faces (F, 4, 3) (camera frame) that may cover a pixel: some corner in front
    of the near plane, and, when all are, a projected bounding box that meets the image."""
    z = corners_camera[..., 2]
    in_front = z.max(axis=1) >= cfg.near
    all_in_front = z.min(axis=1) >= cfg.near
    with np.errstate(divide="ignore", invalid="ignore"):
        u = corners_camera[..., 0] / z * focal + center[0]
        v = corners_camera[..., 1] / z * focal + center[1]
    off_image = (u.max(1) < -0.5) | (u.min(1) > cfg.width - 0.5) | \
        (v.max(1) < -0.5) | (v.min(1) > cfg.height - 0.5)
    return in_front & ~(all_in_front & off_image)


def _pixel_boxes(polygons, focal, center, shape) -> np.ndarray:
    """(N, 4) int64 [u0, u1, v0, v1]: the pixel centres' bounding box of each polygon (N, M, 3)
    (camera frame, all z > 0), clipped to an image of ``shape`` (H, W); empty where u0 > u1 or
    v0 > v1."""
    u = polygons[..., 0] / polygons[..., 2] * focal + center[0]
    v = polygons[..., 1] / polygons[..., 2] * focal + center[1]
    return np.stack([np.maximum(np.ceil(u.min(-1) - 1e-9), 0),
                     np.minimum(np.floor(u.max(-1) + 1e-9), shape[1] - 1),
                     np.maximum(np.ceil(v.min(-1) - 1e-9), 0),
                     np.minimum(np.floor(v.max(-1) + 1e-9), shape[0] - 1)],
                    axis=-1).clip(-1, max(shape)).astype(np.int64)


def _raster_face(polygon, box, xn, yn, depth, face_index, face_buffer):
    """Z-buffer one face: ``polygon`` (M, 3) in the camera frame (all z >= near), convex, its
    pixel box [u0, u1, v0, v1] (:func:`_pixel_boxes`).

    Pixels whose centre ray passes inside the polygon (exact edge tests) and whose depth along
    the face's plane is below ``depth`` get ``face_index`` in ``face_buffer`` (both (H, W),
    updated in place). A face whose box is already covered by nearer surfaces is skipped after
    one look at the buffer.
    """
    u0, u1, v0, v1 = box.tolist()
    if u0 > u1 or v0 > v1:
        return
    z_min, z_max = float(polygon[:, 2].min()), float(polygon[:, 2].max())
    region = depth[v0:v1 + 1, u0:u1 + 1]
    if region.max() <= z_min:
        return
    xs, ys = xn[u0:u1 + 1][None, :], yn[v0:v1 + 1][:, None]
    normal = np.cross(polygon[1] - polygon[0], polygon[2] - polygon[0])
    offset = float(normal @ polygon[0])
    if offset == 0.0:                     # seen edge-on
        return
    # A ray r is inside the cone of a convex polygon seen from the origin iff r . (p_i x p_i+1)
    # has one sign for every edge: that of normal . p_0 (the polygon's winding seen from here).
    edges = np.cross(polygon, np.roll(polygon, -1, axis=0)) * np.sign(offset)
    inside = np.ones((len(ys), xs.shape[1]), dtype=bool)
    for ex, ey, ez in edges.tolist():
        inside &= ex * xs + ey * ys + ez >= 0
    # Depth along the ray (x, y, 1) to the plane normal . p = offset; pixels the edge tests
    # keep lie on the face, so their depth is within the corners' (clipping guards round-off).
    nx, ny, nz = normal.tolist()
    with np.errstate(divide="ignore", invalid="ignore"):
        face_depth = np.clip(offset / (nx * xs + ny * ys + nz), z_min, z_max)
    closer = inside & (face_depth < region)
    region[closer] = face_depth[closer]
    face_buffer[v0:v1 + 1, u0:u1 + 1][closer] = face_index


def rasterise(scene, camera_to_world, intrinsic, cfg: CameraConfig, depth: np.ndarray,
              exclude_ids=()):
    """Z-buffer the box faces of ``scene`` seen by a pinhole camera: ``camera_to_world`` (4, 4)
    its OpenCV axes -> the scene's frame, ``intrinsic`` (3, 3) with fx = fy, ``cfg`` its
    width, height and near plane. ``depth`` (H, W) float32, z along the optical axis of what
    lies behind the faces (inf: nothing), is lowered in place where a face is nearer.

    Returns face_buffer (H, W) int64 (index into the faces, -1 where none is nearest), the
    faces' normals (F, 3) and object ids (F,).
    """
    world_to_camera = np.linalg.inv(camera_to_world)
    camera_center = camera_to_world[:3, 3]
    focal, center = intrinsic[0, 0], intrinsic[:2, 2]
    xn = ((np.arange(cfg.width) - center[0]) / focal).astype(np.float32)
    yn = ((np.arange(cfg.height) - center[1]) / focal).astype(np.float32)
    corners, normals, face_ids = _visible_faces(scene, camera_center, exclude_ids)
    face_buffer = np.full(depth.shape, -1, dtype=np.int64)
    corners_camera = corners @ world_to_camera[:3, :3].T + world_to_camera[:3, 3]
    candidates = np.flatnonzero(_in_view(corners_camera, cfg, focal, center))
    nearest = corners_camera[candidates, :, 2].min(axis=1)
    whole = nearest >= cfg.near                       # no near-plane clipping needed
    boxes = np.zeros((len(corners_camera), 4), dtype=np.int64)
    boxes[candidates[whole]] = _pixel_boxes(corners_camera[candidates[whole]], focal, center,
                                            depth.shape)
    # Nearest first, so that faces hidden behind them are skipped without rasterising.
    for index in candidates[np.argsort(nearest, kind="stable")]:
        polygon, box = corners_camera[index], boxes[index]
        if polygon[:, 2].min() < cfg.near:
            polygon = _clip_near(polygon, cfg.near)
            if len(polygon) < 3:
                continue
            box = _pixel_boxes(polygon[None], focal, center, depth.shape)[0]
        _raster_face(polygon, box, xn, yn, depth, index, face_buffer)
    return face_buffer, normals, face_ids


def render_camera(scene, cords, cfg: CameraConfig, exclude_ids=()) -> CameraImage:
    """Photograph ``scene`` from a camera at ``cords`` ([x, y, z, roll, yaw, pitch], world).

    ``exclude_ids``: objects the camera does not see (the vehicle it is mounted on, as its
    LiDAR's rays pass through it).
    """
    camera_to_world = pose_to_matrix(cords) @ UE4_FROM_OPENCV
    camera_center = camera_to_world[:3, 3]
    intrinsic = intrinsic_matrix(cfg)
    focal, center = intrinsic[0, 0], intrinsic[:2, 2]
    xn = ((np.arange(cfg.width) - center[0]) / focal).astype(np.float32)
    yn = ((np.arange(cfg.height) - center[1]) / focal).astype(np.float32)
    depth = _ground_depth(camera_to_world[:3, :3], camera_center, xn, yn).astype(np.float32)
    rgba = _background(depth, camera_to_world[:3, :3], camera_center, xn, yn)
    face_buffer, normals, face_ids = rasterise(scene, camera_to_world, intrinsic, cfg, depth,
                                               exclude_ids)
    if len(face_ids):
        object_ids, face_objects = np.unique(face_ids, return_inverse=True)
        object_colours = np.array([_object_colour(int(i)) for i in object_ids]).reshape(-1, 3)
        shade = 0.5 + 0.5 * np.clip(normals @ _SUN, 0.0, 1.0)
        face_colours = _packed((object_colours[face_objects] * shade[:, None]).T)
        # Index -1 (no face) reads the last face's colour, which np.where then discards.
        rgba = np.where(face_buffer >= 0, face_colours[face_buffer], rgba)
    rgb = cv2.cvtColor(rgba.view(np.uint8).reshape(rgba.shape + (4,)), cv2.COLOR_RGBA2RGB)
    return CameraImage(rgb, depth, face_buffer, face_ids)


def _packed(planes) -> np.ndarray:
    """Colour planes (3, ...) float, R G B -> (...) little-endian uint32 whose bytes are R, G, B,
    0: one gather and one select compose a picture instead of three."""
    channels = np.clip(np.rint(planes), 0, 255).astype("<u4")
    return channels[0] | (channels[1] << 8) | (channels[2] << 16)


_GROUND_PALETTE = _ground_palette()


def depth_png(depth: np.ndarray) -> np.ndarray:
    """(H, W) uint8 depth image as HEAL reads OPV2V-H's: metres, rounded, 255 for 255 m and
    beyond (and the sky). HEAL loads it with PIL, scales by 1/255 (ToTensor) and back by 255, so
    an 8-bit single-channel image is the only form it reads as metres."""
    return np.clip(np.rint(np.where(np.isfinite(depth), depth, 255.0)), 0, 255).astype(np.uint8)
