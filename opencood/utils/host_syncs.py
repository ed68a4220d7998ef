"""Count what makes the host wait for the device: the audit of the fast training step.

On CUDA a host sync stalls the CPU until every queued kernel has run, so the next kernels are
launched late (a launch-bound step loses most of its speed), and a region with one cannot be
captured in a CUDA graph. The same calls can be counted on CPU, where they cost nothing, because
they are the same ops: this is how the tests check the static-shape, sync-free step without a GPU.

Counted (``HostSyncCounter.counts``, by kind):
  ``item``               ``aten._local_scalar_dense``: ``.item()``, ``bool()``, ``int()``,
                         ``float()`` of a tensor, ``if tensor:``;
  ``tolist``, ``numpy``  a tensor's values read by the host in one go;
  ``nonzero``, ``unique``, ``masked_select``: outputs whose size depends on the values;
  ``boolean_index``      ``x[mask]`` / ``x[mask] = v`` with a bool mask (a nonzero inside);
  ``repeat_interleave``  with tensor repeats and no ``output_size`` (the size is their sum).
"""
from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Iterable, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SIZE_FROM_VALUES = {
    aten.nonzero.default: "nonzero", aten.nonzero_numpy.default: "nonzero",
    aten.unique_consecutive.default: "unique", aten._unique.default: "unique",
    aten._unique2.default: "unique", aten.unique_dim.default: "unique",
    aten.unique_dim_consecutive.default: "unique",
    aten.masked_select.default: "masked_select",
}
_INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default,
             aten._index_put_impl_.default}
_HOST_READS = {"tolist": "tolist", "numpy": "numpy"}


def _has_bool_index(indices) -> bool:
    return any(index is not None and index.dtype in (torch.bool, torch.uint8)
               for index in indices)


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: Counter, ignored_ptrs: set):
        super().__init__()
        self.counts, self.ignored_ptrs = counts, ignored_ptrs

    def kind(self, func, args, kwargs) -> Optional[str]:
        if func is aten._local_scalar_dense.default:
            return None if args[0].data_ptr() in self.ignored_ptrs else "item"
        if func in _SIZE_FROM_VALUES:
            return _SIZE_FROM_VALUES[func]
        if func in _INDEXING and _has_bool_index(args[1]):
            return "boolean_index"
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave"
        if func is aten.repeat_interleave.self_Tensor and len(args) < 4 and \
                kwargs.get("output_size") is None:
            return "repeat_interleave"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.kind(func, args, kwargs)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **kwargs)


class _FunctionCounter(TorchFunctionMode):
    """Host reads that do not reach the dispatcher on CPU (``tolist``, ``numpy``)."""

    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _HOST_READS.get(getattr(func, "__name__", ""))
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.counts`` (a Counter by kind) and
    ``syncs.total``.

    ``host_tensors``: tensors that live on the host on CUDA too, whose ``.item()`` is no
    device sync (e.g. the non-capturable Adam/AdamW step counters); not counted.
    """

    def __init__(self, host_tensors: Iterable[torch.Tensor] = ()):
        self.counts: Counter = Counter()
        ignored = {tensor.data_ptr() for tensor in host_tensors}
        self._modes = [_FunctionCounter(self.counts), _DispatchCounter(self.counts, ignored)]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)


def optimizer_host_tensors(optimizer: torch.optim.Optimizer):
    """The optimizer's per-parameter step counters kept on the host (non-capturable Adam,
    AdamW): reading them is no device sync. Empty before the first step creates the state."""
    return [state["step"] for state in optimizer.state.values()
            if torch.is_tensor(state.get("step")) and state["step"].device.type == "cpu"]


def project_site(frames) -> str:
    """The innermost ``opencood/`` frame of ``frames`` (a ``traceback`` StackSummary or frame
    list, outermost first) as ``opencood/path.py:line``, or "" when none is ours. This
    module's own frames (the detector below) are skipped."""
    marker = f"{os.sep}opencood{os.sep}"
    for frame in reversed(frames):
        if marker in frame.filename and frame.filename != __file__:
            return "opencood" + os.sep + frame.filename.rsplit(marker, 1)[1] + f":{frame.lineno}"
    return ""


class HostDataTensors(TorchDispatchMode):
    """``with HostDataTensors() as found: ...`` then ``found.sites``: one
    ``"opencood/file.py:line op"`` per tensor built from host data inside the region.

    On CUDA such a tensor is a host-to-device copy, which a CUDA graph capture refuses
    ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"). On CPU every such
    construction is one op, ``lift_fresh``: ``torch.tensor``/``as_tensor`` of numbers, lists or
    arrays, ``torch.from_numpy``, a Python-list or numpy index (``x[:, [2, 1]]``). Python
    scalars in arithmetic (``x * 2.0``) are not lifted (the kernel takes them as arguments),
    nor are ``torch.full``/``zeros``/``arange`` (made on the device)."""

    _LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}

    def __init__(self):
        super().__init__()
        self.sites: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self._LIFTS:
            self.sites.append(f"{project_site(traceback.extract_stack())} {func}")
        return func(*args, **(kwargs or {}))
