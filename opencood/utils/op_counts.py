"""Count the operators a piece of code dispatches: the CPU-measurable proxy of a GPU step's
launch overhead (docs/DESIGN.md §6.12).

A launch-bound CUDA step costs a few microseconds of host time per operator whatever the
operator does, so the number of operators per training step is what "fewer, better kernels"
changes, and it is the same number on CPU as on CUDA for the same code path (the ops below the
autograd layer: forward, backward, optimizer, EMA). Counted with a ``TorchDispatchMode``, like
``opencood.utils.host_syncs``:

``total``    every aten operator dispatched;
``kernels``  those that do work on the device: not views or other metadata-only ops (``view``,
             ``t``, ``expand``, ``detach``, ...), not bare allocations (``empty``,
             ``empty_strided``), not host reads (``_local_scalar_dense``) and not the
             profiler's ``record_function`` markers. A ``_foreach_``
             operator counts once, as it launches one kernel per chunk of tensors, not one per
             tensor.

``with OpCounter() as ops: ...`` then ``ops.total``, ``ops.kernels``, ``ops.by_op`` (a Counter
of kernel operators by name) and ``ops.by_phase`` (kernels per phase: code run inside
``ops.phase(name)``, or after ``ops.set_phase(name)`` for phases that begin and end in hooks).
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators that launch no device work: allocations and host reads (views are found by their
# schema, ``OpOverload.is_view``).
_NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
              aten._local_scalar_dense.default, aten.detach.default, aten.lift_fresh.default,
              aten.set_.source_Storage_storage_offset, aten.resize_.default}


def launches_kernel(func) -> bool:
    """Whether the dispatched operator ``func`` (an OpOverload) does work on the device."""
    # profiler.*: the record_function markers optimizer.step and zero_grad put around them
    return not (func.is_view or func in _NO_KERNEL or func.namespace == "profiler")


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten operators while active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_op: Counter = Counter()
        self.by_phase: Dict[str, int] = {}
        self._phase = None

    @property
    def kernels(self) -> int:
        return sum(self.by_op.values())

    def set_phase(self, name: str | None) -> None:
        """Attribute the kernels counted from now on to ``name`` (None: to no phase); a phase
        entered again adds up."""
        self._phase = name
        if name is not None:
            self.by_phase.setdefault(name, 0)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Attribute the kernels counted inside to ``name``, then go back to the outer phase."""
        outer = self._phase
        self.set_phase(name)
        try:
            yield self
        finally:
            self._phase = outer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.total += 1
        if launches_kernel(func):
            self.by_op[func.overloadpacket.__name__] += 1
            if self._phase is not None:
                self.by_phase[self._phase] += 1
        return func(*args, **(kwargs or {}))
