"""The training step as one CUDA graph (``performance.cuda_graph``, opencood.engine.cuda_graph):
on CPU the padding to fixed shapes (same loss and gradients as the unpadded batch), the
fallback reasons and the tensor lr; on CUDA the capture itself (replayed steps = eager steps)."""
from __future__ import annotations

import copy
import logging
import re

import pytest
import torch

from opencood.config import load_config
from opencood.engine.cuda_graph import (CudaGraphStep, GraphLimits, batch_signature,
                                        build_graph_step, capture_failure, hazard_refusal,
                                        pad_batch, run_refusal, tensor_lrs)
from opencood.engine.loop import check_loss_now, optimizer_step
from opencood.engine.recipe import build_training_parts
from opencood.engine.state import TrainState, restore_training, training_state
from opencood.utils.checkpoint import load_checkpoint, save_checkpoint
from opencood.utils.dist import DistInfo
from opencood.utils.ema import ModelEMA
from opencood.utils.fake_batch import fake_collated_batch
from opencood.utils.host_syncs import CaptureHazards

CONFIG = "hypes_yaml/synthetic/point_pillar_attfuse.yaml"
FAST = ["performance.static_pillars=320", "performance.sync_free_step=true",
        "performance.cuda_graph=true"]
# The cuda test's settings, which the CPU hazard test runs too.
CUDA_TEST_OVERRIDES = ["performance.cuda_graph_max_points=6000", "performance.cuda_graph_max_gt=8",
                       "performance.tf32=false", "ema.enabled=true"]


def lite_parts(device: torch.device, overrides=()):
    cfg = load_config(CONFIG, [*FAST, *overrides])
    torch.manual_seed(0)
    parts = build_training_parts(cfg, DistInfo(0, 1, 0, False, None, device), schedule=(5, 5))
    parts.model.train()
    return cfg, parts


def lite_batch(cfg, seed: int, pillars: int = 300, gt: int = 6):
    return fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=2,
                               pillars_per_agent=pillars, points_per_pillar=3, max_gt=gt,
                               seed=seed)


def test_a_padded_batch_gives_the_loss_and_gradients_of_the_batch_itself():
    """Padding points (outside the range) and GT boxes (masked) change nothing: float64, so
    that rounding cannot hide a difference."""
    cfg, parts = lite_parts(torch.device("cpu"))
    model = parts.model.double()
    batch = lite_batch(cfg, seed=1, pillars=120)
    batch["points"] = batch["points"].double()
    limits = GraphLimits(batch["points"].shape[0] + 37, 9,
                         tuple(cfg["preprocess"]["cav_lidar_range"]))
    padded, reason = pad_batch(batch, limits)
    assert reason is None
    assert padded["points"].shape[0] == limits.max_points and padded["gt_boxes"].shape[1] == 9
    assert not padded["gt_mask"][:, 6:].any() and padded["gt_mask"][:, :6].all()
    results = []
    for candidate in (batch, padded):
        model.zero_grad(set_to_none=True)
        loss, terms, samples = parts.task.training_loss(model, candidate)
        loss.backward()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in
                                        model.named_parameters()}, samples))
    (loss, grads, samples), (padded_loss, padded_grads, padded_samples) = results
    assert samples == padded_samples == 2
    torch.testing.assert_close(padded_loss, loss, rtol=1e-12, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(padded_grads[name], grad, rtol=1e-9, atol=1e-14, msg=name)


def test_batches_the_graph_cannot_take_say_why():
    limits = GraphLimits(max_points=100, max_gt=4, lidar_range=(-10, -10, -3, 10, 10, 1))
    batch = {"points": torch.zeros(101, 4), "agent_index": torch.zeros(101, dtype=torch.long),
             "gt_boxes": torch.zeros(2, 3, 7), "gt_mask": torch.ones(2, 3, dtype=torch.bool)}
    assert pad_batch(batch, limits) == (None, "101 points > performance.cuda_graph_max_points 100")
    batch["points"], batch["agent_index"] = batch["points"][:50], batch["agent_index"][:50]
    batch["gt_boxes"], batch["gt_mask"] = torch.zeros(2, 5, 7), torch.ones(2, 5, dtype=torch.bool)
    assert pad_batch(batch, limits)[1] == "5 gt_boxes per sample > performance.cuda_graph_max_gt 4"
    batch["gt_boxes"], batch["gt_mask"] = batch["gt_boxes"][:, :2], batch["gt_mask"][:, :2]
    padded, _ = pad_batch(batch, limits)
    assert (padded["points"][50:, 0] == -11).all()       # outside the range: dropped
    # The signature holds shapes and flags; a nested dict (a teacher's batch) is refused.
    signature, _ = batch_signature({**padded, "flag": True, "sample_keys": [("a", "0")]})
    assert ("points", (100, 4), torch.float32, torch.device("cpu")) in signature
    assert ("flag", True) in signature
    assert batch_signature({**padded, "early_fusion": {}}) == \
        (None, "batch key 'early_fusion' is nested (not captured)")


def test_on_cpu_the_run_steps_eagerly_with_one_line_saying_why(caplog):
    """The eager fallback is the eager step itself: same loss, same weights."""
    cfg, parts = lite_parts(torch.device("cpu"))
    reference = copy.deepcopy(parts)
    batch = lite_batch(cfg, seed=2)
    with caplog.at_level(logging.WARNING, logger="opencood"):
        graph_step = build_graph_step(cfg, parts, torch.device("cpu"), 1, 1)
    assert [r.getMessage() for r in caplog.records] == \
        ["cuda_graph: running eagerly: performance.cuda_graph needs CUDA"]
    stats = graph_step.step([batch], "test")
    expected = optimizer_step(reference.model, [batch], reference.task.training_loss,
                              reference.optimizer, reference.scaler, torch.device("cpu"), None,
                              cfg["train_params"]["grad_clip"], where="test", sync_free=True,
                              ema=reference.ema)
    assert stats["loss"] == expected["loss"] and stats["grad_norm"] == expected["grad_norm"]
    for got, want in zip(parts.model.parameters(), reference.model.parameters()):
        assert torch.equal(got, want)
    refusals = {
        "performance.static_pillars=0": "it needs performance.static_pillars > 0",
        "performance.sync_free_step=false": "it needs performance.sync_free_step: true",
        "optimizer.core_method=SGD": "the optimizer must be Adam or AdamW",
        "train_params.skip_nonfinite_steps=2":
            "train_params.skip_nonfinite_steps > 0: a replayed step cannot be undone"}
    cuda = torch.device("cuda")
    for override, reason in refusals.items():
        cfg = load_config(CONFIG, [*FAST, override])
        optimizer = torch.optim.SGD if "SGD" in override else torch.optim.AdamW
        assert run_refusal(cfg, cuda, 1, 1, optimizer([torch.zeros(1, requires_grad=True)]),
                           torch.amp.GradScaler("cpu", enabled=False)) == reason
    assert run_refusal(load_config(CONFIG, FAST), cuda, 2, 1, parts.optimizer, parts.scaler) == \
        "several ranks (DDP) are not captured"


def captured_step_hazards(device: torch.device) -> dict:
    """The step's recorded work, run eagerly after a warm-up under ``CaptureHazards``, set up as
    the ``cuda`` test below runs it (its overrides: padding, the EMA; tensor lrs, Adam fused
    and capturable as on CUDA; the cosine lr stepped after the warm-up), fp32 and under bf16
    autocast (bench.py's). -> {amp dtype: the sites found}."""
    cfg, parts = lite_parts(device, CUDA_TEST_OVERRIDES)
    perf = cfg["performance"]
    step = CudaGraphStep(parts.model, parts.task.training_loss, parts.optimizer, parts.scaler,
                         parts.ema, device, None, cfg["train_params"]["grad_clip"],
                         GraphLimits(perf["cuda_graph_max_points"], perf["cuda_graph_max_gt"],
                                     tuple(cfg["preprocess"]["cav_lidar_range"])))
    for group in parts.optimizer.param_groups:
        assert group["capturable"] and torch.is_tensor(group["lr"])       # tensor_lrs
        group["fused"] = True         # CUDA's Adam (engine/optim.py), capturable on CPU too
    padded, _ = pad_batch(lite_batch(cfg, seed=3, pillars=150), step.limits)
    padded = {key: value.to(device) if torch.is_tensor(value) else value
              for key, value in padded.items()}
    step.eager([padded], "test", skip_nonfinite=False)           # the warm-ups: the first eager,
    _, warm_up_sites = step.checked_eager(padded, "test")         # the next with its loss checked
    assert warm_up_sites == []
    parts.scheduler.step()
    parts.optimizer.zero_grad(set_to_none=True)
    step.static_batch = padded
    step.ema_weight.fill_(0.25)
    sites = {}
    for amp_dtype in (None, torch.bfloat16):
        step.amp_dtype = amp_dtype
        with CaptureHazards(device=device) as found:
            values = step.captured_step()
        assert bool(values[0]), amp_dtype
        sites[amp_dtype] = found.sites
    return sites


def test_the_captured_step_runs_nothing_a_capture_refuses():
    """On CUDA an op that reads values back (``.item()``, a boolean-mask index, ``nonzero``)
    or builds a tensor from host data inside the step makes the capture fail, and the error
    names no line. The same ops run on CPU: the step has none. The first H200 runs' captures
    failed on a Python-list index in pillar_vfe, then on the EMA's ``_foreach_lerp_`` with a
    tensor weight (a Scalar, read by ``.item()``)."""
    assert captured_step_hazards(torch.device("cpu")) == {None: [], torch.bfloat16: []}
    # The detector sees each kind, and names the innermost opencood frame.
    table = torch.arange(6.0).view(2, 3)
    here = table.device
    with CaptureHazards() as found:
        _ = table[:, [2, 1]] * 2.0 + torch.ones((), device=here)     # a list index
        _ = table + torch.tensor(1.0)                                 # data from the host
        _ = torch.from_numpy(table.numpy().copy()) + 1
        _ = table[table > 1], table.masked_select(table > 1), torch.nonzero(table)
        _ = torch.unique(table), table.repeat_interleave(table[0].long(), dim=1)
        _ = table.cpu(), table.tolist(), torch.rand(2, generator=torch.Generator(), device=here)
        _ = table.to("meta"), torch.empty(3, device="meta").copy_(table[0])   # across devices
        _ = torch.zeros(2), torch.zeros(2, device=here)               # on the host, on the device
        torch._foreach_lerp_([table.clone()], [table], table[0, 1])   # a Scalar weight
        check_loss_now(table.sum(), "test", 0, skip_nonfinite=True)
    kinds = [site.split(" ")[1] for site in found.sites]
    assert kinds == ["host_to_device"] * 2 + ["numpy", "host_to_device", "boolean_index",
                                               "masked_select", "nonzero", "unique",
                                               "repeat_interleave", "cpu", "tolist",
                                               "generator", "device_copy", "device_copy",
                                               "host_factory", "item", "item"]
    assert re.fullmatch(r"opencood/engine/loop\.py:\d+ item \(aten\._local_scalar_dense"
                        r"\.default\)", found.sites[-1])
    assert found.sites[0].startswith("? host_to_device (aten.lift_fresh")
    # On a GPU run (device given) ops on host tensors alone are no hazard; copies still are.
    with CaptureHazards(device=torch.device("meta")) as found:
        _ = table.sum().item(), table[table > 1], table + torch.tensor(1.0), table.tolist()
        _ = table.to("meta")[torch.tensor([0])]        # a copy, then an index read from the host
    assert [site.split(" ")[1] for site in found.sites] == ["device_copy"] * 2


def test_a_warm_up_whose_loss_reads_the_device_back_says_where_before_any_capture():
    """The warm-up runs the loss under CaptureHazards (``checked_eager``): a model that reads a
    value back gets the run's one-line reason naming the line, and eager steps, instead of a
    failed capture; the checked step itself is the eager step."""
    def loss_fn(model, batch, check=False):
        loss = model(batch["x"]).square().mean()
        if check:
            check_loss_now(loss, "test", 0, skip_nonfinite=True)   # reads the loss back
        return loss, {"loss": loss.detach()}, 1

    results = []
    for check in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        step = CudaGraphStep(model, lambda m, b, check=check: loss_fn(m, b, check), optimizer,
                             torch.amp.GradScaler("cpu", enabled=False), None,
                             torch.device("cpu"), None, None, GraphLimits(0, 0, (0.0,) * 6))
        stats, sites = step.checked_eager({"x": torch.arange(6.0).view(3, 2)}, "test")
        results.append((stats["loss"], model.weight.detach().clone(), sites))
    (loss, weight, sites), (checked_loss, checked_weight, checked_sites) = results
    assert sites == [] and checked_loss == loss and torch.equal(checked_weight, weight)
    assert len(checked_sites) == 1
    assert re.fullmatch(r"the step runs 1 op\(s\) a CUDA graph capture refuses, the first at "
                        r"opencood/engine/loop\.py:\d+ item \(aten\._local_scalar_dense\.default\)",
                        hazard_refusal(checked_sites))


def test_a_failed_capture_names_where_it_failed():
    """A GPU run's log line names the innermost opencood frame of the failure."""
    with pytest.raises(KeyError) as error:
        pad_batch({"points": torch.zeros(3, 4)}, GraphLimits(5, 0, (0.0,) * 6))
    assert re.fullmatch(r"the capture failed at opencood/engine/cuda_graph\.py:\d+: "
                        r"'agent_index'", capture_failure(error.value))
    # torch.compile's tracing errors name the user code in their message, the cause apart.
    traced = RuntimeError('RuntimeError when making fake tensor call\n\nfrom user code:\n'
                          '  File "/x/opencood/models/fusion.py", line 12, in forward\n'
                          '  File "/x/opencood/models/warp.py", line 34, in warp')
    traced.__cause__ = RuntimeError("Cannot copy between CPU and CUDA tensors\nmore")
    assert capture_failure(traced) == (
        "the capture failed at opencood/models/warp.py:34: RuntimeError when making fake "
        "tensor call (cause: Cannot copy between CPU and CUDA tensors)")
    # An op refused inside the capture raises, then the end of torch.cuda.graph raises over it
    # at the `with` line (the H200 log's only site): the first error and its site are reported.
    with pytest.raises(RuntimeError) as chained:
        try:
            pad_batch({"points": torch.zeros(3, 4)}, GraphLimits(5, 0, (0.0,) * 6))
        finally:
            raise RuntimeError("operation failed due to a previous error during capture\nmore")
    assert re.fullmatch(r"the capture failed at opencood/engine/cuda_graph\.py:\d+: "
                        r"'agent_index' \(then: operation failed due to a previous error "
                        r"during capture\)", capture_failure(chained.value))


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_lr_schedules_and_the_ema_reach_a_captured_step_through_device_tensors():
    """The lr becomes a tensor the schedule fills in place (the captured kernels read it), and
    the EMA's tensor-weight lerp equals its float update."""
    cfg, parts = lite_parts(torch.device("cpu"))
    lrs = tensor_lrs(parts.optimizer, torch.device("cpu"))
    first = float(lrs[0])
    parts.scheduler.step()
    parts.scheduler.step()
    assert parts.optimizer.param_groups[0]["lr"] is lrs[0]
    assert float(lrs[0]) != first
    model = torch.nn.Linear(3, 2)
    ema, twin = ModelEMA(model, 0.9, 2.0), ModelEMA(model, 0.9, 2.0)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model)
    twin.updates += 1
    twin.lerp_towards(model, torch.tensor(1.0 - twin.current_decay()))
    torch.testing.assert_close(twin.module.weight, ema.module.weight, rtol=1e-6, atol=0)


def test_a_graph_runs_checkpoint_resumes_into_an_eager_foreach_optimizer(tmp_path):
    """A CUDA-graph run's checkpoint (tensor lrs, capturable groups) resumed by an eager run
    (foreach, not capturable; here the CPU): the groups keep this run's step settings, the lr
    its value as a float, and the next step is a resume's of the same state saved eagerly."""
    cpu = torch.device("cpu")
    cfg, parts = lite_parts(cpu)
    fresh = copy.deepcopy(parts)          # the parts a resume builds (one model build, not three)
    for param in parts.model.parameters():
        param.grad = torch.full_like(param, 0.5)
    parts.optimizer.step()
    parts.scheduler.step()
    save_checkpoint(tmp_path / "eager.pth", training_state(parts, TrainState(step=1), cfg, 0))
    tensor_lrs(parts.optimizer, cpu)                      # as a graph run saves its groups
    save_checkpoint(tmp_path / "graph.pth", training_state(parts, TrainState(step=1), cfg, 0))
    weights = []
    for name in ("eager.pth", "graph.pth"):
        checkpoint = load_checkpoint(tmp_path / name)
        saved_group = checkpoint["optimizer"]["param_groups"][0]
        graph_run = name == "graph.pth"
        assert torch.is_tensor(saved_group["lr"]) == saved_group["capturable"] == graph_run
        resumed = copy.deepcopy(fresh)
        for group in resumed.optimizer.param_groups:
            group["foreach"] = True
        assert restore_training(checkpoint, resumed, DistInfo(0, 1, 0, False, None, cpu)).step == 1
        group = resumed.optimizer.param_groups[0]
        assert (group["capturable"], group["foreach"]) == (False, True)
        assert type(group["lr"]) is float and group["lr"] == float(saved_group["lr"])
        for param in resumed.model.parameters():
            param.grad = torch.full_like(param, -0.25)
        resumed.optimizer.step()
        weights.append([param.detach().clone() for param in resumed.model.parameters()])
    for eager, graph in zip(*weights):     # the lrs differ by the graph's float32 rounding
        torch.testing.assert_close(graph, eager, rtol=1e-6, atol=0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_captured_step_runs_nothing_a_capture_refuses():
    """What the CPU test checks, with CUDA's kernels (a sync only CUDA's implementation has
    shows here with its line, where a failed capture names none)."""
    device = torch.device("cuda", torch.cuda.current_device())
    assert captured_step_hazards(device) == {None: [], torch.bfloat16: []}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_replayed_steps_equal_eager_steps_with_a_changing_lr():
    """5 steps (2 eager warm-ups, capture, 3 replays) with a cosine lr and the EMA, on batches
    with different point counts padded to one shape, against 5 eager steps on the same
    batches: the same weights, EMA and lr, within float32 tolerance."""
    saved_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        replayed_and_eager_steps_agree()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved_tf32


def replayed_and_eager_steps_agree():
    device = torch.device("cuda", torch.cuda.current_device())
    cfg, graph_parts = lite_parts(device, CUDA_TEST_OVERRIDES)
    _, eager_parts = lite_parts(device, CUDA_TEST_OVERRIDES)
    batches = [{key: value.to(device) if torch.is_tensor(value) else value
                for key, value in lite_batch(cfg, seed, 280 + 5 * seed, 4 + seed % 3).items()}
               for seed in range(5)]
    graph_step = build_graph_step(cfg, graph_parts, device, 1, 1)
    lrs = []
    for batch in batches:
        got = graph_step.step([batch], "test")
        want = optimizer_step(eager_parts.model, [batch], eager_parts.task.training_loss,
                              eager_parts.optimizer, eager_parts.scaler, device, None,
                              cfg["train_params"]["grad_clip"], where="test", sync_free=True,
                              ema=eager_parts.ema)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        lrs.append(float(graph_parts.optimizer.param_groups[0]["lr"]))
        graph_parts.scheduler.step()
        eager_parts.scheduler.step()
    assert graph_step.graph is not None and graph_step.eager_warmups == 2, graph_step.said
    # A batch of another agent count runs eagerly after the capture (from zero gradients).
    other = {key: value.to(device) if torch.is_tensor(value) else value for key, value in
             fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=3,
                                 pillars_per_agent=200, points_per_pillar=3, max_gt=4,
                                 seed=9).items()}
    graph_step.step([other], "test")
    optimizer_step(eager_parts.model, [other], eager_parts.task.training_loss,
                   eager_parts.optimizer, eager_parts.scaler, device, None,
                   cfg["train_params"]["grad_clip"], where="test", sync_free=True,
                   ema=eager_parts.ema)
    assert any("another agent count" in reason for reason in graph_step.said)
    assert len(set(lrs)) == len(lrs)                     # the lr changed at every step
    for module_pair in ((graph_parts.model, eager_parts.model),
                        (graph_parts.ema.module, eager_parts.ema.module)):
        for got, want in zip(module_pair[0].state_dict().values(),
                             module_pair[1].state_dict().values()):
            if got.is_floating_point():
                # Adam turns rounding in near-zero gradients into lr-sized steps: 1e-3 of the
                # tensor's scale; an lr the graph ignored moves weights by ~lr x steps (~1e-2).
                scale = float(want.abs().max()) + 1e-6
                assert float((got - want).abs().max()) <= 1e-3 * scale
            else:
                assert torch.equal(got, want)
