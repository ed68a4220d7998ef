"""An OpenCOOD run folder -> one of ours that ``tools/eval.py --model_dir`` evaluates (issue 24).

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
from pathlib import Path
from typing import Iterator, Optional, Tuple

import torch

from opencood.config import ConfigError, resolve, save_config
from opencood.interop.opencood_ckpt import InteropError, opencood_to_ours, state_shapes
from opencood.interop.opencood_config import read_opencood_yaml, translate_config
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


def translate_run(peer_dir, checkpoint: Optional[str] = None) -> Tuple[dict, dict, dict]:
    """(our resolved config, our state dict, provenance) for an OpenCOOD run folder; writes
    nothing. Raises an OpencoodError (one line) on anything it cannot translate.

    (The translation only writes registered model, fusion, loss and post-processor names, so
    ``engine.recipe.check_registered_names``, whose import pulls in torchvision, is not needed.)
    """
    peer_dir = Path(peer_dir)
    if not peer_dir.is_dir():
        raise InteropError(f"{peer_dir}: not a folder (give an OpenCOOD run folder)")
    config_path = peer_dir / "config.yaml"
    peer = read_opencood_yaml(config_path)
    source = str(config_path)
    try:
        cfg = resolve(translate_config(peer, source), f"{source} (translated)")
    except ConfigError as error:
        raise InteropError(str(error)) from None
    path, epoch = pick_opencood_checkpoint(peer_dir, checkpoint)
    state = load_checkpoint(path)
    ours = opencood_to_ours(state, peer["model"]["core_method"], our_state_shapes(cfg["model"]),
                            source=str(path))
    provenance = {"codebase": "opencood", "run_dir": str(peer_dir.resolve()),
                  "checkpoint": str(Path(path).resolve()),
                  "model": str(peer["model"]["core_method"])}
    return cfg, ours, {"epoch": epoch, **provenance}


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


def import_opencood_run(peer_dir, out_dir, checkpoint: Optional[str] = None) -> Path:
    """Translate ``peer_dir`` and write our run folder ``out_dir`` (must not exist yet)."""
    cfg, state, provenance = translate_run(peer_dir, checkpoint)
    with staged_folder(Path(out_dir), "import") as staging:
        save_config(cfg, staging / "config.yaml")
        save_checkpoint(staging / "last.pth", {"model": state, "epoch": provenance["epoch"],
                                               "imported_from": provenance})
    return Path(out_dir)
