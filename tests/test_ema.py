"""opencood.utils.ema.ModelEMA: hand-computed updates, buffers, state round trip, DDP ranks."""

import math

import pytest
import torch
from torch import nn

from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import load_checkpoint, save_checkpoint
from opencood.utils.ema import ModelEMA
from dist_helpers import run_on_ranks


def _scalar_model(value):
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(value)
    return model


def test_hand_computed_updates():
    model = _scalar_model(1.0)
    ema = ModelEMA(model, decay=0.9, tau=1)
    expected = 1.0
    for update, new_weight in enumerate([2.0, 3.0, 4.0], start=1):
        with torch.no_grad():
            model.weight.fill_(new_weight)
        ema.update(model)
        decay = 0.9 * (1 - math.exp(-update / 1))
        expected = decay * expected + (1 - decay) * new_weight
        assert ema.updates == update
        assert ema.module.weight.item() == pytest.approx(expected, abs=1e-6)
    # Written out: d = 0.568909, 0.778198, 0.855192 -> EMA 1.431091, 1.779078, 2.100686.
    assert ema.module.weight.item() == pytest.approx(2.100686, abs=1e-6)


def test_no_ramp_when_tau_is_zero():
    model = _scalar_model(0.0)
    ema = ModelEMA(model, decay=0.75, tau=0)
    with torch.no_grad():
        model.weight.fill_(4.0)
    ema.update(model)
    assert ema.module.weight.item() == pytest.approx(1.0)  # 0.75 * 0 + 0.25 * 4


def test_ema_copy_is_frozen_and_independent():
    model = nn.Linear(2, 2)
    ema = ModelEMA(model, decay=0.999, tau=200)
    assert not ema.ema_model.training
    assert not any(p.requires_grad for p in ema.module.parameters())
    assert all(p.requires_grad for p in model.parameters()) and model.training
    before = ema.module.weight.clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    assert torch.equal(ema.module.weight, before)  # a copy, not a view of the live model


def test_buffers_are_averaged_and_counters_copied():
    torch.manual_seed(0)
    model = nn.BatchNorm1d(3)
    ema = ModelEMA(model, decay=0.9, tau=1)
    model.train()
    model(torch.randn(8, 3) * 2 + 5)
    ema.update(model)
    decay = 0.9 * (1 - math.exp(-1))
    # Initial running_mean is 0 and running_var 1, so the EMA is a blend towards the new stats.
    assert torch.allclose(ema.module.running_mean, (1 - decay) * model.running_mean, atol=1e-6)
    assert torch.allclose(ema.module.running_var,
                          decay * torch.ones(3) + (1 - decay) * model.running_var, atol=1e-6)
    assert ema.module.num_batches_tracked.item() == 1
    assert ema.module.num_batches_tracked.dtype == torch.long


def test_state_dict_round_trip_keeps_ramp(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = ModelEMA(model, decay=0.99, tau=5)
    for _ in range(3):
        with torch.no_grad():
            model.weight.add_(0.5)
        ema.update(model)
    save_checkpoint(tmp_path / "ema.pt", {"ema": ema.state_dict()})

    restored = ModelEMA(nn.Linear(3, 2), decay=0.99, tau=5)
    restored.load_state_dict(load_checkpoint(tmp_path / "ema.pt")["ema"])
    assert restored.updates == 3
    assert torch.equal(restored.module.weight, ema.module.weight)
    # The next update uses decay for update 4 on both: identical only if `updates` came back.
    ema.update(model)
    restored.update(model)
    assert torch.equal(restored.module.weight, ema.module.weight)


def _ddp_ema_body(rank, world_size):
    torch.manual_seed(0)  # same initial weights on both ranks (DDP also broadcasts them)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    ddp_model = nn.parallel.DistributedDataParallel(model)
    ema = ModelEMA(ddp_model, decay=0.9, tau=2)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees different samples
    for _ in range(3):
        inputs = torch.randn(8, 4, generator=data)
        loss = ddp_model(inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema.update(ddp_model)
    before_sync = {k: v.clone() for k, v in ema.module.state_dict().items()}
    ema.broadcast_from(0)
    after_sync = {k: v.clone() for k, v in ema.module.state_dict().items()}
    return before_sync, after_sync, ema.updates, dist_utils.get_world_size()


def test_ema_identical_across_ddp_ranks():
    (before0, after0, updates0, world), (before1, after1, updates1, _) = \
        run_on_ranks(_ddp_ema_body, world_size=2)
    assert world == 2 and updates0 == updates1 == 3
    parameter_keys = ["0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"]
    for key in parameter_keys:  # DDP keeps parameters equal, so their EMAs agree without help
        assert torch.equal(before0[key], before1[key]), key
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).state_dict()
    assert not torch.equal(before0["0.weight"], initial["0.weight"])  # training moved the EMA
    # Plain BatchNorm statistics are rank-local (different data), hence broadcast_from.
    assert not torch.equal(before0["1.running_mean"], before1["1.running_mean"])
    for key in after0:
        assert torch.equal(after0[key], after1[key]), key
        assert torch.equal(after0[key], before0[key]), key  # rank 0's values won


def test_update_from_a_different_model_names_the_key():
    ema = ModelEMA(nn.Linear(2, 2), decay=0.999, tau=200)
    with pytest.raises(KeyError, match="'weight'"):
        ema.update(nn.Sequential(nn.Linear(2, 2)))  # keys are "0.weight", "0.bias"
