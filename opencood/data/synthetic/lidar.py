"""A ray-cast spinning LiDAR for the synthetic world.

Rays go out from one origin (the lidar) in ``beams`` elevations x ``azimuth_steps`` azimuths and
stop at the nearest of: the ground plane z = 0, a building box, a vehicle box. Boxes are oriented
(yaw about z) and hit with the exact slab test in each box's own frame. Work is vectorised over
(rays x boxes); rays are processed in azimuth sectors so each sector only meets the boxes whose
azimuth span overlaps it, which keeps the arrays small and skips most ray/box pairs.

Scenes are duck-typed: anything with ``box_arrays() -> (centers (K, 3), half_sizes (K, 3),
yaws_rad (K,), ids (K,), reflectivity (K,))`` in world coordinates can be scanned.
Object ids: vehicles use their (positive) actor id, buildings negative ids below ``GROUND_ID``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from opencood.ops.transforms import pose_to_matrix

GROUND_ID = -1
GROUND_REFLECTIVITY = 0.12       # asphalt is dark in LiDAR intensity


@dataclass(frozen=True)
class LidarConfig:
    """Spinning LiDAR: angles in degrees, lengths in metres."""

    beams: int = 32
    fov_deg: tuple = (-25.0, 2.0)          # lowest and highest beam elevation
    azimuth_steps: int = 720
    max_range: float = 70.0
    min_range: float = 0.5
    range_noise_std: float = 0.02          # gaussian noise on the measured range
    dropout: float = 0.05                  # chance that a return is lost
    intensity_noise_std: float = 0.03
    intensity_falloff: float = 0.5         # share of intensity lost at max range
    sectors: int = 72                      # azimuth chunks for the ray/box tests


def ray_directions(cfg: LidarConfig, azimuth_offset_deg: float = 0.0) -> np.ndarray:
    """Unit ray directions (azimuth_steps * beams, 3) in the lidar frame, azimuth-major.

    Consecutive rays share an azimuth, so a contiguous slice of rays is an azimuth sector.
    """
    elevation = np.radians(np.linspace(cfg.fov_deg[0], cfg.fov_deg[1], cfg.beams))
    azimuth = np.radians(azimuth_offset_deg + np.arange(cfg.azimuth_steps) * 360.0
                         / cfg.azimuth_steps)
    az, el = np.meshgrid(azimuth, elevation, indexing="ij")                # (A, B)
    dirs = np.stack([np.cos(el) * np.cos(az), np.cos(el) * np.sin(az), np.sin(el)], axis=-1)
    return dirs.reshape(-1, 3)


def _wrap(angle):
    """Wrap radians into [-pi, pi)."""
    return (angle + np.pi) % (2 * np.pi) - np.pi


def _box_azimuth_spans(origin, centers, half_sizes, yaws):
    """Azimuth centre and half-width (K,), (K,) of each box's footprint seen from ``origin``.

    A box whose footprint contains the origin spans every azimuth (half-width pi).
    """
    unit = np.array([[1, 1], [1, -1], [-1, 1], [-1, -1]], dtype=np.float64)
    local = unit[None] * half_sizes[:, None, :2]                               # (K, 4, 2)
    cos, sin = np.cos(yaws)[:, None], np.sin(yaws)[:, None]
    corners_x = centers[:, None, 0] + local[..., 0] * cos - local[..., 1] * sin - origin[0]
    corners_y = centers[:, None, 1] + local[..., 0] * sin + local[..., 1] * cos - origin[1]
    center_az = np.arctan2(centers[:, 1] - origin[1], centers[:, 0] - origin[0])
    delta = _wrap(np.arctan2(corners_y, corners_x) - center_az[:, None])       # (K, 4)
    span_center = center_az + (delta.max(1) + delta.min(1)) / 2
    span_half = (delta.max(1) - delta.min(1)) / 2
    rel = origin[None, :2] - centers[:, :2]
    along = np.abs(rel[:, 0] * cos[:, 0] + rel[:, 1] * sin[:, 0])
    across = np.abs(-rel[:, 0] * sin[:, 0] + rel[:, 1] * cos[:, 0])
    inside = (along <= half_sizes[:, 0] + 0.1) & (across <= half_sizes[:, 1] + 0.1)
    return span_center, np.where(inside, np.pi, span_half)


def _ray_azimuth_span(dirs_world):
    """Azimuth centre and half-width of a contiguous group of rays (N, 3)."""
    horizontal = np.hypot(dirs_world[:, 0], dirs_world[:, 1])
    if np.any(horizontal < 1e-6):               # a vertical ray has no azimuth: test every box
        return 0.0, np.pi
    az = np.arctan2(dirs_world[:, 1], dirs_world[:, 0])
    mean = np.arctan2(np.sin(az).mean(), np.cos(az).mean())
    return mean, float(np.abs(_wrap(az - mean)).max())


def slab_intersect(origin, dirs_world, centers, half_sizes, yaws):
    """Exact ray / oriented-box intersection.

    origin (3,), dirs_world (N, 3) unit, boxes: centers (K, 3), half_sizes (K, 3), yaws (K,) rad.
    Returns t_near (N, K) (distance to the entry point, inf where the ray misses or starts inside)
    and incidence (N, K): |cos| between the ray and the normal of the entered face.
    """
    cos, sin = np.cos(yaws), np.sin(yaws)
    rel = origin[None, :] - centers                                             # (K, 3)
    origin_local = np.stack([rel[:, 0] * cos + rel[:, 1] * sin,
                             -rel[:, 0] * sin + rel[:, 1] * cos, rel[:, 2]], axis=-1)
    dx, dy = dirs_world[:, None, 0], dirs_world[:, None, 1]
    dz = np.broadcast_to(dirs_world[:, None, 2], dx.shape[:1] + cos.shape)
    dirs_local = np.stack([dx * cos + dy * sin, -dx * sin + dy * cos, dz], axis=-1)  # (N, K, 3)
    # Axis-parallel rays would divide by zero; a tiny signed value keeps the slab logic exact.
    safe = np.where(np.abs(dirs_local) < 1e-12, np.copysign(1e-12, dirs_local), dirs_local)
    t_a = (-half_sizes[None] - origin_local[None]) / safe
    t_b = (half_sizes[None] - origin_local[None]) / safe
    t_min, t_max = np.minimum(t_a, t_b), np.maximum(t_a, t_b)
    t_near, t_far = t_min.max(axis=-1), t_max.min(axis=-1)
    hit = (t_near <= t_far) & (t_near > 0)
    entry_axis = t_min.argmax(axis=-1)
    incidence = np.abs(np.take_along_axis(dirs_local, entry_axis[..., None], axis=-1)[..., 0])
    return np.where(hit, t_near, np.inf), incidence


def _nearest_box_hits(origin, dirs_world, boxes, sectors):
    """Nearest box hit per ray: t (N,) (inf if none), box index (N,) (-1), incidence (N,)."""
    centers, half_sizes, yaws = boxes
    n_rays = dirs_world.shape[0]
    t_best = np.full(n_rays, np.inf)
    idx_best = np.full(n_rays, -1, dtype=np.int64)
    incidence_best = np.zeros(n_rays)
    if len(centers) == 0:
        return t_best, idx_best, incidence_best
    box_center, box_half = _box_azimuth_spans(origin, centers, half_sizes, yaws)
    for rays in np.array_split(np.arange(n_rays), sectors):
        if len(rays) == 0:
            continue
        ray_center, ray_half = _ray_azimuth_span(dirs_world[rays])
        near = np.abs(_wrap(box_center - ray_center)) <= box_half + ray_half + 1e-3
        candidates = np.flatnonzero(near)
        if len(candidates) == 0:
            continue
        t_near, incidence = slab_intersect(origin, dirs_world[rays], centers[candidates],
                                           half_sizes[candidates], yaws[candidates])
        best = t_near.argmin(axis=1)
        rows = np.arange(len(rays))
        t_best[rays] = t_near[rows, best]
        idx_best[rays] = np.where(np.isfinite(t_near[rows, best]), candidates[best], -1)
        incidence_best[rays] = incidence[rows, best]
    return t_best, idx_best, incidence_best


def _cull_boxes(scene, origin, max_range, exclude_ids):
    """Scene boxes that are not excluded and could be within ``max_range`` of ``origin``."""
    centers, half_sizes, yaws, ids, reflectivity = scene.box_arrays()
    keep = ~np.isin(ids, np.asarray(list(exclude_ids), dtype=np.int64))
    radius = np.linalg.norm(half_sizes, axis=1)
    keep &= np.linalg.norm(centers - origin[None], axis=1) - radius <= max_range
    return centers[keep], half_sizes[keep], yaws[keep], ids[keep], reflectivity[keep]


def _intensity(reflectivity, incidence, ranges, cfg, rng):
    """Intensity in [0, 1]: material reflectivity, shaded by incidence, fading with range."""
    shade = 0.35 + 0.65 * incidence
    fade = 1.0 - cfg.intensity_falloff * np.clip(ranges / cfg.max_range, 0.0, 1.0)
    noise = rng.normal(0.0, cfg.intensity_noise_std, size=ranges.shape)
    return np.clip(reflectivity * shade * fade + noise, 0.0, 1.0)


def cast_lidar(scene, lidar_pose, cfg: LidarConfig, rng: np.random.Generator, exclude_ids=()):
    """Scan ``scene`` from ``lidar_pose`` ([x, y, z, roll, yaw, pitch], m/deg, world frame).

    ``exclude_ids``: object ids the rays pass through (the scanning vehicle's own body).
    Returns points_lidar (N, 4) float32 [x, y, z, intensity] in the lidar frame and hit_ids (N,)
    int64: the id of the object each point lies on (``GROUND_ID`` for the ground).
    Deterministic given the state of ``rng``.
    """
    lidar_to_world = pose_to_matrix(lidar_pose)
    origin, rotation = lidar_to_world[:3, 3], lidar_to_world[:3, :3]
    phase_deg = rng.uniform(0.0, 360.0 / cfg.azimuth_steps)     # spin phase differs per sweep
    dirs_lidar = ray_directions(cfg, phase_deg)
    dirs_world = dirs_lidar @ rotation.T

    with np.errstate(divide="ignore"):
        t_ground = np.where(dirs_world[:, 2] < 0, -origin[2] / dirs_world[:, 2], np.inf)
    if origin[2] <= 0:
        t_ground[:] = np.inf
    centers, half_sizes, yaws, ids, reflectivity = _cull_boxes(scene, origin, cfg.max_range,
                                                               exclude_ids)
    t_box, box_idx, box_incidence = _nearest_box_hits(origin, dirs_world,
                                                      (centers, half_sizes, yaws), cfg.sectors)

    on_box = t_box < t_ground
    ranges = np.where(on_box, t_box, t_ground)
    hit_ids = np.where(on_box, ids[box_idx] if len(ids) else GROUND_ID, GROUND_ID)
    hit_refl = np.where(on_box, reflectivity[box_idx] if len(ids) else 0.0, GROUND_REFLECTIVITY)
    incidence = np.where(on_box, box_incidence, np.abs(dirs_world[:, 2]))

    valid = (ranges >= cfg.min_range) & (ranges <= cfg.max_range)
    ranges, dirs_lidar = ranges[valid], dirs_lidar[valid]
    hit_ids, hit_refl, incidence = hit_ids[valid], hit_refl[valid], incidence[valid]

    measured = ranges + rng.normal(0.0, cfg.range_noise_std, size=ranges.shape)
    kept = rng.random(ranges.shape) >= cfg.dropout
    intensity = _intensity(hit_refl, incidence, ranges, cfg, rng)
    points_lidar = np.concatenate([dirs_lidar * measured[:, None], intensity[:, None]], axis=1)
    return points_lidar[kept].astype(np.float32), hit_ids[kept].astype(np.int64)
