"""opencood.utils.dist: launcher parsing, collectives on real gloo ranks, process-group setup."""

import datetime
import logging
import socket

import pytest
import torch
import torch.distributed as dist

from opencood.utils import dist as dist_utils
from dist_helpers import free_port, run_on_ranks


# ----------------------------------------------------------------------------------------------
# resolve_dist_env / node lists (pure)
# ----------------------------------------------------------------------------------------------

def test_resolve_torchrun_env():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
           "MASTER_PORT": "29600", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    # torchrun inside a SLURM allocation: torchrun's variables win.
    assert dist_utils.resolve_dist_env(env) == (5, 8, 1, "10.0.0.2", 29600, "torchrun")


def test_resolve_slurm_env():
    env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
           "SLURM_JOB_NODELIST": "gpu[07-08]"}
    rank, world, local_rank, master_addr, master_port, source = dist_utils.resolve_dist_env(env)
    assert (rank, world, local_rank, master_addr, source) == (3, 8, 1, "gpu07", "slurm")
    assert master_port == dist_utils.DEFAULT_MASTER_PORT


def test_resolve_slurm_port_and_address_overrides():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
           "SLURM_JOB_ID": "123456", "SLURM_NODELIST": "cn[3-4]"}
    _, _, _, master_addr, master_port, _ = dist_utils.resolve_dist_env(env)
    assert (master_addr, master_port) == ("cn3", 29500 + 456)  # spread by job id
    env.update(MASTER_PORT="31000", MASTER_ADDR="head")
    _, _, _, master_addr, master_port, _ = dist_utils.resolve_dist_env(env)
    assert (master_addr, master_port) == ("head", 31000)


def test_resolve_rejects_rank_outside_world():
    with pytest.raises(ValueError, match="rank 4, world size 4"):
        dist_utils.resolve_dist_env({"SLURM_PROCID": "4", "SLURM_NTASKS": "4",
                                     "SLURM_NODELIST": "n1"})


def test_resolve_single_process_env():
    assert dist_utils.resolve_dist_env({}) == (0, 1, 0, None, None, "single")


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu5", ["gpu5"]),
    ("a,b", ["a", "b"]),
    ("gpu[07-08]", ["gpu07", "gpu08"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("x-[098-100]", ["x-098", "x-099", "x-100"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert dist_utils.expand_nodelist(nodelist) == hosts
    assert dist_utils.first_host(nodelist) == hosts[0]


def test_expand_nodelist_rejects_unbalanced_brackets():
    with pytest.raises(ValueError, match="node\\[01-02"):
        dist_utils.expand_nodelist("node[01-02")


# ----------------------------------------------------------------------------------------------
# Single process: everything works without a process group
# ----------------------------------------------------------------------------------------------

def test_helpers_before_init():
    assert not dist_utils.is_dist_initialized()
    assert (dist_utils.get_rank(), dist_utils.get_world_size(), dist_utils.get_local_rank()) \
        == (0, 1, 0)
    assert dist_utils.is_main_process()
    dist_utils.barrier()
    payload = {"boxes": [1, 2]}
    assert dist_utils.all_gather_object(payload) == [payload]
    assert dist_utils.gather_object_to_main(payload) == [payload]
    assert dist_utils.broadcast_object(payload) is payload
    assert dist_utils.any_across_ranks(True) is True
    assert dist_utils.any_across_ranks(False) is False
    values = torch.tensor([1.0, 2.0])
    assert torch.equal(dist_utils.all_reduce_sum(values.clone()), values)
    assert dist_utils.reduce_mean_exact(6.0, 3) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="count"):
        dist_utils.reduce_mean_exact(0.0, 0)


def test_init_single_process_creates_no_group():
    info = dist_utils.init_distributed_mode(env={})
    assert (info.rank, info.world_size, info.local_rank, info.distributed) == (0, 1, 0, False)
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert info.device.type == expected_device
    assert not dist_utils.is_dist_initialized()


def test_port_in_use_gives_clear_error():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as blocker:
        blocker.bind(("0.0.0.0", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        with pytest.raises(RuntimeError) as excinfo:
            dist_utils.init_distributed_mode(backend="gloo", timeout_minutes=0.5, env=env)
    message = str(excinfo.value)
    assert f"127.0.0.1:{port}" in message and "--master_port" in message
    assert "\n" not in message
    assert not dist_utils.is_dist_initialized()


def test_distributed_session_destroys_group_on_exception():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    with pytest.raises(KeyError, match="boom"):
        with dist_utils.distributed_session(backend="gloo", env=env) as info:
            assert info.distributed and info.backend == "gloo" and info.world_size == 1
            assert dist_utils.is_dist_initialized()
            raise KeyError("boom")
    assert not dist_utils.is_dist_initialized()
    dist_utils.cleanup_distributed()  # safe to call with no group


# ----------------------------------------------------------------------------------------------
# Two real gloo ranks
# ----------------------------------------------------------------------------------------------

def _collectives_body(rank, world_size):
    # Rank 0 saw 3 samples with losses 1, 2, 3; rank 1 one sample with loss 10.
    per_rank_losses = {0: [1.0, 2.0, 3.0], 1: [10.0]}[rank]
    return {
        "rank": (dist_utils.get_rank(), dist_utils.get_world_size(), dist_utils.is_main_process()),
        "gathered": dist_utils.all_gather_object({"rank": rank}),
        "to_main": dist_utils.gather_object_to_main(rank * 10),
        "broadcast": dist_utils.broadcast_object(f"from {rank}", src=1),
        "any_one_true": dist_utils.any_across_ranks(rank == 1),
        "any_none_true": dist_utils.any_across_ranks(False),
        "mean": dist_utils.reduce_mean_exact(sum(per_rank_losses), len(per_rank_losses)),
        "summed": dist_utils.all_reduce_sum(torch.tensor([rank + 1.0])).item(),
        "together": dist_utils.run_together(lambda: rank * 2, "doubling"),
        "together_failed": _failure_of(lambda: dist_utils.run_together(
            lambda: _fail_on_rank_1(rank), "reading its shard")),
        "after_failure": dist_utils.all_gather_object(rank),  # the group is still usable
        "buffers": _broadcast_batchnorm_buffers(rank),
    }


def _fail_on_rank_1(rank):
    if rank == 1:
        raise ValueError("bad shard")
    return "fine"


def _failure_of(function):
    try:
        return {"returned": function()}
    except Exception as error:
        return {"raised": type(error).__name__, "message": str(error)}


def _broadcast_batchnorm_buffers(rank):
    """Each rank's BatchNorm statistics differ (rank-valued); after the broadcast, rank 0's."""
    norm = torch.nn.BatchNorm1d(3)
    with torch.no_grad():
        norm.running_mean.fill_(rank + 1.0)
        norm.running_var.fill_(10.0 * (rank + 1))
        norm.num_batches_tracked.fill_(7 + rank)
        norm.weight.fill_(rank + 5.0)  # a parameter: DDP's business, left alone
    dist_utils.broadcast_buffers(norm, src=0)
    return {key: value.tolist() for key, value in norm.state_dict().items()}


def test_collectives_on_two_ranks():
    results = run_on_ranks(_collectives_body, world_size=2)
    assert [r["rank"] for r in results] == [(0, 2, True), (1, 2, False)]
    for result in results:
        assert result["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert result["broadcast"] == "from 1"
        assert result["any_one_true"] is True
        assert result["any_none_true"] is False
        # (1+2+3+10) / 4 samples, not the mean of the rank means (2 + 10) / 2 = 6.
        assert result["mean"] == pytest.approx(4.0, abs=1e-12)
        assert result["summed"] == 3.0
    assert results[0]["to_main"] == [0, 10]
    assert results[1]["to_main"] is None
    assert [r["together"] for r in results] == [0, 2]
    # Rank 1's failure raises on both: rank 1 its own error, rank 0 one naming it.
    assert results[1]["together_failed"] == {"raised": "ValueError", "message": "bad shard"}
    assert results[0]["together_failed"] == {
        "raised": "PeerRankError",
        "message": "rank 1 failed during reading its shard: ValueError: bad shard"}
    assert all(r["after_failure"] == [0, 1] for r in results)
    for rank, result in enumerate(results):
        buffers = result["buffers"]
        assert buffers["running_mean"] == [1.0] * 3 and buffers["running_var"] == [10.0] * 3
        assert buffers["num_batches_tracked"] == 7
        assert buffers["weight"] == [rank + 5.0] * 3


def _init_from_env_body(rank, world_size, port):
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with dist_utils.distributed_session(timeout_minutes=1, env=env) as info:
        seen = (info.rank, info.world_size, info.local_rank, info.distributed, info.backend,
                str(info.device), dist_utils.get_local_rank(),
                dist_utils.all_gather_object(dist_utils.get_rank()))
    return seen, dist_utils.is_dist_initialized()


def test_init_distributed_mode_on_two_ranks():
    results = run_on_ranks(_init_from_env_body, world_size=2, args=(free_port(),),
                           init_group=False)
    for rank, (seen, initialized_after) in enumerate(results):
        assert seen == (rank, 2, rank, True, "gloo", "cpu", rank, [0, 1])
        assert initialized_after is False


def _wait_for(path, limit_s: float) -> None:
    import time as time_module
    deadline = time_module.monotonic() + limit_s
    while not path.exists() and time_module.monotonic() < deadline:
        time_module.sleep(0.05)


def _object_collective_without_its_peer(rank, world_size, port, timeout_s, signals):
    """Rank 0 makes an object collective that rank 1 never joins.

    Under NCCL, object collectives go through a gloo side group. The default group is gloo
    here, so the collectives are told it is NCCL: they then create that side group exactly as
    under NCCL. Both ranks first make one object collective together (it creates the group);
    rank 1 then stays alive, away from the group, until rank 0 is done (or 5 x timeout_s: a
    rank that leaves closes the connection and ends rank 0's wait early). ``signals``: a
    folder for the files the ranks signal each other with, outside torch.distributed.
    -> on rank 0: {"waited": seconds in the lone collective, "error": what ended it}.
    """
    import time as time_module
    from opencood.utils import collectives
    collectives._uses_nccl = lambda: True
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # Start together: the short timeout also bounds the rendezvous, and the ranks' imports
    # can end seconds apart on a loaded machine.
    (signals / f"ready_{rank}").touch()
    _wait_for(signals / f"ready_{1 - rank}", 60.0)
    done = signals / "done"
    outcome = {"error": None}
    try:
        with dist_utils.distributed_session(backend="gloo", timeout_minutes=timeout_s / 60,
                                            env=env):
            dist_utils.all_gather_object(rank)
            assert collectives._object_group is not None  # the side group exists
            if rank == 1:
                _wait_for(done, 5 * timeout_s)
                return None
            start = time_module.monotonic()
            try:
                dist_utils.all_gather_object("rank 0 alone")
            finally:
                outcome["waited"] = time_module.monotonic() - start
                done.touch()
    except dist_utils.CollectiveTimeoutError as error:   # the session names the setting
        outcome["error"] = str(error)
    return outcome


def test_the_object_collective_side_group_waits_distributed_timeout_minutes(tmp_path):
    """The gloo side group of object collectives (run_together, the RNG gather, the run-folder
    broadcast) gives up on a missing rank after distributed.timeout_minutes, as the default
    group does, not after torch's 30-minute default for a new group."""
    timeout_s = 2.0
    rank0, _ = run_on_ranks(_object_collective_without_its_peer, world_size=2, init_group=False,
                            timeout_s=30, args=(free_port(), timeout_s, tmp_path))
    # Without the timeout, rank 0 waits until rank 1 leaves (5 x timeout_s), or 30 minutes.
    assert timeout_s - 0.5 < rank0["waited"] < timeout_s + 3.0, rank0
    assert "timed out" in str(rank0["error"]).lower(), rank0
    assert "distributed.timeout_minutes" in rank0["error"]


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------

def test_setup_logging_rank0_console_and_file(tmp_path, capsys):
    log = dist_utils.setup_logging(run_dir=tmp_path / "run", rank=0)
    log = dist_utils.setup_logging(run_dir=tmp_path / "run", rank=0)  # again: no duplicate lines
    log.info("epoch 1 done")
    for handler in log.handlers:
        handler.flush()
    assert capsys.readouterr().out.count("epoch 1 done") == 1
    assert (tmp_path / "run" / "train.log").read_text().count("epoch 1 done") == 1


def test_setup_logging_other_ranks_only_warn(tmp_path, capsys):
    log = dist_utils.setup_logging(run_dir=tmp_path / "run", rank=1)
    log.info("chatter")
    log.error("disk full")
    out = capsys.readouterr().out
    assert "chatter" not in out
    assert "disk full" in out and "rank 1" in out
    assert not (tmp_path / "run" / "train.log").exists()
    assert log.getEffectiveLevel() == logging.WARNING
    dist_utils.setup_logging(rank=0)  # leave the shared logger as rank 0 for other tests


def _late_rank_body(rank, world_size, sleep_s, timeout_s, port):
    """Rank 1 arrives ``sleep_s`` late at a monitored barrier of ``timeout_s``. The group is
    this body's own: a barrier that timed out leaves it unusable for the harness's teardown."""
    import time as time_module
    from opencood.utils.dist import HungRankError, monitored_barrier
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=30))
    if rank == 1:
        time_module.sleep(sleep_s)
    start = time_module.monotonic()
    try:
        monitored_barrier("the end of epoch 3", timeout_s)
        outcome = None
    except HungRankError as error:
        outcome = str(error)
    except RuntimeError as error:      # the late rank finds rank 0 gone: not what we test
        outcome = f"runtime: {error}"
    waited = time_module.monotonic() - start
    dist.destroy_process_group()
    return {"error": outcome, "waited": waited}


def test_a_hung_rank_is_named_within_the_timeout():
    rank0, rank1 = run_on_ranks(_late_rank_body, world_size=2, args=(6.0, 2.0, free_port()),
                                init_group=False, timeout_s=30)
    assert rank0["error"] == ("rank(s) 1 did not reach the end of epoch 3 within 2 s (seen from "
                              "rank 0): stuck or dead; distributed.timeout_minutes sets the wait")
    assert rank0["waited"] < 2.0 + 3.0     # the timeout, not the sleep, ended the wait


def test_ranks_on_time_pass_the_monitored_barrier():
    results = run_on_ranks(_late_rank_body, world_size=2, args=(0.0, 20.0, free_port()),
                           init_group=False, timeout_s=40)
    assert [r["error"] for r in results] == [None, None]
