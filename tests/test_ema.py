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


def test_update_is_two_operators_whatever_the_model_size():
    # The lerp of every float tensor and the copy of every integer buffer, one operator each;
    # walking the state dicts per update cost a detach per tensor and a copy per counter.
    from opencood.utils.op_counts import OpCounter
    model = nn.Sequential(*[nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4))
                            for _ in range(6)])
    ema = ModelEMA(model, decay=0.9, tau=0)
    ema.update(model)                          # pairs the tensors
    with OpCounter() as ops:
        ema.update(model)
    assert dict(ops.by_op) == {"_foreach_lerp_": 1, "_foreach_copy_": 1}
    assert ops.total == 2


def test_update_follows_tensors_the_model_replaced():
    # module.to() replaces buffers (and load_state_dict does not): the pairs found at the first
    # update must not keep averaging the old tensors.
    model = nn.BatchNorm1d(2)
    ema = ModelEMA(model, decay=0.5, tau=0)
    ema.update(model)
    model.running_mean = torch.full((2,), 4.0)       # a new tensor object under the same name
    model.num_batches_tracked = torch.tensor(7)
    ema.update(model)
    assert ema.module.running_mean.tolist() == [2.0, 2.0]   # 0.5 * 0 + 0.5 * 4
    assert ema.module.num_batches_tracked.item() == 7
    ema.module.running_var = torch.zeros(2)          # and the EMA's own tensors too
    ema.update(model)
    assert ema.module.running_var.tolist() == [0.5, 0.5]    # 0.5 * 0 + 0.5 * 1


def test_update_equals_the_state_dict_walk_bit_for_bit():
    # The previous update: both state dicts walked each time, floats lerped, the rest copied.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Conv2d(5, 2, 1))
    ema = ModelEMA(model, decay=0.99, tau=3)
    reference = {key: value.clone() for key, value in ema.module.state_dict().items()}
    for update in range(1, 4):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.sub_(0.1 * parameter.grad)
        ema.update(model)
        weight = 1.0 - 0.99 * (1.0 - math.exp(-update / 3))
        for key, value in model.state_dict().items():
            if value.dtype.is_floating_point:
                reference[key] = torch.lerp(reference[key], value, weight)
            else:
                reference[key] = value.clone()
    for key, value in ema.module.state_dict().items():
        assert torch.equal(value, reference[key]), key
