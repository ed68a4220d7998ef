"""Seams of the training flow: optional callbacks that ``opencood.engine.trainer.train`` calls
at fixed points, so that a caller (the tests) can watch or adjust a run through its parameters
instead of patching the flow's module.

Each default does nothing (or returns its argument unchanged): a run without hooks is the run.
Hooks are called on every rank; they are built inside the process that trains (a spawned rank
builds its own), so they need not be picklable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

from opencood.engine.state import TrainingParts
from opencood.utils.dist import DistInfo


def _unchanged(dataset):
    return dataset


def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True)
class TrainHooks:
    """Callbacks at fixed points of ``train``, in the order they are first called.

    ``wrap_train_set(dataset) -> dataset``: once, right after the training split is built; the
        dataset returned (the same length) is the one sampled, loaded and trained on.
    ``on_parts(parts, info)``: once, when the model (DDP, EMA), task, optimizer and schedule
        exist, before a resume restores their states; it may replace members of ``parts``.
    ``before_step(step)``: before each optimizer step, with its 1-based number in the run.
    ``after_step(step, stats)``: after that step, with its number and its statistics (``loss``,
        the loss terms, ``lr``, ``grad_norm``, ...), as logged.
    """
    wrap_train_set: Callable[[Any], Any] = _unchanged
    on_parts: Callable[[TrainingParts, DistInfo], None] = _nothing
    before_step: Callable[[int], None] = _nothing
    after_step: Callable[[int, Dict], None] = _nothing


NO_HOOKS = TrainHooks()
