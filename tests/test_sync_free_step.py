"""The sync-free hot path (``performance.sync_free_step`` with ``static_pillars``): host syncs
counted on CPU (``opencood.utils.host_syncs``), and the step equal to today's."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from opencood.engine.loop import NonFiniteLossError, optimizer_step
from opencood.engine.optim import build_optimizer
from opencood.utils.host_syncs import HostSyncCounter, optimizer_host_tensors

from test_static_step import CPU, STATIC_PILLARS, lite_step_parts

FAST = [f"performance.static_pillars={STATIC_PILLARS}", "performance.sync_free_step=true"]


def test_counter_counts_each_kind_of_host_sync_and_nothing_else():
    values = torch.tensor([3.0, 0.0, 2.0, 2.0])
    host_counter = torch.tensor(5.0)
    with HostSyncCounter(host_tensors=[host_counter]) as syncs:
        values.sum().item(), bool(values[0] > 1), float(values.max()), host_counter.item()
        values.tolist()
        torch.nonzero(values), values[values > 1], torch.unique_consecutive(values)
        torch.repeat_interleave(values.long()), torch.masked_select(values, values > 1)
        # Fixed-size equivalents: not syncs.
        torch.where(values > 1, values, 0.0), values.cumsum(0), values.sort()
        torch.repeat_interleave(torch.arange(4), values.long(), output_size=7)
    assert dict(syncs.counts) == {"item": 3, "tolist": 1, "nonzero": 1, "boolean_index": 1,
                                  "unique": 1, "repeat_interleave": 1, "masked_select": 1}


def counted_step(config: str, overrides, micro_batches: int = 1):
    """Host syncs of one optimizer step (after a first one has created the optimizer state)."""
    cfg, model, loss_fn, batch = lite_step_parts(config, overrides)
    optimizer = build_optimizer(model.parameters(), cfg["optimizer"])
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    sync_free = cfg["performance"]["sync_free_step"]

    def step():
        return optimizer_step(model, [batch] * micro_batches, loss_fn, optimizer, scaler, CPU,
                              grad_clip=10.0, sync_free=sync_free)

    step()
    with HostSyncCounter(optimizer_host_tensors(optimizer)) as syncs:
        step()
    return syncs.counts


@pytest.mark.parametrize("config", ["point_pillar_attfuse", "point_pillar_no_fusion",
                                    "point_pillar_fcooper"])
def test_the_fast_step_reads_the_host_once_where_today_s_step_syncs_throughout(config):
    today = counted_step(config, [])
    # Pillarisation's unique/nonzero, the VFE's boolean masks (forward and backward), the
    # agent counts and the per-term and non-finite reads.
    assert {"unique", "nonzero", "boolean_index"} <= set(today) and today["item"] >= 8
    static_only = counted_step(config, FAST[:1])
    assert set(static_only) == {"item", "tolist"}   # no data-dependent size left, reads remain
    assert dict(counted_step(config, FAST, micro_batches=2)) == {"tolist": 1}


def test_sync_free_step_takes_the_same_steps_and_reports_the_same_numbers():
    results = {}
    for sync_free in (False, True):
        overrides = FAST if sync_free else FAST[:1]
        cfg, model, loss_fn, batch = lite_step_parts("point_pillar_attfuse", overrides)
        optimizer = build_optimizer(model.parameters(), cfg["optimizer"])
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        stats = [optimizer_step(model, [batch, batch], loss_fn, optimizer, scaler, CPU,
                                grad_clip=10.0, sync_free=sync_free) for _ in range(2)]
        results[sync_free] = stats, model.state_dict()
    (stats, weights), (free_stats, free_weights) = results[False], results[True]
    assert free_stats == stats                  # loss, every term, grad norm: the same floats
    assert stats[0]["grad_norm"] > 10.0         # the clip was active
    for name, tensor in weights.items():
        assert torch.equal(free_weights[name], tensor), name


class InfiniteGradient(torch.autograd.Function):
    """Identity forward, infinite gradient backward: finite loss, non-finite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def toy_step(loss_of, skip_nonfinite: bool):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    inputs = torch.ones(2, 3)

    def loss_fn(model_, _batch):
        loss = loss_of(model_(inputs))
        return loss, {"term": loss.detach()}, 2

    stats = optimizer_step(model, [None, None], loss_fn, optimizer, scaler, CPU, where="here",
                           skip_nonfinite=skip_nonfinite, sync_free=True)
    unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return stats, unchanged


@pytest.mark.parametrize("loss_of, reason", [
    (lambda out: out.sum() * float("nan"), "non-finite loss (nan) at here micro-batch 0"),
    (lambda out: InfiniteGradient.apply(out).sum(), "non-finite gradients (norm inf) at here"),
])
def test_sync_free_step_raises_or_skips_a_non_finite_step(loss_of, reason):
    with pytest.raises(NonFiniteLossError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        toy_step(loss_of, skip_nonfinite=False)
    stats, unchanged = toy_step(loss_of, skip_nonfinite=True)
    assert unchanged and stats["skipped"] == 1 and stats["nonfinite"] == reason
    finite_stats, moved = toy_step(lambda out: out.sum(), skip_nonfinite=True)
    assert not moved and finite_stats["skipped"] == 0 and finite_stats["nonfinite"] is None
