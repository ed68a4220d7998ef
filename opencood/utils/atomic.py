"""The one atomic file write of the project: checkpoints, configs, results, caches.

A reader (another rank, a concurrent loader, a user after a crash) sees either the previous file
or the complete new one, never half a file.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_write(path, mode: str = "w", durable: bool = False) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; on a clean exit rename it over ``path``.

    An exception inside the block (a failed serialisation, a full disk) removes the temporary
    file and leaves ``path`` as it was. ``durable`` also fsyncs the data and the folder, so the
    rename survives a power loss (checkpoints). ``mode`` is "w" (text, utf-8) or "wb".
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not mkstemp: its files are private (0600); this one gets the umask's usual permissions.
    temp_path = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    encoding = None if "b" in mode else "utf-8"
    try:
        with open(temp_path, mode.replace("w", "x"), encoding=encoding) as stream:
            yield stream
            if durable:
                stream.flush()
                os.fsync(stream.fileno())
        os.replace(temp_path, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp_path.unlink()
        raise
    if durable:
        fsync_folder(path.parent)


def fsync_folder(folder) -> None:
    """Make a rename in ``folder`` durable (POSIX); skipped where folders cannot be opened."""
    try:
        folder_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(folder_fd)
    except OSError:
        pass
    finally:
        os.close(folder_fd)
