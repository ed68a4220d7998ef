"""Run a function on N real ``torch.distributed`` ranks (gloo, CPU) and collect what each returns.

Usage in a test::

    def _body(rank, world_size, offset):        # module level, so spawn can pickle it
        return dist_utils.all_gather_object(rank + offset)

    results = run_on_ranks(_body, world_size=2, args=(10,))   # [result of rank 0, of rank 1]

Each rank is a fresh process (no CUDA, one intra-op thread so two ranks share two cores
politely), forked by the forkserver of the loader workers (opencood.data.collate), which has
imported torch and the trainer once: a spawned rank spent about 2 s of CPU importing them again,
and the suite starts some fifty ranks (spawned where there is no forkserver). A rank gets the
test's environment of the moment it starts. By default the helper creates the gloo group through a
``file://`` store in a temporary folder (no port to race for) and destroys it afterwards; with
``init_group=False`` the function sets up its own group, e.g. to exercise
``init_distributed_mode`` with a port from :func:`free_port`. A failing rank re-raises in the
test with the rank's traceback; a hung collective fails after ``timeout_s`` instead of hanging the
test session.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import os
import pickle
import socket
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from opencood.data.collate import WORKER_PRELOAD

RANK_PRELOAD = WORKER_PRELOAD + ("torch.distributed", "opencood.engine.trainer",
                                 "opencood.engine.evaluator")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(rank: int, fn: Callable, world_size: int, args: tuple, work_dir: str,
               init_group: bool, timeout_s: float, environ: dict) -> None:
    # The test's environment at launch (the forkserver's own is that of its start).
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU tests must not touch a GPU the host may have
    if init_group:
        dist.init_process_group("gloo", init_method=f"file://{work_dir}/rendezvous", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        if init_group and dist.is_initialized():
            # Objects holding the group (a DDP reducer in a reference cycle) must go, and every
            # rank must be done communicating, before the group is destroyed: gloo aborts the
            # process ("terminate called without an active exception") otherwise.
            gc.collect()
            dist.barrier()
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(work_dir, f"result_{rank}.pkl"), "wb") as result_file:
        pickle.dump(result, result_file)


def run_on_ranks(fn: Callable[..., Any], world_size: int = 2, args: tuple = (),
                 init_group: bool = True, timeout_s: float = 60.0) -> list:
    """``[fn(rank, world_size, *args) for rank in range(world_size)]``, each in its own process.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level). Results come back
    through pickle files, so they can be any picklable object.
    """
    with tempfile.TemporaryDirectory(prefix="dist_test_") as work_dir:
        start_method = "spawn"
        if "forkserver" in multiprocessing.get_all_start_methods():
            start_method = "forkserver"     # read when the server starts; a no-op afterwards
            multiprocessing.get_context(start_method).set_forkserver_preload(list(RANK_PRELOAD))
        context = mp.start_processes(
            _rank_main, args=(fn, world_size, args, work_dir, init_group, timeout_s,
                              dict(os.environ)),
            nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout_s + 30  # spawning and importing torch take time
        while not context.join(timeout=1):  # re-raises a rank's exception with its traceback
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in "
                                   f"{timeout_s + 30:.0f} s (a collective that not every rank "
                                   "entered?)")
        results = []
        for rank in range(world_size):
            with open(os.path.join(work_dir, f"result_{rank}.pkl"), "rb") as result_file:
                results.append(pickle.load(result_file))
        return results
