"""Our lift-splat encoder against HEAL's (github.com/yifanlu0227/HEAL), issue 36 point 4.

``tests/fixtures/parity/lift_splat.pt`` was made by running HEAL's own ``LiftSplatShoot`` (the
single-agent model with its BevEncode and heads) and its heterogeneous encoder of the same name
(``tools/reference/make_lss_parity_fixture.py``, never run in CI): EfficientNet-b0 at strides 8
and 16 and ResNet-101, LID and UD bins, one and two height cells, 2 agents x 2 cameras with
pitched, shifted cameras and an image augmentation (resize, crop, rotation, a flip) from HEAL's
``img_transform``, generated weights and images, eval mode, fp32.

Here the same weights go through :func:`heal_to_ours` (EfficientNet keys through
:func:`efficientnet_pytorch_to_ours`) into our :class:`LiftSplat` built from HEAL's arguments
(:func:`args_from_heal`), and the BEV maps, heads, depth logits, depth targets and depth loss must
agree within 1e-5 relative, and so do the gradients of a fixed probe of the outputs (the
splat's backward included). Each defining piece is shown to matter: skipping the post-augmentation
undo, the other depth-bin mode, pooling without sorting by cell, torchvision's symmetric padding in
the EfficientNet each move the outputs by far more than the tolerance.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from opencood.config import load_config
from opencood.config_schema import SchemaError, parse, to_plain
from opencood.models import build_model
from opencood.models import lift_splat
from opencood.models.camera_backbones import (EfficientNetB0, SamePadConv2d, WeightMappingError,
                                              efficientnet_pytorch_to_ours)
from opencood.models.heads import AnchorHead
from opencood.losses.depth import depth_focal_loss
from opencood.models.lift_splat import (BevGridSpec, CumsumPool, LiftSplat, LiftSplatArgs,
                                        args_from_heal, depth_bin_indices, depth_bin_starts,
                                        frustum_to_agent, heal_to_ours, lidar_depth_maps,
                                        make_frustum, splat)
from opencood.registry import ENCODERS
from parity_weights import generated_tensor, materialize
from tests.reference_fixtures import load_parity_fixture

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "parity" / "lift_splat.pt"
TOLERANCE = 1e-5
BROKEN = 1e-3          # a broken piece must move the outputs by at least this (relative)
HEAD_KEYS = {"cls_head": "cls_conv", "reg_head": "reg_conv", "dir_head": "dir_conv"}


pytestmark = pytest.mark.usefixtures("one_thread")     # as the fixture was made (conftest)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return load_parity_fixture(FIXTURE, "make_lss_parity_fixture.py")


def our_batch(fixture: dict) -> dict:
    inputs = fixture["inputs"]
    generated = materialize(inputs["recipes"])
    return {"images": generated["images"], "depth_maps": generated["depth_maps"],
            "intrinsics": inputs["intrins"], "extrinsics": inputs["extrinsics"],
            "post_rots": inputs["post_rots"], "post_trans": inputs["post_trans"]}


class Case:
    """One fixture case: our encoder with HEAL's weights (and, for the single-agent model, our
    anchor head with its heads' weights)."""

    def __init__(self, fixture: dict, name: str):
        self.expected = fixture["cases"][name]["outputs"]
        self.batch = our_batch(fixture)
        args = parse(LiftSplatArgs, args_from_heal(fixture["cases"][name]["heal_args"]))
        heal_state = materialize(fixture["cases"][name]["state_dict"])
        self.model = LiftSplat(args).eval()
        self.model.load_state_dict(heal_to_ours(heal_state, args.camera_encoder))
        self.head = None
        if "cls_preds" in self.expected:
            self.head = AnchorHead(args.bev_encoder_channels, num_anchors=2).eval()
            self.head.load_state_dict({f"{HEAD_KEYS[key.split('.')[0]]}.{key.split('.')[1]}": v
                                       for key, v in heal_state.items()
                                       if key.split(".")[0] in HEAD_KEYS})

    def run(self, batch: dict | None = None, grad: bool = False) -> dict:
        """Our outputs under HEAL's names: bev (the splat), heads, depth logits / targets."""
        captured = {}
        model = self.model
        hook = None
        if model.bev_encoder is not None:
            hook = model.bev_encoder.register_forward_pre_hook(
                lambda module, inputs: captured.setdefault("bev", inputs[0]))
        with torch.set_grad_enabled(grad):
            features = model(batch or self.batch)
            if hook is not None:
                hook.remove()
            outputs = {"bev": captured.get("bev", features)}
            if self.head is not None:
                outputs.update(self.head(features))
            if model.depth_outputs is not None:
                outputs.update(model.depth_outputs)
                outputs["depth_loss"] = depth_focal_loss(outputs["depth_logits"],
                                                         outputs["depth_target"])
        return outputs

    def differences(self, outputs: dict) -> dict:
        diffs = {}
        for key, expected in self.expected.items():
            assert outputs[key].shape == expected.shape, key
            if key == "depth_target":
                diffs[key] = float((outputs[key] != expected).float().mean())
                continue
            diffs[key] = float((outputs[key] - expected).abs().max() / expected.abs().max())
        return diffs


@pytest.fixture(scope="module")
def cases(fixture) -> dict:
    return {name: Case(fixture, name) for name in fixture["cases"]}


# -- parity ------------------------------------------------------------------------------------

def test_fixture_exercises_what_matters(fixture):
    cases = fixture["cases"]
    modes = {case["heal_args"]["grid_conf"]["mode"] for case in cases.values()}
    encoders = {(case["heal_args"]["camera_encoder"], case["heal_args"]["img_downsample"])
                for case in cases.values()}
    assert modes == {"UD", "LID"}
    assert encoders == {("EfficientNet", 8), ("EfficientNet", 16), ("Resnet101", 8)}
    assert any(case["heal_args"]["grid_conf"]["zbound"][2] < 20 for case in cases.values())
    post_rots = fixture["inputs"]["post_rots"]
    assert (post_rots[..., :2, :2] < 0).any()                       # a flip
    assert (post_rots[..., 0, 1] != 0).any()                        # a rotation
    for case in cases.values():               # splats neither empty nor saturated
        bev = case["outputs"]["bev"]
        occupied = float((bev.abs().sum(1) > 0).float().mean())
        assert 0.05 < occupied < 0.9, occupied
    target = cases["eff_lid_full"]["outputs"]["depth_target"]
    assert target.min() == 0 and target.max() == 11            # clamped at both ends


@pytest.mark.parametrize("name", ["eff_lid_full", "eff_ud_heter", "res_ud_heter"])
def test_parity(cases, name):
    case = cases[name]
    diffs = case.differences(case.run())
    assert max(diffs.values()) <= TOLERANCE, diffs


@pytest.mark.parametrize("name", ["eff_lid_full", "eff_ud_heter", "res_ud_heter"])
def test_gradient_parity(fixture, cases, name):
    """The gradient of sum_k <output_k, G_k> (the fixture script's probe) reaches the depth and
    image heads through the splat's backward (and BevEncode's first conv) as HEAL's does."""
    case = cases[name]
    case.model.zero_grad()
    probe = sum((value * generated_tensor(f"gradient.{key}", list(value.shape))).sum()
                for key, value in case.run(grad=True).items() if value.is_floating_point())
    probe.backward()
    expected = heal_to_ours(fixture["cases"][name]["gradients"],
                            case.model.args.camera_encoder)
    parameters = dict(case.model.named_parameters())
    assert len(expected) >= 4
    for key, gradient in expected.items():
        ours = parameters[key].grad
        relative = float((ours - gradient).abs().max() / gradient.abs().max())
        assert relative <= TOLERANCE, (key, relative)


# -- each defining piece matters ---------------------------------------------------------------

def assert_broken(case: Case, outputs: dict, key: str = "bev") -> None:
    assert case.differences(outputs)[key] > BROKEN


def test_post_augmentation_undo_matters(cases):
    case = cases["eff_lid_full"]
    batch = dict(case.batch, post_rots=torch.eye(3).expand_as(case.batch["post_rots"]),
                 post_trans=torch.zeros_like(case.batch["post_trans"]))
    assert_broken(case, case.run(batch))


@pytest.mark.parametrize("name, other", [("eff_lid_full", "UD"), ("res_ud_heter", "LID")])
def test_depth_mode_matters(cases, name, other):
    case = cases[name]
    d_min, d_max, bins = case.model.args.ddiscr
    kept = case.model.frustum
    case.model.frustum = make_frustum(case.model.args.image_size, case.model.args.img_downsample,
                                      depth_bin_starts(d_min, d_max, bins, other))
    try:
        assert_broken(case, case.run())
    finally:
        case.model.frustum = kept


def test_pooling_needs_points_sorted_by_cell(cases, monkeypatch):
    case = cases["res_ud_heter"]
    monkeypatch.setattr(lift_splat, "rank_order", lambda ranks: torch.arange(ranks.numel()))
    assert_broken(case, case.run())


def test_efficientnet_needs_tensorflow_padding(cases, monkeypatch):
    case = cases["eff_lid_full"]
    for module in case.model.modules():
        if isinstance(module, SamePadConv2d):          # torchvision's: k // 2 on every side
            monkeypatch.setattr(module, "pads", (module.kernel_size[0] // 2,) * 4)
    assert_broken(case, case.run(), key="depth_logits")


# -- the pieces by hand ------------------------------------------------------------------------

def test_depth_bins_by_hand():
    assert depth_bin_starts(2, 50, 48, "UD").tolist() == list(range(2, 50))
    # LID: unit 2 * 10 / (4 * 5) = 1, widths 1, 2, 3, 4
    assert depth_bin_starts(0, 10, 4, "LID").tolist() == [0, 1, 3, 6]
    depths = torch.tensor([0.0, 0.99, 1.0, 2.9, 3.0, 6.0, 9.99, 10.0, -0.1, -1.0, math.inf,
                           math.nan])
    indices, inside = depth_bin_indices(depths, 0, 10, 4, "LID")
    # -1: sqrt(1 + 8 * -1) has no real value: the last bin, as HEAL's
    assert indices.tolist() == [0, 0, 1, 1, 2, 3, 3, 3, 0, 3, 3, 3]
    assert inside.tolist() == [True] * 7 + [False] * 5
    indices, _ = depth_bin_indices(torch.tensor([2.0, 2.5, 49.9]), 2, 50, 48, "UD")
    assert indices.tolist() == [0, 0, 47]
    with pytest.raises(ValueError, match="SID"):
        depth_bin_starts(0, 10, 4, "SID")


def test_depth_focal_loss_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25])).view(1, 3, 1, 1)
    target = torch.tensor([[[1]]])
    expected = -0.25 * 0.75 ** 2 * math.log(0.25)
    assert depth_focal_loss(logits, target).item() == pytest.approx(expected, rel=1e-6)


def test_depth_focal_loss_over_valid_pixels():
    logits = torch.zeros(1, 4, 1, 3)
    target = torch.tensor([[[0, 1, 2]]])
    per_pixel = -0.25 * 0.75 ** 2 * math.log(0.25)
    valid = torch.tensor([[[True, False, False]]])
    assert depth_focal_loss(logits, target, valid=valid).item() == pytest.approx(per_pixel)
    assert depth_focal_loss(logits, target, valid=torch.zeros_like(valid)).item() == 0.0


def small_camera_rig():
    """Two cameras: a flipped, shifted one and a rotated, halved one with a turned extrinsic."""
    angle = 0.3
    post_rots = torch.eye(3).repeat(2, 1, 1)
    post_rots[0, 0, 0] = -0.75
    post_rots[1, :2, :2] = 0.5 * torch.tensor([[math.cos(angle), math.sin(angle)],
                                               [-math.sin(angle), math.cos(angle)]])
    post_trans = torch.tensor([[60.0, -3.0, 0.0], [9.0, 2.0, 0.0]])
    intrinsics = torch.tensor([[[90.0, 0, 31], [0, 80.0, 17], [0, 0, 1]]] * 2)
    extrinsics = torch.eye(4).repeat(2, 1, 1)
    extrinsics[1, :3, :3] = torch.tensor([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])
    extrinsics[:, :3, 3] = torch.tensor([[1.0, 2, 3], [-1, 0.5, 1.5]])
    return intrinsics, extrinsics, post_rots, post_trans


def test_lidar_depth_maps_invert_the_frustum():
    """Frustum points moved into the agent frame and projected back land on their own pixel,
    and the nearest bin (the first) wins there; every other pixel stays 0."""
    rig = small_camera_rig()
    frustum = make_frustum((32, 64), 8, depth_bin_starts(2, 20, 6, "LID"))
    points = frustum_to_agent(frustum, *(tensor[None] for tensor in rig))[0]   # (2, D, h, w, 3)
    maps = lidar_depth_maps(points.reshape(-1, 3), *rig, image_size=(32, 64))
    assert maps.shape == (2, 32, 64)
    for cam in range(2):
        u = frustum[0, ..., 0].round().long()
        v = frustum[0, ..., 1].round().long()
        # camera 1 sees camera 0's points too, elsewhere: check only its own pixels' depth
        assert torch.allclose(maps[cam, v, u], torch.full_like(u, 2.0, dtype=torch.float),
                              atol=1e-4)
    expected_hits = torch.zeros(32, 64, dtype=torch.bool)
    expected_hits[frustum[0, ..., 1].round().long(), frustum[0, ..., 0].round().long()] = True
    only_own = lidar_depth_maps(points[0].reshape(-1, 3), *(t[:1] for t in rig), (32, 64))[0]
    assert torch.equal(only_own > 0, expected_hits)


def test_lidar_depth_maps_by_hand():
    intrinsics = torch.tensor([[[10.0, 0, 4], [0, 10.0, 3], [0, 0, 1]]])
    extrinsics = torch.eye(4)[None]
    post_rots, post_trans = torch.eye(3)[None], torch.zeros(1, 3)
    # camera axes = agent axes here: z forward. Two returns on pixel (4, 3), one behind.
    points = torch.tensor([[0.0, 0.0, 12.0], [0.0, 0.0, 7.0], [0.0, 0.0, -5.0],
                           [0.5, -0.4, 5.0]])
    maps = lidar_depth_maps(points, intrinsics, extrinsics, post_rots, post_trans, (6, 8))
    expected = torch.zeros(1, 6, 8)
    expected[0, 3, 4] = 7.0            # the nearer of the two
    expected[0, 2, 5] = 5.0            # u = 4 + 10 * 0.1, v = 3 - 10 * 0.08
    assert torch.equal(maps, expected)


@pytest.mark.parametrize("sampling, expected_valid", [("pixel", [[False, True]]),
                                                       ("cell_min", [[True, True]])])
def test_depth_target_sampling(sampling, expected_valid):
    args = parse(LiftSplatArgs, dict(xbound=[-8, 8, 1.0], ybound=[-8, 8, 1.0], image_size=[8, 16],
                                     camera_encoder="Resnet101", ddiscr=[1, 9, 8], depth_mode="UD",
                                     img_features=2, depth_supervision=True,
                                     depth_sampling=sampling))
    model = LiftSplat(args)
    depth = torch.zeros(1, 1, 8, 16)
    depth[0, 0, 1, 2] = 3.5            # a return off the centre pixel (4, 4) of cell 0
    depth[0, 0, 6, 13] = 5.5           # a nearer one and the centre pixel (4, 12) of cell 1
    depth[0, 0, 4, 12] = 7.5
    target, valid = model.depth_targets(depth)
    assert valid.tolist() == [expected_valid]
    assert target[0, 0, 1].item() == (4 if sampling == "cell_min" else 6)
    if sampling == "cell_min":
        assert target[0, 0, 0].item() == 2


def test_cumsum_pool_sums_and_gradients():
    features = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [5.0, 50.0]],
                            requires_grad=True)
    ranks = torch.tensor([0, 0, 5, 7, 7])
    sums, last_rows = CumsumPool.apply(features, ranks)
    assert sums.tolist() == [[3.0, 30.0], [3.0, 30.0], [9.0, 90.0]]
    assert last_rows.tolist() == [1, 2, 4]
    weights = torch.tensor([[1.0, -1.0], [2.0, 0.5], [3.0, 0.25]])
    (sums * weights).sum().backward()
    # every row gets the gradient of its cell's sum
    assert features.grad.tolist() == [[1.0, -1.0], [1.0, -1.0], [2.0, 0.5], [3.0, 0.25],
                                      [3.0, 0.25]]


def test_splat_cells_by_hand():
    grid = BevGridSpec(torch.tensor([-2.0, -1.0, -1.0]), torch.tensor([1.0, 1.0, 1.0]), (4, 2, 2))
    # (x, y, z): two in cell (x 0, y 0, z 0), one 0.5 cells below x's lower edge (truncation:
    # cell 0 too), one at z cell 1, one outside
    points = torch.tensor([[-1.5, -0.5, -0.5], [-1.2, -0.9, -0.1], [-2.5, -0.5, -0.5],
                           [1.5, 0.5, 0.5], [3.0, 0.0, 0.0]]).view(1, 1, 5, 1, 1, 3)
    features = torch.tensor([[1.0], [2.0], [4.0], [8.0], [16.0]]).view(1, 1, 5, 1, 1, 1)
    bev = splat(points, features, grid)
    assert bev.shape == (1, 2, 2, 4)           # channels: C x nz (z = 0 first)
    expected = torch.zeros(1, 2, 2, 4)
    expected[0, 0, 0, 0] = 7.0
    expected[0, 1, 1, 3] = 8.0
    assert torch.equal(bev, expected)


def test_no_agent_and_no_point_inside():
    grid = BevGridSpec(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]), (4, 2, 1))
    assert splat(torch.zeros(0, 2, 3, 1, 1, 3), torch.zeros(0, 2, 3, 1, 1, 5), grid).shape == \
        (0, 5, 2, 4)
    outside = torch.full((2, 1, 3, 1, 1, 3), -5.0)
    assert torch.equal(splat(outside, torch.ones(2, 1, 3, 1, 1, 5), grid), torch.zeros(2, 5, 2, 4))


def test_splat_sums_in_float32_under_half_precision():
    """A bf16 running total over 4096 points of about 1 would keep no digit of a cell's sum."""
    generator = torch.Generator().manual_seed(1)
    grid = BevGridSpec(torch.tensor([0.0, 0.0, 0.0]), torch.tensor([1.0, 1.0, 1.0]), (8, 8, 1))
    points = torch.rand(1, 1, 4096, 1, 1, 3, generator=generator) * torch.tensor([8.0, 8.0, 1.0])
    features = (torch.rand(1, 1, 4096, 1, 1, 2, generator=generator) + 0.5).bfloat16()
    bev = splat(points, features, grid)
    assert bev.dtype == torch.float32
    assert torch.equal(bev, splat(points, features.float(), grid))


def test_geometry_stays_float32_under_autocast(cases, monkeypatch):
    case = cases["res_ud_heter"]
    seen = []
    real = lift_splat.frustum_to_agent
    monkeypatch.setattr(lift_splat, "frustum_to_agent",
                        lambda *args: seen.append(real(*args)) or seen[-1])
    case.run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        case.run()
    assert seen[1].dtype == torch.float32 and torch.equal(seen[0], seen[1])


def test_frustum_points_project_back_to_their_pixels():
    generator = torch.Generator().manual_seed(3)
    frustum = make_frustum((32, 64), 8, depth_bin_starts(2, 20, 6, "LID"))
    angle = 0.3
    post_rots = torch.eye(3).repeat(1, 2, 1, 1)
    post_rots[0, 1, :2, :2] = 0.5 * torch.tensor([[math.cos(angle), math.sin(angle)],
                                                  [-math.sin(angle), math.cos(angle)]])
    post_rots[0, 0, 0, 0] = -0.25                 # a flip and a resize
    post_trans = torch.rand(1, 2, 3, generator=generator) * 10
    post_trans[..., 2] = 0
    intrinsics = torch.tensor([[[[90.0, 0, 31], [0, 80.0, 17], [0, 0, 1]]] * 2])
    extrinsics = torch.eye(4).repeat(1, 2, 1, 1)
    extrinsics[0, 1, :3, :3] = torch.tensor([[0.0, 0, 1], [-1, 0, 0], [0, -1, 0]])
    extrinsics[0, :, :3, 3] = torch.tensor([[1.0, 2, 3], [-1, 0.5, 1.5]])
    points = frustum_to_agent(frustum, intrinsics, extrinsics, post_rots, post_trans)
    for cam in range(2):
        in_camera = (points[0, cam] - extrinsics[0, cam, :3, 3]) @ extrinsics[0, cam, :3, :3]
        pixels = in_camera @ intrinsics[0, cam].T
        depth = pixels[..., 2:]
        augmented = torch.cat([pixels[..., :2] / depth, depth], -1) @ post_rots[0, cam].T \
            + post_trans[0, cam]
        assert torch.allclose(augmented, frustum, atol=1e-3)


def test_efficientnet_mapping_covers_every_key_and_refuses_unknown_ones(fixture):
    heal = fixture["cases"]["eff_ud_heter"]["state_dict"]
    theirs = {key[len("camencode.trunk."):]: value for key, value in heal.items()
              if key.startswith("camencode.trunk.")}
    mapped = efficientnet_pytorch_to_ours(theirs)
    ours = EfficientNetB0().state_dict()
    assert set(mapped) == set(ours)
    dropped = {key for key in theirs if key.startswith(("_conv_head.", "_bn1.", "_fc."))}
    assert len(mapped) == len(theirs) - len(dropped) and dropped
    full = fixture["cases"]["eff_lid_full"]["state_dict"]
    untaken = {key.split(".")[0] for key in full} - {"camencode", "bevencode"}
    assert untaken == set(HEAD_KEYS)         # heal_to_ours takes all but the heads
    with pytest.raises(WeightMappingError, match=r"^efficientnet_pytorch key _blocks.16._bn0.weight: no block 16 in b0$"):
        efficientnet_pytorch_to_ours({"_blocks.16._bn0.weight": torch.zeros(1)})
    with pytest.raises(WeightMappingError, match="unknown layer '_expand_conv'"):
        efficientnet_pytorch_to_ours({"_blocks.0._expand_conv.weight": torch.zeros(1)})


def test_heal_args_translate_and_refuse_ground_truth_depth(fixture):
    heal = fixture["cases"]["eff_lid_full"]["heal_args"]
    args = args_from_heal(heal)
    assert (args["xbound"], args["ddiscr"], args["depth_mode"], args["image_size"],
            args["bev_encoder_channels"]) == ([-16.0, 16.0, 1.0], [1.0, 25.0, 12], "LID",
                                              [64, 128], 16)
    spelled_as_heal = parse(LiftSplatArgs, dict(image_size=[64, 128], mode="UD",
                                                bevout_feature=16))
    assert (spelled_as_heal.depth_mode, spelled_as_heal.bev_encoder_channels) == ("UD", 16)
    with pytest.raises(ValueError, match="use_depth_gt: true is not reproduced"):
        args_from_heal(dict(heal, use_depth_gt=True))


def test_args_refuse_sizes_the_trunk_cannot_take():
    base = dict(xbound=[-16, 16, 1.0], ybound=[-16, 16, 1.0], image_size=[64, 128])
    assert LiftSplat(parse(LiftSplatArgs, dict(base, img_features=4, camera_encoder="Resnet101",
                                               zbound=[-4, 4, 4.0]))).out_channels == 8
    with pytest.raises(SchemaError, match="'image_size' must be multiples of 32"):
        parse(LiftSplatArgs, dict(base, image_size=[48, 128]))
    with pytest.raises(SchemaError, match="'img_downsample' must be 8 with Resnet101"):
        parse(LiftSplatArgs, dict(base, camera_encoder="Resnet101", img_downsample=16))
    with pytest.raises(SchemaError, match="'xbound' must be"):
        parse(LiftSplatArgs, dict(base, xbound=[16, -16, 1.0]))
    with pytest.raises(ValueError, match="BevEncode.* not 12 x 32"):
        LiftSplat(parse(LiftSplatArgs, dict(base, xbound=[-6, 6, 1.0], camera_encoder="Resnet101",
                                            bev_encoder_channels=4)))


class FakeBevGrid(NamedTuple):        # what the encoder slot's BevGrid offers
    lidar_range: tuple
    voxel_size: tuple
    nx: int
    ny: int


class FakeGeometry(NamedTuple):
    bev: FakeBevGrid


def test_grid_from_the_bev_grid():
    args = parse(LiftSplatArgs, dict(image_size=[64, 128], camera_encoder="Resnet101",
                                     img_features=4))
    geometry = FakeGeometry(FakeBevGrid((-12.8, -6.4, -3.0, 12.8, 6.4, 1.0), (0.4, 0.4), 64, 32))
    model = LiftSplat(args, geometry=geometry)
    assert model.cells == (64, 32, 1)
    assert torch.allclose(model.grid_lower, torch.tensor([-12.8, -6.4, -10.0]))
    assert torch.allclose(model.cell_size, torch.tensor([0.4, 0.4, 20.0]))
    same = dataclasses.replace(args, xbound=(-12.8, 12.8, 0.4))
    assert LiftSplat(same, geometry=geometry).cells == (64, 32, 1)
    with pytest.raises(ValueError, match=r"xbound \[-12.8, 12.8, 0.2\] is not the BEV grid's"):
        LiftSplat(dataclasses.replace(args, xbound=(-12.8, 12.8, 0.2)), geometry=geometry)
    with pytest.raises(ValueError, match="64 x 32 cells, the BEV grid has 65 x 32"):
        LiftSplat(args, geometry=FakeGeometry(geometry.bev._replace(nx=65)))
    with pytest.raises(ValueError, match="xbound and ybound are needed without a BEV grid"):
        LiftSplat(args)


# -- the encoder slot --------------------------------------------------------------------------

def test_registered_as_lss_and_a_detector_runs_on_cameras_alone():
    """``model.args.encoder: {core_method: lss}`` in a LiDAR config's detector: the splat is
    the bev_grid's map (128 x 64 cells of 0.8 m), the heads run on it and train the cameras."""
    cfg = load_config("hypes_yaml/synthetic/point_pillar_attfuse.yaml")
    model_section = to_plain(cfg["model"])
    for key in ("pillar_vfe", "point_pillar_scatter"):
        model_section["args"].pop(key)
    model_section["args"]["encoder"] = {"core_method": "lss", "args": {
        "image_size": [64, 128], "camera_encoder": "Resnet101", "img_features": 8,
        "ddiscr": [1, 25, 8]}}
    assert ENCODERS.get("lss") is LiftSplat
    model = build_model(model_section)
    assert isinstance(model.encoder, LiftSplat) and model.encoder.out_channels == 8
    assert model.encoder.cells == (128, 64, 1)
    agents, cams = 3, 2
    batch = {"images": torch.randn(agents, cams, 3, 64, 128),
             "intrinsics": torch.tensor([[100.0, 0, 64], [0, 100.0, 32], [0, 0, 1]]).repeat(
                 agents, cams, 1, 1),
             "extrinsics": torch.tensor([[0.0, 0, 1, 0], [-1, 0, 0, 0], [0, -1, 0, 1.5],
                                         [0, 0, 0, 1]]).repeat(agents, cams, 1, 1),
             "post_rots": torch.eye(3).repeat(agents, cams, 1, 1),
             "post_trans": torch.zeros(agents, cams, 3), "record_len": torch.tensor([2, 1])}
    outputs = model(batch)
    assert outputs["cls_preds"].shape == (2, 2, 32, 64)
    outputs["cls_preds"].sum().backward()
    assert model.encoder.camera_encoder.depth_head.weight.grad.abs().sum() > 0
