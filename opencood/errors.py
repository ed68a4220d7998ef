"""The one error boundary of the command-line tools.

Every error that means "bad input" (a config key, a data file, a checkpoint, a command-line value)
derives from :class:`OpencoodError`. A tool's ``main`` runs inside :func:`run_cli`, which turns such
an error into one ``error: ...`` line naming the file, key or value, and exit status 1. Anything
else is a bug and keeps its traceback.
"""
from __future__ import annotations

import logging
import sys
from typing import Callable, Optional, Sequence, TypeVar

Result = TypeVar("Result")


class OpencoodError(Exception):
    """Bad input, reported as one line by the tools (never a traceback)."""


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


def run_cli(main: Callable[[Optional[Sequence[str]]], Result],
            argv: Optional[Sequence[str]] = None) -> Result:
    """Run a tool's ``main(argv)``; an :class:`OpencoodError` exits with ``error: <one line>``.

    The line also goes to the "opencood" logger when it has handlers (a training run's log file
    then records why the run stopped).
    """
    try:
        return main(argv)
    except OpencoodError as error:
        message = one_line(error)
        log = logging.getLogger("opencood")
        if log.handlers:
            log.error("%s", message)
        sys.stderr.flush()
        raise SystemExit(f"error: {message}") from None
