"""The synthetic town: a street grid with buildings, parked cars, moving traffic and CAVs.

World frame: metres, ground plane z = 0, yaw in degrees about +z measured from +x (the CARLA pose
convention of ``opencood.ops.transforms``). Traffic keeps to the right of its direction of travel
(right of heading (dx, dy) is (dy, -dx)). Every vehicle moves at constant speed along a route of
straight street segments; at a turn the corner is cut by one diagonal segment so the heading
changes in two 45-degree steps instead of one 90-degree jump. Vehicles never overlap: each new
one is checked against all earlier ones at every frame (separating-axis test on footprints).
Roadside units (RSUs), when a scenario has them, are static LiDARs on poles at the corners of
intersections, as in V2XSet; their ids are -1, -2, ... (negative ids mark infrastructure).

Road users (opt-in, ``RoadUserConfig``): pedestrians walk along the sidewalks (a few cross the
street at a crosswalk beside an intersection) and cyclists ride near the curb-side edge of the
lane. They are Tracks like the vehicles (``kind`` "pedestrian" / "cyclist"; the sensors see
them shaped, ``ROAD_USER_SHAPES``, inside their label boxes), drawn after everything else, so
the rest of a world is the same with or without them; ``OBJECT_CLASSES`` names every kind in
the labelled formats.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from opencood.data.synthetic.lidar import LidarConfig

# kind -> (length range, width range, height range, share of traffic). Truck height stays below
# 2.8 m: with the lidar 1.9 m up, taller boxes would poke above the z = 1 m top of the default
# evaluation range and be dropped from every ground truth.
VEHICLE_KINDS = {
    "car": ((4.2, 4.9), (1.8, 2.0), (1.4, 1.6), 0.60),
    "van": ((5.2, 5.8), (2.0, 2.2), (2.0, 2.3), 0.25),
    "truck": ((8.0, 10.0), (2.4, 2.6), (2.5, 2.75), 0.15),
}
# Road users: kind -> (length range, width range, height range), metres.
ROAD_USER_KINDS = {
    "pedestrian": ((0.5, 0.8), (0.5, 0.8), (1.6, 1.9)),
    "cyclist": ((1.6, 1.9), (0.5, 0.8), (1.6, 1.9)),
}

# What the LiDAR and the cameras see of a road user: boxes (centre, half size) given as fractions
# of its label box's half length, half width and height (z from the ground), all inside that box,
# so the label stays tight around its returns. A pedestrian: legs, torso with arms, head; a
# cyclist: a thin bicycle the whole length, the rider above its middle. (The V2X-Real parity
# fixture is read from tiny_multiclass's clouds: a change here means remaking it.)
ROAD_USER_SHAPES = {
    "pedestrian": (((0.0, 0.0, 0.25), (0.55, 0.6, 0.25)),       # legs: 0 - 0.5 h
                   ((0.0, 0.0, 0.68), (1.0, 1.0, 0.18)),        # torso: 0.5 - 0.86 h
                   ((0.0, 0.0, 0.93), (0.45, 0.45, 0.07))),     # head: 0.86 - 1.0 h
    "cyclist": (((0.0, 0.0, 0.28), (1.0, 0.25, 0.28)),          # bicycle: 0 - 0.56 h
                ((-0.1, 0.0, 0.72), (0.35, 1.0, 0.28))),        # rider: 0.44 - 1.0 h
}


@dataclass(frozen=True)
class ObjectClass:
    """What one world kind is called in the data set formats that label classes."""

    vehicle: bool          # written by the vehicle-only formats (OPV2V, V2XSet, V2V4Real)
    v2xreal: str           # V2X-Real's label name (its meta-classes group these names)
    dairv2x: str           # DAIR-V2X-C's label ``type``


# The one mapping from world kinds to class names: every writer reads its names here.
OBJECT_CLASSES = {
    "car": ObjectClass(vehicle=True, v2xreal="Car", dairv2x="Car"),
    "van": ObjectClass(vehicle=True, v2xreal="Van", dairv2x="Van"),
    "truck": ObjectClass(vehicle=True, v2xreal="Truck", dairv2x="Truck"),
    "pedestrian": ObjectClass(vehicle=False, v2xreal="Pedestrian", dairv2x="Pedestrian"),
    "cyclist": ObjectClass(vehicle=False, v2xreal="BicycleRider", dairv2x="Cyclist"),
}
VEHICLE_KIND_NAMES = tuple(kind for kind, names in OBJECT_CLASSES.items() if names.vehicle)
CAV_SIZE = (4.6, 1.9, 1.5)            # l, w, h of every CAV (fits OPV2V's own-body box)
LIDAR_MOUNT_X = -0.5                  # lidar sits 0.5 m behind the car centre, as in OPV2V
LIDAR_HEIGHT = (1.85, 1.95)           # above the ground, drawn per CAV
LIDAR_TILT_DEG = 0.15                 # max |roll|, |pitch| of the lidar per frame (road camber)
_ONE_KMH = 1.0 / 3.6                  # m/s


@dataclass(frozen=True)
class TownConfig:
    """Street grid, buildings and traffic of one scenario (lengths in metres, speeds km/h)."""

    blocks_x: int = 4                      # blocks along x (nodes = blocks + 1)
    blocks_y: int = 4
    block_size: tuple = (45.0, 75.0)       # street-centre spacing range, drawn per row/column
    lanes_per_direction: int = 1
    lane_width: float = 3.5
    parking_width: float = 2.5
    sidewalk_width: float = 2.5
    open_block_prob: float = 0.1           # blocks left empty (plazas, parks)
    building_frontage: tuple = (10.0, 28.0)
    building_depth: tuple = (10.0, 22.0)
    building_height: tuple = (6.0, 30.0)
    building_setback: tuple = (0.0, 1.5)
    building_gap_prob: float = 0.25        # chance of a gap (alley, driveway) after a building
    building_gap: tuple = (3.0, 9.0)
    parked_occupancy: float = 0.7          # chance a curb slot holds a parked vehicle
    moving_vehicles: int = 30              # moving traffic (CAVs not included)
    traffic_radius: float = 80.0           # moving traffic starts within this of the focus point
    speed_kmh: tuple = (20.0, 40.0)
    cavs: tuple = (2, 4)                   # inclusive range of CAVs per scenario
    ego_focus_distance: tuple = (12.0, 35.0)   # the ego starts this far from the focus
                                           # intersection (and at least the lower bound from any
                                           # other): near a crossing, not inside it, so the
                                           # crossing street is partly hidden from the ego
    cav_radius: float = 40.0               # other CAVs start within this of the ego
    cav_min_gap: float = 8.0               # ... and at least this far from it
    cav_other_street_prob: float = 0.7     # chance a CAV must drive on a street no earlier CAV
                                           # is on: crossing streets are where cooperation pays

    @property
    def half_street(self) -> float:
        """Centre line to the building line (lanes, parking lane, sidewalk)."""
        return self.lanes_per_direction * self.lane_width + self.parking_width + \
            self.sidewalk_width


@dataclass(frozen=True)
class RsuConfig:
    """Roadside units of a scenario: LiDARs on poles at intersection corners, never moving.

    The pole stands ``curb_inset`` metres onto the sidewalk at a corner, its LiDAR facing the
    crossing: the buildings are behind the vehicle own-body box that readers crop from every
    agent's cloud (OpenCOOD crops RSUs too) and the lanes before it, so the box holds none of
    its returns (none in all of ``v2x_small``, seed 0).
    """

    lidar: LidarConfig                     # its own beam pattern (a FOV that looks down)
    count: tuple = (1, 1)                  # inclusive range of RSUs per scenario
    height: tuple = (4.0, 5.0)             # lidar above the ground (m), drawn per RSU
    curb_inset: float = 0.5                # pole distance from the curb onto the sidewalk (m)


@dataclass(frozen=True)
class RoadUserConfig:
    """Pedestrians and cyclists of a scenario (counts; lengths in metres, speeds km/h).

    Pedestrians walk along a sidewalk, their centre ``sidewalk_clearance`` inside its edges;
    ``crossing_share`` of them cross the street instead, on a crosswalk ``crosswalk_offset``
    before the next intersection's corner (between it and the first parked vehicle). Cyclists
    ride the street routes the traffic rides, ``cyclist_curb_gap`` inside the curb-side edge of
    the lane. All start within ``radius`` of the focus intersection (None: the town's
    ``traffic_radius``); ``margin`` grows their footprints in the overlap test (the vehicles'
    0.4 m would not fit a walker between parked trucks and buildings).
    """

    pedestrians: int = 20
    cyclists: int = 8
    pedestrian_speed_kmh: tuple = (3.0, 6.0)
    cyclist_speed_kmh: tuple = (12.0, 20.0)
    crossing_share: float = 0.15
    crosswalk_offset: float = 1.0
    sidewalk_clearance: tuple = (0.9, 0.5)     # from the parking-lane side, from the building line
    cyclist_curb_gap: float = 0.9
    radius: float | None = None
    margin: float = 0.2
    attempts_per_user: int = 10


@dataclass(frozen=True)
class Building:
    """A box standing on the ground, turned by yaw_deg; ids are negative (below lidar.GROUND_ID)."""

    building_id: int
    x: float
    y: float
    half_length: float
    half_width: float
    height: float
    yaw_deg: float = 0.0
    reflectivity: float = 0.3


@dataclass(frozen=True)
class Vehicle:
    """A vehicle at one instant: origin (x, y) on the ground at the box centre's footprint."""

    actor_id: int
    x: float
    y: float
    yaw_deg: float
    extent: tuple                          # half length, half width, half height
    speed_kmh: float = 0.0
    reflectivity: float = 0.5
    kind: str = "car"                      # a key of OBJECT_CLASSES


@dataclass
class Scene:
    """Everything a LiDAR can hit at one instant (besides the ground)."""

    buildings: list = field(default_factory=list)
    vehicles: list = field(default_factory=list)

    @cached_property
    def _arrays(self):
        rows = [(b.x, b.y, b.height / 2, b.half_length, b.half_width, b.height / 2,
                 np.radians(b.yaw_deg), b.building_id, b.reflectivity) for b in self.buildings]
        for v in self.vehicles:
            rows += _shape_rows(v)
        table = np.asarray(rows, dtype=np.float64).reshape(-1, 9)
        return (table[:, 0:3], table[:, 3:6], table[:, 6], table[:, 7].astype(np.int64),
                table[:, 8])

    def box_arrays(self):
        """centers (K, 3), half_sizes (K, 3), yaws_rad (K,), ids (K,) int64, reflectivity (K,);
        a road user is several boxes of one id (``ROAD_USER_SHAPES``)."""
        return self._arrays


def _shape_rows(vehicle: Vehicle) -> list:
    """Box rows (x, y, z, half l, half w, half h, yaw rad, id, reflectivity) of what the
    sensors see of ``vehicle``: its label box, or a road user's parts."""
    yaw = np.radians(vehicle.yaw_deg)
    half_l, half_w, half_h = vehicle.extent
    if vehicle.kind not in ROAD_USER_SHAPES:
        return [(vehicle.x, vehicle.y, half_h, half_l, half_w, half_h, yaw, vehicle.actor_id,
                 vehicle.reflectivity)]
    rows = []
    for (along, across, up), (size_l, size_w, size_h) in ROAD_USER_SHAPES[vehicle.kind]:
        dx, dy = along * half_l, across * half_w
        rows.append((vehicle.x + dx * np.cos(yaw) - dy * np.sin(yaw),
                     vehicle.y + dx * np.sin(yaw) + dy * np.cos(yaw), up * 2 * half_h,
                     size_l * half_l, size_w * half_w, size_h * 2 * half_h, yaw,
                     vehicle.actor_id, vehicle.reflectivity))
    return rows


# ---------------------------------------------------------------------------------------------
# Street grid and routes

@dataclass(frozen=True)
class StreetGrid:
    """Street centre lines: x = xs[i] (running along y) and y = ys[j] (running along x)."""

    xs: np.ndarray
    ys: np.ndarray

    def node(self, i, j) -> np.ndarray:
        return np.array([self.xs[i], self.ys[j]], dtype=np.float64)

    def inside(self, i, j) -> bool:
        return 0 <= i < len(self.xs) and 0 <= j < len(self.ys)


def make_grid(town: TownConfig, rng: np.random.Generator) -> StreetGrid:
    """Street grid centred on the origin with block sizes drawn from ``town.block_size``."""
    def axis(blocks):
        pitches = rng.uniform(*town.block_size, size=blocks)
        nodes = np.concatenate([[0.0], np.cumsum(pitches)])
        return nodes - nodes[-1] / 2
    return StreetGrid(xs=axis(town.blocks_x), ys=axis(town.blocks_y))


_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))


def _right_of(direction) -> np.ndarray:
    return np.array([direction[1], -direction[0]], dtype=np.float64)


@dataclass(frozen=True)
class Route:
    """A polyline (P, 2) followed at constant speed, parameterised by arc length."""

    points: np.ndarray

    @cached_property
    def cumulative(self) -> np.ndarray:
        steps = np.linalg.norm(np.diff(self.points, axis=0), axis=1)
        return np.concatenate([[0.0], np.cumsum(steps)])

    def pose_at(self, arc) -> np.ndarray:
        """Poses (n, 3) [x, y, yaw_deg] at arc lengths ``arc`` (n,), clamped to the route."""
        arc = np.clip(np.asarray(arc, dtype=np.float64), 0.0, self.cumulative[-1])
        seg = np.clip(np.searchsorted(self.cumulative, arc, side="right") - 1, 0,
                      len(self.points) - 2)
        start, end = self.points[seg], self.points[seg + 1]
        length = self.cumulative[seg + 1] - self.cumulative[seg]
        frac = (arc - self.cumulative[seg]) / np.maximum(length, 1e-9)
        xy = start + (end - start) * frac[:, None]
        yaw = np.degrees(np.arctan2(end[:, 1] - start[:, 1], end[:, 0] - start[:, 0]))
        return np.concatenate([xy, yaw[:, None]], axis=1)


def _next_direction(grid, i, j, direction, rng):
    """Straight (likely), left or right at node (i, j); never a U-turn or off the grid."""
    left = (-direction[1], direction[0])
    right = (direction[1], -direction[0])
    options = [(d, w) for d, w in ((direction, 0.6), (left, 0.2), (right, 0.2))
               if grid.inside(i + d[0], j + d[1])]
    weights = np.array([w for _, w in options])
    return options[rng.choice(len(options), p=weights / weights.sum())][0]


def random_route(grid, start_node, direction, lane_offset, min_length, rng,
                 corner_cut=3.0) -> Route:
    """Route from ``start_node`` towards ``direction`` in the lane ``lane_offset`` right of the
    centre line, turning at random, until it is at least ``min_length`` long."""
    i, j = start_node
    points = [grid.node(i, j) + _right_of(direction) * lane_offset]
    length = 0.0
    while True:
        i, j = i + direction[0], j + direction[1]
        here = grid.node(i, j) + _right_of(direction) * lane_offset
        length += np.linalg.norm(here - points[-1])
        if length >= min_length:
            points.append(here)
            return Route(np.asarray(points))
        new_direction = _next_direction(grid, i, j, direction, rng)
        if new_direction != direction:
            corner = grid.node(i, j) + (_right_of(direction) + _right_of(new_direction)) * \
                lane_offset
            points.append(corner - np.asarray(direction) * corner_cut)
            points.append(corner + np.asarray(new_direction) * corner_cut)
            length += 2 * corner_cut  # close enough for a length budget
            direction = new_direction


def street_segments(grid):
    """Every (start_node, direction) pair whose next node is on the grid."""
    return [((i, j), d) for i in range(len(grid.xs)) for j in range(len(grid.ys))
            for d in _DIRECTIONS if grid.inside(i + d[0], j + d[1])]


# ---------------------------------------------------------------------------------------------
# Buildings

def _block_side_buildings(x0, x1, y_front, depth_sign, max_depth, town, rng, along_x, next_id):
    """Buildings along one side of a block: frontage walks from x0 to x1 on the line y_front."""
    buildings = []
    u = x0
    while x1 - u > 4.0:
        frontage = min(rng.uniform(*town.building_frontage), x1 - u)
        depth = min(rng.uniform(*town.building_depth), max_depth)
        setback = rng.uniform(*town.building_setback)
        height = rng.uniform(*town.building_height)
        along = u + frontage / 2
        across = y_front + depth_sign * (setback + depth / 2)
        x, y = (along, across) if along_x else (across, along)
        half_l, half_w = (frontage / 2, depth / 2) if along_x else (depth / 2, frontage / 2)
        buildings.append(Building(next_id - len(buildings), float(x), float(y), float(half_l),
                                  float(half_w), float(height),
                                  reflectivity=float(rng.uniform(0.2, 0.45))))
        u += frontage
        if rng.random() < town.building_gap_prob:
            u += rng.uniform(*town.building_gap)
    return buildings


def place_buildings(grid, town: TownConfig, rng) -> list:
    """Buildings lining the four sides of each block; some blocks are left open."""
    buildings = []
    hs = town.half_street
    for i in range(len(grid.xs) - 1):
        for j in range(len(grid.ys) - 1):
            if rng.random() < town.open_block_prob:
                continue
            x0, x1 = grid.xs[i] + hs, grid.xs[i + 1] - hs
            y0, y1 = grid.ys[j] + hs, grid.ys[j + 1] - hs
            sides = ((x0, x1, y0, +1, True), (x0, x1, y1, -1, True),
                     (y0, y1, x0, +1, False), (y0, y1, x1, -1, False))
            for start, end, front, sign, along_x in sides:
                max_depth = ((y1 - y0) if along_x else (x1 - x0)) / 2
                next_id = -2 - len(buildings)
                buildings += _block_side_buildings(start, end, front, sign, max_depth, town,
                                                   rng, along_x, next_id)
    return buildings


# ---------------------------------------------------------------------------------------------
# Vehicles

@dataclass
class Track:
    """One vehicle over the scenario: poses (F, 3) [x, y, yaw_deg] at every frame."""

    actor_id: int
    kind: str
    extent: tuple                          # half length, half width, half height
    reflectivity: float
    speed_kmh: float
    poses: np.ndarray
    route: Route | None = None
    start_arc: float = 0.0

    def vehicle_at(self, frame: int) -> Vehicle:
        x, y, yaw = self.poses[frame]
        return Vehicle(self.actor_id, float(x), float(y), float(yaw), self.extent,
                       self.speed_kmh, self.reflectivity, self.kind)

    def future_poses(self, frame, dt, horizons) -> np.ndarray:
        """Poses (len(horizons), 3) ``horizons`` seconds after ``frame``."""
        if self.route is None:
            return np.repeat(self.poses[frame][None], len(horizons), axis=0)
        arc = self.start_arc + self.speed_kmh * _ONE_KMH * (frame * dt + np.asarray(horizons))
        return self.route.pose_at(arc)


def sample_kind(rng, kinds=VEHICLE_KINDS) -> str:
    names = list(kinds)
    shares = np.array([kinds[k][3] for k in names])
    return names[rng.choice(len(names), p=shares / shares.sum())]


def sample_extent(kind, rng) -> tuple:
    sizes = VEHICLE_KINDS[kind] if kind in VEHICLE_KINDS else ROAD_USER_KINDS[kind]
    length, width, height = (rng.uniform(*r) for r in sizes[:3])
    return (float(length / 2), float(width / 2), float(height / 2))


def _footprint(poses, extents):
    """Corners (..., 4, 2) and unit axes (..., 2, 2) of footprints; poses (..., 3), extents
    (..., 2) half length / width."""
    yaw = np.radians(poses[..., 2])
    heading = np.stack([np.cos(yaw), np.sin(yaw)], axis=-1)
    normal = np.stack([-np.sin(yaw), np.cos(yaw)], axis=-1)
    signs = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]], dtype=np.float64)
    offsets = (signs[:, 0, None] * extents[..., None, 0:1] * heading[..., None, :]
               + signs[:, 1, None] * extents[..., None, 1:2] * normal[..., None, :])
    return poses[..., None, :2] + offsets, np.stack([heading, normal], axis=-2)


def footprints_overlap(poses_new, extent_new, poses_old, extents_old, margin=0.4) -> bool:
    """Whether a new vehicle (poses (F, 3), extent (3,)) touches any old one (poses (F, K, 3),
    extents (K, 3)) at any frame, footprints grown by ``margin``: separating-axis test."""
    extents_old = np.asarray(extents_old).reshape(-1, 3)
    # Bounding circles first: only vehicles that ever come close need the exact test.
    distance = np.linalg.norm(poses_old[..., :2] - poses_new[:, None, :2], axis=-1)   # (F, K)
    reach = np.hypot(*extent_new[:2]) + np.hypot(extents_old[:, 0], extents_old[:, 1]) \
        + 2 * margin
    close = (distance <= reach).any(axis=0)
    if not close.any():
        return False
    poses_old, extents_old = poses_old[:, close], extents_old[close]
    grow = np.array([margin, margin])
    corners_a, axes_a = _footprint(poses_new[:, None], np.asarray(extent_new[:2]) + grow)
    corners_b, axes_b = _footprint(poses_old, np.asarray(extents_old)[:, :2] + grow)
    corners_a = np.broadcast_to(corners_a, corners_b.shape)
    axes = np.concatenate([np.broadcast_to(axes_a, axes_b.shape), axes_b], axis=-2)  # F,K,4,2
    proj_a = np.einsum("fkac,fkpc->fkap", axes, corners_a)
    proj_b = np.einsum("fkac,fkpc->fkap", axes, corners_b)
    separated = (proj_a.max(-1) < proj_b.min(-1)) | (proj_b.max(-1) < proj_a.min(-1))
    return bool((~separated.any(axis=-1)).any())


class TrackSet:
    """Accepted tracks plus stacked poses for fast overlap tests."""

    def __init__(self, frames):
        self.tracks = []
        self._poses = np.zeros((frames, 0, 3))
        self._extents = np.zeros((0, 3))

    def try_add(self, track: Track, margin: float = 0.4) -> bool:
        if footprints_overlap(track.poses, track.extent, self._poses, self._extents, margin):
            return False
        self.add(track)
        return True

    def add(self, track: Track):
        self.tracks.append(track)
        self._poses = np.concatenate([self._poses, track.poses[:, None]], axis=1)
        self._extents = np.concatenate([self._extents, np.asarray(track.extent)[None]], axis=0)


def _curb_vehicles(start, end, line_point, direction, yaw_deg, town, rng):
    """Parked (kind, extent, x, y) along one curb from arc ``start`` to ``end``."""
    parked = []
    u = start + rng.uniform(0.0, 3.0)
    while True:
        if rng.random() >= town.parked_occupancy:
            u += rng.uniform(5.0, 8.0)
            if u > end:
                return parked
            continue
        kind = sample_kind(rng)
        extent = sample_extent(kind, rng)
        if u + 2 * extent[0] > end:
            return parked
        xy = line_point + direction * (u + extent[0])
        parked.append((kind, extent, float(xy[0]), float(xy[1]), yaw_deg))
        u += 2 * extent[0] + rng.uniform(0.8, 2.5)


def place_parked(grid, town: TownConfig, frames, rng, next_id) -> list:
    """Static tracks for vehicles parked along both curbs of every street segment."""
    tracks = []
    curb = town.lanes_per_direction * town.lane_width + town.parking_width / 2
    margin = town.half_street + 2.0        # keep crossings clear
    for (i, j), d in street_segments(grid):
        if d not in ((1, 0), (0, 1)):      # each segment once; both curbs below
            continue
        a, b = grid.node(i, j), grid.node(i + d[0], j + d[1])
        direction = (b - a) / np.linalg.norm(b - a)
        seg_len = float(np.linalg.norm(b - a))
        for side, yaw_offset in ((-1.0, 0.0), (1.0, 180.0)):   # right curb faces along d
            line_point = a + _right_of(d) * curb * -side
            yaw = float(np.degrees(np.arctan2(direction[1], direction[0])) + yaw_offset)
            for kind, extent, x, y, yaw_deg in _curb_vehicles(
                    margin, seg_len - margin, line_point, direction, yaw, town, rng):
                poses = np.repeat([[x, y, yaw_deg]], frames, axis=0)
                tracks.append(Track(next_id(), kind, extent, float(rng.uniform(0.35, 0.85)),
                                    0.0, poses))
    return tracks


def _segment_near(grid, center, radius, rng) -> tuple:
    """(start node, direction, length) of a random street segment whose middle lies within
    ``radius`` of ``center`` (any segment when none does)."""
    segments = street_segments(grid)
    middles = np.array([(grid.node(*n) + grid.node(n[0] + d[0], n[1] + d[1])) / 2
                        for n, d in segments])
    near = np.flatnonzero(np.linalg.norm(middles - center, axis=1) <= radius)
    pool = near if len(near) else np.arange(len(segments))
    node, direction = segments[pool[rng.integers(len(pool))]]
    seg_len = float(np.linalg.norm(grid.node(node[0] + direction[0], node[1] + direction[1])
                                   - grid.node(*node)))
    return node, direction, seg_len


def sample_moving_track(grid, town, frames, dt, center, radius, rng, kind=None,
                        extent=None, lane_offset=None, speed_kmh_range=None) -> Track:
    """A vehicle driving a random route from a street segment whose middle lies within
    ``radius`` of ``center`` (actor id 0: set by the caller). ``lane_offset`` (m right of the
    centre line; default: the centre of a random lane) and ``speed_kmh_range`` (default the
    town's) let a cyclist ride the same routes."""
    node, direction, seg_len = _segment_near(grid, center, radius, rng)
    if lane_offset is None:
        lane = rng.integers(town.lanes_per_direction)
        lane_offset = (lane + 0.5) * town.lane_width
    start_arc = rng.uniform(town.half_street, seg_len - town.half_street)
    speed_kmh = float(rng.uniform(*(speed_kmh_range or town.speed_kmh)))
    duration = (frames - 1) * dt + 3.0     # margin for plan_trajectory's look-ahead
    route = random_route(grid, node, direction, lane_offset,
                         start_arc + speed_kmh * _ONE_KMH * duration + 1.0, rng)
    kind = kind or sample_kind(rng)
    extent = extent or sample_extent(kind, rng)
    arcs = start_arc + speed_kmh * _ONE_KMH * dt * np.arange(frames)
    return Track(0, kind, extent, float(rng.uniform(0.35, 0.85)), speed_kmh,
                 route.pose_at(arcs), route, float(start_arc))


def sample_pedestrian_track(grid, town, users: RoadUserConfig, frames, dt, center, radius,
                            rng) -> Track:
    """A pedestrian walking in a straight line at constant speed (actor id 0: set by the
    caller): along the sidewalk right of a street segment near ``center``, between the two
    intersections' building lines, or (``users.crossing_share`` of them) across the street on
    the crosswalk just before the segment's far intersection, from the right sidewalk to the
    left one; a crossing pedestrian may start anywhere on it."""
    node, direction, seg_len = _segment_near(grid, center, radius, rng)
    start_node = grid.node(*node)
    along, right = np.asarray(direction, dtype=np.float64), _right_of(direction)
    speed_kmh = float(rng.uniform(*users.pedestrian_speed_kmh))
    walked = speed_kmh * _ONE_KMH * dt * max(frames - 1, 0)
    sidewalk_inner = town.lanes_per_direction * town.lane_width + town.parking_width
    if rng.random() < users.crossing_share:
        crossing_at = seg_len - town.half_street - users.crosswalk_offset
        middle_of_sidewalk = sidewalk_inner + town.sidewalk_width / 2
        start = start_node + along * crossing_at + right * middle_of_sidewalk
        end = start_node + along * crossing_at - right * middle_of_sidewalk
    else:
        inner, outer = users.sidewalk_clearance
        offset = rng.uniform(sidewalk_inner + inner, town.half_street - outer)
        start = start_node + along * town.half_street + right * offset
        end = start_node + along * (seg_len - town.half_street) + right * offset
    route = Route(np.stack([start, end]))
    start_arc = float(rng.uniform(0.0, max(route.cumulative[-1] - walked, 0.0)))
    extent = sample_extent("pedestrian", rng)
    arcs = start_arc + speed_kmh * _ONE_KMH * dt * np.arange(frames)
    return Track(0, "pedestrian", extent, float(rng.uniform(0.2, 0.5)), speed_kmh,
                 route.pose_at(arcs), route, start_arc)


def place_road_users(grid, town, users: RoadUserConfig, frames, dt, focus, track_set,
                     rng) -> list:
    """Pedestrians, then cyclists, each added to ``track_set`` when it overlaps no earlier
    track at any frame (footprints grown by ``users.margin``); at most
    ``users.attempts_per_user`` draws per wanted one. Returns the added tracks (actor id 0)."""
    radius = town.traffic_radius if users.radius is None else users.radius
    curb_side = town.lanes_per_direction * town.lane_width - users.cyclist_curb_gap
    samplers = (
        (users.pedestrians, lambda: sample_pedestrian_track(grid, town, users, frames, dt,
                                                            focus, radius, rng)),
        (users.cyclists, lambda: sample_moving_track(
            grid, town, frames, dt, focus, radius, rng, kind="cyclist", lane_offset=curb_side,
            speed_kmh_range=users.cyclist_speed_kmh)),
    )
    added = []
    for wanted, sample in samplers:
        placed = 0
        for _ in range(wanted * users.attempts_per_user):
            if placed == wanted:
                break
            track = sample()
            if track_set.try_add(track, margin=users.margin):
                added.append(track)
                placed += 1
    return added


@dataclass
class World:
    """One scenario: static buildings, vehicle tracks, CAVs (ego first) and their lidar poses."""

    grid: StreetGrid
    buildings: list
    tracks: list
    cav_ids: list                          # ascending; the first is the ego (OPV2V sorts ids)
    lidar_poses: dict                      # cav id -> (F, 6) [x, y, z, roll, yaw, pitch]
    frames: int
    dt: float
    rsu_ids: list = field(default_factory=list)   # -1, -2, ...; their poses in lidar_poses

    @property
    def agent_ids(self) -> list:
        """Every agent in the order a reader lists them: vehicle CAVs, then RSUs."""
        return self.cav_ids + self.rsu_ids

    def track(self, actor_id) -> Track:
        return next(t for t in self.tracks if t.actor_id == actor_id)

    def scene_at(self, frame: int) -> Scene:
        return Scene(self.buildings, [t.vehicle_at(frame) for t in self.tracks])


def street_of(grid, pose) -> tuple:
    """(axis, index) of the street a pose [x, y, yaw_deg] drives along: axis 0 = a street of
    constant y (running along x), 1 = constant x."""
    yaw = np.radians(pose[2])
    if abs(np.cos(yaw)) >= abs(np.sin(yaw)):
        return 0, int(np.argmin(np.abs(grid.ys - pose[1])))
    return 1, int(np.argmin(np.abs(grid.xs - pose[0])))


def _distance_to_nodes(grid, xy) -> float:
    """Distance from ``xy`` to the nearest intersection centre."""
    nodes = np.stack(np.meshgrid(grid.xs, grid.ys, indexing="ij"), axis=-1).reshape(-1, 2)
    return float(np.linalg.norm(nodes - np.asarray(xy)[None], axis=1).min())


def _place_cavs(grid, town, frames, dt, focus, track_set, rng, attempts=400):
    """CAV tracks: the first near ``focus``, the others within ``cav_radius`` of it, most of
    them on streets no earlier CAV drives on (they see what the others cannot)."""
    cav_extent = tuple(s / 2 for s in CAV_SIZE)
    n_cavs = int(rng.integers(town.cavs[0], town.cavs[1] + 1))
    cavs = []
    for _ in range(attempts):
        if len(cavs) == n_cavs:
            break
        center = focus if not cavs else cavs[0].poses[0, :2]
        radius = town.block_size[1] if not cavs else town.cav_radius + town.block_size[1] / 2
        other_street = rng.random() < town.cav_other_street_prob
        track = sample_moving_track(grid, town, frames, dt, center, radius, rng, "car",
                                    cav_extent)
        if not cavs:
            low, high = town.ego_focus_distance
            if not low <= np.linalg.norm(track.poses[0, :2] - focus) <= high or \
                    _distance_to_nodes(grid, track.poses[0, :2]) < low:
                continue
        else:
            gap = np.linalg.norm(track.poses[0, :2] - cavs[0].poses[0, :2])
            if not town.cav_min_gap <= gap <= town.cav_radius:
                continue
            taken = {street_of(grid, cav.poses[0]) for cav in cavs}
            if other_street and street_of(grid, track.poses[0]) in taken:
                continue
        if track_set.try_add(track):
            cavs.append(track)
    return cavs


def _lidar_poses(track: Track, rng) -> np.ndarray:
    """(F, 6) lidar poses of a CAV: mount offset, per-CAV height, small per-frame tilt."""
    yaw = np.radians(track.poses[:, 2])
    x = track.poses[:, 0] + LIDAR_MOUNT_X * np.cos(yaw)
    y = track.poses[:, 1] + LIDAR_MOUNT_X * np.sin(yaw)
    z = np.full_like(x, rng.uniform(*LIDAR_HEIGHT))
    roll, pitch = rng.uniform(-LIDAR_TILT_DEG, LIDAR_TILT_DEG, size=(2, len(x)))
    return np.stack([x, y, z, roll, track.poses[:, 2], pitch], axis=1)


def _nodes_by_distance(grid, xy) -> list:
    """Intersections (i, j) ordered by distance from ``xy``, nearest first."""
    nodes = [(i, j) for i in range(len(grid.xs)) for j in range(len(grid.ys))]
    return sorted(nodes, key=lambda n: float(np.linalg.norm(grid.node(*n) - xy)))


def place_rsus(grid, town: TownConfig, rsu: RsuConfig, focus, frames, rng) -> dict:
    """{rsu_id: (F, 6) lidar pose, the same every frame}: one RSU per intersection, the focus
    intersection first, then the nearest others; each on a random corner, facing the crossing.

    Ids -1, -2, ... as V2XSet names its infrastructure folders.
    """
    count = int(rng.integers(rsu.count[0], rsu.count[1] + 1))
    offset = town.lanes_per_direction * town.lane_width + town.parking_width + rsu.curb_inset
    poses = {}
    for index, node in enumerate(_nodes_by_distance(grid, focus)[:count]):
        corner = rng.choice([-1.0, 1.0], size=2)
        x, y = grid.node(*node) + offset * corner
        yaw = float(np.degrees(np.arctan2(-corner[1], -corner[0])))
        height = float(rng.uniform(*rsu.height))
        poses[-1 - index] = np.repeat([[x, y, height, 0.0, yaw, 0.0]], frames, axis=0)
    return poses


def build_world(town: TownConfig, frames: int, dt: float, rng: np.random.Generator,
                rsu: RsuConfig | None = None, road_users: RoadUserConfig | None = None) -> World:
    """A whole scenario from ``rng``: grid, buildings, parked cars, CAVs, moving traffic and,
    with ``rsu``, roadside units, then with ``road_users`` pedestrians and cyclists (each drawn
    after the rest, so the rest is the same with or without them)."""
    grid = make_grid(town, rng)
    buildings = place_buildings(grid, town, rng)
    id_pool = iter(rng.permutation(np.arange(1000, 10000)).tolist())   # 4-digit actor ids
    track_set = TrackSet(frames)
    for track in place_parked(grid, town, frames, rng, lambda: next(id_pool)):
        track_set.add(track)                # curb slots never overlap by construction
    focus = grid.node(int(rng.integers(1, len(grid.xs) - 1)),
                      int(rng.integers(1, len(grid.ys) - 1)))
    cavs = _place_cavs(grid, town, frames, dt, focus, track_set, rng)
    # The ego is the first CAV folder in string order: give it the smallest id.
    for track, cav_id in zip(cavs, sorted(next(id_pool) for _ in cavs)):
        track.actor_id = cav_id
    added = 0
    for _ in range(town.moving_vehicles * 10):
        if added == town.moving_vehicles:
            break
        track = sample_moving_track(grid, town, frames, dt, focus, town.traffic_radius, rng)
        if track_set.try_add(track):
            track.actor_id = next(id_pool)
            added += 1
    lidar_poses = {t.actor_id: _lidar_poses(t, rng) for t in cavs}
    rsu_poses = place_rsus(grid, town, rsu, focus, frames, rng) if rsu is not None else {}
    if road_users is not None:
        for track in place_road_users(grid, town, road_users, frames, dt, focus, track_set, rng):
            track.actor_id = next(id_pool)
    return World(grid, buildings, track_set.tracks, [t.actor_id for t in cavs],
                 {**lidar_poses, **rsu_poses}, frames, dt, rsu_ids=list(rsu_poses))
