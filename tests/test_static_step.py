"""The static-shape training step (``performance.static_pillars``): fixed pillar slots per
agent, a validity mask, and a step that equals today's dynamic one in loss and gradients."""
from __future__ import annotations

import copy

import pytest
import torch

from opencood.config import load_config
from opencood.data.pipeline import BatchPreparer
from opencood.engine.recipe import prepare_model
from opencood.engine.task import DetectionTask
from opencood.losses import build_loss
from opencood.models.pillar_vfe import masked_batch_norm
from opencood.models.scatter import PointPillarScatter
from opencood.ops.voxelize import pillarize, pillarize_static
from opencood.utils.dist import DistInfo
from opencood.utils.fake_batch import fake_collated_batch

from test_voxelize import SMALL_RANGE, random_cloud

CPU = torch.device("cpu")


def real_slots(static: dict) -> dict:
    """The static output's real pillars, in slot order (-> the dynamic layout)."""
    valid = static["voxel_valid"].flatten()
    return {key: static[key][valid] for key in ("voxel_features", "voxel_num_points",
                                                "voxel_coords")}


def assert_same_pillars(static: dict, dynamic: dict) -> None:
    for key, value in real_slots(static).items():
        assert torch.equal(value, dynamic[key]), key


@pytest.mark.parametrize("max_pillars", [None, 20])
def test_static_pillars_are_the_dynamic_ones_plus_empty_padded_slots(max_pillars):
    # 3 agents on 8 x 8 pillars with max 4 points: crowded pillars overflow, agent 1 has none.
    points, batch_index = random_cloud(2000, SMALL_RANGE, 3, channels=4, seed=4)
    points, batch_index = points[batch_index != 1], batch_index[batch_index != 1]
    dynamic = pillarize(points, batch_index, SMALL_RANGE, [1, 1, 4], 4, max_pillars)
    static = pillarize_static(points, batch_index, 3, SMALL_RANGE, [1, 1, 4], 4,
                              pillars_per_agent=70, max_pillars=max_pillars)
    assert_same_pillars(static, dynamic)
    assert static["voxel_features"].shape == (3 * 70, 4, 4)
    per_agent = dynamic["voxel_coords"][:, 0].bincount(minlength=3)
    assert static["voxel_valid"].sum(dim=1).tolist() == per_agent.tolist()
    assert per_agent[1] == 0 and (per_agent[0] == 64 if max_pillars is None else 20)
    # Real pillars fill each agent's first slots; padded ones are empty, at [agent, 0, 0, 0].
    assert torch.equal(static["voxel_valid"], torch.arange(70) < per_agent[:, None])
    padded = ~static["voxel_valid"].flatten()
    assert static["voxel_num_points"][padded].eq(0).all()
    assert static["voxel_features"][padded].eq(0).all()
    assert static["voxel_coords"][padded].tolist() == [
        [agent, 0, 0, 0] for agent in range(3) for _ in range(70 - int(per_agent[agent]))]


def test_static_pillars_cap_each_agent_at_its_slots_like_max_pillars():
    points, batch_index = random_cloud(2000, SMALL_RANGE, 2, channels=4, seed=6)
    static = pillarize_static(points, batch_index, 2, SMALL_RANGE, [1, 1, 4], 8,
                              pillars_per_agent=10)
    assert static["voxel_valid"].all()
    assert_same_pillars(static, pillarize(points, batch_index, SMALL_RANGE, [1, 1, 4], 8, 10))


def test_static_pillars_of_an_empty_cloud_are_all_padding():
    static = pillarize_static(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), 2,
                              SMALL_RANGE, [1, 1, 4], 32, pillars_per_agent=5)
    assert static["voxel_features"].shape == (10, 32, 4)
    assert not static["voxel_valid"].any()
    assert static["voxel_num_points"].eq(0).all()


# -- the model on static pillars -------------------------------------------------------------

def test_masked_batch_norm_equals_batch_norm_over_the_real_rows_alone():
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(40, 3, generator=generator) * 3.0 + 1.0
    mask = torch.rand(40, generator=generator) < 0.6
    for momentum in (0.1, None):            # None: BatchNorm's cumulative average
        plain = torch.nn.BatchNorm1d(3, eps=1e-3, momentum=momentum)
        with torch.no_grad():
            plain.weight.copy_(torch.tensor([0.5, 2.0, -1.0]))
            plain.bias.copy_(torch.tensor([0.1, 0.0, 3.0]))
        masked = copy.deepcopy(plain)
        for _ in range(2):
            expected = plain(values[mask])
            got = masked_batch_norm(masked, values, mask)
            torch.testing.assert_close(got[mask], expected, rtol=1e-6, atol=1e-6)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(masked, name), getattr(plain, name),
                                       rtol=1e-6, atol=1e-7)
    # The padded rows really would move the statistics: what the mask keeps out.
    assert not torch.allclose(torch.nn.BatchNorm1d(3)(values)[mask],
                              torch.nn.BatchNorm1d(3)(values[mask]), atol=1e-2)
    plain.eval()
    masked.eval()
    torch.testing.assert_close(masked_batch_norm(masked, values, mask), plain(values))


def test_static_scatter_keeps_padded_pillars_off_the_canvas():
    scatter = PointPillarScatter(num_features=2, nx=4, ny=3)
    pillars = torch.tensor([[1.0, 2.0], [9.0, 9.0], [3.0, 4.0], [7.0, 7.0]])
    # Slot 1 and 3 are padding whose coords name real cells (agent 0 and 1's (0, 0)).
    coords = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 2, 1], [1, 0, 0, 0]])
    valid = torch.tensor([[True, False], [True, False]])
    canvas = scatter(pillars, coords, torch.tensor([2]), valid)
    assert canvas.shape == (2, 2, 3, 4)
    assert canvas[0, :, 0, 0].tolist() == [1.0, 2.0]
    assert canvas[1, :, 2, 1].tolist() == [3.0, 4.0]
    assert canvas.abs().sum() == 10.0                    # nothing written anywhere else


STATIC_PILLARS = 320        # slots per agent; the fake agents have 300 pillars (or none)


def lite_step_parts(config: str, overrides=()):
    """(cfg, model in train mode, loss_fn, a fake batch whose agent 1 has no points)."""
    cfg = load_config(f"hypes_yaml/synthetic/{config}.yaml", list(overrides))
    torch.manual_seed(0)
    model, _, _ = prepare_model(cfg, DistInfo(0, 1, 0, False, None, CPU), None, None)
    model.train()
    batch = fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=3,
                                pillars_per_agent=300,
                                points_per_pillar=4, max_gt=6,
                                single_agent=config == "point_pillar_no_fusion")
    keep = batch["agent_index"] != 1
    batch["points"], batch["agent_index"] = batch["points"][keep], batch["agent_index"][keep]
    sync_free = cfg["performance"]["sync_free_step"]
    loss_fn = DetectionTask(BatchPreparer.from_config(cfg, CPU), build_loss(cfg["loss"]),
                            host_terms=not sync_free).training_loss
    return cfg, model, loss_fn, batch


def loss_and_gradients(config: str, overrides=(), dtype=torch.float32):
    """One step's loss, gradients and buffers; ``dtype`` of the model and points (the loss
    itself runs in float32 whatever the model's dtype: ``flat_float``)."""
    _, model, loss_fn, batch = lite_step_parts(config, overrides)
    model.to(dtype)
    batch["points"] = batch["points"].to(dtype)
    loss, _, _ = loss_fn(model, batch)
    loss.backward()
    return (loss.detach(), {name: p.grad for name, p in model.named_parameters()},
            dict(model.named_buffers()))


def assert_close_to_scale(got: torch.Tensor, expected: torch.Tensor, name: str,
                          relative: float, floor: float = 0.0) -> None:
    """max |got - expected| <= relative x max |expected| + floor."""
    scale = expected.abs().max()
    error = (got - expected).abs().max()
    assert error <= relative * scale + floor, f"{name}: max error {error:.3g}, scale {scale:.3g}"


def assert_same_step(config: str, dtype, relative: float) -> None:
    loss, grads, buffers = loss_and_gradients(config, dtype=dtype)
    static_loss, static_grads, static_buffers = loss_and_gradients(
        config, [f"performance.static_pillars={STATIC_PILLARS}"], dtype)
    torch.testing.assert_close(static_loss, loss, rtol=1e-6, atol=0)
    assert grads.keys() == static_grads.keys()
    # A floor for tensors whose gradient is 0 but for rounding (attention key biases).
    floor = relative * 1e-3 * max(grad.abs().max() for grad in grads.values())
    for name, grad in grads.items():
        assert_close_to_scale(static_grads[name], grad, name, relative, floor)
    for name, buffer in buffers.items():               # BatchNorm running statistics
        assert_close_to_scale(static_buffers[name].double(), buffer.double(), name, relative)


@pytest.mark.parametrize("config", ["point_pillar_attfuse", "point_pillar_no_fusion",
                                    "point_pillar_fcooper"])
def test_static_step_in_float32_differs_from_the_dynamic_step_by_rounding_only(config):
    """float32, as trained: the static step's distance from the exact (float64) dynamic step
    is of the size of the float32 dynamic step's own distance from it. A fixed tolerance does
    not serve: the same sums in another order (masked BatchNorm statistics, the VFE's GEMM over
    padded slots, a multithreaded reduction) move a BatchNorm-amplified gradient by up to ~0.4%
    with 2 threads and by far less with 1."""
    exact_loss, exact_grads, exact_buffers = loss_and_gradients(config, dtype=torch.float64)
    loss, grads, buffers = loss_and_gradients(config)
    static_loss, static_grads, static_buffers = loss_and_gradients(
        config, [f"performance.static_pillars={STATIC_PILLARS}"])
    torch.testing.assert_close(static_loss.double(), exact_loss.double(), rtol=1e-5, atol=0)
    pairs = [(name, static_grads[name], grads[name], exact) for name, exact in exact_grads.items()]
    pairs += [(name, static_buffers[name], buffers[name], exact)
              for name, exact in exact_buffers.items()]
    for name, static, dynamic, exact in pairs:
        scale = exact.abs().max()
        rounding = (dynamic.double() - exact).abs().max()
        error = (static.double() - exact).abs().max()
        assert error <= 8 * rounding + 1e-5 * scale + 1e-9, \
            f"{name}: static error {error:.3g}, float32 rounding {rounding:.3g}, scale {scale:.3g}"


@pytest.mark.parametrize("config", ["point_pillar_attfuse", "point_pillar_no_fusion",
                                    "point_pillar_fcooper", "point_pillar_where2comm",
                                    "point_pillar_v2xvit", "point_pillar_disconet"])
def test_static_step_equals_the_dynamic_step_in_float64(config):
    """In float64 rounding no longer hides a difference: gradients agree to ~1e-14 (float32
    differs up to 3% in a few V2X-ViT tensors, from rounding alone: this test is the proof).
    Fusion modules other than attfuse/fcooper keep their record_len.max() sync, but run on
    static pillars unchanged."""
    assert_same_step(config, torch.float64, relative=1e-10)


def test_static_inputs_really_hold_padded_slots_and_an_empty_agent():
    cfg, _, _, batch = lite_step_parts("point_pillar_attfuse",
                                       [f"performance.static_pillars={STATIC_PILLARS}"])
    inputs = BatchPreparer.from_config(cfg, CPU).model_inputs(batch)
    assert inputs["voxel_features"].shape[0] == 6 * STATIC_PILLARS
    assert inputs["voxel_valid"].sum(dim=1).tolist() == [300, 0, 300, 300, 300, 300]
    # Validation and evaluation keep the dynamic path (every pillar up to max_voxel_test).
    assert "voxel_valid" not in BatchPreparer.from_config(cfg, CPU, training=False)\
        .model_inputs(batch)


# -- torch.compile without graph breaks ------------------------------------------------------

def explain_step(config: str, overrides) -> "torch._dynamo.backends.debugging.ExplainOutput":
    """Dynamo's trace (no compilation) of the training step's pillarise + targets + forward +
    loss on the lite config."""
    cfg, model, _, batch = lite_step_parts(config, overrides)
    preparer = BatchPreparer.from_config(cfg, CPU)
    criterion = build_loss(cfg["loss"])

    def step_loss(batch):
        inputs, targets = preparer(batch)
        return criterion(model(inputs), targets)[0]

    torch._dynamo.reset()
    try:
        return torch._dynamo.explain(step_loss)(batch)
    finally:
        torch._dynamo.reset()


def break_reasons(explained) -> str:
    return "\n".join(f"{reason.reason.splitlines()[0]} at {reason.user_stack[-1:]}"
                     for reason in explained.break_reasons)


@pytest.mark.parametrize("config", ["point_pillar_attfuse", "point_pillar_no_fusion"])
def test_static_step_traces_as_one_graph(config):
    static = explain_step(config, [f"performance.static_pillars={STATIC_PILLARS}"])
    assert static.graph_break_count == 0, break_reasons(static)
    assert static.graph_count == 1


def test_the_dynamic_step_breaks_the_graph():
    """What the test above would see without static pillars (so it can fail)."""
    dynamic = explain_step("point_pillar_no_fusion", [])
    reasons = break_reasons(dynamic)
    assert "voxelize.py" in reasons and "scatter.py" in reasons   # .item(), unique, nonzero


def _masked_sync_batch_norm_on_rank(rank: int, world_size: int):
    """Each rank normalises its own rows with a SyncBatchNorm's masked statistics."""
    generator = torch.Generator().manual_seed(rank)
    values = (torch.randn(30, 3, generator=generator) * (rank + 1) + rank).requires_grad_()
    mask = torch.rand(30, generator=generator) < 0.5
    norm = torch.nn.SyncBatchNorm(3, eps=1e-3, momentum=0.1)
    output = masked_batch_norm(norm, values, mask)
    (output[mask] * torch.arange(1.0, 4.0)).sum().backward()
    return values.detach(), mask, output.detach(), values.grad, norm.running_mean, \
        norm.running_var


def test_masked_statistics_of_a_sync_batch_norm_span_every_rank():
    """Two gloo ranks (SyncBatchNorm itself runs on CUDA only; its masked form runs anywhere)
    equal one BatchNorm over both ranks' real rows: outputs, input gradients, running stats."""
    from dist_helpers import run_on_ranks
    ranks = run_on_ranks(_masked_sync_batch_norm_on_rank, world_size=2, timeout_s=120)
    values = torch.cat([rank[0] for rank in ranks]).requires_grad_()
    mask = torch.cat([rank[1] for rank in ranks])
    plain = torch.nn.BatchNorm1d(3, eps=1e-3, momentum=0.1)
    expected = plain(values[mask])
    (expected * torch.arange(1.0, 4.0)).sum().backward()
    torch.testing.assert_close(torch.cat([rank[2] for rank in ranks])[mask], expected.detach())
    torch.testing.assert_close(torch.cat([rank[3] for rank in ranks])[mask], values.grad[mask])
    for rank in ranks:
        torch.testing.assert_close(rank[4], plain.running_mean)
        torch.testing.assert_close(rank[5], plain.running_var)


def test_masked_linear_batch_norm_equals_linear_then_masked_batch_norm():
    from opencood.models.pillar_vfe import masked_linear_batch_norm
    generator = torch.Generator().manual_seed(1)
    values = (torch.randn(300, 10, generator=generator) * 4.0 + 2.0).double().requires_grad_()
    mask = torch.rand(300, generator=generator) < 0.3
    linear = torch.nn.Linear(10, 16, bias=False).double()
    norm = torch.nn.BatchNorm1d(16, eps=1e-3, momentum=0.1).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0, generator=generator)
        norm.bias.uniform_(-1.0, 1.0, generator=generator)
    folded_linear, folded_norm = copy.deepcopy(linear), copy.deepcopy(norm)
    for _ in range(2):
        expected = masked_batch_norm(norm, linear(values), mask)
        got = masked_linear_batch_norm(folded_linear, folded_norm, values, mask)
        torch.testing.assert_close(got[mask], expected[mask], rtol=1e-10, atol=1e-10)
        (expected[mask] * torch.arange(16.0, dtype=torch.float64)).sum().backward()
        expected_grads = [values.grad.clone(), linear.weight.grad, norm.weight.grad,
                          norm.bias.grad]
        values.grad = None
        (got[mask] * torch.arange(16.0, dtype=torch.float64)).sum().backward()
        got_grads = [values.grad.clone(), folded_linear.weight.grad, folded_norm.weight.grad,
                     folded_norm.bias.grad]
        for got_grad, expected_grad in zip(got_grads, expected_grads):
            torch.testing.assert_close(got_grad, expected_grad, rtol=1e-9, atol=1e-10)
        values.grad = None
        for module in (linear, norm, folded_linear, folded_norm):
            module.zero_grad()
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        torch.testing.assert_close(getattr(folded_norm, name), getattr(norm, name),
                                   rtol=1e-10, atol=1e-12)
    folded_norm.eval()
    norm.eval()
    torch.testing.assert_close(masked_linear_batch_norm(folded_linear, folded_norm, values, mask),
                               norm(linear(values)))


def test_static_vfe_dispatches_no_pass_over_its_output_channels_for_statistics():
    # The statistics of the static VFE run over C_in (10) channels: the (R, 64) tensors are
    # only the GEMM's output, the ReLU, the mask and the max (issue 40: static slower than
    # dynamic on an H100 from the statistics passes over every point slot).
    from opencood.models.pillar_vfe import PillarLayer
    from opencood.utils.op_counts import OpCounter, launches_kernel
    layer = PillarLayer(10, 64, last_layer=True)
    features = torch.randn(50, 32, 10)
    mask = torch.arange(32) < torch.randint(0, 33, (50, 1))
    wide = []

    class WideOps(OpCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if launches_kernel(func) and torch.is_tensor(out) and out.numel() >= 50 * 32 * 64:
                wide.append(func.overloadpacket.__name__)
            return out

    with WideOps():
        layer(features, mask, static_shapes=True)
    assert wide == ["addmm", "relu", "mul"]
