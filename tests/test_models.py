"""Detectors and fusion modules on a tiny hand-made pillar batch (CPU, 32x32 grid), and the
camera models of hypes_yaml/synthetic/camera_*.yaml on a fake camera batch."""
import math
from pathlib import Path

import pytest
import torch

from opencood.config import load_config, resolve_section
from opencood.config_schema import to_plain
from opencood.losses import DetectionLoss, build_loss
from opencood.models import build_model
from opencood.models.backbone import BackboneArgs, BaseBEVBackbone
from opencood.models.fusion import DenseFusionArgs, Where2comm, Where2commArgs
from opencood.models.pillar_vfe import PillarVFE, PillarVFEArgs
from opencood.models.scatter import PointPillarScatter
from opencood.registry import ENCODERS, FUSIONS, MODELS, RegistryError
from opencood.utils.fake_batch import fake_camera_batch

LIDAR_RANGE = [0.0, -8.0, -3.0, 16.0, 8.0, 1.0]
VOXEL_SIZE = [0.5, 0.5, 4.0]
NX = NY = 32                     # grid of the range above
H = W = 16                       # backbone output stride 2
NUM_ANCHORS = 2
MAX_POINTS = 6
PILLARS_PER_AGENT = 40
BACKBONE = {"layer_nums": [1, 1, 1], "layer_strides": [2, 2, 2], "num_filters": [8, 16, 16],
            "upsample_strides": [1, 2, 4], "num_upsample_filter": [8, 8, 8]}
BACKBONE_CHANNELS = 24
SCALE_SHAPES = [(8, 16, 16), (16, 8, 8), (16, 4, 4)]   # (C, H, W) of the three down blocks
RECORD_LENS = {"one_agent": [1, 1], "two_agents": [2, 2], "five_agents": [5],
               "mixed_1_3": [1, 3]}


def model_args(fusion=None):
    args = {"voxel_size": VOXEL_SIZE, "lidar_range": LIDAR_RANGE,
            "max_points_per_voxel": MAX_POINTS, "pillar_vfe": {"num_filters": [8]},
            "point_pillar_scatter": {"num_features": 8}, "base_bev_backbone": BACKBONE,
            "anchor_number": NUM_ANCHORS}
    if fusion is not None:
        args["fusion"] = fusion
    return args


def intermediate_cfg(core_method, **fusion_args):
    """A resolved ``model`` section (every default filled in, as build_model gets it)."""
    return resolve_section("model", {
        "core_method": "point_pillar_intermediate",
        "args": model_args({"core_method": core_method, "args": fusion_args})})


def make_pillars(num_agents, generator):
    """Random pillars of every agent: coords unique per agent, 1..MAX_POINTS points inside each
    pillar's cell, padding slots filled with garbage (the model must ignore them)."""
    features, num_points, coords = [], [], []
    for agent in range(num_agents):
        cells = torch.randperm(NX * NY, generator=generator)[:PILLARS_PER_AGENT]
        y, x = cells // NX, cells % NX
        counts = torch.randint(1, MAX_POINTS + 1, (PILLARS_PER_AGENT,), generator=generator)
        offsets = torch.rand(PILLARS_PER_AGENT, MAX_POINTS, 2, generator=generator)
        points = torch.empty(PILLARS_PER_AGENT, MAX_POINTS, 4)
        points[..., 0] = LIDAR_RANGE[0] + (x[:, None] + offsets[..., 0]) * VOXEL_SIZE[0]
        points[..., 1] = LIDAR_RANGE[1] + (y[:, None] + offsets[..., 1]) * VOXEL_SIZE[1]
        points[..., 2] = -3.0 + 4.0 * torch.rand(PILLARS_PER_AGENT, MAX_POINTS,
                                                 generator=generator)
        points[..., 3] = torch.rand(PILLARS_PER_AGENT, MAX_POINTS, generator=generator)
        padding = torch.arange(MAX_POINTS)[None, :] >= counts[:, None]
        points[padding] = 0.0
        features.append(points)
        num_points.append(counts.to(torch.int32))
        coords.append(torch.stack([torch.full_like(x, agent), torch.zeros_like(x), y, x], 1))
    return torch.cat(features), torch.cat(num_points), torch.cat(coords).long()


def make_batch(record_len, seed=0):
    generator = torch.Generator().manual_seed(seed)
    features, num_points, coords = make_pillars(sum(record_len), generator)
    return {"voxel_features": features, "voxel_num_points": num_points, "voxel_coords": coords,
            "record_len": torch.tensor(record_len, dtype=torch.int64)}


def make_targets(batch_size, seed=0, cells=H * W):
    generator = torch.Generator().manual_seed(seed + 100)
    num_anchors = cells * NUM_ANCHORS
    draw = torch.rand(batch_size, num_anchors, generator=generator)
    labels = torch.where(draw < 0.05, 1, torch.where(draw < 0.1, -1, 0)).long()
    positive = labels == 1
    return {"labels": labels,
            "reg_targets": torch.randn(batch_size, num_anchors, 7, generator=generator) * positive[
                ..., None],
            "dir_targets": torch.randint(0, 2, (batch_size, num_anchors), generator=generator)
            * positive,
            "reg_weights": positive.float(), "num_positives": positive.sum(1)}


def select_agents(batch, keep_agents, new_record_len):
    """Sub-batch with only the pillars of ``keep_agents`` (renumbered in the order given)."""
    agent_of_pillar = batch["voxel_coords"][:, 0]
    parts = [torch.nonzero(agent_of_pillar == agent).flatten() for agent in keep_agents]
    new_ids = [torch.full((len(p),), i) for i, p in enumerate(parts)]
    index = torch.cat(parts)
    coords = batch["voxel_coords"][index].clone()
    coords[:, 0] = torch.cat(new_ids)
    return {"voxel_features": batch["voxel_features"][index],
            "voxel_num_points": batch["voxel_num_points"][index], "voxel_coords": coords,
            "record_len": torch.tensor(new_record_len)}


MODEL_CFGS = {
    "point_pillar": resolve_section("model", {"core_method": "point_pillar",
                                              "args": model_args()}),
    "attfuse": intermediate_cfg("attfuse"),
    "fcooper": intermediate_cfg("fcooper"),
    "where2comm": intermediate_cfg("where2comm", max_bytes_per_agent=10_000),
    "where2comm_max_no_budget": intermediate_cfg("where2comm", fusion_mode="max"),
    "where2comm_budget0": intermediate_cfg("where2comm", max_bytes_per_agent=0),
    "disconet": intermediate_cfg("disconet", hidden=[16, 8]),
}


def test_every_registered_model_and_fusion_is_covered():
    covered_models = {cfg["core_method"] for cfg in MODEL_CFGS.values()}
    covered_fusions = {cfg["args"]["fusion"]["core_method"] for cfg in MODEL_CFGS.values()
                       if cfg["args"].get("fusion") is not None}
    # The issue-14 baselines have their own file (tests/test_baselines.py).
    from test_baselines import BASELINES
    covered_fusions |= set(BASELINES)
    # HEAL's heterogeneous models: tests/test_parity_heal_pyramid.py (parity, forward+backward)
    from test_parity_heal_pyramid import HETER_MODELS
    covered_models |= set(HETER_MODELS)
    assert covered_models == set(MODELS.names())
    assert covered_fusions == set(FUSIONS.names())
    camera_encoders = {load_config(path)["model"]["args"]["encoder"]["core_method"]
                       for path in CAMERA_CONFIGS.values()}
    assert camera_encoders | {"pillar"} == set(ENCODERS.names())


CAMERA_CONFIGS = {path.stem: path for path in sorted(
    (Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic").glob("camera_*.yaml"))
    if path.stem != "camera_base"}
# the configs' networks on smaller images (EfficientNet: multiples of 32) and a 32 x 16 grid
CAMERA_IMAGE = (32, 64)
CAMERA_BEV_RANGE = [-12.8, -6.4, -3.0, 12.8, 6.4, 1.0]


@pytest.mark.parametrize("name", list(CAMERA_CONFIGS))
def test_camera_model_forward_backward_every_parameter_gets_a_finite_grad(name):
    """Every camera model (no / late fusion and each intermediate fusion on the lift-splat
    BEV): a fake camera batch of two samples (1 and 2 agents, own-frame maps warped to the
    ego), head maps of the BEV grid / feature stride, a finite loss and a finite gradient
    for every parameter."""
    torch.manual_seed(0)
    cfg = load_config(CAMERA_CONFIGS[name])
    model_cfg = to_plain(cfg["model"])          # a changed copy: the loaded config is read-only
    model_cfg["args"]["encoder"]["args"]["image_size"] = list(CAMERA_IMAGE)
    model_cfg["args"]["bev_range"] = CAMERA_BEV_RANGE
    model = build_model(model_cfg)
    single_agent = cfg["model"]["core_method"] == "point_pillar"
    record_len = [1, 1] if single_agent else [1, 2]
    agents = sum(record_len)
    batch = {**fake_camera_batch(agents, image_size=CAMERA_IMAGE,
                                 depth="depth" in cfg["input_source"]),
             "record_len": torch.tensor(record_len),
             "transforms_to_ego": torch.eye(4).repeat(agents, 1, 1),
             "points_in_agent_frame": True}
    outputs = model(batch)

    grid_range, cell = model_cfg["args"]["bev_range"], model_cfg["args"]["bev_cell_size"]
    stride = cfg["postprocess"]["anchor_args"]["feature_stride"]
    rows = round((grid_range[4] - grid_range[1]) / cell[1]) // stride
    cols = round((grid_range[3] - grid_range[0]) / cell[0]) // stride
    assert outputs["cls_preds"].shape == (2, NUM_ANCHORS, rows, cols)
    assert outputs["reg_preds"].shape == (2, 7 * NUM_ANCHORS, rows, cols)
    loss, terms = build_loss(cfg["loss"])(outputs, make_targets(2, cells=rows * cols))
    assert torch.isfinite(loss) and loss > 0
    assert ("depth_loss" in terms) == ("depth" in cfg["input_source"])
    loss.backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{param_name} has a non-finite gradient"


@pytest.mark.parametrize("agents", list(RECORD_LENS))
@pytest.mark.parametrize("name", list(MODEL_CFGS))
def test_forward_backward_every_parameter_gets_a_finite_grad(name, agents):
    torch.manual_seed(0)
    record_len = RECORD_LENS[agents]
    if name == "point_pillar":          # single agent: each CAV is its own sample (late fusion)
        record_len = [1] * sum(record_len)
    model = build_model(MODEL_CFGS[name])
    batch = make_batch(record_len)
    batch_size = len(record_len)
    outputs = model(batch)

    assert outputs["cls_preds"].shape == (batch_size, NUM_ANCHORS, H, W)
    assert outputs["reg_preds"].shape == (batch_size, 7 * NUM_ANCHORS, H, W)
    assert outputs["dir_preds"].shape == (batch_size, 2 * NUM_ANCHORS, H, W)
    assert outputs["comm_bytes"].shape == (batch_size,)
    alone = torch.tensor(record_len) == 1
    assert torch.all(outputs["comm_bytes"][alone] == 0)

    loss, terms = DetectionLoss()(outputs, make_targets(batch_size))
    assert torch.isfinite(loss) and loss > 0
    if name.startswith("where2comm"):
        assert "conf_loss" in terms
    loss.backward()
    for param_name, param in model.named_parameters():
        assert param.grad is not None, f"{param_name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{param_name} has a non-finite gradient"


def test_point_pillar_counts_early_fusion_bytes_and_rejects_multi_agent_samples():
    model = build_model(MODEL_CFGS["point_pillar"]).eval()
    batch = make_batch([1, 1, 1])
    batch["shared_points"] = torch.tensor([0, 100, 30])
    batch["num_agents_sent"] = torch.tensor([0, 2, 1])
    with torch.no_grad():
        # 16 bytes per point (4 x fp32), split over the agents that sent them.
        assert model(batch)["comm_bytes"].tolist() == [0.0, 800.0, 480.0]
        with pytest.raises(ValueError, match="single-agent"):
            model(make_batch([2]))


def test_dense_fusion_bytes_follow_the_fused_maps():
    batch = make_batch([1, 3])
    with torch.no_grad():
        attfuse = build_model(MODEL_CFGS["attfuse"]).eval()(batch)["comm_bytes"]
        fcooper = build_model(MODEL_CFGS["fcooper"]).eval()(batch)["comm_bytes"]
    every_scale = sum(c * h * w * 4 for c, h, w in SCALE_SHAPES)
    assert attfuse.tolist() == [0.0, float(every_scale)]
    assert fcooper.tolist() == [0.0, float(8 * NY * NX * 4)]   # the 8-channel pillar canvas


def permute_non_ego(batch, record_len, order_within_samples):
    """Renumber agents so each sample's non-ego agents appear in a new order."""
    keep, start = [], 0
    for count, order in zip(record_len, order_within_samples):
        keep += [start + i for i in order]
        start += count
    return select_agents(batch, keep, record_len)


@pytest.mark.parametrize("name", ["attfuse", "fcooper", "where2comm",
                                  "where2comm_max_no_budget"])
def test_fusion_ignores_the_order_of_non_ego_agents(name):
    torch.manual_seed(0)
    model = build_model(MODEL_CFGS[name]).eval()
    record_len = [4, 1, 3]
    batch = make_batch(record_len, seed=3)
    shuffled = permute_non_ego(batch, record_len, [[0, 3, 1, 2], [0], [0, 2, 1]])
    assert not torch.equal(shuffled["voxel_coords"], batch["voxel_coords"])
    with torch.no_grad():
        reference, permuted = model(batch), model(shuffled)
    for key in ("cls_preds", "reg_preds", "dir_preds", "comm_bytes"):
        torch.testing.assert_close(permuted[key], reference[key], atol=1e-5, rtol=1e-5)
    if name == "fcooper":
        return          # a max over agents is symmetric in the ego too
    # The ego is special (its query / its unmasked map): swapping it in changes the result.
    with torch.no_grad():
        swapped_ego = model(permute_non_ego(batch, record_len, [[1, 0, 2, 3], [0], [0, 1, 2]]))
    assert not torch.allclose(swapped_ego["cls_preds"], reference["cls_preds"], atol=1e-5)


@pytest.mark.parametrize("fusion_mode", ["attention", "max"])
def test_where2comm_with_zero_budget_is_exactly_ego_only(fusion_mode):
    torch.manual_seed(0)
    cfg = intermediate_cfg("where2comm", max_bytes_per_agent=0, fusion_mode=fusion_mode,
                           threshold=0.0)
    model = build_model(cfg).eval()
    batch = make_batch([3, 2], seed=1)
    ego_only = select_agents(batch, [0, 3], [1, 1])
    with torch.no_grad():
        fused, alone = model(batch), model(ego_only)
    # Not bitwise: the pillar linear layer and the convs sum in a batch-size dependent order
    # (1e-8 here); the fusion itself is exact, see the next test.
    for key in ("cls_preds", "reg_preds", "dir_preds"):
        torch.testing.assert_close(fused[key], alone[key], atol=1e-6, rtol=0)
    assert fused["comm_bytes"].tolist() == [0.0, 0.0]
    # Control: the same model with an unlimited budget does use the other agents.
    model.fusion.max_bytes_per_agent = None
    with torch.no_grad():
        assert not torch.allclose(model(batch)["cls_preds"], alone["cls_preds"])


@pytest.mark.parametrize("fusion_mode", ["attention", "max"])
def test_where2comm_fusion_with_zero_budget_returns_the_ego_map_bit_for_bit(fusion_mode):
    torch.manual_seed(0)
    fusion = Where2comm(Where2commArgs(threshold=0.0, max_bytes_per_agent=0,
                                       fusion_mode=fusion_mode), in_channels=6, num_anchors=2)
    features = torch.randn(5, 6, 4, 4)           # negative values too: max would pick others
    result = fusion(features, torch.tensor([3, 2]))
    assert torch.equal(result.features, features[[0, 3]])
    assert result.comm_bytes.tolist() == [0.0, 0.0]
    fusion.max_bytes_per_agent = None
    assert not torch.allclose(fusion(features, torch.tensor([3, 2])).features, features[[0, 3]])


def cells_above(conf_logits, threshold):
    return (torch.sigmoid(conf_logits.amax(dim=1)) > threshold).flatten(1).sum(1)


def test_where2comm_bytes_count_the_selected_cells():
    torch.manual_seed(0)
    threshold = 0.01
    model = build_model(intermediate_cfg("where2comm", threshold=threshold)).eval()
    batch = make_batch([3, 1], seed=2)
    with torch.no_grad():
        outputs = model(batch)
    cells = cells_above(outputs["conf_preds"], threshold)       # per agent, agents 0..3
    assert 5 < cells[1] < H * W and 5 < cells[2] < H * W      # the threshold really selects
    bytes_per_cell = BACKBONE_CHANNELS * 4
    expected = (cells[1] + cells[2]).item() / 2 * bytes_per_cell
    assert outputs["comm_bytes"].tolist() == [expected, 0.0]
    assert outputs["conf_sample_index"].tolist() == [0, 0, 0, 1]

    # A budget of 5 cells (plus change) caps each sender at its 5 most confident cells.
    model.fusion.max_bytes_per_agent = 5 * bytes_per_cell + bytes_per_cell - 1
    with torch.no_grad():
        capped = model(batch)["comm_bytes"]
    assert capped.tolist() == [5.0 * bytes_per_cell, 0.0]


def test_where2comm_top_k_keeps_the_most_confident_cells():
    fusion = Where2comm(Where2commArgs(threshold=0.5, max_bytes_per_agent=2 * 8), in_channels=2,
                        num_anchors=1)
    confidence = torch.tensor([[[0.9, 0.2], [0.6, 0.7]],     # ego: everything kept
                               [[0.9, 0.2], [0.6, 0.7]],     # top-2 of those above 0.5
                               [[0.1, 0.2], [0.55, 0.3]]])   # only one above the threshold
    sent = fusion.select_cells(confidence, torch.tensor([True, False, False]))
    assert sent.tolist() == [[[True, True], [True, True]],
                             [[True, False], [False, True]],
                             [[False, False], [True, False]]]


def test_build_model_unknown_names_list_the_registered_ones():
    with pytest.raises(RegistryError) as info:
        build_model({"core_method": "point_pilar", "args": model_args()})
    assert "point_pillar, point_pillar_intermediate" in str(info.value)
    with pytest.raises(RegistryError) as info:
        build_model(intermediate_cfg("v2vnett"))
    assert all(name in str(info.value) for name in ("attfuse", "fcooper", "where2comm"))


def test_where2comm_refuses_a_stage_without_anchor_grid():
    cfg = to_plain(intermediate_cfg("where2comm"))
    cfg["args"]["fusion"]["stage"] = "multiscale"
    with pytest.raises(ValueError, match="supported: backbone"):
        build_model(cfg)


def test_fcooper_at_backbone_stage_fuses_the_backbone_output():
    cfg = to_plain(MODEL_CFGS["fcooper"])
    cfg["args"]["fusion"]["stage"] = "backbone"
    with torch.no_grad():
        outputs = build_model(cfg).eval()(make_batch([2]))
    assert outputs["comm_bytes"].tolist() == [float(BACKBONE_CHANNELS * H * W * 4)]


def test_pillar_vfe_decorates_with_mean_and_centre_offsets_and_ignores_padding():
    vfe = PillarVFE(PillarVFEArgs(num_filters=(8,)), VOXEL_SIZE, LIDAR_RANGE)
    features = torch.zeros(1, 3, 4)
    features[0, :2] = torch.tensor([[1.1, -7.9, -1.0, 0.5], [1.3, -7.7, 0.0, 0.1]])
    num_points = torch.tensor([2])
    coords = torch.tensor([[0, 0, 0, 2]])        # x cell 2 -> centre x 1.25, y cell 0 -> -7.75
    mask = torch.tensor([[True, True, False]])
    decorated = vfe.decorate(features, num_points, coords, mask)
    expected_first = [1.1, -7.9, -1.0, 0.5, -0.1, -0.1, -0.5, -0.15, -0.15, 0.0]
    torch.testing.assert_close(decorated[0, 0], torch.tensor(expected_first))
    assert torch.all(decorated[0, 2] == 0)

    vfe.eval()
    garbage = features.clone()
    garbage[0, 2] = torch.tensor([50.0, 50.0, 50.0, 9.0])
    torch.testing.assert_close(vfe(garbage, num_points, coords), vfe(features, num_points, coords))

    two_layers = PillarVFE(PillarVFEArgs(num_filters=(6, 8)), VOXEL_SIZE, LIDAR_RANGE).eval()
    assert two_layers.out_channels == 8
    torch.testing.assert_close(two_layers(garbage, num_points, coords),
                               two_layers(features, num_points, coords))


def test_scatter_puts_each_pillar_in_its_agent_and_cell():
    scatter = PointPillarScatter(num_features=2, nx=4, ny=3)
    pillars = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    coords = torch.tensor([[0, 0, 2, 3], [1, 0, 0, 1], [2, 0, 1, 0]])
    canvas = scatter(pillars, coords, torch.tensor([1, 2]))
    assert canvas.shape == (3, 2, 3, 4)
    assert canvas[0, :, 2, 3].tolist() == [1.0, 2.0]
    assert canvas[1, :, 0, 1].tolist() == [3.0, 4.0]
    assert canvas[2, :, 1, 0].tolist() == [5.0, 6.0]
    assert canvas.abs().sum() == 21.0                    # nothing written anywhere else


def test_backbone_calls_the_fusion_once_per_scale():
    backbone = BaseBEVBackbone(BackboneArgs(**BACKBONE), in_channels=8).eval()
    seen = []

    def ego_only(features, record_len):
        seen.append(tuple(features.shape))
        starts = torch.cumsum(record_len, 0) - record_len
        return features[starts]

    canvas = torch.randn(3, 8, NY, NX)
    record_len = torch.tensor([2, 1])
    with torch.no_grad():
        fused = backbone(canvas, fuse_fn=ego_only, record_len=record_len)
        unfused = backbone(canvas)
    assert seen == [(3, *shape) for shape in SCALE_SHAPES]
    assert fused.shape == (2, BACKBONE_CHANNELS, H, W)
    torch.testing.assert_close(fused, unfused[[0, 2]])


def test_attention_fusion_weights_agents_by_similarity_to_the_ego():
    attfuse = FUSIONS.get("attfuse")(DenseFusionArgs(), in_channels=2, num_anchors=1)
    ego = torch.tensor([1.0, 0.0])
    other = torch.tensor([0.0, 2.0])
    features = torch.stack([ego, other]).view(2, 2, 1, 1)
    fused = attfuse(features, torch.tensor([2])).features.flatten()
    # scores: ego.ego / sqrt(2) = 1/sqrt(2), ego.other = 0
    weight_ego = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)
    torch.testing.assert_close(fused, weight_ego * ego + (1 - weight_ego) * other)


def test_an_own_frame_camera_map_warped_to_the_ego_is_the_map_its_cameras_write_there():
    """The lss map and the own-frame warp share one layout (rows y, columns x, cell (0, 0) at
    (xmin, ymin)): an agent's own-frame camera map warped by T (what the intermediate detectors
    do with proj_first: false) equals the map its cameras write with their extrinsics composed
    with T (proj_first: true) on every cell whose source lies inside the grid. T: a 90-degree
    yaw and a shift of (3, -2) cells, so cell centres land on cell centres."""
    from opencood.models.lift_splat import LiftSplat, LiftSplatArgs
    from opencood.models.warp import BevGrid, warp_to_ego
    torch.manual_seed(0)
    half, cell = 8.0, 0.5
    encoder = LiftSplat(LiftSplatArgs(
        xbound=(-half, half, cell), ybound=(-half, half, cell), ddiscr=(1.0, 12.0, 12),
        image_size=(32, 64), img_downsample=16, img_features=4)).eval()
    own = fake_camera_batch(1, image_size=(32, 64))
    # the rig off the cell lines: at the agent's origin a camera's frustum points (x = depth
    # ahead, bin depths such as 1.0 m) sit exactly on cell edges, where rounding picks the cell
    off_lines = torch.eye(4)
    off_lines[:2, 3] = torch.tensor([0.13, -0.07])
    own["extrinsics"] = off_lines @ own["extrinsics"]
    to_ego = torch.tensor([[0.0, -1.0, 0.0, 3 * cell], [1.0, 0.0, 0.0, -2 * cell],
                           [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    moved = {**own, "extrinsics": to_ego @ own["extrinsics"]}
    with torch.no_grad():
        own_map, ego_map = encoder(own), encoder(moved)
    cells = int(2 * half / cell)
    grid = BevGrid((-half, -half, -3.0, half, half, 1.0), (cell, cell), cells, cells)
    warped = warp_to_ego(own_map, to_ego[None], grid)

    # ego cell centres -> the own frame: inside the grid there, the warp has their source.
    # Border cells of either grid are left out: the splat truncates toward zero, so points
    # up to a cell below the lower edge land in the first cell (HEAL's, DESIGN §2.3), points a
    # rotation moves out of the other grid.
    centres = -half + cell / 2 + cell * torch.arange(cells, dtype=torch.float64)
    y, x = torch.meshgrid(centres, centres, indexing="ij")
    ego_points = torch.stack([x, y, torch.zeros_like(x), torch.ones_like(x)], -1)
    own_points = ego_points @ torch.linalg.inv(to_ego.double()).T
    inside = (own_points[..., :2].abs() < half - cell).all(-1) & \
        (ego_points[..., :2].abs() < half - cell).all(-1)
    assert 0.3 < inside.float().mean() < 0.9
    seen = ego_map[0].abs().sum(0) > 0
    assert (seen & inside).sum() >= 20          # the comparison covers cameras' cells
    scale = float(ego_map.abs().max())
    assert torch.allclose(warped[0][:, inside], ego_map[0][:, inside], atol=1e-5 * scale)
