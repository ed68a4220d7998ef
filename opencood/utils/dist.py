"""Distributed training in one import (``from opencood.utils import dist as dist_utils``), from
three homes by concern:

* :mod:`opencood.utils.collectives`: rank queries and collectives, safe without a process group
  (a single process is rank 0 of a world of 1), and the errors that name a failing rank;
* :mod:`opencood.utils.launch`: the process group for torchrun, SLURM or one process
  (``init_distributed_mode``, ``distributed_session``);
* :mod:`opencood.utils.run_logging`: per-rank logging of a run.
"""
from opencood.utils.collectives import (  # noqa: F401
    CollectiveTimeoutError, HungRankError, PeerRankError, all_gather_object, all_reduce_sum,
    any_across_ranks, barrier, broadcast_buffers, broadcast_object, collective_device,
    gather_object_to_main, get_local_rank, get_rank, get_world_size, is_dist_initialized,
    is_main_process, is_peer_failure, monitored_barrier, reduce_mean_exact, run_together,
    sum_across_ranks)
from opencood.utils.launch import (  # noqa: F401
    DEFAULT_MASTER_PORT, DistInfo, cleanup_distributed, distributed_session, expand_nodelist,
    first_host, init_distributed_mode, launcher_rank, resolve_dist_env)
from opencood.utils.run_logging import setup_logging  # noqa: F401
