"""Checkpoint files: atomic CPU-only save, ``weights_only`` load, RNG state, compatibility check.

A checkpoint is a plain dict of tensors, numbers, strings and containers, so that
``torch.load(weights_only=True)`` (which refuses arbitrary pickled objects) can read it back.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from opencood.errors import OpencoodError
from opencood.utils.atomic import atomic_write
from opencood.utils.ema import unwrap_model

# Leaf types the weights_only unpickler reads back (containers are walked separately).
_PLAIN_LEAF_TYPES = (torch.Tensor, str, bytes, int, float, bool, complex, type(None),
                     torch.dtype, torch.device)


class CheckpointError(OpencoodError, RuntimeError):
    """A checkpoint file that is missing, unreadable, or does not fit the model."""


# ----------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------

def _to_cpu(value: Any, where: str) -> Any:
    """Copy of ``value`` with every tensor detached on CPU; ``where`` names it in errors."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if type(value) in (dict, OrderedDict):  # subclasses (defaultdict...) would not load back
        moved = type(value)()
        for key, item in value.items():
            moved[key] = _to_cpu(item, f"{where}[{key!r}]")
        if hasattr(value, "_metadata"):  # module state dicts carry version info for loading
            moved._metadata = value._metadata
        return moved
    if isinstance(value, torch.Size):
        return value
    if type(value) in (list, tuple):  # not namedtuples: weights_only refuses them
        return type(value)(_to_cpu(item, f"{where}[{index}]") for index, item in enumerate(value))
    if isinstance(value, np.generic):  # e.g. a numpy float in the resolved config
        return value.item()
    if isinstance(value, _PLAIN_LEAF_TYPES):
        return value
    # Refuse now rather than when resuming: weights_only=True load would reject the whole file.
    raise TypeError(f"checkpoint entry {where} is a {type(value).__name__}, which "
                    "torch.load(weights_only=True) cannot read back; store tensors, numbers, "
                    "strings or containers of them")


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Write ``state`` to ``path`` with every tensor on CPU, atomically.

    The data go to a temporary file in the same folder, are fsynced, then renamed over ``path``:
    a crash or a failed serialization mid-write leaves the previous checkpoint intact, never a
    truncated file. CPU tensors mean the file loads on a machine without (or with other) GPUs.
    """
    state_cpu = _to_cpu(state, "state")
    try:
        with atomic_write(path, "wb", durable=True) as stream:
            torch.save(state_cpu, stream)
    except OSError as error:
        # A full disk or a lost mount: say so in one line; the previous file is untouched.
        raise CheckpointError(f"cannot write checkpoint {os.fspath(path)}: "
                              f"{error.strerror or error}; the previous one is intact") from error


HISTORY_DIR = "checkpoints"


def history_path(run_dir, step: int) -> Path:
    """RUN/checkpoints/step_<step>.pth: one file per save, the newest ``keep`` kept."""
    return Path(run_dir) / HISTORY_DIR / f"step_{step:09d}.pth"


def save_with_history(run_dir, state: dict, step: int, keep: int) -> Path:
    """Save ``state`` as the history file of ``step`` and as RUN/last.pth; drop older history.

    last.pth is a separate copy (not a link), so a damaged last.pth leaves the history file of
    the same step readable: :func:`newest_readable_checkpoint` then loses nothing.
    """
    if keep < 1:
        raise CheckpointError(f"train_params.keep_checkpoints must be >= 1, got {keep}")
    step_file = history_path(run_dir, step)
    save_checkpoint(step_file, state)
    try:
        with open(step_file, "rb") as source, \
                atomic_write(Path(run_dir) / "last.pth", "wb", durable=True) as target:
            shutil.copyfileobj(source, target)
    except OSError as error:
        raise CheckpointError(f"cannot write checkpoint {Path(run_dir) / 'last.pth'}: "
                              f"{error.strerror or error}; the previous one is intact") from error
    for old in history_files(run_dir)[keep:]:
        old.unlink()
    return step_file


def history_files(run_dir) -> list:
    """The history files of a run, newest (highest step) first."""
    return sorted((Path(run_dir) / HISTORY_DIR).glob("step_*.pth"), reverse=True)


def run_checkpoint(run_dir: Path, explicit: str | None = None) -> Path:
    """The checkpoint a run is evaluated or exported from: ``explicit`` when given, else the
    run folder's best.pth, else its last.pth."""
    if explicit:
        return Path(explicit)
    for name in ("best.pth", "last.pth"):
        if (Path(run_dir) / name).is_file():
            return Path(run_dir) / name
    raise CheckpointError(f"{run_dir}: no best.pth or last.pth in the run folder "
                          f"(give --checkpoint FILE)")


def newest_readable_checkpoint(run_dir) -> tuple:
    """(path, state, [(unreadable path, reason), ...]) of the newest checkpoint that loads:
    RUN/last.pth, else the history newest first. (None, None, []) for a run never saved; a
    CheckpointError when files exist and none of them loads."""
    candidates = [Path(run_dir) / "last.pth"] + history_files(run_dir)
    candidates = [path for path in candidates if path.exists()]
    unreadable = []
    for path in candidates:
        try:
            return path, load_checkpoint(path), unreadable
        except CheckpointError as error:
            unreadable.append((path, str(error)))
    if unreadable:
        raise CheckpointError(f"{run_dir}: none of its {len(unreadable)} checkpoints loads "
                              f"(last.pth: {unreadable[0][1]})")
    return None, None, []


# ----------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------

def _first_line(text: str, limit: int = 200) -> str:
    line = next((part.strip() for part in str(text).splitlines() if part.strip()), "")
    return line[:limit]


def _unpickling_problem(error: BaseException) -> str:
    # torch's message is a long paragraph; the useful part is the "Unsupported global" line.
    detail = next((line.strip() for line in str(error).splitlines()
                   if "Unsupported global" in line), _first_line(error))
    # Keep "Unsupported global: GLOBAL pkg.Class was not an allowed global by default", not the
    # advice to allowlist the class that follows it (a checkpoint never needs one).
    detail = detail.replace("WeightsUnpickler error: ", "").split(". Please use")[0]
    return f"it holds objects that torch.load(weights_only=True) refuses ({detail})"


def _file_problem(path: str) -> str | None:
    """Why ``path`` cannot be a checkpoint, judged without unpickling; None if it may be one."""
    if not os.path.exists(path):
        return "no such file"
    if os.path.isdir(path):
        return "it is a directory, not a file"
    if os.path.getsize(path) == 0:
        return "the file is empty"
    if not zipfile.is_zipfile(path):
        # torch.save has written zip archives since 1.6; anything else is truncated or foreign.
        return "not a PyTorch zip archive (truncated, corrupted, or another kind of file)"
    return None


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Read a checkpoint written by :func:`save_checkpoint` with ``weights_only=True``.

    Raises :class:`CheckpointError` with one line naming the file and the problem.
    """
    path = os.fspath(path)
    problem = _file_problem(path)
    if problem is not None:
        raise CheckpointError(f"cannot load checkpoint {path}: {problem}")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise CheckpointError(
            f"cannot load checkpoint {path}: {_unpickling_problem(error)}") from error
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as error:
        raise CheckpointError(f"cannot load checkpoint {path}: unreadable "
                              f"({type(error).__name__}: {_first_line(error)})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"cannot load checkpoint {path}: it holds a "
                              f"{type(state).__name__}, not a checkpoint dict")
    return state


# ----------------------------------------------------------------------------------------------
# RNG state
# ----------------------------------------------------------------------------------------------

def capture_rng_state() -> dict:
    """This process's python, numpy, torch CPU and CUDA (every visible GPU) generator states.

    Stored as tensors, ints and tuples only, so it survives ``weights_only=True``. Each rank has its
    own streams: to resume them all, gather one dict per rank.
    """
    numpy_kind, numpy_keys, numpy_pos, numpy_has_gauss, numpy_gauss = np.random.get_state()
    state = {
        "python": random.getstate(),  # (version, tuple of 625 ints, gauss_next)
        "numpy": {"kind": numpy_kind,
                  "keys": torch.from_numpy(numpy_keys.astype(np.int64)),  # uint32 -> int64
                  "pos": int(numpy_pos), "has_gauss": int(numpy_has_gauss),
                  "cached_gaussian": float(numpy_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict) -> None:
    """Inverse of :func:`capture_rng_state`.

    CUDA states are restored for the GPUs both the checkpoint and this machine have; a GPU run
    resumed on a CPU-only machine simply has no CUDA generators to restore.
    """
    version, internal_state, gauss_next = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal_state), gauss_next))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"],
                         numpy_state["keys"].numpy().astype(np.uint32),
                         int(numpy_state["pos"]), int(numpy_state["has_gauss"]),
                         float(numpy_state["cached_gaussian"])))
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    if torch.cuda.is_available():
        cuda_states = state.get("cuda", [])[:torch.cuda.device_count()]
        for device_index, cuda_state in enumerate(cuda_states):
            torch.cuda.set_rng_state(cuda_state.cpu().to(torch.uint8), device_index)


def rng_state_for_rank(checkpoint: dict, rank: int, world_size: int) -> dict:
    """The generator state ``rank`` resumes from.

    ``rng_per_rank`` holds every rank's :func:`capture_rng_state` (index = rank): with the world
    size it was saved with, each rank takes its own, so a model drawing random numbers per rank
    resumes exactly. With another world size the data partition changes (the run cannot repeat
    the uninterrupted one anyway) and every rank takes rank 0's ``rng``, as with checkpoints
    written before per-rank states were saved.
    """
    per_rank = checkpoint.get("rng_per_rank") or []
    if len(per_rank) == world_size:
        return per_rank[rank]
    return checkpoint["rng"]


# ----------------------------------------------------------------------------------------------
# Model compatibility
# ----------------------------------------------------------------------------------------------

def _listing(items: list[str], limit: int = 3) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... (+{len(items) - limit})" if len(items) > limit else "")


def check_state_dict_compatible(model: nn.Module, state_dict: dict, path: str | os.PathLike
                                ) -> None:
    """Raise :class:`CheckpointError` (one line) unless ``state_dict`` fits ``model`` exactly.

    ``load_state_dict`` reports mismatches as a long multi-line dump; this names the file and the
    first few missing keys, unexpected keys and shape mismatches, which usually reveals a
    checkpoint from another model or config.
    """
    model_state = unwrap_model(model).state_dict()
    missing = [key for key in model_state if key not in state_dict]
    unexpected = [key for key in state_dict if key not in model_state]
    mismatched = [f"{key} {tuple(state_dict[key].shape)} vs model {tuple(tensor.shape)}"
                  for key, tensor in model_state.items()
                  if key in state_dict and hasattr(state_dict[key], "shape")
                  and tuple(state_dict[key].shape) != tuple(tensor.shape)]
    if not (missing or unexpected or mismatched):
        return
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing keys: {_listing(missing)}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected keys: {_listing(unexpected)}")
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatches (checkpoint vs model): "
                        f"{_listing(mismatched)}")
    hint = ""
    if unexpected and all(key.startswith("module.") for key in unexpected):
        hint = " (keys start with 'module.': saved from a DDP-wrapped model; strip the prefix)"
    raise CheckpointError(f"checkpoint {os.fspath(path)} does not fit the model (from another "
                          f"model or config?): {'; '.join(problems)}{hint}")
