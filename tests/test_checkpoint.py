"""opencood.utils.checkpoint: round trips under weights_only, broken files, RNG, atomic save."""

import os
import random

import numpy as np
import pytest
import torch
from torch import nn

from opencood.utils import checkpoint as ckpt
from opencood.utils.checkpoint import CheckpointError


class _NotPlainData:
    """Stands in for an object torch.load(weights_only=True) refuses."""


def _model_and_trained_adam():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(2):
        loss = model(torch.randn(5, 3)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def _fresh_model_and_adam():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, optimizer, inputs):
    loss = model(inputs).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def test_round_trip_model_optimizer_rng(tmp_path):
    model, optimizer = _model_and_trained_adam()
    config = {"train_params": {"batch_size": np.int64(8), "lr": np.float64(0.01)},
              "ranges": [-140.8, -40.0], "betas": (0.9, 0.999), "name": "lite"}
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "epoch": 3, "rng": ckpt.capture_rng_state(), "config": config}
    path = tmp_path / "sub" / "checkpoint.pt"
    ckpt.save_checkpoint(path, state)

    torch.load(path, weights_only=True)  # the file is plain data, readable by the safe loader
    loaded = ckpt.load_checkpoint(path)
    assert loaded["epoch"] == 3
    assert loaded["config"]["train_params"] == {"batch_size": 8, "lr": 0.01}
    assert type(loaded["config"]["train_params"]["batch_size"]) is int
    assert loaded["config"]["betas"] == (0.9, 0.999)

    restored_model, restored_optimizer = _fresh_model_and_adam()
    restored_model.load_state_dict(loaded["model"])
    restored_optimizer.load_state_dict(loaded["optimizer"])
    for key, tensor in model.state_dict().items():
        assert torch.equal(restored_model.state_dict()[key], tensor), key
    # One more step from both: equal only if Adam's moments and step counts came back too.
    inputs = torch.randn(5, 3)
    _step(model, optimizer, inputs)
    _step(restored_model, restored_optimizer, inputs)
    for original, restored in zip(model.parameters(), restored_model.parameters()):
        assert torch.equal(original, restored)


def test_saved_tensors_are_plain_and_on_cpu(tmp_path):
    parameter = nn.Parameter(torch.ones(2))
    ckpt.save_checkpoint(tmp_path / "c.pt", {"weight": parameter, "nested": [{"t": parameter}]})
    locations = []

    def record_location(storage, location):
        locations.append(location)
        return storage

    loaded = torch.load(tmp_path / "c.pt", map_location=record_location, weights_only=True)
    assert locations and set(locations) == {"cpu"}
    assert type(loaded["weight"]) is torch.Tensor and not loaded["weight"].requires_grad
    assert type(loaded["nested"][0]["t"]) is torch.Tensor


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_saved_on_cpu(tmp_path):
    model = nn.Linear(2, 2).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 2, device="cuda")).sum().backward()
    optimizer.step()
    ckpt.save_checkpoint(tmp_path / "c.pt", {"model": model.state_dict(),
                                             "optimizer": optimizer.state_dict()})
    loaded = torch.load(tmp_path / "c.pt", map_location=None, weights_only=True)
    assert loaded["model"]["weight"].device.type == "cpu"
    assert all(t.device.type == "cpu" for s in loaded["optimizer"]["state"].values()
               for t in s.values() if isinstance(t, torch.Tensor))


def _assert_one_line_error(path, match):
    with pytest.raises(CheckpointError, match=match) as excinfo:
        ckpt.load_checkpoint(path)
    message = str(excinfo.value)
    assert str(path) in message and "\n" not in message
    return message


def test_truncated_file(tmp_path):
    path = tmp_path / "truncated.pt"
    ckpt.save_checkpoint(path, {"model": nn.Linear(8, 8).state_dict()})
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    _assert_one_line_error(path, "truncated")


def test_random_bytes_file(tmp_path):
    path = tmp_path / "random.pt"
    path.write_bytes(np.random.default_rng(0).bytes(1000))
    _assert_one_line_error(path, "not a PyTorch zip archive")


def test_missing_and_empty_files(tmp_path):
    _assert_one_line_error(tmp_path / "absent.pt", "no such file")
    (tmp_path / "empty.pt").write_bytes(b"")
    _assert_one_line_error(tmp_path / "empty.pt", "empty")


def test_file_with_objects_weights_only_refuses(tmp_path):
    path = tmp_path / "unsafe.pt"
    torch.save({"thing": _NotPlainData()}, path)  # written by someone else's plain torch.save
    message = _assert_one_line_error(path, "weights_only")
    assert "_NotPlainData" in message


def test_file_holding_a_non_dict(tmp_path):
    path = tmp_path / "tensor.pt"
    torch.save(torch.zeros(2), path)
    _assert_one_line_error(path, "not a checkpoint dict")


def _draws():
    # The gaussians come first: they use the value each generator cached at capture time.
    numpy_draws = np.concatenate([[np.random.randn()], np.random.rand(3)])
    python_draws = [random.gauss(0, 1)] + [random.random() for _ in range(3)]
    return torch.rand(4), numpy_draws, python_draws


def test_restore_rng_reproduces_draws(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # gaussians come in pairs: each generator now caches the second
    np.random.randn()
    ckpt.save_checkpoint(tmp_path / "rng.pt", {"rng": ckpt.capture_rng_state()})
    expected_torch, expected_numpy, expected_python = _draws()
    _draws()  # move every generator on
    ckpt.restore_rng_state(ckpt.load_checkpoint(tmp_path / "rng.pt")["rng"])
    got_torch, got_numpy, got_python = _draws()
    assert torch.equal(got_torch, expected_torch)
    assert np.array_equal(got_numpy, expected_numpy)
    assert got_python == expected_python


def test_failed_save_keeps_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_checkpoint(path, {"epoch": 1})
    assert os.listdir(tmp_path) == ["checkpoint.pt"]

    def failing_save(obj, file):
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(CheckpointError, match="disk full; the previous one is intact"):
        ckpt.save_checkpoint(path, {"epoch": 2})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
    assert ckpt.load_checkpoint(path)["epoch"] == 1


def test_unloadable_entry_refused_at_save_time(tmp_path):
    path = tmp_path / "checkpoint.pt"
    ckpt.save_checkpoint(path, {"epoch": 1})
    with pytest.raises(TypeError, match=r"\['config'\]\['callback'\]"):
        ckpt.save_checkpoint(path, {"epoch": 2, "config": {"callback": _NotPlainData()}})
    assert os.listdir(tmp_path) == ["checkpoint.pt"]
    assert ckpt.load_checkpoint(path)["epoch"] == 1


def test_check_state_dict_compatible(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    ckpt.check_state_dict_compatible(model, model.state_dict(), tmp_path / "ok.pt")  # no error

    other = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2), nn.Linear(2, 1))
    with pytest.raises(CheckpointError) as excinfo:
        ckpt.check_state_dict_compatible(model, other.state_dict(), tmp_path / "other.pt")
    message = str(excinfo.value)
    assert "other.pt" in message and "\n" not in message
    assert "2 unexpected keys: 3.weight, 3.bias" in message
    assert "0.weight (5, 4) vs model (3, 4)" in message

    partial = {k: v for k, v in model.state_dict().items() if k != "2.bias"}
    with pytest.raises(CheckpointError, match="1 missing keys: 2.bias"):
        ckpt.check_state_dict_compatible(model, partial, "partial.pt")


def test_check_state_dict_hints_ddp_prefix():
    model = nn.Linear(2, 2)
    prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="module\\."):
        ckpt.check_state_dict_compatible(model, prefixed, "ddp.pt")


# ----------------------------------------------------------------------------------------------
# History: the last K checkpoints, and resuming past a damaged one
# ----------------------------------------------------------------------------------------------

def _state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "step": step}


def test_history_keeps_the_newest_k_and_last_is_the_newest(tmp_path):
    for step in (10, 20, 30, 40):
        ckpt.save_with_history(tmp_path, _state(step), step, keep=3)
    assert [p.name for p in ckpt.history_files(tmp_path)] == [
        "step_000000040.pth", "step_000000030.pth", "step_000000020.pth"]
    assert ckpt.load_checkpoint(tmp_path / "last.pth")["step"] == 40
    assert not (tmp_path / "last.pth").samefile(ckpt.history_path(tmp_path, 40))  # a copy


def test_a_truncated_last_falls_back_to_the_newest_readable(tmp_path):
    for step in (10, 20):
        ckpt.save_with_history(tmp_path, _state(step), step, keep=3)
    data = (tmp_path / "last.pth").read_bytes()
    (tmp_path / "last.pth").write_bytes(data[: len(data) // 2])
    path, state, unreadable = ckpt.newest_readable_checkpoint(tmp_path)
    assert path == ckpt.history_path(tmp_path, 20) and state["step"] == 20   # nothing lost
    assert [p.name for p, _ in unreadable] == ["last.pth"] and "truncated" in unreadable[0][1]
    ckpt.history_path(tmp_path, 20).write_bytes(b"garbage")
    path, state, unreadable = ckpt.newest_readable_checkpoint(tmp_path)
    assert state["step"] == 10 and len(unreadable) == 2


def test_no_checkpoint_at_all_and_none_readable(tmp_path):
    assert ckpt.newest_readable_checkpoint(tmp_path) == (None, None, [])
    (tmp_path / "last.pth").write_bytes(b"")
    with pytest.raises(CheckpointError, match="none of its 1 checkpoints loads"):
        ckpt.newest_readable_checkpoint(tmp_path)


def test_a_full_disk_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    ckpt.save_with_history(tmp_path, _state(10), 10, keep=3)
    before = (tmp_path / "last.pth").read_bytes()

    def half_then_full(obj, stream):
        stream.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", half_then_full)
    with pytest.raises(CheckpointError) as info:
        ckpt.save_with_history(tmp_path, _state(20), 20, keep=3)
    assert "No space left on device" in str(info.value) and "\n" not in str(info.value)
    assert "step_000000020.pth" in str(info.value)
    assert (tmp_path / "last.pth").read_bytes() == before
    assert [p.name for p in ckpt.history_files(tmp_path)] == ["step_000000010.pth"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000000010.pth"]


def _sync_and_rename_log(monkeypatch) -> list:
    """Every os.fsync (of the inode it synced) and os.replace (the renamed inode, the target),
    in order: a rename is durable only with the file's data synced before it and its folder's
    entry synced after it."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync_spy(fd):
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    def replace_spy(source, target):
        events.append(("replace", os.stat(source).st_ino, str(target)))
        return real_replace(source, target)

    monkeypatch.setattr(os, "fsync", fsync_spy)
    monkeypatch.setattr(os, "replace", replace_spy)
    return events


def test_a_checkpoint_is_synced_before_its_rename_and_its_folder_after(tmp_path, monkeypatch):
    """The history file and last.pth, as training saves them: for each, the temporary file's
    data are fsynced before it is renamed into place, and the folder after the rename."""
    events = _sync_and_rename_log(monkeypatch)
    step_file = ckpt.save_with_history(tmp_path, {"model": {"w": torch.ones(3)}, "step": 7}, 7,
                                       keep=3)
    renames = [(index, event) for index, event in enumerate(events) if event[0] == "replace"]
    assert [target for _, (_, _, target) in renames] == [str(step_file), str(tmp_path /
                                                                              "last.pth")]
    for index, (_, file_inode, target) in renames:
        folder_inode = os.stat(os.path.dirname(target)).st_ino
        synced_before = [inode for kind, inode, *_ in events[:index] if kind == "fsync"]
        synced_after = [inode for kind, inode, *_ in events[index + 1:] if kind == "fsync"]
        assert file_inode in synced_before, (target, events)
        assert folder_inode in synced_after, (target, events)
