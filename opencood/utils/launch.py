"""Process-group setup for every launcher (docs/DESIGN.md §6.1).

Launchers understood by :func:`init_distributed_mode`, in this order:

* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (``env://``);
  under ``--max-restarts`` the restarted workers meet in a store scoped to the restart;
* SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, master address = first
  host of the step/job node list, ``MASTER_PORT`` if set, else a port derived from the job id;
* anything else: one process, no process group.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
import re
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from opencood.errors import OpencoodError, one_line
from opencood.utils.collectives import (CollectiveTimeoutError, forget_groups,
                                        is_dist_initialized, is_peer_failure, set_local_rank,
                                        set_object_group_timeout)

DEFAULT_MASTER_PORT = 29500
# SLURM jobs that share a node would all pick DEFAULT_MASTER_PORT and collide; spreading the default
# over this many ports by job id makes that unlikely without asking the user for a port.
_SLURM_PORT_SPREAD = 1000




# ----------------------------------------------------------------------------------------------
# Launcher environment
# ----------------------------------------------------------------------------------------------

def _split_top_level(text: str) -> list[str]:
    """Split ``text`` on commas that are outside square brackets."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part.strip() for part in parts if part.strip()]


def _expand_range_list(spec: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]``, keeping the zero padding of each bound."""
    values = []
    for item in spec.split(","):
        item = item.strip()
        if "-" in item:
            low, high = item.split("-", 1)
            width = len(low)
            values.extend(str(number).zfill(width) for number in range(int(low), int(high) + 1))
        elif item:
            values.append(item)
    return values


def _expand_host_pattern(pattern: str) -> list[str]:
    """One host pattern, possibly with several bracket groups: ``"r[1-2]n[01-02]"`` -> 4 hosts."""
    match = re.search(r"\[([^\]]*)\]", pattern)
    if match is None:
        return [pattern]
    prefix, suffix = pattern[:match.start()], pattern[match.end():]
    hosts = []
    for value in _expand_range_list(match.group(1)):
        hosts.extend(_expand_host_pattern(prefix + value + suffix))
    return hosts


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM node list.

    ``"node[01-03,07],gpu5"`` -> ``["node01", "node02", "node03", "node07", "gpu5"]``.
    """
    if nodelist.count("[") != nodelist.count("]"):
        raise ValueError(f"malformed SLURM node list {nodelist!r}: unbalanced brackets")
    hosts = []
    for pattern in _split_top_level(nodelist):
        hosts.extend(_expand_host_pattern(pattern))
    return hosts


def first_host(nodelist: str) -> str:
    """First host name of a SLURM node list (where SLURM puts task 0)."""
    hosts = expand_nodelist(nodelist)
    if not hosts:
        raise ValueError(f"SLURM node list {nodelist!r} names no host")
    return hosts[0]


def _slurm_master_port(env: Mapping[str, str]) -> int:
    if "MASTER_PORT" in env:
        return int(env["MASTER_PORT"])
    job_id = env.get("SLURM_JOB_ID", "")
    if job_id.isdigit():
        return DEFAULT_MASTER_PORT + int(job_id) % _SLURM_PORT_SPREAD
    return DEFAULT_MASTER_PORT


def _slurm_master_addr(env: Mapping[str, str]) -> str:
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    for key in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(key):
            return first_host(env[key])
    raise ValueError("SLURM launch without a node list: set MASTER_ADDR or SLURM_JOB_NODELIST")


def launcher_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank as its launcher (torchrun, SLURM) set it, readable before any process
    group exists; 0 for a plain ``python`` or a value that is not a number (init_distributed_mode
    reports that one)."""
    for rank_key, size_key in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank_key in env and size_key in env:
            return int(env[rank_key]) if env[rank_key].isdigit() else 0
    return 0


def resolve_dist_env(env: Mapping[str, str]
                     ) -> tuple[int, int, int, str | None, int | None, str]:
    """Read the launcher's variables without touching torch.distributed.

    Returns ``(rank, world_size, local_rank, master_addr, master_port, source)`` with ``source`` one
    of ``"torchrun"``, ``"slurm"``, ``"single"`` (then rank 0, world 1, no master).
    """
    resolved = _read_launcher_env(env)
    rank, world_size, source = resolved[0], resolved[1], resolved[5]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"inconsistent {source} environment: rank {rank}, world size {world_size}")
    return resolved


def _read_launcher_env(env: Mapping[str, str]
                       ) -> tuple[int, int, int, str | None, int | None, str]:
    if "RANK" in env and "WORLD_SIZE" in env:
        rank = int(env["RANK"])
        # Launchers that omit LOCAL_RANK are single-node ones, where the two coincide.
        local_rank = int(env.get("LOCAL_RANK", rank))
        return (rank, int(env["WORLD_SIZE"]), local_rank, env.get("MASTER_ADDR", "127.0.0.1"),
                int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)), "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return (int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                int(env.get("SLURM_LOCALID", 0)), _slurm_master_addr(env),
                _slurm_master_port(env), "slurm")
    return 0, 1, 0, None, None, "single"


# ----------------------------------------------------------------------------------------------
# Process group setup
# ----------------------------------------------------------------------------------------------

@dataclass
class DistInfo:
    """What this process is in the job. ``device`` is where its model and batches go."""

    rank: int
    world_size: int
    local_rank: int
    distributed: bool
    backend: str | None
    device: torch.device


def _cuda_device_index(local_rank: int) -> int:
    """Index (among CUDA_VISIBLE_DEVICES) of the GPU this process drives."""
    visible = torch.cuda.device_count()
    if local_rank < visible:
        return local_rank
    if visible == 1:
        # SLURM with --gpus-per-task (or a per-rank CUDA_VISIBLE_DEVICES) shows each task only its
        # own GPU, which is then device 0 whatever the local rank.
        return 0
    raise RuntimeError(
        f"local rank {local_rank} needs a GPU but only {visible} are visible "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
        "start at most one process per visible GPU")


def _is_address_in_use(error: BaseException) -> bool:
    message = str(error).lower()
    return "eaddrinuse" in message or "address already in use" in message


def _init_method(source: str, env: Mapping[str, str], master_addr: str, master_port: int) -> str:
    # torchrun's agent already hosts the rendezvous store; env:// connects to it, whereas tcp://
    # would make rank 0 open a second server on the agent's port. env:// reads os.environ, so a
    # caller-supplied mapping (tests, wrappers) gets an explicit tcp:// address instead.
    if source == "torchrun" and env is os.environ:
        return "env://"
    return f"tcp://{master_addr}:{master_port}"


def _restart_scoped_store(rank: int, world_size: int, timeout: datetime.timedelta,
                          env: Mapping[str, str]) -> "dist.Store":
    """torchrun's rendezvous store, with keys scoped to this restart of the worker group.

    Under ``--max-restarts`` the restarted workers meet in the same store as the killed ones;
    without a scope they can read the dead workers' addresses (gloo then fails with "connection
    refused" during init). torchrun counts restarts in TORCHELASTIC_RESTART_COUNT.
    """
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size,
                                       timeout=timeout))
    return dist.PrefixStore(f"opencood_restart_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                            store)


def init_distributed_mode(backend: str | None = None, timeout_minutes: float = 30,
                          env: Mapping[str, str] = os.environ) -> DistInfo:
    """Set up this process for training as torchrun, SLURM or a plain ``python`` launched it.

    On CUDA the process's GPU is selected (``torch.cuda.set_device``) before the process group
    exists, so NCCL and every later CUDA call use it. Backend: ``nccl`` with CUDA, ``gloo`` without,
    unless ``backend`` says otherwise. Launches by torchrun or SLURM get a process group even with
    one process, so the training code path is the same for every world size.
    """
    if is_dist_initialized():
        raise RuntimeError("init_distributed_mode: a process group already exists; "
                           "call cleanup_distributed() first")
    rank, world_size, local_rank, master_addr, master_port, source = resolve_dist_env(env)
    use_cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if use_cuda:
        device = torch.device("cuda", _cuda_device_index(local_rank))
        torch.cuda.set_device(device)
    if source == "single":
        return DistInfo(0, 1, 0, False, None, device)

    backend = backend or ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise RuntimeError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
    timeout = datetime.timedelta(minutes=timeout_minutes)
    try:
        if source == "torchrun" and env is os.environ:
            dist.init_process_group(backend=backend, store=_restart_scoped_store(
                rank, world_size, timeout, env), rank=rank, world_size=world_size,
                timeout=timeout)
        else:
            dist.init_process_group(backend=backend,
                                    init_method=_init_method(source, env, master_addr,
                                                             master_port),
                                    rank=rank, world_size=world_size, timeout=timeout)
    except RuntimeError as error:  # DistNetworkError from TCPStore is a RuntimeError
        if _is_address_in_use(error):
            raise RuntimeError(
                f"cannot start the rendezvous at MASTER_ADDR:MASTER_PORT = "
                f"{master_addr}:{master_port}: the port is already in use (another job?); "
                f"pick a free one with --master_port (torchrun) or MASTER_PORT=...") from None
        raise
    set_local_rank(local_rank)
    set_object_group_timeout(timeout)
    return DistInfo(rank, world_size, local_rank, True, backend, device)


def cleanup_distributed() -> None:
    """Destroy the process group (and the object-collective group) if one exists."""
    if is_dist_initialized():
        # A DDP reducer left in a reference cycle would otherwise be freed after the group is
        # gone, which can abort the process at exit under gloo.
        gc.collect()
        dist.destroy_process_group()
    forget_groups()


@contextlib.contextmanager
def distributed_session(backend: str | None = None, timeout_minutes: float = 30,
                        env: Mapping[str, str] = os.environ) -> Iterator[DistInfo]:
    """``with distributed_session() as info:`` inits, and destroys the group on any exit."""
    info = init_distributed_mode(backend=backend, timeout_minutes=timeout_minutes, env=env)
    try:
        yield info
    except OpencoodError as error:
        error.rank = info.rank      # its one line names a rank other than 0 (errors.run_cli)
        raise
    except RuntimeError as error:
        if info.distributed and is_peer_failure(error):
            raise CollectiveTimeoutError(
                f"rank {info.rank}: a collective failed: another rank did not join it within "
                f"{60 * timeout_minutes:g} s (distributed.timeout_minutes) or left (it died, "
                f"hangs, or runs other code); {one_line(error)}") from error
        raise
    finally:
        cleanup_distributed()


