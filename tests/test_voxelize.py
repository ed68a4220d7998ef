"""Pillarisation: hand-made cases and agreement with a plain per-point Python reference."""
import pytest
import torch

from opencood.ops.voxelize import PillarizeConfig, grid_size, pillarize
from opencood.testing.reference_impls import reference_pillarize

SMALL_RANGE = [0.0, 0.0, -3.0, 8.0, 8.0, 1.0]
OPV2V_RANGE = [-140.8, -40.0, -3.0, 140.8, 40.0, 1.0]


def random_cloud(num_points, lidar_range, num_batches, channels, seed):
    """Points spread 10% beyond the range on every side, shuffled batch indices."""
    generator = torch.Generator().manual_seed(seed)
    low = torch.tensor(lidar_range[:3])
    high = torch.tensor(lidar_range[3:])
    margin = 0.1 * (high - low)
    xyz = low - margin + torch.rand(num_points, 3, generator=generator) * (high - low + 2 * margin)
    extra = torch.rand(num_points, channels - 3, generator=generator)
    batch_index = torch.randint(0, num_batches, (num_points,), generator=generator)
    return torch.cat([xyz, extra], dim=1), batch_index


def assert_matches_reference(points, batch_index, lidar_range, voxel_size, max_points,
                             max_pillars=None):
    out = pillarize(points, batch_index, lidar_range, voxel_size, max_points, max_pillars)
    features, counts, coords = reference_pillarize(points, batch_index, lidar_range, voxel_size,
                                                   max_points, max_pillars)
    assert torch.equal(out["voxel_coords"], coords)
    assert torch.equal(out["voxel_num_points"], counts)
    assert torch.equal(out["voxel_features"], features)
    return out


def test_grid_size_rounds_instead_of_truncating():
    assert grid_size(OPV2V_RANGE, [0.4, 0.4, 4]) == (704, 200, 1)
    assert grid_size([-140.8, -38.4, -3, 140.8, 38.4, 1], [0.4, 0.4, 4]) == (704, 192, 1)
    # 0.3 / 0.1 == 2.9999999999999996 in floats: int() would say 2.
    assert grid_size([0, 0, 0, 0.3, 0.3, 0.3], [0.1, 0.1, 0.1]) == (3, 3, 3)
    assert grid_size(SMALL_RANGE, [1, 1, 4]) == (8, 8, 1)


def test_grid_size_rejects_partial_voxels():
    with pytest.raises(ValueError, match="along y"):
        grid_size([0, 0, -3, 8, 7.5, 1], [1, 1, 4])


def test_hand_made_cloud():
    # columns x, y, z, intensity; range [0, 8) x [0, 8) x [-3, 1), 1 x 1 x 4 m pillars
    rows = [
        (1, [7.99, 7.99, 0.99, 0.6]),   # batch 1, cell x7 y7 (listed first: output sorts it last)
        (0, [2.5, 3.5, 0.0, 0.1]),      # cell x2 y3
        (0, [2.9, 3.1, -1.0, 0.2]),     # cell x2 y3, second point
        (0, [2.1, 3.9, 0.5, 0.3]),      # cell x2 y3, third: over max_points=2, dropped
        (0, [0.0, 0.0, -3.0, 0.4]),     # exactly on the lower bounds: kept, cell x0 y0
        (0, [8.0, 1.0, 0.0, 0.5]),      # x == xmax: outside (half-open range)
        (0, [1.0, 1.0, 1.0, 0.7]),      # z == zmax: outside
        (1, [-0.01, 4.0, 0.0, 0.8]),    # x < xmin: outside
    ]
    batch_index = torch.tensor([b for b, _ in rows])
    points = torch.tensor([p for _, p in rows])
    out = pillarize(points, batch_index, SMALL_RANGE, [1, 1, 4], max_points_per_pillar=2)

    assert out["voxel_coords"].tolist() == [[0, 0, 0, 0], [0, 0, 3, 2], [1, 0, 7, 7]]
    assert out["voxel_num_points"].tolist() == [1, 2, 1]
    assert out["voxel_num_points"].dtype == torch.int32
    expected = torch.zeros(3, 2, 4)
    expected[0, 0] = points[4]
    expected[1, 0], expected[1, 1] = points[1], points[2]
    expected[2, 0] = points[0]
    assert torch.equal(out["voxel_features"], expected)


def test_last_cell_absorbs_float_slack_and_non_finite_points_are_dropped():
    # 8.0004 m is 8 voxels within the grid tolerance; x = 8.0002 is inside the range but
    # floor(8.0002 / 1) = 8 is past the grid: it belongs to the last cell, x_idx 7.
    points = torch.tensor([[8.0002, 0.5, 0.0, 0.1], [float("nan"), 0.5, 0.0, 0.2],
                           [float("inf"), 0.5, 0.0, 0.3], [1e30, 0.5, 0.0, 0.4]])
    out = pillarize(points, torch.zeros(4, dtype=torch.int64), [0, 0, -3, 8.0004, 8, 1],
                    [1, 1, 4], max_points_per_pillar=2)
    assert out["voxel_coords"].tolist() == [[0, 0, 0, 7]]
    assert out["voxel_num_points"].tolist() == [1]


def test_max_pillars_keeps_first_pillars_in_key_order_per_batch_element():
    points = torch.tensor([[2.5, 3.5, 0.0, 0.1], [0.5, 0.5, 0.0, 0.2], [7.5, 7.5, 0.0, 0.3],
                           [1.5, 0.5, 0.0, 0.4]])
    batch_index = torch.tensor([0, 0, 1, 0])
    out = pillarize(points, batch_index, SMALL_RANGE, [1, 1, 4], max_pillars=2)
    # batch 0 has pillars (y0,x0), (y0,x1), (y3,x2): the last one in key order goes.
    assert out["voxel_coords"].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 7, 7]]
    assert torch.equal(out["voxel_features"][:, 0], points[[1, 3, 2]])


@pytest.mark.parametrize("seed", [0, 1])
def test_matches_reference_with_crowded_pillars(seed):
    # 8 x 4 pillars, 3 batch elements, ~1160 points inside: most pillars overflow max_points=5.
    lidar_range = [-2.0, -1.0, -3.0, 2.0, 1.0, 1.0]
    points, batch_index = random_cloud(2000, lidar_range, 3, channels=5, seed=seed)
    out = assert_matches_reference(points, batch_index, lidar_range, [0.5, 0.5, 4], 5)
    assert (out["voxel_num_points"] == 5).sum() > 50        # the cap is really exercised
    assert len(out["voxel_coords"]) == 3 * 8 * 4            # every pillar is hit


def test_matches_reference_on_3d_voxels_and_opv2v_range():
    points, batch_index = random_cloud(3000, OPV2V_RANGE, 4, channels=4, seed=2)
    assert_matches_reference(points, batch_index, OPV2V_RANGE, [0.4, 0.4, 4], 32)
    small_points, small_batch = random_cloud(1500, SMALL_RANGE, 2, channels=4, seed=3)
    out = assert_matches_reference(small_points, small_batch, SMALL_RANGE, [2, 2, 1], 3)
    assert out["voxel_coords"][:, 1].max() == 3              # four z layers are really used


def test_matches_reference_with_max_pillars():
    points, batch_index = random_cloud(2000, SMALL_RANGE, 3, channels=4, seed=4)
    out = assert_matches_reference(points, batch_index, SMALL_RANGE, [1, 1, 4], 4,
                                   max_pillars=20)
    assert out["voxel_coords"][:, 0].bincount().tolist() == [20, 20, 20]


def test_empty_cloud_and_all_points_outside():
    for points in (torch.zeros(0, 4), torch.tensor([[100.0, 0.0, 0.0, 1.0]])):
        batch_index = torch.zeros(len(points), dtype=torch.int64)
        out = pillarize(points, batch_index, SMALL_RANGE, [1, 1, 4], max_points_per_pillar=32)
        assert out["voxel_features"].shape == (0, 32, 4)
        assert out["voxel_num_points"].shape == (0,)
        assert out["voxel_num_points"].dtype == torch.int32
        assert out["voxel_coords"].shape == (0, 4)
        assert out["voxel_coords"].dtype == torch.int64


def test_agent_without_points_in_the_batch():
    points, batch_index = random_cloud(500, SMALL_RANGE, 3, channels=4, seed=5)
    has_points = batch_index != 1
    out = assert_matches_reference(points[has_points], batch_index[has_points], SMALL_RANGE,
                                   [1, 1, 4], 8)
    assert set(out["voxel_coords"][:, 0].tolist()) == {0, 2}


def test_config_reads_opencood_preprocess_section():
    preprocess = {"core_method": "SpVoxelPreprocessor", "cav_lidar_range": OPV2V_RANGE,
                  "args": {"voxel_size": [0.4, 0.4, 4], "max_points_per_voxel": 32,
                           "max_voxel_train": 32000, "max_voxel_test": 70000}}
    train = PillarizeConfig.from_config(preprocess, training=True)
    test = PillarizeConfig.from_config(preprocess, training=False)
    assert (train.max_pillars, test.max_pillars) == (32000, 70000)
    assert train.grid_size == (704, 200, 1)
    points, batch_index = random_cloud(200, OPV2V_RANGE, 2, channels=4, seed=6)
    direct = pillarize(points, batch_index, OPV2V_RANGE, [0.4, 0.4, 4], 32, 32000)
    assert torch.equal(train(points, batch_index)["voxel_coords"], direct["voxel_coords"])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_output_identical_to_cpu():
    points, batch_index = random_cloud(20000, OPV2V_RANGE, 3, channels=4, seed=7)
    on_cpu = pillarize(points, batch_index, OPV2V_RANGE, [0.4, 0.4, 4], 4, max_pillars=5000)
    on_gpu = pillarize(points.cuda(), batch_index.cuda(), OPV2V_RANGE, [0.4, 0.4, 4], 4,
                       max_pillars=5000)
    for key, value in on_cpu.items():
        assert on_gpu[key].device.type == "cuda"
        assert torch.equal(on_gpu[key].cpu(), value), key


def test_pillar_groups_of_sorted_keys_by_hand():
    from opencood.ops.voxelize import _pillar_groups
    starts, ends, rank = _pillar_groups(torch.tensor([3, 3, 5, 7, 7, 7, 9]))
    assert rank.tolist() == [0, 1, 0, 0, 1, 2, 0]
    assert starts.tolist() == [True, False, True, True, False, False, True]
    assert ends.tolist() == [False, True, True, False, False, True, True]
    empty = _pillar_groups(torch.zeros(0, dtype=torch.int64))
    assert [t.numel() for t in empty] == [0, 0, 0]


def test_pillar_groups_dispatch_no_scan():
    # The rank inside a pillar is a binary search, not a running maximum over every point
    # (cummax took 1.6 ms of an H100 step); cumsum's one scan is in _agent_slots alone.
    from opencood.ops.voxelize import _pillar_groups
    from opencood.utils.op_counts import OpCounter
    keys = torch.sort(torch.randint(0, 50, (1000,))).values
    with OpCounter() as ops:
        _pillar_groups(keys)
    assert not {"cummax", "cumsum", "_cummax_helper"} & set(ops.by_op)
    assert ops.by_op["searchsorted"] == 1


def test_cell_keys_work_on_all_three_axes_at_once():
    # One operator per step over (N, 3) rather than one per axis (36 kernels before); keys
    # equal to ((b * nz + z) * ny + y) * nx + x computed by hand.
    from opencood.ops.voxelize import _cell_keys
    from opencood.utils.op_counts import OpCounter
    points = torch.tensor([[0.5, 1.5, -2.0, 0.0], [3.99, 0.0, 1.9, 0.0], [4.0, 0.0, 0.0, 0.0],
                           [-0.01, 2.0, 0.0, 0.0], [float("nan"), 0.0, 0.0, 0.0]])
    batch_index = torch.tensor([0, 1, 1, 0, 0])
    lidar_range, voxel, grid = [0.0, 0.0, -2.0, 4.0, 3.0, 2.0], [1.0, 1.0, 2.0], (4, 3, 2)
    _cell_keys(points, batch_index, lidar_range, voxel, grid)          # constants made once
    with OpCounter() as ops:
        keys, inside = _cell_keys(points, batch_index, lidar_range, voxel, grid)
    assert inside.tolist() == [True, True, False, False, False]
    # point 0: x 0, y 1, z 0 -> 4; point 1: batch 1, x 3, y 0, z 1 -> 24 + 12 + 3
    assert keys[:2].tolist() == [(0 * 2 + 0) * 3 * 4 + 1 * 4 + 0, ((1 * 2 + 1) * 3 + 0) * 4 + 3]
    assert ops.kernels <= 16
