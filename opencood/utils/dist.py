"""Distributed-training helpers: rank queries, collectives, process-group setup, logging.

Every query and collective here is safe to call before (or without) ``init_process_group``: a single
process behaves as rank 0 of a world of 1 and the collectives return their input. So library code
can call ``get_rank()`` or ``all_gather_object()`` without knowing how it was launched.

Launchers understood by :func:`init_distributed_mode`, in this order:

* torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT`` (``env://``);
* SLURM (``srun``): ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, master address = first
  host of the step/job node list, ``MASTER_PORT`` if set, else a port derived from the job id;
* anything else: one process, no process group.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from opencood.errors import OpencoodError, one_line

DEFAULT_MASTER_PORT = 29500
# SLURM jobs that share a node would all pick DEFAULT_MASTER_PORT and collide; spreading the default
# over this many ports by job id makes that unlikely without asking the user for a port.
_SLURM_PORT_SPREAD = 1000

# Set by init_distributed_mode: the launcher's local rank and the gloo group for object collectives.
_local_rank = 0
_object_group = None

logger = logging.getLogger("opencood")


# ----------------------------------------------------------------------------------------------
# Rank queries (safe before init)
# ----------------------------------------------------------------------------------------------

def is_dist_initialized() -> bool:
    """True when a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process; 0 without a process group."""
    return dist.get_rank() if is_dist_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the default group; 1 without a process group."""
    return dist.get_world_size() if is_dist_initialized() else 1


def get_local_rank() -> int:
    """Rank of this process on its node (as given by the launcher); 0 without a process group."""
    return _local_rank if is_dist_initialized() else 0


def is_main_process() -> bool:
    """True on global rank 0 (the rank that logs, writes TensorBoard and saves checkpoints)."""
    return get_rank() == 0


# ----------------------------------------------------------------------------------------------
# Collectives (no-ops for a single process)
# ----------------------------------------------------------------------------------------------

def _uses_nccl() -> bool:
    return "nccl" in str(dist.get_backend()).lower()


def collective_device() -> torch.device:
    """Device for tensors passed to collectives: the current GPU under NCCL, else CPU."""
    if is_dist_initialized() and _uses_nccl():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _get_object_group():
    """Group used for pickled-object collectives.

    Objects (detections, metrics) are pickled into byte tensors; with NCCL those would be staged in
    GPU memory, so like detectron2 we route them through a gloo group on CPU. Created lazily, which
    is safe because every object collective is called by all ranks in the same order.
    """
    global _object_group
    if not _uses_nccl():
        return None  # the default group already works on CPU
    if _object_group is None:
        _object_group = dist.new_group(backend="gloo")
    return _object_group


def barrier() -> None:
    """Wait until every rank gets here."""
    if get_world_size() == 1:
        return
    if _uses_nccl():
        # Naming the device avoids NCCL guessing (and warning about) which GPU this rank uses.
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


class HungRankError(OpencoodError):
    """Some ranks did not reach a monitored barrier in time; the message names them."""


def monitored_barrier(what: str, timeout_s: float) -> None:
    """Wait for every rank; when some do not arrive within ``timeout_s``, raise on rank 0
    naming them (gloo's monitored_barrier, through the gloo object group under NCCL).

    Without it a rank stuck in I/O or a deadlock leaves the others in their next collective
    until the process-group timeout, with an error that names no one.
    """
    if get_world_size() == 1:
        return
    try:
        dist.monitored_barrier(group=_get_object_group(),
                               timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as error:
        late = sorted({int(rank) for rank in re.findall(r"\d+", _late_ranks_text(str(error)))})
        names = ", ".join(map(str, late)) if late else "some"
        raise HungRankError(f"rank(s) {names} did not reach {what} within {timeout_s:g} s "
                            f"(seen from rank {get_rank()}): stuck or dead; "
                            f"distributed.timeout_minutes sets the wait") from None


def _late_ranks_text(message: str) -> str:
    """The rank list of gloo's "Ranks 1, 3 failed to pass monitoredBarrier" message ('' when
    the message has another form, e.g. on a non-zero rank whose rank 0 is gone)."""
    match = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", message)
    return match.group(1) if match else ""


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks, in place, and return it (on the backend's device)."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_object(obj: Any) -> list:
    """Picklable ``obj`` from every rank, as a list indexed by rank (on every rank)."""
    world_size = get_world_size()
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size
    dist.all_gather_object(gathered, obj, group=_get_object_group())
    return gathered


def gather_object_to_main(obj: Any) -> list | None:
    """Picklable ``obj`` from every rank as a list on rank 0; None on the other ranks."""
    world_size = get_world_size()
    if world_size == 1:
        return [obj]
    gathered = [None] * world_size if is_main_process() else None
    dist.gather_object(obj, gathered, dst=0, group=_get_object_group())
    return gathered


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (the argument is ignored on the other ranks)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=_get_object_group())
    return box[0]


@torch.no_grad()
def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running statistics) to every rank; all ranks call.

    DDP keeps parameters equal, but each rank's last training forward moved its own plain
    BatchNorm statistics: without this, every rank would validate a slightly different model.
    """
    if get_world_size() == 1:
        return
    device = collective_device()
    for buffer in module.buffers():
        staged = buffer.to(device)
        dist.broadcast(staged, src=src)
        buffer.copy_(staged)


def any_across_ranks(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on at least one rank.

    Use it for decisions such as "skip this batch": if one rank skips on its own while the others
    enter a gradient all-reduce, the job hangs until the collective timeout.
    """
    if get_world_size() == 1:
        return bool(flag)
    flag_tensor = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag_tensor, op=dist.ReduceOp.MAX)
    return bool(flag_tensor.item())


class CollectiveTimeoutError(OpencoodError, RuntimeError):
    """A collective waited longer than the process-group timeout for a rank that never came."""


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a backend's report of a missing peer: a collective timeout (gloo:
    "Timed out waiting ...", "Application timeout caused pair closure"; NCCL's watchdog:
    "... operation timeout") or a peer that left (gloo: "Connection closed by peer")."""
    text = str(error).lower()
    return not isinstance(error, OpencoodError) and any(
        sign in text for sign in ("timed out", "timeout", "closed by peer", "connection reset"))


class PeerRankError(OpencoodError, RuntimeError):
    """Another rank failed in a step every rank takes together; this rank stops with its message
    (the failing rank reports its own error, with its traceback if it is a bug)."""


def run_together(step: Callable[[], Any], what: str) -> Any:
    """``step()`` on every rank, then one exchange of outcomes: if any rank raised, every rank
    raises (that rank its own error, the others :class:`PeerRankError` naming it).

    For work that can fail on one rank alone (a corrupt file in its shard; rank 0's AP or file
    writing): without the exchange the other ranks would wait in their next collective until
    the process-group timeout. All ranks must call it. Returns ``step()``'s result.
    """
    if get_world_size() == 1:
        return step()
    try:
        result, failure = step(), None
    except Exception as error:  # KeyboardInterrupt / SystemExit end the whole job anyway
        result, failure = None, error
    report = None if failure is None else f"{type(failure).__name__}: {one_line(failure)}"
    reports = all_gather_object(report)
    if failure is not None:
        raise failure
    for rank, peer_report in enumerate(reports):
        if peer_report is not None:
            raise PeerRankError(f"rank {rank} failed during {what}: {peer_report}")
    return result


def sum_across_ranks(*values: float | int | torch.Tensor) -> tuple:
    """Each scalar summed over all ranks, in float64, with one all-reduce -> tuple of floats."""
    totals = torch.tensor([float(v) for v in values], dtype=torch.float64,
                          device=collective_device())
    all_reduce_sum(totals)
    return tuple(totals.tolist())


def reduce_mean_exact(loss_sum: float | torch.Tensor, count: int | float | torch.Tensor) -> float:
    """Exact mean over all ranks: sum(loss_sum) / sum(count).

    ``loss_sum`` is this rank's sum of per-sample losses (mean loss x n), ``count`` its n. Averaging
    per-rank means instead would weight ranks with fewer samples (the unpadded validation shards
    differ by one) too much. Computed in float64 so large sums keep their precision.
    """
    total_loss, total_count = sum_across_ranks(loss_sum, count)
    if total_count <= 0:
        raise ValueError("reduce_mean_exact: the sample count summed over all ranks is 0, "
                         "so there is no mean (empty validation set?)")
    return total_loss / total_count


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
    global _local_rank
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
    _local_rank = local_rank
    return DistInfo(rank, world_size, local_rank, True, backend, device)


def cleanup_distributed() -> None:
    """Destroy the process group (and the object-collective group) if one exists."""
    global _object_group, _local_rank
    if is_dist_initialized():
        # A DDP reducer left in a reference cycle would otherwise be freed after the group is
        # gone, which can abort the process at exit under gloo.
        gc.collect()
        dist.destroy_process_group()
    _object_group = None
    _local_rank = 0


@contextlib.contextmanager
def distributed_session(backend: str | None = None, timeout_minutes: float = 30,
                        env: Mapping[str, str] = os.environ) -> Iterator[DistInfo]:
    """``with distributed_session() as info:`` inits, and destroys the group on any exit."""
    info = init_distributed_mode(backend=backend, timeout_minutes=timeout_minutes, env=env)
    try:
        yield info
    except RuntimeError as error:
        if info.distributed and is_peer_failure(error):
            raise CollectiveTimeoutError(
                f"rank {info.rank}: a collective failed: another rank did not join it within "
                f"{60 * timeout_minutes:g} s (distributed.timeout_minutes) or left (it died, "
                f"hangs, or runs other code); {one_line(error)}") from error
        raise
    finally:
        cleanup_distributed()


# ----------------------------------------------------------------------------------------------
# Logging
# ----------------------------------------------------------------------------------------------

def setup_logging(run_dir: str | os.PathLike | None = None, rank: int | None = None,
                  name: str = "opencood") -> logging.Logger:
    """Configure the ``opencood`` logger for this rank and return it.

    Rank 0 logs INFO and up to the console and, with ``run_dir``, to ``run_dir/train.log``; other
    ranks log WARNING and up to the console only (so errors show from every rank, chatter from one).
    Calling it again replaces the handlers it installed before.
    """
    rank = get_rank() if rank is None else rank
    log = logging.getLogger(name)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False  # a root handler (basicConfig elsewhere) would print every line twice

    prefix = "" if rank == 0 else f"[rank {rank}] "
    formatter = logging.Formatter(f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
                                  datefmt="%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(formatter)
    log.addHandler(console)
    if run_dir is not None and rank == 0:
        os.makedirs(run_dir, exist_ok=True)
        log_file = logging.FileHandler(os.path.join(run_dir, "train.log"))
        log_file.setFormatter(formatter)
        log.addHandler(log_file)
    return log
