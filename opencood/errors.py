"""The one error boundary of the command-line tools.

Every error that means "bad input" (a config key, a data file, a checkpoint, a command-line value)
derives from :class:`OpencoodError`. A tool's ``main`` runs inside :func:`run_cli`, which turns such
an error into one ``error: ...`` line naming the file, key or value, and exit status 1. Anything
else is a bug and keeps its traceback.

A job of several ranks prints each error once: an error every rank raises alike (a config key, a
batch the world size cannot divide, a checkpoint that does not fit the model) is printed by rank 0
alone (:func:`alike_on_every_rank`), and a rank's own error names that rank.
"""
from __future__ import annotations

import contextlib
import logging
import re
import sys
from typing import Callable, Iterator, Optional, Sequence, TypeVar

Result = TypeVar("Result")


class OpencoodError(Exception):
    """Bad input, reported as one line by the tools (never a traceback).

    ``rank`` is the rank that raised it (set when it leaves a distributed session; its line then
    names a rank other than 0). ``printed_by_rank_0`` marks, on another rank, an error whose line
    rank 0 prints for the whole job, so this rank exits without printing it again.
    """
    rank = 0
    printed_by_rank_0 = False


class ConfigError(OpencoodError, ValueError):
    """A config file or override is invalid; the message names the file and the key."""


def one_line(error: BaseException) -> str:
    """The message of ``error`` on one line.

    An error raised in a DataLoader worker arrives wrapped ("Caught PcdError in DataLoader worker
    process 0. Original Traceback ..."): its last line is the original one-line message.
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else type(error).__name__
    last = lines[-1]
    prefix = f"{type(error).__module__}.{type(error).__name__}: "
    return last[len(prefix):] if last.startswith(prefix) else last


def leave_to_rank_0(error: BaseException, rank: int) -> None:
    """On a rank other than 0, mark ``error`` as one rank 0 prints for the job (a bug, not an
    :class:`OpencoodError`, keeps its traceback on every rank and is left alone)."""
    if rank != 0 and isinstance(error, OpencoodError):
        error.printed_by_rank_0 = True


@contextlib.contextmanager
def alike_on_every_rank(rank: int) -> Iterator[None]:
    """The block's errors come from what every rank reads alike (the config, the world size, a
    file every rank loads): only rank 0 prints them, so a job of N ranks shows the line once."""
    try:
        yield
    except OpencoodError as error:
        leave_to_rank_0(error, rank)
        raise


def _log_to_run_files(message: str) -> None:
    """Record why the run stopped in its log file (train.log). Not on the console: there the
    ``error:`` line of SystemExit already says it."""
    log = logging.getLogger("opencood")
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in log.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def run_cli(main: Callable[[Optional[Sequence[str]]], Result],
            argv: Optional[Sequence[str]] = None) -> Result:
    """Run a tool's ``main(argv)``; an :class:`OpencoodError` exits with ``error: <one line>``
    (on a rank other than 0, ``error: rank N: ...``), or silently with status 1 on a rank whose
    error rank 0 prints. The line also goes to the run's log file when one is open."""
    try:
        return main(argv)
    except OpencoodError as error:
        message = one_line(error)
        _log_to_run_files(message)
        sys.stderr.flush()
        if error.printed_by_rank_0:
            raise SystemExit(1) from error     # an int status: Python prints nothing
        if error.rank and not re.search(rf"\brank {error.rank}\b", message):
            message = f"rank {error.rank}: {message}"
        raise SystemExit(f"error: {message}") from None
