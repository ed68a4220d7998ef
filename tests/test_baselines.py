"""The field's standard baselines (issue 14): V2VNet, V2X-ViT, CoBEVT's FuseBEVT.

Tiny hand-made pillar batches on CPU (the 32x32 grid of test_models), the model-specific
properties each paper defines, 2-rank DDP steps with gloo (of these baselines, and of every
registered fusion module at the extremes its schema allows), and a short training run of each
lite config through the trainer.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opencood.config import resolve_section
from opencood.config_schema import to_plain
from opencood.engine import trainer
from opencood.losses import DetectionLoss
from opencood.models import build_model
from opencood.models.v2vnet import V2VNetArgs, V2VNetFusion
from opencood.models.warp import bev_affine, warp_to_receivers
from opencood.registry import FUSIONS
from dist_helpers import run_on_ranks
from test_models import make_batch, make_targets, model_args, permute_non_ego, select_agents

REPO_ROOT = Path(__file__).resolve().parents[1]
NUM_ANCHORS, H, W = 2, 16, 16          # test_models' grid: 32x32 pillars, output stride 2
SHRINK = {"dim": 16, "stride": 1}      # keeps the 16x16 anchor grid of make_targets


def baseline_cfg(core_method, **fusion_args):
    args = model_args({"core_method": core_method, "args": fusion_args})
    args["shrink_header"] = dict(SHRINK)
    # Resolved, as build_model gets it (every default filled in).
    return resolve_section("model", {"core_method": "point_pillar_intermediate", "args": args})


# Small arguments of the fusion modules (schema defaults for those not listed).
SMALL_FUSION_ARGS = {
    "v2vnet": {"num_iteration": 2, "cell_size": 1.0, "grid_center": [8.0, 0.0]},
    # Window 3 does not divide the 16x16 map: exercises the padding.
    "v2xvit": {"depth": 2, "num_blocks": 1, "heads": 2, "dim_head": 4, "window_sizes": [3, 4],
               "window_heads": [2, 1], "window_dim_heads": [4, 8], "mlp_dim": 16},
    # Window 3 leaves padding here too (16 = 5 x 3 + 1).
    "cobevt": {"depth": 2, "window": 3, "dim_head": 8, "mlp_dim": 16},
    "disconet": {"hidden": [16, 8]},
}
BASELINES = {name: baseline_cfg(name, **SMALL_FUSION_ARGS[name])
             for name in ("v2vnet", "v2xvit", "cobevt")}


def forward_backward(model, batch, batch_size):
    outputs = model(batch)
    loss, _ = DetectionLoss()(outputs, make_targets(batch_size))
    loss.backward()
    return outputs, loss


@pytest.mark.parametrize("record_len", [[1, 1], [2, 2], [5]], ids=["1", "2", "5"])
@pytest.mark.parametrize("name", list(BASELINES))
def test_forward_backward_every_parameter_gets_a_finite_grad(name, record_len):
    torch.manual_seed(0)
    model = build_model(BASELINES[name])
    batch = make_batch(record_len)
    batch["agent_types"] = torch.zeros(sum(record_len), dtype=torch.int64)
    batch["agent_latency"] = torch.zeros(sum(record_len), dtype=torch.int64)
    outputs, loss = forward_backward(model, batch, len(record_len))
    assert outputs["cls_preds"].shape == (len(record_len), NUM_ANCHORS, H, W)
    assert outputs["comm_bytes"].shape == (len(record_len),)
    assert torch.isfinite(loss) and loss > 0
    missing = [key for key, param in model.named_parameters() if param.grad is None]
    assert not missing, f"{name}: no gradient for {missing}"
    for key, param in model.named_parameters():
        assert torch.isfinite(param.grad).all(), key


@pytest.mark.parametrize("name", list(BASELINES))
def test_ego_output_ignores_the_order_of_non_ego_agents(name):
    torch.manual_seed(0)
    model = build_model(BASELINES[name]).eval()
    record_len = [4, 1, 3]
    batch = make_batch(record_len, seed=3)
    shuffled = permute_non_ego(batch, record_len, [[0, 3, 1, 2], [0], [0, 2, 1]])
    with torch.no_grad():
        reference, permuted = model(batch), model(shuffled)
    for key in ("cls_preds", "reg_preds", "dir_preds", "comm_bytes"):
        torch.testing.assert_close(permuted[key], reference[key], atol=1e-5, rtol=1e-5)
    if name == "cobevt":
        return      # its mean over agents is symmetric in the ego too (as OpenCOOD's)
    # Control: the ego is special, so putting another agent first changes the output.
    with torch.no_grad():
        swapped = model(permute_non_ego(batch, record_len, [[1, 0, 2, 3], [0], [0, 1, 2]]))
    assert not torch.allclose(swapped["cls_preds"], reference["cls_preds"], atol=1e-5)


@pytest.mark.parametrize("name", list(BASELINES))
def test_non_ego_agents_send_their_whole_fused_map(name):
    model = build_model(BASELINES[name]).eval()
    with torch.no_grad():
        comm_bytes = model(make_batch([1, 3]))["comm_bytes"]
    rounds = model.fusion.num_iteration if name == "v2vnet" else 1
    assert comm_bytes.tolist() == [0.0, float(rounds * SHRINK["dim"] * H * W * 4)]


# ---------------------------------------------------------------------------------------------
# V2VNet
# ---------------------------------------------------------------------------------------------

def test_v2vnet_without_rounds_is_the_single_agent_path():
    torch.manual_seed(0)
    cfg = to_plain(BASELINES["v2vnet"])
    cfg["args"]["fusion"]["args"]["num_iteration"] = 0
    model = build_model(cfg).eval()
    batch = make_batch([3, 2], seed=1)
    with torch.no_grad():
        fused = model(batch)
        alone = model(select_agents(batch, [0, 3], [1, 1]))
        # Identity pairwise transforms (what proj_first data means) give the same result.
        fusion_in = torch.randn(5, 4, 6, 6)
        identity = torch.eye(4).expand(2, 3, 3, 4, 4)
        fusion = V2VNetFusion(V2VNetArgs(num_iteration=0), 4, NUM_ANCHORS)
        with_pose = fusion(fusion_in, torch.tensor([3, 2]), pairwise=identity).features
    for key in ("cls_preds", "reg_preds", "dir_preds"):
        # Not bitwise: the pillar encoder sums in a batch-size dependent order (test_models).
        torch.testing.assert_close(fused[key], alone[key], atol=1e-6, rtol=0)
    torch.testing.assert_close(with_pose, fusion.output(fusion_in[[0, 3]]))
    assert fused["comm_bytes"].tolist() == [0.0, 0.0]
    assert model.fusion.message_cnn is None and model.fusion.gru is None   # built for rounds only
    # Control: with rounds the other agents do change the ego's output.
    with_rounds = build_model(BASELINES["v2vnet"]).eval()
    with torch.no_grad():
        difference = with_rounds(batch)["reg_preds"] - with_rounds(
            select_agents(batch, [0, 3], [1, 1]))["reg_preds"]
    # 10x the tolerance of the equality above (untrained convs give small outputs).
    assert difference.flatten(1).abs().amax(1).min() > 1e-5


def translation(dx, dy):
    transform = torch.eye(4)
    transform[0, 3], transform[1, 3] = dx, dy
    return transform


@pytest.mark.parametrize("cells_x, cells_y", [(3, 0), (0, -2), (-1, 4)])
def test_v2vnet_warp_by_a_translation_of_n_cells_moves_the_map_by_n_cells(cells_x, cells_y):
    cell, height, width = 0.4, 10, 12
    sender = torch.randn(1, 1, 3, height, width)
    # The sender's frame sits (cells_x, cells_y) cells along +x, +y in the receiver's frame, so
    # its cell (r, c) lands on the receiver's (r + cells_y, c + cells_x).
    pair = translation(cells_x * cell, cells_y * cell).view(1, 1, 1, 4, 4)
    theta = bev_affine(pair, (height, width), cell, grid_center=(5.0, -1.0))
    warped, covered = warp_to_receivers(sender, theta)
    warped, covered = warped[0, 0, 0], covered[0, 0, 0, 0]
    expected = torch.zeros_like(warped)
    expected_covered = torch.zeros_like(covered)
    rows = slice(max(cells_y, 0), height + min(cells_y, 0))
    cols = slice(max(cells_x, 0), width + min(cells_x, 0))
    src_rows = slice(max(-cells_y, 0), height + min(-cells_y, 0))
    src_cols = slice(max(-cells_x, 0), width + min(-cells_x, 0))
    expected[:, rows, cols] = sender[0, 0][:, src_rows, src_cols]
    expected_covered[rows, cols] = True
    torch.testing.assert_close(warped, expected, atol=1e-5, rtol=0)
    assert torch.equal(covered, expected_covered)


def test_v2vnet_warp_by_a_quarter_turn_rotates_the_map():
    cell, size = 1.0, 8          # square map centred on the origin: a 90 deg turn maps it onto
    sender = torch.randn(1, 1, 2, size, size)   # itself, cell centres onto cell centres
    turn = torch.eye(4)
    turn[:2, :2] = torch.tensor([[0.0, -1.0], [1.0, 0.0]])     # +90 deg about z
    theta = bev_affine(turn.view(1, 1, 1, 4, 4), (size, size), cell)
    warped, covered = warp_to_receivers(sender, theta)
    # Sender point (x, y) -> receiver (-y, x): column index follows x, row index follows y.
    expected = torch.flip(sender[0, 0].transpose(1, 2), dims=[2])
    torch.testing.assert_close(warped[0, 0, 0], expected, atol=1e-5, rtol=0)
    assert covered.all()


def literal_v2vnet(fusion: V2VNetFusion, features, record_len):
    """V2VNet's rounds evaluated as written, all maps in one frame: every receiver, every
    round, the message CNN over each [receiver, sender] pair, averaged over real senders."""
    padded = torch.zeros(len(record_len), int(record_len.max()), *features.shape[1:])
    starts = torch.cumsum(record_len, 0) - record_len
    for sample, (start, count) in enumerate(zip(starts.tolist(), record_len.tolist())):
        padded[sample, :count] = features[start:start + count]
    states = padded
    for _ in range(fusion.num_iteration):
        updated = torch.zeros_like(states)
        for sample, count in enumerate(record_len.tolist()):
            for receiver in range(count):
                messages = [fusion.message_cnn(torch.cat([states[sample, receiver],
                                                          states[sample, sender]])[None])
                            for sender in range(count)]
                mean = torch.cat(messages).mean(0, keepdim=True)
                gru_input = torch.cat([mean, padded[sample, receiver][None]], dim=1)
                updated[sample, receiver] = fusion.gru(gru_input, states[sample, receiver][None])[0]
        states = updated
    return fusion.output(states[:, 0])


@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_v2vnet_split_messages_and_ego_only_last_round_equal_the_literal_rounds(rounds):
    torch.manual_seed(0)
    fusion = V2VNetFusion(V2VNetArgs(num_iteration=rounds, cell_size=1.0), 4, NUM_ANCHORS).eval()
    features, record_len = torch.randn(6, 4, 5, 7), torch.tensor([3, 1, 2])
    identity = torch.eye(4).expand(3, 3, 3, 4, 4)
    with torch.no_grad():
        expected = literal_v2vnet(fusion, features, record_len)
        one_frame = fusion(features, record_len).features          # the split convolution
        warped = fusion(features, record_len, pairwise=identity).features   # pairwise CNN
    torch.testing.assert_close(one_frame, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(warped, expected, atol=1e-5, rtol=1e-5)


def test_v2vnet_masks_messages_from_cells_outside_the_senders_view():
    torch.manual_seed(0)
    fusion = V2VNetFusion(V2VNetArgs(num_iteration=1, cell_size=1.0), 3, NUM_ANCHORS)
    features = torch.randn(2, 3, 6, 6)
    record_len = torch.tensor([2])
    far = torch.eye(4).expand(1, 2, 2, 4, 4).clone()
    far[0, 0, 1] = translation(100.0, 0.0)          # the sender's map lies outside the ego's
    far[0, 1, 0] = translation(-100.0, 0.0)
    alone = V2VNetFusion(V2VNetArgs(num_iteration=1, cell_size=1.0), 3, NUM_ANCHORS)
    alone.load_state_dict(fusion.state_dict())
    with torch.no_grad():
        out_far = fusion(features, record_len, pairwise=far).features
        out_alone = alone(features[:1], torch.tensor([1])).features
        out_near = fusion(features, record_len).features
    torch.testing.assert_close(out_far, out_alone)
    assert not torch.allclose(out_near, out_alone)


# ---------------------------------------------------------------------------------------------
# V2X-ViT
# ---------------------------------------------------------------------------------------------

def v2xvit_model(**overrides):
    cfg = to_plain(BASELINES["v2xvit"])
    cfg["args"]["fusion"]["args"].update(overrides)
    torch.manual_seed(0)
    return build_model(cfg).eval()


def with_agent_info(batch, types, latency):
    batch = dict(batch)
    batch["agent_types"] = torch.tensor(types, dtype=torch.int64)
    batch["agent_latency"] = torch.tensor(latency, dtype=torch.int64)
    return batch


def test_v2xvit_agent_types_have_their_own_projections():
    model = v2xvit_model()
    attention = model.fusion.blocks[0][0].agent_attention
    for layers in (attention.to_q, attention.to_k, attention.to_v, attention.to_out):
        vehicle, infrastructure = layers
        assert vehicle.weight is not infrastructure.weight
        assert vehicle.weight.data_ptr() != infrastructure.weight.data_ptr()
        assert not torch.equal(vehicle.weight, infrastructure.weight)
    batch = make_batch([3], seed=4)
    with torch.no_grad():
        all_vehicles = model(with_agent_info(batch, [0, 0, 0], [0, 0, 0]))["reg_preds"]
        with_rsu = model(with_agent_info(batch, [0, 0, 1], [0, 0, 0]))["reg_preds"]
    assert (all_vehicles - with_rsu).abs().max() > 1e-5
    # Control: make every type's weights identical and the type stops mattering.
    with torch.no_grad():
        for blocks in model.fusion.blocks:
            for block in blocks:
                hmsa = block.agent_attention
                for layers in (hmsa.to_q, hmsa.to_k, hmsa.to_v, hmsa.to_out):
                    layers[1].load_state_dict(layers[0].state_dict())
                hmsa.relation_att.copy_(hmsa.relation_att[:1].expand_as(hmsa.relation_att))
                hmsa.relation_msg.copy_(hmsa.relation_msg[:1].expand_as(hmsa.relation_msg))
        same_vehicles = model(with_agent_info(batch, [0, 0, 0], [0, 0, 0]))["reg_preds"]
        same_rsu = model(with_agent_info(batch, [0, 0, 1], [0, 0, 0]))["reg_preds"]
    torch.testing.assert_close(same_rsu, same_vehicles, atol=1e-6, rtol=0)


def test_v2xvit_latency_acts_only_through_the_delay_encoding():
    model = v2xvit_model()
    batch = make_batch([3, 2], seed=5)
    on_time = with_agent_info(batch, [0, 0, 1, 0, 0], [0, 0, 0, 0, 0])
    late = with_agent_info(batch, [0, 0, 1, 0, 0], [0, 0, 3, 0, 0])   # the RSU of sample 0
    with torch.no_grad():
        reference, delayed = model(on_time)["reg_preds"], model(late)["reg_preds"]
    assert (reference[0] - delayed[0]).abs().max() > 1e-5
    torch.testing.assert_close(reference[1], delayed[1], atol=0, rtol=0)
    # With the encoding zeroed (its linear layer: the only path latency takes) nothing changes.
    with torch.no_grad():
        model.fusion.delay_encoding.linear.weight.zero_()
        model.fusion.delay_encoding.linear.bias.zero_()
        torch.testing.assert_close(model(late)["reg_preds"], model(on_time)["reg_preds"],
                                   atol=0, rtol=0)
    # Same for a model built without the encoding: latency is ignored.
    plain = v2xvit_model(use_delay_encoding=False)
    with torch.no_grad():
        torch.testing.assert_close(plain(late)["reg_preds"], plain(on_time)["reg_preds"],
                                   atol=0, rtol=0)


def test_intermediate_dataset_reports_each_agents_latency(tmp_path):
    from opencood.data.collate import collate_samples
    from opencood.data.datasets import IntermediateFusionDataset
    from opencood.config import load_config
    from opencood.data.pipeline import BatchPreparer
    from opencood.data.wild import WildSetting
    from opv2v_factory import write_simple_split
    write_simple_split(tmp_path / "split", num_cavs=2, timestamps=("000000", "000002", "000004"))
    dataset = IntermediateFusionDataset(tmp_path / "split", wild=WildSetting(latency_frames=1))
    # The first frame has no earlier one: the delay is clamped to what was applied.
    assert [dataset[i]["agent_latency"].tolist() for i in range(3)] == [[0, 0], [0, 1], [0, 1]]
    batch = collate_samples([dataset[0], dataset[2]])
    assert batch["agent_latency"].tolist() == [0, 0, 0, 1]
    smoke = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"
    preparer = BatchPreparer.from_config(load_config(smoke), "cpu")
    assert preparer.model_inputs(batch)["agent_latency"].tolist() == [0, 0, 0, 1]


# ---------------------------------------------------------------------------------------------
# CoBEVT
# ---------------------------------------------------------------------------------------------

def test_cobevt_windows_are_local_blocks_and_grid_groups_are_dilated():
    from opencood.models.cobevt import from_windows, to_windows
    height, width, window = 6, 4, 2
    cells = torch.arange(height * width).view(1, 1, height, width, 1).float()
    two_agents = torch.cat([cells, cells + 100], dim=1)                 # (1, 2, 6, 4, 1)
    local = to_windows(two_agents, window, grid=False)                  # (1, 3, 2, 2, 4, 1)
    sparse = to_windows(two_agents, window, grid=True)
    # Local group (1, 0): rows 2-3, cols 0-1, every agent's copy in the same group.
    assert local[0, 1, 0, :, :, 0].tolist() == [[8, 9, 12, 13], [108, 109, 112, 113]]
    # Grid group (1, 0): rows 1 and 1 + 3, cols 0 and 0 + 2 (stride = size / window).
    assert sparse[0, 1, 0, 0, :, 0].tolist() == [4, 6, 16, 18]
    for grid, groups in ((False, local), (True, sparse)):
        assert torch.equal(from_windows(groups, height, width, grid), two_agents)


def test_cobevt_padding_and_absent_agents_do_not_leak():
    from opencood.models.cobevt import CoBEVTArgs, FuseBEVT
    torch.manual_seed(0)
    fusion = FuseBEVT(CoBEVTArgs(depth=1, window=4, dim_head=4, mlp_dim=8), 8, NUM_ANCHORS).eval()
    features = torch.randn(3, 8, 6, 7)            # 6 x 7 pads to 8 x 8
    with torch.no_grad():
        alone = fusion(features[:1], torch.tensor([1])).features
        batched = fusion(features, torch.tensor([1, 2])).features
        three = fusion(features, torch.tensor([3])).features
    torch.testing.assert_close(batched[0], alone[0], atol=1e-6, rtol=0)
    assert not torch.allclose(three[0], alone[0], atol=1e-4)


# ---------------------------------------------------------------------------------------------
# DDP and the trainer
# ---------------------------------------------------------------------------------------------

# record_len of rank 0's and rank 1's batches: a lone ego beside a pair, and three agents.
MIXED_AGENTS = ([1, 2], [3])
ONE_AGENT_PER_SAMPLE = ([1, 1], [1])


def _ddp_steps_on_rank(rank, world_size, cases):
    """Two SGD steps of each case's model under DDP without unused-parameter search (a
    parameter left without gradient makes the second forward raise).

    cases: name -> (resolved model cfg, record_len of each rank's batches).
    -> name -> the trained parameters, or the error's text when the steps raised.
    """
    trained = {}
    for name, (cfg, record_lens) in cases.items():
        torch.manual_seed(0)
        model = build_model(cfg)
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=False)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        record_len = record_lens[rank]
        try:
            for step in range(2):
                batch = make_batch(record_len, seed=10 * rank + step)
                optimizer.zero_grad()
                forward_backward(ddp, batch, len(record_len))
                optimizer.step()
        except RuntimeError as error:   # both ranks raise alike: the next case still runs
            trained[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            continue
        trained[name] = [p.detach().clone() for p in model.parameters()]
    return trained


def assert_trained_in_sync(ranks, cases):
    """Every case trained on both ranks, to the same weights, which moved from the initial."""
    failed = {name: ranks[0][name] for name in cases if isinstance(ranks[0][name], str)}
    assert not failed, f"DDP steps raised: {failed}"
    for name, (cfg, _) in cases.items():
        torch.manual_seed(0)                   # the ranks' initial weights
        initial = build_model(cfg)
        for first, second in zip(ranks[0][name], ranks[1][name]):
            torch.testing.assert_close(first, second)
        moved = [not torch.equal(a, b) for a, b in zip(ranks[0][name], initial.parameters())]
        assert any(moved), f"{name}: the steps changed nothing"


def test_two_rank_ddp_training_steps_keep_ranks_in_sync():
    # One 2-process session for every model: spawning ranks costs seconds each.
    cases = {name: (cfg, MIXED_AGENTS) for name, cfg in BASELINES.items()}
    ranks = run_on_ranks(_ddp_steps_on_rank, world_size=2, args=(cases,), timeout_s=180)
    assert set(ranks[0]) == set(BASELINES)
    assert_trained_in_sync(ranks, cases)


# Where a schema allows a layer to go unused: fusion args overrides, trained with MIXED_AGENTS.
SCHEMA_EXTREMES = {
    "v2vnet": {"no_rounds": {"num_iteration": 0}},
    # Nothing sent: a threshold no sigmoid exceeds, and a zero byte budget.
    "where2comm": {"threshold_1": {"threshold": 1.0}, "zero_budget": {"max_bytes_per_agent": 0}},
    "disconet": {"no_hidden_layer": {"hidden": []}},
    "v2xvit": {"one_block_one_window": {"depth": 1, "window_sizes": [4], "window_heads": [1],
                                        "window_dim_heads": [4], "use_delay_encoding": False}},
    "cobevt": {"one_block_window_1": {"depth": 1, "window": 1}},
}


def schema_extreme_cases() -> dict:
    """Every registered fusion module (a new one included, at its schema defaults): its small
    arguments with one agent per sample on both ranks, then each of its SCHEMA_EXTREMES.
    -> case name -> (resolved model cfg, record_len of each rank)."""
    cases = {}
    for name in FUSIONS.names():
        small = SMALL_FUSION_ARGS.get(name, {})
        cases[f"{name}-one_agent_per_sample"] = (baseline_cfg(name, **small),
                                                 ONE_AGENT_PER_SAMPLE)
        for extreme, overrides in SCHEMA_EXTREMES.get(name, {}).items():
            cases[f"{name}-{extreme}"] = (baseline_cfg(name, **{**small, **overrides}),
                                          MIXED_AGENTS)
    return cases


def test_every_fusion_at_its_schema_extremes_trains_under_ddp_without_unused_parameters():
    """A layer a configuration leaves without gradient ends DDP training (find_unused_parameters
    off, the default) at its second step: every registered fusion module, at the extremes its
    schema allows, must build only layers that get a gradient."""
    assert set(SCHEMA_EXTREMES) <= set(FUSIONS.names())     # a renamed module is noticed
    cases = schema_extreme_cases()
    ranks = run_on_ranks(_ddp_steps_on_rank, world_size=2, args=(cases,), timeout_s=180)
    assert_trained_in_sync(ranks, cases)


LITE_CONFIGS = [f"point_pillar_{name}" for name in BASELINES]


@pytest.mark.parametrize("name", LITE_CONFIGS)
def test_lite_config_trains_with_the_trainer(name, tmp_path, monkeypatch):
    """Two optimiser steps of the lite config (smoke geometry) through trainer.main."""
    from opv2v_factory import frame_stamps, write_simple_split
    from process_state import preserved_opencood_logger, preserved_torch_switches
    from test_train import fusion_yaml
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    stamps = frame_stamps(4)
    write_simple_split(tmp_path / "train", num_cavs=2, timestamps=stamps)
    argv = ["--hypes_yaml", str(fusion_yaml(tmp_path, name)),
            "--model_dir", str(tmp_path / "run"),
            "--set", f"root_dir={tmp_path / 'train'}", "--set", "validate_dir=null",
            "--set", "train_params.epoches=1"]
    with preserved_torch_switches(), preserved_opencood_logger():
        result = trainer.main(argv)
    assert result["step"] == 2 and result["skipped_steps"] == 0
    state = torch.load(Path(result["run_dir"]) / "last.pth", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
