"""Process-wide state that in-process training runs change, saved and put back by tests."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch


@contextlib.contextmanager
def preserved_opencood_logger():
    """In-process tools/train.py runs reconfigure the "opencood" logger (file handler, no
    propagation); put it back so later tests (caplog included) see the usual logger."""
    log = logging.getLogger("opencood")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    try:
        yield
    finally:
        for handler in list(log.handlers):
            if handler not in handlers:
                log.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in log.handlers:
                log.addHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


# The global torch switches configure_cuda sets from the yaml. Read and written back by plain
# getattr/setattr: torch serves some of them through a module __getattr__, which pytest's
# monkeypatch cannot restore (it tries delattr on teardown and fails from pytest 9.2 on).
TORCH_SWITCHES = ((torch.backends.cudnn, "benchmark"), (torch.backends.cudnn, "allow_tf32"),
                   (torch.backends.cuda.matmul, "allow_tf32"))


@contextlib.contextmanager
def preserved_torch_switches():
    saved = [(owner, name, getattr(owner, name)) for owner, name in TORCH_SWITCHES]
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


@pytest.fixture
def cpu_and_process_state(monkeypatch):
    """In-process runs stay on CPU, and the logger and torch switches they change come back.
    A test module uses it with ``pytestmark = pytest.mark.usefixtures(...)`` after importing it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with preserved_torch_switches(), preserved_opencood_logger():
        yield
