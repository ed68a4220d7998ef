"""HEAL's merge of per-type run folders into one collaboration checkpoint (issue 37 point 5):
``tools/import_checkpoint.py --from heal FINAL_RUN --merge RUN [RUN ...]``.

HEAL trains a collaboration base (stage one, ``heter_pyramid_collab``), aligns each new type
alone against it (stage two, ``heter_pyramid_single``) and assembles the collaboration model
with ``opencood/tools/heal_tools.py merge_final ALIGNED... BASE OUT`` (its README: the aligned
runs first, the base second to last, the folder holding the final ``config.yaml`` last); its
``merge SINGLE STAGE1 OUT`` is the same fold over two runs. Each run's checkpoint is the one
its ``get_model_path_from_dir`` picks (the bestval file, else the highest epoch:
:func:`pick_heal_checkpoint`), and the fold (``merge_dict``) is: keep what was merged so far
except keys naming a late model's own parts (``layers_m``, ``head_m``, ``shrink_conv_m``
anywhere in the key), then put every tensor of the next run over it. So the last run (the base)
gives the shared fusion and heads, and each aligned run its own type's encoder, backbone and
aligner. :func:`merged_heal_state` is that fold, and remembers which file each tensor came from.

Unlike HEAL's final inference (``load_state_dict(strict=False)``), the import is strict:
:func:`check_merged_keys` names, in one line, a merged tensor the final model has no place
for (with the file it came from), one whose shape differs, or a key of the model no run holds
(tools/reference/make_heal_merge_fixture.py runs HEAL's own merge on the test's folders).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, Mapping, Sequence, Tuple

import torch

from opencood.interop.heal import pick_heal_checkpoint
from opencood.interop.opencood_ckpt import InteropError, _listing
from opencood.utils.checkpoint import load_checkpoint

# HEAL's merge_dict drops these from what was merged before each next run (a late model's own
# layers, heads and shrink): a substring test, as HEAL's
LATE_OWN_PARTS = ("layers_m", "head_m", "shrink_conv_m")


def merged_heal_state(run_dirs: Sequence) -> Tuple[Dict[str, torch.Tensor], Dict[str, str]]:
    """(HEAL's merged state dict, key -> the checkpoint file its tensor came from) of
    ``run_dirs`` in HEAL's order (the base last); module doc."""
    if not run_dirs:
        raise InteropError("--merge: give the run folders to merge (the base last)")
    state: Dict[str, torch.Tensor] = {}
    origin: Dict[str, str] = {}
    for run_dir in run_dirs:
        run_dir = Path(run_dir)
        if not run_dir.is_dir():
            raise InteropError(f"{run_dir}: not a folder (give HEAL run folders to --merge)")
        path, _ = pick_heal_checkpoint(run_dir, None)
        loaded = load_checkpoint(path)
        state = {key: value for key, value in state.items()
                 if not any(part in key for part in LATE_OWN_PARTS)}
        for key, value in loaded.items():
            if not isinstance(value, torch.Tensor):
                raise InteropError(f"{path}: entry {key!r} is a {type(value).__name__}, not a "
                                   "tensor: not a HEAL state dict")
            state[key] = value
            origin[key] = str(path)
    return state, {key: origin[key] for key in state}


def check_merged_keys(state: Mapping[str, torch.Tensor], origin: Mapping[str, str],
                      expected: Mapping[str, Tuple[int, ...]], what: str) -> None:
    """Every merged tensor has a key of HEAL's model ``expected`` (key -> shape) and its
    shape, and every key of it is held; else one line naming the key and its file."""
    for key, tensor in state.items():
        if key not in expected:
            raise InteropError(f"{origin[key]}: {key} has no place in {what} (merged with "
                               f"--merge)")
        if tuple(tensor.shape) != tuple(expected[key]):
            raise InteropError(f"{origin[key]}: {key} {tuple(tensor.shape)} does not fit "
                               f"{tuple(expected[key])} of {what}")
    missing = [key for key in expected if key not in state]
    if missing:
        files = sorted(set(origin.values()))
        raise InteropError(f"{what}: {len(missing)} of its tensors are in none of the merged "
                           f"checkpoints ({', '.join(files)}): {_listing(missing)}")
