"""Rank queries and collectives, safe before (or without) ``init_process_group``: a single
process behaves as rank 0 of a world of 1 and the collectives return their input, so library code
can call ``get_rank()`` or ``all_gather_object()`` without knowing how it was launched. Also the
errors that name a failing or missing rank, and ``run_together`` (one rank's failure ends all).
"""
from __future__ import annotations

import datetime
import logging
import re
from typing import Any, Callable

import torch
import torch.distributed as dist

from opencood.errors import OpencoodError, leave_to_rank_0, one_line

# Set by opencood.utils.launch.init_distributed_mode: the launcher's local rank, and how long a
# collective of the gloo group for object collectives waits (None: torch's default for a new
# group, 30 minutes). The group itself is created on first use.
_local_rank = 0
_object_group_timeout: datetime.timedelta | None = None
_object_group = None

logger = logging.getLogger("opencood")


def set_local_rank(local_rank: int) -> None:
    """Record the launcher's local rank (init_distributed_mode)."""
    global _local_rank
    _local_rank = local_rank


def set_object_group_timeout(timeout: datetime.timedelta) -> None:
    """Record the default group's timeout (init_distributed_mode) for the object group."""
    global _object_group_timeout
    _object_group_timeout = timeout


def forget_groups() -> None:
    """Drop the object-collective group, its timeout and the local rank (the process group is
    gone)."""
    global _object_group, _object_group_timeout, _local_rank
    _object_group = None
    _object_group_timeout = None
    _local_rank = 0


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
        # A new group does not inherit the default group's timeout: without it a missing rank
        # would keep the others here for torch's 30 minutes, whatever timeout_minutes says.
        _object_group = dist.new_group(backend="gloo", timeout=_object_group_timeout)
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

    The job prints each failure once: rank 0 prints its own error or, when it did not fail, the
    first failing rank's (naming it); another rank prints only an error of its own that rank 0's
    line does not already tell.
    """
    if get_world_size() == 1:
        return step()
    try:
        result, failure = step(), None
    except Exception as error:  # KeyboardInterrupt / SystemExit end the whole job anyway
        result, failure = None, error
    report = None if failure is None else f"{type(failure).__name__}: {one_line(failure)}"
    reports = all_gather_object(report)
    rank = get_rank()
    if failure is not None:
        if _told_by_rank_0(reports, rank):
            leave_to_rank_0(failure, rank)
        raise failure
    for failed_rank, peer_report in enumerate(reports):
        if peer_report is not None:
            error = PeerRankError(f"rank {failed_rank} failed during {what}: {peer_report}")
            leave_to_rank_0(error, rank)      # rank 0 prints this line, or its own error
            raise error
    return result


def _told_by_rank_0(reports: list, rank: int) -> bool:
    """Whether rank 0's line tells the failure ``rank`` reported: rank 0 failed alike, or rank 0
    did not fail and its PeerRankError names ``rank``, the first rank that did."""
    first_failed = next(index for index, report in enumerate(reports) if report is not None)
    return reports[0] == reports[rank] or first_failed == rank


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


