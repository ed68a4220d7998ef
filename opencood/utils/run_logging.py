"""Per-rank logging of a run: rank 0 to the console and RUN/train.log, the others warnings only."""
from __future__ import annotations

import logging
import os
import sys

from opencood.utils.collectives import get_rank


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
