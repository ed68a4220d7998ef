"""A run folder of OpenCOOD, HEAL, CoAlign, V2V4Real, V2X-Real or QuantV2X -> one of ours that ``tools/eval.py --model_dir``
evaluates (issue 24). Each codebase is a :class:`Codebase`: its config translation
(``opencood_config``, ``heal``, ``coalign``, ``v2v4real``, ``v2xreal``, ``quantv2x``), its checkpoint choice (as its own
``load_saved_model`` picks) and its key rules (``opencood_ckpt``, ``heal``).

OpenCOOD's ``train.py`` leaves ``config.yaml`` (``yaml.dump`` of its parsed hypes) and
``net_epoch<N>.pth`` files, each a bare state dict; ``latest.pth`` when something wrote one. The
checkpoint taken is the one OpenCOOD's own ``load_saved_model`` (which its inference uses) would
load: ``latest.pth`` when present, else the highest ``net_epoch<N>.pth``; ``--checkpoint``
names another.

The run folder written: ``config.yaml`` (our resolved config, ``opencood.config.save_config``)
and ``last.pth`` (``{"model": state_dict, "epoch": N, "imported_from": {...}}``, written by
``opencood.utils.checkpoint.save_checkpoint``). Everything is checked (config translated and
validated, every tensor placed, see ``opencood_ckpt``) before anything is written, the files go
to a hidden temporary folder beside the destination, and one rename publishes it: on any error
nothing is left behind, and an existing destination is never touched.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from opencood.config import ConfigError, resolve, save_config
from opencood.interop.coalign import coalign_notes, coalign_rules, translate_coalign_config
from opencood.interop.heal import (heal_notes, heal_rules, heal_unused_keys, pick_heal_checkpoint,
                                   translate_heal_config)
from opencood.interop.heal_heter_run import is_heal_heter, translate_heal_heter_run
from opencood.interop.opencood_ckpt import (InteropError, peer_state_to_ours, rules_for,
                                            strip_ddp_prefix,
                                            state_shapes)
from opencood.interop.opencood_config import read_opencood_yaml, translate_config
from opencood.interop.v2v4real import translate_v2v4real_config
from opencood.interop.quantv2x import (quantv2x_notes, quantv2x_rules, quantv2x_unused_keys,
                                       translate_quantv2x_config)
from opencood.interop.v2xreal import translate_v2xreal_config, v2xreal_rules
from opencood.utils.checkpoint import load_checkpoint, save_checkpoint

EPOCH_FILE = re.compile(r"net_epoch(\d+)\.pth")


def pick_opencood_checkpoint(peer_dir: Path, explicit: Optional[str]) -> Tuple[Path, int]:
    """(checkpoint path, epoch or -1 when unknown), as OpenCOOD's load_saved_model picks."""
    if explicit:
        path = Path(explicit)
        match = EPOCH_FILE.fullmatch(path.name)
        return path, int(match.group(1)) if match else -1
    epochs = sorted((int(m.group(1)), p) for p in peer_dir.iterdir()
                    if (m := EPOCH_FILE.fullmatch(p.name)))
    if (peer_dir / "latest.pth").exists():
        return peer_dir / "latest.pth", epochs[-1][0] if epochs else -1
    if not epochs:
        raise InteropError(f"{peer_dir}: no net_epoch<N>.pth or latest.pth (give --checkpoint "
                           "FILE)")
    epoch, path = epochs[-1]
    return path, epoch


def our_state_shapes(model_cfg: dict) -> dict:
    """State-dict shapes of our model for ``model_cfg``, built on the meta device (no memory,
    no initialisation)."""
    from opencood.models.build import build_model
    with torch.device("meta"):
        model = build_model(model_cfg)
    return state_shapes(model.state_dict())


def pick_v2v4real_checkpoint(peer_dir: Path, explicit: Optional[str]) -> Tuple[Path, int]:
    """(checkpoint, epoch) as V2V4Real's load_saved_model picks: the highest net_epoch<N>
    (it never reads latest.pth)."""
    if explicit:
        return pick_opencood_checkpoint(peer_dir, explicit)
    epochs = sorted((int(m.group(1)), p) for p in peer_dir.iterdir()
                    if (m := EPOCH_FILE.fullmatch(p.name)))
    if not epochs:
        raise InteropError(f"{peer_dir}: no net_epoch<N>.pth (give --checkpoint FILE)")
    return epochs[-1][1], epochs[-1][0]


@dataclass(frozen=True)
class Codebase:
    """How one codebase's run folder is read: its config translation, its checkpoint choice,
    its key rules and its model name (for messages and provenance)."""

    name: str
    display: str
    translate_config: Callable[[dict, str], dict]
    pick_checkpoint: Callable[[Path, Optional[str]], Tuple[Path, int]]
    rules: Callable[[dict, str], tuple]
    model_name: Callable[[dict], str]
    notes: Callable[[dict], List[str]] = lambda data: []
    # key prefixes of the peer's state dict its forward never runs (HEAL's EfficientNet
    # classifier): dropped before the strict match, nothing else is
    unused_keys: Callable[[dict], Tuple[str, ...]] = lambda data: ()


def _opencood_rules(data: dict, source: str) -> tuple:
    return rules_for(str(data["model"]["core_method"]), source)


def _heal_model_name(data: dict) -> str:
    return f"heter_model_baseline/{data['model']['args']['fusion_method']}"


CODEBASES: Dict[str, Codebase] = {
    "opencood": Codebase("opencood", "OpenCOOD", translate_config, pick_opencood_checkpoint,
                         _opencood_rules, lambda data: str(data["model"]["core_method"])),
    "v2v4real": Codebase("v2v4real", "V2V4Real", translate_v2v4real_config, pick_v2v4real_checkpoint,
                         _opencood_rules, lambda data: str(data["model"]["core_method"])),
    "heal": Codebase("heal", "HEAL", translate_heal_config, pick_heal_checkpoint, heal_rules,
                     _heal_model_name, heal_notes, heal_unused_keys),
    # V2X-Real's load_saved_model is OpenCOOD's (latest.pth, else the highest net_epoch<N>)
    "v2xreal": Codebase("v2xreal", "V2X-Real", translate_v2xreal_config,
                        pick_opencood_checkpoint, v2xreal_rules,
                        lambda data: str(data["model"]["core_method"])),
    # QuantV2X is HEAL's code base (its checkpoint choice); its V2X-Real runs multi-class
    "quantv2x": Codebase("quantv2x", "QuantV2X", translate_quantv2x_config,
                         pick_heal_checkpoint, quantv2x_rules,
                         lambda data: str(data["model"]["core_method"]), quantv2x_notes,
                         quantv2x_unused_keys),
    # CoAlign's train.py saves and its load_saved_model picks as HEAL's
    "coalign": Codebase("coalign", "CoAlign", translate_coalign_config, pick_heal_checkpoint,
                        coalign_rules, lambda data: str(data["model"]["core_method"]),
                        coalign_notes),
}


def translate_run(peer_dir, checkpoint: Optional[str] = None, codebase: str = "opencood",
                  merge: Optional[List] = None) -> Tuple[dict, dict, dict]:
    """(our resolved config, our state dict, provenance) for a run folder of ``codebase``
    (opencood, heal, coalign, v2v4real, v2xreal, quantv2x); writes nothing. Raises an OpencoodError (one line) on anything
    it cannot translate. ``provenance["notes"]``: differences the import cannot remove.
    ``merge``: HEAL's heterogeneous runs only, the run folders its ``merge_final`` assembles
    (the base last), whose merged weights replace ``peer_dir``'s checkpoint
    (``opencood.interop.heal_merge``).

    (The translation only writes registered model, fusion, loss and post-processor names, so
    ``engine.recipe.check_registered_names`` is not needed.)
    """
    if codebase not in CODEBASES:
        raise InteropError(f"codebase {codebase!r} unknown ({', '.join(CODEBASES)})")
    peer_format = CODEBASES[codebase]
    peer_dir = Path(peer_dir)
    if not peer_dir.is_dir():
        raise InteropError(f"{peer_dir}: not a folder (give a {peer_format.display} run "
                           "folder)")
    config_path = peer_dir / "config.yaml"
    peer = read_opencood_yaml(config_path)
    source = str(config_path)
    if merge and checkpoint:
        raise InteropError("give --checkpoint or --merge, not both (--merge picks each run's "
                           "checkpoint as HEAL's merge does)")
    if codebase == "heal" and is_heal_heter(peer):
        cfg, ours, provenance = translate_heal_heter_run(peer_dir, peer, source, checkpoint,
                                                       our_state_shapes, merge)
        provenance["notes"] += validation_as_test_notes(peer, cfg, source)
        return cfg, ours, provenance
    if merge:
        raise InteropError(f"{source}: --merge assembles HEAL's heterogeneous runs "
                           "(heter_pyramid_collab, heter_pyramid_single, heter_model_late); "
                           f"this is {peer_format.display}'s {peer_format.model_name(peer)}")
    try:
        cfg = resolve(peer_format.translate_config(peer, source), f"{source} (translated)")
    except ConfigError as error:
        raise InteropError(str(error)) from None
    rules = peer_format.rules(peer, source)
    model_name = peer_format.model_name(peer)
    path, epoch = peer_format.pick_checkpoint(peer_dir, checkpoint)
    unused = peer_format.unused_keys(peer)
    state = {key: value for key, value in strip_ddp_prefix(load_checkpoint(path)).items()
             if not (unused and key.startswith(unused))}
    ours = peer_state_to_ours(state, rules, our_state_shapes(cfg["model"]), str(path),
                              f"our model (for {peer_format.display}'s {model_name})")
    provenance = {"codebase": codebase, "run_dir": str(peer_dir.resolve()),
                  "checkpoint": str(Path(path).resolve()), "model": model_name,
                  "notes": peer_format.notes(peer) + validation_as_test_notes(peer, cfg, source)}
    return cfg, ours, {"epoch": epoch, **provenance}


def validation_as_test_notes(peer: dict, cfg: dict, source: str) -> List[str]:
    """A note when the peer's config names no ``test_dir`` and the translation made its
    ``validate_dir`` our test split (what OpenCOOD's inference evaluates): ``tools/eval.py
    --split test`` then scores the validation folder unless told another."""
    if isinstance(peer.get("test_dir"), str) or not isinstance(cfg.get("test_dir"), str):
        return []
    return [f"{source} names no test_dir: the test split is its validate_dir "
            f"{cfg['test_dir']} (the folder its own inference evaluates); give tools/eval.py "
            f"--set test_dir=PATH to evaluate a test folder"]


@contextlib.contextmanager
def staged_folder(out_dir: Path, purpose: str) -> Iterator[Path]:
    """Yield a hidden staging folder beside ``out_dir`` (which must not exist yet); when the
    block ends it becomes ``out_dir`` in one rename, and on any error it is removed: a reader
    never sees a half-written folder, and a failed ``purpose`` (import, export) leaves nothing
    behind."""
    if out_dir.exists():
        raise InteropError(f"{out_dir}: already exists; give a new folder for the {purpose}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = out_dir.with_name(f".{out_dir.name}.{purpose}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        staging.mkdir()
        yield staging
        try:
            os.rename(staging, out_dir)
        except OSError as error:
            raise InteropError(f"{out_dir}: cannot create the folder "
                               f"({error.strerror or error})") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def import_run(peer_dir, out_dir, checkpoint: Optional[str] = None,
               codebase: str = "opencood", merge: Optional[List] = None
               ) -> Tuple[Path, List[str]]:
    """Translate ``peer_dir`` (a run folder of ``codebase``; ``merge``: :func:`translate_run`)
    and write our run folder ``out_dir`` (must not exist yet). Returns (out_dir, notes)."""
    cfg, state, provenance = translate_run(peer_dir, checkpoint, codebase, merge)
    with staged_folder(Path(out_dir), "import") as staging:
        save_config(cfg, staging / "config.yaml")
        save_checkpoint(staging / "last.pth", {"model": state, "epoch": provenance["epoch"],
                                               "imported_from": provenance})
    return Path(out_dir), provenance["notes"]


def import_opencood_run(peer_dir, out_dir, checkpoint: Optional[str] = None) -> Path:
    """:func:`import_run` of an OpenCOOD run folder; returns ``out_dir``."""
    return import_run(peer_dir, out_dir, checkpoint, "opencood")[0]
