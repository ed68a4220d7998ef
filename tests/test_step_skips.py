"""A step that is not taken leaves no trace (issue 22, points 1 and 2).

Two ways a step is not taken: skipped as non-finite (``train_params.skip_nonfinite_steps``), or
skipped by the fp16 GradScaler on inf gradients. Either way the weights, the buffers the forward
moved (BatchNorm running statistics) and the EMA stay as they were, and the scaler is updated
(its scale backs off), so the next step runs normally. Single process here; the same on two
gloo ranks in tests/test_train_equivalence.py.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from opencood.engine.loop import optimizer_step, shard_loss_sum
from opencood.utils.ema import ModelEMA

from test_sync_free_step import InfiniteGradient

CPU = torch.device("cpu")
INIT_SCALE = 2.0 ** 16


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 1))


def training_objects():
    """(BatchNorm model, SGD, an EMA that follows every step taken closely)."""
    model = bn_model()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), ModelEMA(model, decay=0.5, tau=0)


def good_batch() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 12).reshape(4, 3)


def inf_batch() -> torch.Tensor:
    """One inf input: the BatchNorm's batch variance (and so running_var) becomes NaN."""
    batch = good_batch()
    batch[0, 0] = float("inf")
    return batch


def mean_output_loss(model, batch):
    loss = model(batch).mean()
    return loss, {"term": loss.detach()}, len(batch)


def inf_gradient_loss(model, batch):
    loss = InfiniteGradient.apply(model(batch)).mean()
    return loss, {"term": loss.detach()}, len(batch)


def state_of(model: nn.Module, ema: ModelEMA) -> dict:
    return {"model": copy.deepcopy(model.state_dict()),
            "ema": copy.deepcopy(ema.module.state_dict()), "ema_updates": ema.updates}


def assert_same_state(before: dict, after: dict) -> None:
    assert after["ema_updates"] == before["ema_updates"]
    for part in ("model", "ema"):
        for key, tensor in before[part].items():
            assert torch.equal(after[part][key], tensor), f"{part}.{key} moved"


def run_step(model, ema, optimizer, scaler, batch, loss_fn, sync_free, skip=True):
    return optimizer_step(model, [batch], loss_fn, optimizer, scaler, CPU, where="here",
                          skip_nonfinite=skip, sync_free=sync_free, ema=ema)


@pytest.mark.parametrize("sync_free", [False, True], ids=["per_micro_batch", "sync_free"])
def test_a_skipped_step_under_an_fp16_scaler_backs_off_and_the_next_step_runs(sync_free):
    """Point 1: unscale_ runs every step, so the scaler must be updated every step."""
    model, optimizer, ema = training_objects()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    before = state_of(model, ema)
    stats = run_step(model, ema, optimizer, scaler, inf_batch(), mean_output_loss, sync_free)
    assert stats["skipped"] == 1 and stats["nonfinite"].startswith("non-finite loss")
    assert scaler.get_scale() == INIT_SCALE / 2              # backed off
    assert_same_state(before, state_of(model, ema))
    stats = run_step(model, ema, optimizer, scaler, good_batch(), mean_output_loss, sync_free)
    assert stats["skipped"] == 0 and stats["overflow"] == 0 and ema.updates == 1
    assert not torch.equal(model[0].weight, before["model"]["0.weight"])


@pytest.mark.parametrize("sync_free", [False, True], ids=["per_micro_batch", "sync_free"])
def test_a_step_the_scaler_skips_moves_neither_weights_nor_buffers_nor_the_ema(sync_free):
    """Point 1: inf gradients under fp16 are the scaler's skip; the EMA must not move."""
    model, optimizer, ema = training_objects()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    run_step(model, ema, optimizer, scaler, good_batch(), mean_output_loss, sync_free)
    before = state_of(model, ema)
    stats = run_step(model, ema, optimizer, scaler, good_batch() * 2, inf_gradient_loss,
                     sync_free, skip=False)          # no skip budget: the scaler's own skip
    assert stats["overflow"] == 1 and stats["skipped"] == 0 and stats["nonfinite"] is None
    assert not math.isfinite(stats["grad_norm"])
    assert scaler.get_scale() == INIT_SCALE / 2
    assert_same_state(before, state_of(model, ema))


@pytest.mark.parametrize("sync_free", [False, True], ids=["per_micro_batch", "sync_free"])
def test_a_skipped_non_finite_step_leaves_batchnorm_statistics_and_validation_finite(sync_free):
    """Point 2: the forward of a skipped step moved the running statistics (NaN variance);
    they are put back, the EMA does not blend the NaN in, and validation stays finite."""
    model, optimizer, ema = training_objects()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    run_step(model, ema, optimizer, scaler, good_batch(), mean_output_loss, sync_free)
    before = state_of(model, ema)
    stats = run_step(model, ema, optimizer, scaler, inf_batch(), mean_output_loss, sync_free)
    assert stats["skipped"] == 1
    assert_same_state(before, state_of(model, ema))
    run_step(model, ema, optimizer, scaler, good_batch(), mean_output_loss, sync_free)
    assert ema.updates == 2
    for name, tensor in ema.module.state_dict().items():
        assert torch.isfinite(tensor.float()).all(), name
    loss_sum, count = shard_loss_sum(ema.module, [good_batch()], mean_output_loss, CPU)
    assert count == 4 and math.isfinite(loss_sum)
