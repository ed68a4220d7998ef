"""The training step's distributed contract (docs/DESIGN.md §6.3, 6.6, 6.10) on real gloo ranks.

Toy model (BatchNorm only in the skipped-step check) and toy data, but the real machinery:
``build_train_sampler``, ``split_global_batch``, ``group_micro_batches``, ``optimizer_step`` (DDP
+ ``no_sync``) and ``validation_loss``. Each spawned rank imports torch, so every multi-rank check of this file runs
in as few spawns as possible: one 2-rank session (module fixture) and one 3-rank one.
"""
from __future__ import annotations

import copy
import math
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from opencood.engine.loop import (NonFiniteLossError, group_micro_batches, optimizer_step,
                                  validation_loss)
from opencood.utils.batching import split_global_batch
from opencood.utils.samplers import InferenceSampler, build_train_sampler
from dist_helpers import run_on_ranks

GLOBAL_BATCH = 8
MAX_MICRO = 2          # 2 ranks: micro 2 x accum 2; 1 process: micro 2 x accum 4
TRAIN_LEN = 32         # 4 optimiser steps per epoch
EPOCHS = 2
SEED = 5
OPTIMIZERS = {  # SGD with momentum is sensitive to gradient scale, Adam mostly is not
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}
GRAD_CLIP = 8.0        # active on some steps only (asserted): the clip must see the global norm,
                       # and the unclipped steps keep the update sensitive to the gradient scale
VAL_LEN = 7            # divisible by neither 2 nor 3
VAL_BATCH = 2          # shards of 4/3 (2 ranks) and 3/2/2 (3 ranks): uneven last batches


# -- toy problem ---------------------------------------------------------------------------

def toy_model(batch_norm: bool = False) -> nn.Module:
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(16)] if batch_norm else []
    return nn.Sequential(nn.Linear(6, 16), *norm, nn.Tanh(), nn.Linear(16, 2))


def toy_dataset(length: int, seed: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(length, 6, generator=generator)
    targets = torch.randn(length, 2, generator=generator) * 2.0 + 1.0
    return torch.utils.data.TensorDataset(inputs, targets)


def mse_loss_fn(model, batch):
    """Mean over the micro-batch of the per-sample squared error (the loop's LossFn contract)."""
    inputs, targets = batch
    loss = ((model(inputs) - targets) ** 2).sum(dim=1).mean()
    return loss, {"mse": float(loss.detach())}, len(inputs)


def train_toy(model, rank: int, world_size: int, optimizer_name: str, forward_log=None):
    """EPOCHS epochs of the trainer's inner loop; returns the per-step stats."""
    micro, accum = split_global_batch(GLOBAL_BATCH, world_size, MAX_MICRO)
    batch_sampler, sampler = build_train_sampler(TRAIN_LEN, micro, rank, world_size, seed=SEED)
    loader = torch.utils.data.DataLoader(toy_dataset(TRAIN_LEN, seed=1),
                                         batch_sampler=batch_sampler)
    params = model.module.parameters() if isinstance(model, DistributedDataParallel) \
        else model.parameters()
    optimizer = OPTIMIZERS[optimizer_name](params)
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def loss_fn(model_, batch):
        if forward_log is not None:
            forward_log.append(None)
        return mse_loss_fn(model_, batch)

    history = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for micro_batches in group_micro_batches(loader, accum):
            assert len(micro_batches) == accum
            history.append(optimizer_step(model, micro_batches, loss_fn, optimizer, scaler,
                                          torch.device("cpu"), grad_clip=GRAD_CLIP))
    return history, (micro, accum)


def per_sample_losses(model, dataset) -> torch.Tensor:
    with torch.no_grad():
        inputs, targets = dataset.tensors
        return ((model(inputs) - targets) ** 2).sum(dim=1).double()


def distributed_validation(rank: int, world_size: int):
    dataset = toy_dataset(VAL_LEN, seed=2)
    loader = torch.utils.data.DataLoader(
        dataset, batch_size=VAL_BATCH, sampler=InferenceSampler(VAL_LEN, rank, world_size))
    model = toy_model()
    model.train()
    loss, count = validation_loss(model, loader, mse_loss_fn, torch.device("cpu"))
    return {"loss": loss, "count": count, "still_training": model.training}


# -- rank bodies ---------------------------------------------------------------------------

def _counting_allreduce_hook(state, bucket):
    """DDP communication hook: the default mean all-reduce, counted."""
    state["calls"] += 1
    tensor = bucket.buffer()
    tensor.div_(dist.get_world_size())
    future = dist.all_reduce(tensor, async_op=True).get_future()
    return future.then(lambda fut: fut.value()[0])


def _capture(results, key, function):
    try:
        results[key] = function()
    except BaseException:  # the test reports it; one failing part must not hide the others
        results[key] = {"error": traceback.format_exc()}


def _two_rank_body(rank, world_size):
    results = {}

    def equivalence():
        runs = {}
        for optimizer_name in OPTIMIZERS:
            state = {"calls": 0}
            model = DistributedDataParallel(toy_model())
            model.register_comm_hook(state, _counting_allreduce_hook)
            calls_at_forward = []
            forward_log = _ForwardLog(state, calls_at_forward)
            history, split = train_toy(model, rank, world_size, optimizer_name, forward_log)
            runs[optimizer_name] = {
                "state": {k: v.clone() for k, v in model.module.state_dict().items()},
                "history": history, "split": split, "allreduce_calls": state["calls"],
                "calls_at_forward": calls_at_forward}
        return runs

    def validation():
        return distributed_validation(rank, world_size)

    def non_finite():
        outcomes = {}
        for bad_position in (0, 1):
            model = DistributedDataParallel(toy_model())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            before = copy.deepcopy(model.module.state_dict())
            dataset = toy_dataset(8, seed=3)
            micro_batches = [(dataset.tensors[0][i:i + 2], dataset.tensors[1][i:i + 2])
                             for i in (0, 2)]
            seen = []

            def nan_on_rank1(model_, batch):
                loss, terms, count = mse_loss_fn(model_, batch)
                position = len(seen)
                seen.append(position)
                if rank == 1 and position == bad_position:
                    loss = loss * float("nan")
                return loss, terms, count

            try:
                optimizer_step(model, micro_batches, nan_on_rank1, optimizer,
                               torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"),
                               where="epoch 1 step 1")
                outcome = {"raised": None}
            except NonFiniteLossError as error:
                outcome = {"raised": str(error)}
            outcome["forwards"] = len(seen)
            outcome["unchanged"] = all(torch.equal(before[k], v)
                                       for k, v in model.module.state_dict().items())
            outcomes[bad_position] = outcome
        return outcomes

    _capture(results, "equivalence", equivalence)
    _capture(results, "validation", validation)
    def skip_non_finite():
        """An inf input on rank 1's second micro-batch with skipping on: both ranks skip, the
        weights and every rank's BatchNorm statistics (NaN on rank 1 after its forward, moved
        on rank 0) stay, and the next step trains normally (DDP's all-reduce still matched)."""
        model = DistributedDataParallel(toy_model(batch_norm=True))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        before = copy.deepcopy(model.module.state_dict())
        dataset = toy_dataset(8, seed=3)
        micro_batches = [(dataset.tensors[0][i:i + 2], dataset.tensors[1][i:i + 2])
                         for i in (0, 2)]
        calls = []

        def nan_once_on_rank1(model_, batch):
            calls.append(1)
            inputs, targets = batch
            if rank == 1 and len(calls) == 2:
                inputs = inputs.clone()
                inputs[0, 0] = float("inf")
            return mse_loss_fn(model_, (inputs, targets))

        scaler = torch.amp.GradScaler("cpu", enabled=False)
        first = optimizer_step(model, micro_batches, nan_once_on_rank1, optimizer, scaler,
                               torch.device("cpu"), where="step 1", skip_nonfinite=True)
        unchanged = all(torch.equal(before[k], v) for k, v in model.module.state_dict().items())
        second = optimizer_step(model, micro_batches, nan_once_on_rank1, optimizer, scaler,
                                torch.device("cpu"), where="step 2", skip_nonfinite=True)
        return {"first": first["skipped"], "unchanged": unchanged, "second": second["skipped"],
                "weights": {k: v.clone() for k, v in model.module.state_dict().items()}}

    _capture(results, "non_finite", non_finite)
    _capture(results, "skip_non_finite", skip_non_finite)
    return results


class _ForwardLog:
    """list-like: on every micro-batch forward, records how many all-reduces have run so far."""

    def __init__(self, state, record):
        self.state, self.record = state, record

    def append(self, _):
        self.record.append(self.state["calls"])


def _three_rank_body(rank, world_size):
    return distributed_validation(rank, world_size)


# -- fixtures ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_two_rank_body, world_size=2, timeout_s=120)


def _part(two_ranks, key):
    parts = [rank_results[key] for rank_results in two_ranks]
    for rank, part in enumerate(parts):
        if isinstance(part, dict) and "error" in part:
            pytest.fail(f"rank {rank} failed in {key}:\n{part['error']}")
    return parts


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def optimizer_name(request):
    return request.param


@pytest.fixture(scope="module")
def single_process_run(optimizer_name):
    model = toy_model()
    history, split = train_toy(model, rank=0, world_size=1, optimizer_name=optimizer_name)
    return model.state_dict(), history, split


# -- 1. DDP == accumulation ------------------------------------------------------------------

def test_ddp_equals_single_process_accumulation(two_ranks, optimizer_name, single_process_run):
    ranks = [runs[optimizer_name] for runs in _part(two_ranks, "equivalence")]
    single_state, single_history, single_split = single_process_run
    assert single_split == (2, 4)
    assert all(rank["split"] == (2, 2) for rank in ranks)
    steps = EPOCHS * TRAIN_LEN // GLOBAL_BATCH
    assert len(single_history) == steps and all(len(r["history"]) == steps for r in ranks)

    # DDP keeps the ranks bitwise identical.
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), key
    # ... and equal to one process accumulating the same global batch.
    initial = toy_model().state_dict()
    for key, value in single_state.items():
        assert not torch.allclose(value, initial[key], atol=1e-3), f"{key} did not train"
        torch.testing.assert_close(ranks[0]["state"][key], value, rtol=0, atol=1e-5)

    for step, single in enumerate(single_history):
        # Each rank's loss is its half of the global batch; the mean is the global loss.
        mean_loss = (ranks[0]["history"][step]["loss"] + ranks[1]["history"][step]["loss"]) / 2
        assert mean_loss == pytest.approx(single["loss"], rel=1e-5, abs=1e-6)
        # The clipped norm is the norm of the global (all-reduced) gradient, on every rank.
        for rank in ranks:
            assert rank["history"][step]["grad_norm"] == pytest.approx(single["grad_norm"],
                                                                       rel=1e-5)
            assert rank["history"][step]["samples"] == GLOBAL_BATCH // 2
        assert single["samples"] == GLOBAL_BATCH
    norms = [entry["grad_norm"] for entry in single_history]
    assert min(norms) < GRAD_CLIP < max(norms), f"clipping should act on some steps only: {norms}"


def test_accumulation_all_reduces_once_per_step(two_ranks):
    ranks = [runs["sgd"] for runs in _part(two_ranks, "equivalence")]
    steps = EPOCHS * TRAIN_LEN // GLOBAL_BATCH
    for rank in ranks:
        micro, accum = rank["split"]
        # The toy model fits one DDP bucket: one all-reduce per optimiser step, not per micro-batch.
        assert rank["allreduce_calls"] == steps
        # Before every forward of step s, exactly s all-reduces have run: the first micro-batch's
        # backward (under no_sync) communicated nothing.
        expected = [step for step in range(steps) for _ in range(accum)]
        assert rank["calls_at_forward"] == expected


# -- 3. exact validation loss ----------------------------------------------------------------

def _single_process_validation():
    per_sample = per_sample_losses(toy_model(), toy_dataset(VAL_LEN, seed=2))
    return per_sample, float(per_sample.mean())


def test_validation_loss_two_ranks_equals_single_process(two_ranks):
    ranks = _part(two_ranks, "validation")
    per_sample, expected = _single_process_validation()
    # The shards are 4 and 3 samples: a mean of per-rank means would be off (checked here so the
    # assertion below can tell the exact reduction from the naive one).
    naive = (float(per_sample[:4].mean()) + float(per_sample[4:].mean())) / 2
    assert abs(naive - expected) > 1e-3
    for rank in ranks:
        assert rank["count"] == VAL_LEN
        assert rank["loss"] == pytest.approx(expected, rel=1e-6)
        assert rank["still_training"]  # validation_loss restores the training mode
    single = distributed_validation(0, 1)
    assert single["count"] == VAL_LEN and single["loss"] == pytest.approx(expected, rel=1e-6)


def test_validation_loss_three_ranks_equals_single_process():
    ranks = run_on_ranks(_three_rank_body, world_size=3, timeout_s=120)
    per_sample, expected = _single_process_validation()
    naive = sum(float(shard.mean()) for shard in per_sample.split([3, 2, 2])) / 3
    assert abs(naive - expected) > 1e-3
    for rank in ranks:
        assert rank["count"] == VAL_LEN
        assert rank["loss"] == pytest.approx(expected, rel=1e-6)


# -- 5. collective decisions ---------------------------------------------------------------

@pytest.mark.parametrize("bad_position", [0, 1], ids=["no_sync-micro-batch", "last-micro-batch"])
def test_non_finite_loss_on_one_rank_raises_on_both(two_ranks, bad_position):
    ranks = [outcomes[bad_position] for outcomes in _part(two_ranks, "non_finite")]
    for rank, outcome in enumerate(ranks):
        assert outcome["raised"] is not None, f"rank {rank} did not raise"
        assert "non-finite loss" in outcome["raised"]
        assert f"micro-batch {bad_position}" in outcome["raised"]
        assert "epoch 1 step 1" in outcome["raised"]
        assert outcome["forwards"] == bad_position + 1  # both stop at the same micro-batch
        assert outcome["unchanged"]  # no optimiser step with a NaN gradient
    assert "on another rank" in ranks[0]["raised"]
    assert "nan" in ranks[1]["raised"]


# -- AMP -------------------------------------------------------------------------------------

def _dtype_recording_loss_fn(seen):
    def loss_fn(model, batch):
        inputs, targets = batch
        outputs = model(inputs)
        seen.append(outputs.dtype)
        loss = ((outputs.float() - targets) ** 2).sum(dim=1).mean()
        return loss, {}, len(inputs)
    return loss_fn


def _autocast_step(device: torch.device, amp_dtype: torch.dtype):
    model = toy_model().to(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, targets = toy_dataset(4, seed=4).tensors
    seen = []
    stats = optimizer_step(model, [(inputs.to(device), targets.to(device))],
                           _dtype_recording_loss_fn(seen),
                           torch.optim.SGD(model.parameters(), lr=0.01),
                           torch.amp.GradScaler(device.type, enabled=False), device, amp_dtype)
    assert seen == [amp_dtype]  # the forward ran under autocast
    assert math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])
    for key, value in model.state_dict().items():
        assert value.dtype == torch.float32  # master weights stay fp32
        assert not torch.equal(value, before[key]), key


def test_bf16_autocast_step_on_cpu():
    _autocast_step(torch.device("cpu"), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
def test_bf16_autocast_step_on_cuda():
    _autocast_step(torch.device("cuda"), torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
def test_fp16_grad_scaler_skips_overflow_then_unscales():
    device = torch.device("cuda")
    model = nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 16)
    batch = (torch.full((1, 4), 0.5, device=device), torch.zeros(1, 1, device=device))

    def loss_fn(model_, batch_):
        output = model_(batch_[0])
        assert output.dtype == torch.float16
        return output.float().mean(), {}, 1

    weight, bias = model.weight.detach().clone(), model.bias.detach().clone()
    # d(loss)/d(output) = 1, scaled by 2**16: inf in fp16, so the step is skipped, scale halved.
    stats = optimizer_step(model, [batch], loss_fn, optimizer, scaler, device, torch.float16)
    assert not math.isfinite(stats["grad_norm"])
    assert scaler.get_scale() == 2.0 ** 15
    assert torch.equal(model.weight, weight) and torch.equal(model.bias, bias)
    # Now the scaled gradients fit; unscaled they are exactly 0.5 (weights) and 1 (bias).
    stats = optimizer_step(model, [batch], loss_fn, optimizer, scaler, device, torch.float16)
    assert stats["grad_norm"] == pytest.approx(math.sqrt(2.0), rel=1e-4)
    torch.testing.assert_close(model.weight.detach(), weight - 0.05, rtol=0, atol=1e-6)
    torch.testing.assert_close(model.bias.detach(), bias - 0.1, rtol=0, atol=1e-6)


def test_a_skipped_non_finite_step_is_skipped_on_both_ranks_and_training_goes_on(two_ranks):
    ranks = _part(two_ranks, "skip_non_finite")
    assert [r["first"] for r in ranks] == [1, 1]          # decided together
    assert all(r["unchanged"] for r in ranks)            # the optimizer did not move
    assert [r["second"] for r in ranks] == [0, 0]        # the next step is a normal one
    for key, value in ranks[0]["weights"].items():       # and it kept the ranks in step
        assert torch.equal(value, ranks[1]["weights"][key]), key
    assert any(not torch.equal(value, ranks[0]["weights"][key]) for key, value in
               toy_model(batch_norm=True).state_dict().items())
