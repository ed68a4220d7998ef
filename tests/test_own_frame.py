"""The own-frame path (``fusion.args.proj_first: false``): clouds stay in their agents' frames and
the detector warps each agent's BEV map into the ego frame (``opencood.models.warp``)."""
import math

import numpy as np
import pytest
import torch
import yaml

from opencood.data.collate import collate_samples
from opencood.data.datasets import IntermediateFusionDataset
from opencood.strategies import choose_strategy
from opencood.data.wild import WildSetting
from opencood.errors import ConfigError
from opencood.models import build_model
from opencood.data.synthetic.writer import generate_dataset
from opencood.models.detectors import PointPillarIntermediate, is_own_frame, pairwise_transforms
from opencood.models.warp import BevGrid, warp_to_ego
from opencood.ops.voxelize import PillarizeConfig
from opencood.ops.transforms import apply_transform, points_in_range_mask
from opencood.registry import FUSIONS
from tests.opv2v_factory import write_simple_split
from test_datasets import AUGMENT, RANGE, make
from test_baselines import BASELINES
from test_models import MODEL_CFGS, make_batch
from test_train import fusion_yaml, trainer
from process_state import preserved_opencood_logger, preserved_torch_switches

SQUARE = (-12.8, -12.8, -3.0, 12.8, 12.8, 1.0)        # 32 x 32 cells of 0.8 m
GRID = BevGrid(SQUARE, (0.8, 0.8), 32, 32)


def rigid(yaw_deg: float, tx: float, ty: float) -> torch.Tensor:
    """(4, 4) float32: rotate by ``yaw_deg`` about z, then translate by (tx, ty)."""
    cos, sin = math.cos(math.radians(yaw_deg)), math.sin(math.radians(yaw_deg))
    matrix = torch.eye(4)
    matrix[:2, :2] = torch.tensor([[cos, -sin], [sin, cos]])
    matrix[:2, 3] = torch.tensor([tx, ty])
    return matrix


def test_warp_with_the_identity_is_the_identity_at_every_scale():
    features = torch.randn(3, 5, 32, 32)
    for size in (32, 16, 8, 4):
        maps = features[..., :size, :size]
        warped = warp_to_ego(maps.contiguous(), torch.eye(4).repeat(3, 1, 1), GRID)
        assert torch.allclose(warped, maps, atol=1e-5)     # affine_grid rounding


@pytest.mark.parametrize("yaw", [0.0, 90.0])
def test_a_translation_moves_a_hot_cell_by_its_cells_at_every_scale(yaw):
    # 6.4 m along x and -3.2 m along y: 8 / -4 pillars, so 4 / -2, 2 / -1 cells at strides 2, 4.
    to_ego = rigid(yaw, 6.4, -3.2)
    for stride in (1, 2, 4):
        size = 32 // stride
        cell, center = GRID.cell_and_center(size, size)
        assert cell == (0.8 * stride, 0.8 * stride) and center == (0.0, 0.0)
        row, col = size // 4, size // 4 + 1            # (y, x) cell in the agent's map
        features = torch.zeros(1, 1, size, size)
        features[0, 0, row, col] = 1.0
        warped = warp_to_ego(features, to_ego[None], GRID)
        # Cell centre in metres, through the transform, back to a cell of the ego map.
        x, y = (col + 0.5 - size / 2) * cell[0], (row + 0.5 - size / 2) * cell[1]
        ego_xy = to_ego[:2, :2] @ torch.tensor([x, y]) + to_ego[:2, 3]
        ego_col = int(round(float(ego_xy[0]) / cell[0] + size / 2 - 0.5))
        ego_row = int(round(float(ego_xy[1]) / cell[1] + size / 2 - 0.5))
        if yaw == 0.0:
            assert (ego_row - row, ego_col - col) == (-4 // stride, 8 // stride)
        hot = (warped[0, 0] > 0.5).nonzero().tolist()
        assert hot == [[ego_row, ego_col]]
        assert torch.isclose(warped.sum(), torch.tensor(1.0), atol=1e-5)


FRONT = (0.0, -12.8, -3.0, 25.6, 12.8, 1.0)           # x from 0: the map centre is (12.8, 0)


@pytest.mark.parametrize("yaw, tx, ty", [(90.0, 16.0, -3.2), (-90.0, 3.2, 6.4),
                                         (180.0, 19.2, 6.4)])
def test_a_rotation_on_a_front_only_range_moves_a_cell_where_the_geometry_says(yaw, tx, ty):
    # On a range centred on the agent the map centre cancels out of the warp; on a front-only
    # one a rotation turns about the agent (x = 0), not the map's middle. Translations of whole
    # cells at stride 4 (3.2 m), so cell centres land on cell centres at every scale.
    grid = BevGrid(FRONT, (0.8, 0.8), 32, 32)
    to_ego = rigid(yaw, tx, ty)
    for stride in (1, 2, 4):
        size = 32 // stride
        cell, center = grid.cell_and_center(size, size)
        assert center == (12.8, 0.0)
        row, col = 3 * size // 4, size // 4 + 2 // stride       # (y, x) cell of the agent's map
        x, y = FRONT[0] + (col + 0.5) * cell[0], FRONT[1] + (row + 0.5) * cell[1]
        ego_x, ego_y = (to_ego[:2, :2].double() @ torch.tensor([x, y], dtype=torch.float64)
                        + to_ego[:2, 3].double()).tolist()
        ego_col = round((ego_x - FRONT[0]) / cell[0] - 0.5)
        ego_row = round((ego_y - FRONT[1]) / cell[1] - 0.5)
        assert 0 <= ego_col < size and 0 <= ego_row < size, (ego_row, ego_col)
        features = torch.zeros(1, 1, size, size)
        features[0, 0, row, col] = 1.0
        warped = warp_to_ego(features, to_ego[None], grid)
        assert (warped[0, 0] > 0.5).nonzero().tolist() == [[ego_row, ego_col]]
        assert torch.isclose(warped.sum(), torch.tensor(1.0), atol=1e-5)


def count_canvas(points: np.ndarray) -> torch.Tensor:
    """(N, 4) points -> (1, 1, 32, 32) points per SQUARE pillar (the map a VFE starts from)."""
    pillarize = PillarizeConfig(lidar_range=SQUARE, voxel_size=(0.8, 0.8, 4.0),
                                max_points_per_pillar=1000)
    pillars = pillarize(torch.from_numpy(points), torch.zeros(len(points), dtype=torch.int64), 1)
    canvas = torch.zeros(1, 1, 32, 32)
    coords = pillars["voxel_coords"]
    canvas[0, 0, coords[:, 2], coords[:, 3]] = pillars["voxel_num_points"].float()
    return canvas


@pytest.mark.parametrize("yaw", [0.0, 90.0, -90.0])
def test_own_frame_canvas_warped_equals_the_proj_first_canvas(yaw):
    """Map-aligned transform (integer pillars, right-angle yaw), no noise, no augmentation:
    the own-frame pillar canvas warped into the ego frame is the proj_first canvas wherever the
    agent's own crop reaches (elsewhere the agent has no data in its own frame)."""
    rng = np.random.default_rng(0)
    cells = rng.integers(-20, 20, size=(400, 2))
    xy = (cells + 0.5 + rng.uniform(-0.3, 0.3, size=(400, 2))) * 0.8
    points = np.concatenate([xy, rng.uniform(-2, 0, (400, 1)), rng.uniform(0, 1, (400, 1))],
                            axis=1).astype(np.float32)
    to_ego = rigid(yaw, 4.0, -2.4)
    own = points[points_in_range_mask(points, SQUARE)]
    projected = apply_transform(points, to_ego.double().numpy()).astype(np.float32)
    projected = projected[points_in_range_mask(projected, SQUARE)]
    theta = GRID.affine(to_ego[None], 32, 32)
    grid = torch.nn.functional.affine_grid(theta, [1, 1, 32, 32], align_corners=False)
    covered = (grid.abs() <= 1.0).all(dim=-1)[0]
    warped = warp_to_ego(count_canvas(own), to_ego[None], GRID)[0, 0]
    proj_canvas = count_canvas(projected)[0, 0]
    assert covered.sum() >= 400 and proj_canvas[covered].sum() > 50
    assert torch.allclose(warped[covered], proj_canvas[covered], atol=1e-4)
    assert warped[~covered].abs().max() < 1e-4


@pytest.fixture(scope="module")
def road(tmp_path_factory):
    return write_simple_split(tmp_path_factory.mktemp("own_road") / "train", num_cavs=3,
                              spacing=15.0)


def test_own_frame_points_through_transforms_to_ego_are_the_proj_first_points(road):
    """Augmented and noisy: own-frame clouds mapped with ``transforms_to_ego`` are the proj_first
    clouds (on the points inside both crops); the clean transforms are the true ones."""
    wild = WildSetting(loc_err=True, xyz_std=0.5, yaw_std=2.0)
    kwargs = dict(train=True, augment_cfg=AUGMENT, wild=wild, seed=3)
    proj = make(IntermediateFusionDataset, road, **kwargs)
    own = make(IntermediateFusionDataset, road, proj_first=False, with_early_fusion=True,
               **kwargs)
    for index in range(len(own)):
        a, b = proj[index], own[index]
        assert b["points_in_agent_frame"] and not a["points_in_agent_frame"]
        assert np.allclose(b["transforms_to_ego"][0], np.eye(4), atol=1e-5)
        assert not np.allclose(b["transforms_to_ego"][1:], b["transforms_to_ego_clean"][1:],
                               atol=1e-3)
        clean_points = []
        for agent, (mine, theirs) in enumerate(zip(b["agent_points"], a["agent_points"])):
            to_ego = b["transforms_to_ego"][agent].astype(np.float64)
            mapped = apply_transform(mine, to_ego)
            back = apply_transform(theirs, np.linalg.inv(to_ego))
            in_both = mapped[points_in_range_mask(mapped, RANGE)]
            expected = theirs[points_in_range_mask(back, RANGE)]
            assert len(in_both) > 50 and in_both.shape == expected.shape
            assert np.allclose(in_both, expected, atol=1e-3)
            clean = apply_transform(mine, b["transforms_to_ego_clean"][agent].astype(np.float64))
            clean_points.append(clean[points_in_range_mask(clean, RANGE)])
        # The clean transforms put the points where the early-fusion (true pose) cloud has them.
        assert np.allclose(np.concatenate(clean_points), b["early_fusion_points"], atol=1e-3)
    batch = collate_samples([own[0], own[1]])
    assert batch["transforms_to_ego_clean"].shape == batch["transforms_to_ego"].shape
    assert batch["points_in_agent_frame"] is True


def test_proj_first_false_is_refused_for_a_strategy_without_own_frame_samples(road):
    cfg = {"root_dir": str(road), "fusion": {"core_method": "early",
                                             "args": {"proj_first": False}}}
    with pytest.raises(ConfigError, match="proj_first"):
        choose_strategy(cfg)
    choose_strategy(cfg, "late")       # another strategy than the config's reads its own samples


def test_pairwise_transforms_map_agent_j_into_agent_i():
    to_ego = torch.stack([torch.eye(4), rigid(30, 2.0, 1.0), rigid(-45, -3.0, 4.0),
                          torch.eye(4), rigid(90, 1.0, 0.0)]).double()
    pairwise = pairwise_transforms(to_ego, torch.tensor([3, 2]))
    assert pairwise.shape == (2, 3, 3, 4, 4)
    assert torch.allclose(to_ego[1] @ pairwise[0, 1, 2], to_ego[2])
    assert torch.allclose(pairwise[1, 0, 1], to_ego[4]) and torch.allclose(pairwise[1, 2, 2],
                                                                           torch.eye(4).double())


def own_frame_batch(batch, transforms):
    return {**batch, "points_in_agent_frame": True, "transforms_to_ego": transforms}


FUSION_CFGS = {**{name: cfg for name, cfg in MODEL_CFGS.items() if name != "point_pillar"},
               **BASELINES}


def test_every_fusion_module_is_run_own_frame():
    fusions = {cfg["args"]["fusion"]["core_method"] for cfg in FUSION_CFGS.values()}
    assert fusions == set(FUSIONS.names())


@pytest.mark.parametrize("name", list(FUSION_CFGS))
def test_every_fusion_runs_own_frame_and_identity_transforms_change_nothing(name):
    """Every fusion module runs on an own-frame batch; with identity transforms (every frame the
    ego's) its outputs are the proj_first ones, with a shift they differ (the warp is wired)."""
    torch.manual_seed(0)
    model = build_model(FUSION_CFGS[name]).eval()
    batch = make_batch([2, 3])
    batch["agent_types"] = torch.zeros(5, dtype=torch.int64)
    batch["agent_latency"] = torch.zeros(5, dtype=torch.int64)
    identity = torch.eye(4).repeat(5, 1, 1)
    shifted = identity.clone()
    shifted[[1, 3, 4], 0, 3] = 3.2                    # the non-ego agents, 4 pillars along x
    with torch.no_grad():
        plain = model(batch)
        same = model(own_frame_batch(batch, identity))
        moved = model(own_frame_batch(batch, shifted))
    # The fused map (the head's input): V2VNet's messages move it by ~1e-3 only.
    assert (plain["fused_features"] - same["fused_features"]).abs().max() < 1e-5
    # A zero budget sends nothing: the ego's own map, wherever the others are.
    changed = (plain["fused_features"] - moved["fused_features"]).abs().max() > 1e-4
    assert changed == (name != "where2comm_budget0")


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory):
    out = tmp_path_factory.mktemp("own_tiny")
    generate_dataset(out, preset="tiny", seed=0, progress=False)
    return out


@pytest.mark.slow
def test_coalign_trains_two_steps_on_the_tiny_preset(tiny_root, tmp_path, monkeypatch):
    """hypes_yaml/synthetic/point_pillar_coalign.yaml at the smoke geometry: own-frame batches
    with pose noise, the model warping every scale, two optimiser steps on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))
    seen = []
    real_forward = PointPillarIntermediate.forward

    def recording_forward(model, batch):
        seen.append((is_own_frame(batch), batch["transforms_to_ego"].shape[0]))
        return real_forward(model, batch)

    monkeypatch.setattr(PointPillarIntermediate, "forward", recording_forward)
    with preserved_torch_switches(), preserved_opencood_logger():
        result = trainer.main([
            "--hypes_yaml", str(fusion_yaml(tmp_path, "point_pillar_coalign")),
            "--model_dir", str(tmp_path / "run"), "--set", f"root_dir={tiny_root / 'train'}",
            "--set", "validate_dir=null", "--set", "test_dir=null",
            "--set", "train_params.epoches=1", "--set", "train_params.max_steps=2"])
    assert result["step"] == 2
    # Two steps (and the model summary's forward): every batch own-frame, 2-3 agents a sample.
    assert len(seen) >= 2 and all(own and n >= 4 for own, n in seen)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["fusion"]["args"]["proj_first"] is False
    assert saved["model"]["args"]["base_bev_backbone"]["resnet"] is True


def test_the_warp_samples_in_float32_under_bf16_autocast():
    """A 704-cell map shifted by 3 cells: with a bf16 grid the samples would land up to a third
    of a cell off; the warp keeps its grid in float32 and returns the map's dtype."""
    grid = BevGrid((-140.8, -40.0, -3.0, 140.8, 40.0, 1.0), (0.4, 0.4), 704, 200)
    features = torch.randn(1, 2, 200, 704).bfloat16()
    to_ego = rigid(0.0, 1.2, 0.0)[None]
    expected = warp_to_ego(features.float(), to_ego, grid)
    assert torch.allclose(expected[..., 3:], features[..., :-3].float(), atol=2e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        warped = warp_to_ego(features, to_ego, grid)
    assert warped.dtype == torch.bfloat16
    # bf16 rounding of the values only (|x| < 6: < 0.025), not of the positions.
    assert (warped.float() - expected).abs().max() < 0.025
