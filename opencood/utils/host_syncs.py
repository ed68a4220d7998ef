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

``CaptureHazards`` records the same ops, and what else a CUDA graph capture refuses (a tensor
built from host data or by a factory without a device, a copy between devices, ``.cpu()``, a
random op with its own generator), each with the ``opencood/file.py:line`` that runs it: the
check of the captured step (``engine.cuda_graph``), whose failed capture names no line itself.
"""
from __future__ import annotations

import os
import traceback
from collections import Counter
from typing import Iterable, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


def value_dependent_kind(func, args, kwargs) -> Optional[str]:
    """The kind (a key of ``HostSyncCounter.counts``) of an aten call whose result needs the
    tensor's values on the host (a device sync on CUDA), or None."""
    if func is aten._local_scalar_dense.default:
        return "item"
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


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: Counter, ignored_ptrs: set):
        super().__init__()
        self.counts, self.ignored_ptrs = counts, ignored_ptrs

    def kind(self, func, args, kwargs) -> Optional[str]:
        if func is aten._local_scalar_dense.default and args[0].data_ptr() in self.ignored_ptrs:
            return None
        return value_dependent_kind(func, args, kwargs)

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


class _Modes:
    """Enters and leaves ``self._modes`` (a function mode, then a dispatch mode) as one."""
    _modes: list

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc_info)


class HostSyncCounter(_Modes):
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


class CaptureHazards(_Modes):
    """``with CaptureHazards() as found: ...`` then ``found.sites``: one
    ``"opencood/file.py:line kind (op)"`` per call inside the region that a CUDA graph capture
    refuses, named by the innermost ``opencood/`` frame of its stack (``?`` when none). The
    capture's own error names none of them: it is raised at the end of ``torch.cuda.graph``
    ("operation failed due to a previous error during capture"). The same ops run on CPU, so
    the recorded step is checked here without a GPU. Kinds:

    ``host_to_device``  a tensor built from host data (``aten.lift_fresh``: ``torch.tensor``/
                        ``as_tensor`` of numbers, lists or arrays, ``from_numpy``, a Python-list
                        or numpy index ``x[:, [2, 1]]``), copied to the device on CUDA. Python
                        scalars in arithmetic (``x * 2.0``) are kernel arguments, not lifted;
                        ``torch.full``/``zeros``/``arange`` are made on the device;
    ``item``, ``nonzero``, ``unique``, ``masked_select``, ``boolean_index``,
    ``repeat_interleave``  a device sync (``value_dependent_kind``; ``_foreach_lerp_`` with a 0-d
                        tensor weight is an ``item`` too: it takes a Scalar);
    ``device_copy``     an aten copy between two devices, or (on a GPU run of the detector) a
                        device op given a host tensor, e.g. an index;
    ``cpu``, ``numpy``, ``tolist``, ``pin_memory``  host reads or pinning, seen at the Python
                        level (on CPU ``.cpu()`` dispatches nothing);
    ``generator``       a random op with its own ``generator=`` (not registered with the graph);
    ``host_factory``    ``torch.zeros``/``full``/``arange``/... without ``device=``: made on the
                        host on CUDA too (then copied, or mixed with device tensors).

    ``host_tensors``: tensors that stay on the host on CUDA too (the non-capturable Adam's
    step counters), whose ``.item()`` is no sync. ``device``: on a GPU run, the device the step
    runs on (only its type matters): an op on host tensors alone is no hazard there (a copy to
    the device is); None or the CPU, every op counts (the CPU stands in for the device). Not seen:
    ``torch.cuda.synchronize`` and stream waits (no tensor op; the step calls none)."""

    def __init__(self, host_tensors: Iterable[torch.Tensor] = (),
                 device: Optional[torch.device] = None):
        self.sites: List[str] = []
        ignored = {tensor.data_ptr() for tensor in host_tensors}
        gpu_run = device is not None and device.type != "cpu"
        on_device = _OnDevice(device.type if gpu_run else None)
        self._modes = [_HazardFunctions(self._record, on_device),
                       _HazardOps(self._record, ignored, on_device)]

    def _record(self, kind: str, func) -> None:
        site = project_site(traceback.extract_stack()) or "?"
        self.sites.append(f"{site} {kind} ({func if isinstance(func, str) else func})")


_LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_PYTHON_HAZARDS = {"cpu", "numpy", "tolist", "pin_memory"}
# Tensors made from sizes or numbers: on the host unless given a device.
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.linspace,
              torch.eye, torch.rand, torch.randn, torch.randint, torch.randperm,
              torch.scalar_tensor, torch.empty_strided}


def _same_device(target: Optional[torch.device], source: torch.device) -> bool:
    """Whether a copy to ``target`` (None: no device given) stays on ``source``'s device;
    ``cuda`` without an index is the tensor's own GPU."""
    if target is None:
        return True
    return target.type == source.type and (target.index is None or source.index is None
                                           or target.index == source.index)


class _OnDevice:
    """Whether a call's tensors include one on the device of type ``device_type`` (always
    True for None: every tensor stands for a device tensor)."""

    def __init__(self, device_type: Optional[str]):
        self.device_type = device_type

    def __call__(self, args, kwargs) -> bool:
        return self.device_type is None or any(
            torch.is_tensor(leaf) and leaf.device.type == self.device_type
            for leaf in tree_leaves((args, kwargs)))

    def host_operand(self, args, kwargs) -> bool:
        """On a GPU run, a host tensor of one dimension or more in a device op (an index
        ``x[host_indices]``: the op copies it to the device itself)."""
        return self.device_type is not None and any(
            torch.is_tensor(leaf) and leaf.device.type == "cpu" and leaf.dim() > 0
            for leaf in tree_leaves((args, kwargs)))


class _HazardOps(TorchDispatchMode):
    def __init__(self, record, ignored_ptrs: set, on_device: _OnDevice):
        super().__init__()
        self.record, self.ignored_ptrs, self.on_device = record, ignored_ptrs, on_device

    def kind(self, func, args, kwargs) -> Optional[str]:
        if func is aten._to_copy.default and not _same_device(kwargs.get("device"),
                                                              args[0].device):
            return "device_copy"
        if func is aten.copy_.default and not _same_device(args[0].device, args[1].device):
            return "device_copy"
        if not self.on_device(args, kwargs):
            return None
        if func in _LIFTS:
            return "host_to_device"
        if self.on_device.host_operand(args, kwargs):
            return "device_copy"
        if func is aten._local_scalar_dense.default and args[0].data_ptr() in self.ignored_ptrs:
            return None
        kind = value_dependent_kind(func, args, kwargs)
        if kind is not None:
            return kind
        if kwargs.get("generator") is not None:
            return "generator"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self.kind(func, args, kwargs)
        if kind is not None:
            self.record(kind, func)
        return func(*args, **kwargs)


class _HazardFunctions(TorchFunctionMode):
    def __init__(self, record, on_device: _OnDevice):
        super().__init__()
        self.record, self.on_device = record, on_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in _PYTHON_HAZARDS and self.on_device(args[:1], {}):
            self.record(name, f"Tensor.{name}")
        elif func in _FACTORIES and kwargs.get("device") is None:
            self.record("host_factory", f"torch.{name}")
        return func(*args, **kwargs)
