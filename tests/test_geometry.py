"""Pose and box geometry (opencood.ops.transforms) against hand-made cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

from opencood.ops.transforms import (
    apply_transform,
    boxes_to_corners_3d,
    corners_to_boxes,
    count_points_in_boxes,
    points_in_boxes_mask,
    pose_to_matrix,
    relative_transform,
)

HALF_SQRT3 = math.sqrt(3.0) / 2.0


def _wrap(angle):
    return (np.asarray(angle) + np.pi) % (2 * np.pi) - np.pi


def test_pure_yaw_90_is_rotation_about_z_and_translation_in_last_column():
    matrix = pose_to_matrix([1.0, 2.0, 3.0, 0.0, 90.0, 0.0])
    expected = np.array([[0.0, -1.0, 0.0, 1.0],
                         [1.0, 0.0, 0.0, 2.0],
                         [0.0, 0.0, 1.0, 3.0],
                         [0.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(matrix, expected, atol=1e-12)


def test_pure_roll_30_follows_carla_convention():
    # cy=1, sy=0, cp=1, sp=0: R11=cr, R12=sr, R21=-sr, R22=cr (left-handed CARLA).
    matrix = pose_to_matrix([0.0, 0.0, 0.0, 30.0, 0.0, 0.0])
    expected = np.array([[1.0, 0.0, 0.0],
                         [0.0, HALF_SQRT3, 0.5],
                         [0.0, -0.5, HALF_SQRT3]])
    np.testing.assert_allclose(matrix[:3, :3], expected, atol=1e-12)


def test_pure_pitch_30_follows_carla_convention():
    # cy=1, sy=0, cr=1, sr=0: R00=cp, R02=-sp, R20=sp, R22=cp.
    matrix = pose_to_matrix([0.0, 0.0, 0.0, 0.0, 0.0, 30.0])
    expected = np.array([[HALF_SQRT3, 0.0, -0.5],
                         [0.0, 1.0, 0.0],
                         [0.5, 0.0, HALF_SQRT3]])
    np.testing.assert_allclose(matrix[:3, :3], expected, atol=1e-12)


def test_roll_yaw_pitch_pose_matches_design_formula():
    roll, yaw, pitch = 7.0, -35.0, 12.0          # pose order is [x, y, z, roll, yaw, pitch]
    cr, sr = math.cos(math.radians(roll)), math.sin(math.radians(roll))
    cy, sy = math.cos(math.radians(yaw)), math.sin(math.radians(yaw))
    cp, sp = math.cos(math.radians(pitch)), math.sin(math.radians(pitch))
    expected = np.array([
        [cp * cy, cy * sp * sr - sy * cr, -cy * sp * cr - sy * sr, 4.0],
        [sy * cp, sy * sp * sr + cy * cr, -sy * sp * cr + cy * sr, -5.0],
        [sp, -cp * sr, cp * cr, 0.5],
        [0.0, 0.0, 0.0, 1.0]])
    np.testing.assert_allclose(pose_to_matrix([4.0, -5.0, 0.5, roll, yaw, pitch]), expected,
                               atol=1e-12)


@pytest.mark.parametrize("pose", [[3.0, -2.0, 1.5, 0.8, 30.0, -1.2],
                                  [-50.0, 12.0, 0.0, -20.0, 200.0, 45.0],
                                  [0.0, 0.0, 0.0, 89.0, -170.0, 60.0]])
def test_rotation_is_orthonormal_with_determinant_one(pose):
    rotation = pose_to_matrix(pose)[:3, :3]
    np.testing.assert_allclose(rotation @ rotation.T, np.eye(3), atol=1e-12)
    assert np.linalg.det(rotation) == pytest.approx(1.0, abs=1e-12)


def test_relative_transform_of_pose_to_itself_is_identity():
    pose = [12.0, -7.0, 1.9, 0.8, 123.0, -1.2]
    np.testing.assert_allclose(relative_transform(pose, pose), np.eye(4), atol=1e-12)


def test_relative_transform_hand_case_and_round_trip():
    # Frame b sits at (10, 0) facing world +y: the world point (10, 5) is 5 m straight ahead.
    pose_world_origin = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    pose_b = [10.0, 0.0, 0.0, 0.0, 90.0, 0.0]
    points_world = np.array([[10.0, 5.0, 1.0, 0.25]])
    points_b = apply_transform(points_world, relative_transform(pose_world_origin, pose_b))
    np.testing.assert_allclose(points_b, [[5.0, 0.0, 1.0, 0.25]], atol=1e-12)

    pose_a = [3.0, -2.0, 1.5, 0.8, 30.0, -1.2]
    pose_c = [-40.0, 25.0, 0.3, -2.0, 250.0, 3.0]
    points_a = np.array([[1.0, 2.0, 3.0, 0.5], [-30.0, 4.0, -1.0, 0.0]])
    points_c = apply_transform(points_a, relative_transform(pose_a, pose_c))
    np.testing.assert_allclose(apply_transform(points_c, relative_transform(pose_c, pose_a)),
                               points_a, atol=1e-9)
    # Both frames must see the same world point: T_c @ p_c == T_a @ p_a.
    np.testing.assert_allclose(apply_transform(points_c, pose_to_matrix(pose_c)),
                               apply_transform(points_a, pose_to_matrix(pose_a)), atol=1e-9)


def test_box_corners_of_hand_made_box():
    # Centre (1, 2, 0), h=2, w=2, l=4, yaw 90 deg: the length runs along +y.
    box = np.array([[1.0, 2.0, 0.0, 2.0, 2.0, 4.0, math.pi / 2]])
    expected_bottom = [[2.0, 4.0, -1.0],    # front-right
                       [0.0, 4.0, -1.0],    # front-left
                       [0.0, 0.0, -1.0],    # back-left
                       [2.0, 0.0, -1.0]]    # back-right
    expected_top = [[x, y, 1.0] for x, y, _ in expected_bottom]
    corners = boxes_to_corners_3d(box, order="hwl")
    assert corners.shape == (1, 8, 3)
    np.testing.assert_allclose(corners[0], expected_bottom + expected_top, atol=1e-12)


def test_lwh_order_gives_same_corners_as_hwl():
    box_hwl = np.array([[1.0, 2.0, 0.5, 1.5, 2.0, 4.5, 0.3]])
    box_lwh = box_hwl[:, [0, 1, 2, 5, 4, 3, 6]]
    np.testing.assert_allclose(boxes_to_corners_3d(box_lwh, order="lwh"),
                               boxes_to_corners_3d(box_hwl, order="hwl"), atol=1e-12)


@pytest.mark.parametrize("order", ["hwl", "lwh"])
def test_corners_to_boxes_inverts_boxes_to_corners_including_yaw_wrap(order):
    yaws = [0.0, 0.7, -2.0, math.pi, -math.pi, math.pi - 1e-6, -math.pi + 1e-6, 3.1, -3.1]
    boxes = np.array([[5.0 * i, -3.0 + i, -1.0 + 0.1 * i, 1.5, 1.8, 4.2, yaw]
                      for i, yaw in enumerate(yaws)])
    if order == "lwh":
        boxes = boxes[:, [0, 1, 2, 5, 4, 3, 6]]
    recovered = corners_to_boxes(boxes_to_corners_3d(boxes, order=order), order=order)
    np.testing.assert_allclose(recovered[:, :6], boxes[:, :6], atol=1e-9)
    np.testing.assert_allclose(_wrap(recovered[:, 6] - boxes[:, 6]), 0.0, atol=1e-9)


def test_count_points_in_boxes_equals_the_mask_and_lifts_the_bottom():
    rng = np.random.default_rng(3)
    points = np.c_[rng.uniform(-20, 20, (20000, 2)), rng.uniform(-3, 1, 20000),
                   np.zeros(20000)].astype(np.float32)
    boxes = np.c_[rng.uniform(-20, 20, (30, 2)), rng.uniform(-1.5, -0.5, 30),
                  rng.uniform(1.4, 2.0, 30), rng.uniform(1.6, 2.2, 30), rng.uniform(3.5, 6, 30),
                  rng.uniform(-3, 3, 30)]
    for order in ("hwl", "lwh"):
        for margin in (0.0, 0.1):
            expected = points_in_boxes_mask(points, boxes, order, margin).sum(axis=1)
            np.testing.assert_array_equal(count_points_in_boxes(points, boxes, order, margin),
                                          expected)
    # Box z -1, h 1.5 (hwl): bottom face at -1.75. A point 5 cm above it is a ground return.
    box = np.array([[0.0, 0.0, -1.0, 1.5, 2.0, 4.0, 0.0]])
    low, high = [1.0, 0.5, -1.70, 0.0], [1.0, 0.5, -1.40, 0.0]
    cloud = np.array([low, high, [9.0, 0.0, -1.0, 0.0]], dtype=np.float32)
    assert count_points_in_boxes(cloud, box).tolist() == [2]
    assert count_points_in_boxes(cloud, box, ground_clearance=0.25).tolist() == [1]
    lwh_box = box[:, [0, 1, 2, 5, 4, 3, 6]].copy()
    assert count_points_in_boxes(cloud, lwh_box, "lwh", ground_clearance=0.25).tolist() == [1]
    assert lwh_box[0, 2] == -1.0 and lwh_box[0, 5] == 1.5   # the caller's boxes are untouched
    # Boxes far outside the cloud, or straddling its edge cells, find nothing / the right points.
    far = np.array([[500.0, -500.0, -1.0, 1.5, 2.0, 4.0, 0.3],
                    [-20.5, 0.0, -1.0, 4.0, 2.0, 4.0, 0.0]])
    np.testing.assert_array_equal(count_points_in_boxes(points, far),
                                  points_in_boxes_mask(points, far).sum(axis=1))
    assert count_points_in_boxes(cloud[:0], box).tolist() == [0]
    assert count_points_in_boxes(cloud, np.zeros((0, 7))).shape == (0,)
