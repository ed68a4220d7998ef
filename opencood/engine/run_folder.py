"""A run folder belongs to one config: its ``config.yaml``, written when the run started.

* ``--hypes_yaml X --model_dir RUN`` on a folder that already holds a config resumes it only when
  X (with its ``--set`` overrides) resolves to that same config; otherwise it is refused in one
  line (:func:`refuse_another_config`), before anything is read or written. Without the check the
  folder would silently resume another model's weights under its old config.yaml.
* ``--model_dir RUN --set train_params.K=V`` (a resume from the folder's own config) is held to the
  same rule for ``train_params``: a key other than the schedule's (the batch, gradient clipping,
  agents per sample, skipped steps) is refused in one line (:func:`refuse_training_changes`).
  Other sections stay settable there: data folders move, and a changed model is refused by its
  checkpoint's shapes.
* Schedule keys (:data:`SCHEDULE_KEYS`: how long to train, how often to validate and save, loader
  workers) may change on resume; the run's next checkpoint save records them in config.yaml
  (:func:`record_schedule`), so the folder says what the run did.
* A resumed run with nothing left to train says so in one line (:func:`say_if_finished`).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict, Mapping

from opencood.config import ConfigError, get_key, load_config, replaced, save_config

logger = logging.getLogger("opencood")

# What a resume may change: the length of the run, how often it validates and saves, how many
# loader workers it uses. Nothing that changes what the weights learn step by step.
SCHEDULE_KEYS = ("train_params.epoches", "train_params.max_steps", "train_params.eval_freq",
                 "train_params.save_freq", "train_params.checkpoint_every_steps",
                 "train_params.checkpoint_every_minutes", "train_params.keep_checkpoints",
                 "train_params.num_workers")
DIFFERENCES_SHOWN = 3
_ABSENT = object()


def config_differences(saved: Mapping, new: Mapping, prefix: str = "") -> list:
    """Dotted keys whose values differ between two resolved configs: ``saved``'s key order first,
    then keys only ``new`` has."""
    keys = list(saved) + [key for key in new if key not in saved]
    differing = []
    for key in keys:
        old_value, new_value = saved.get(key, _ABSENT), new.get(key, _ABSENT)
        if isinstance(old_value, Mapping) and isinstance(new_value, Mapping):
            differing += config_differences(old_value, new_value, f"{prefix}{key}.")
        elif old_value != new_value:
            differing.append(f"{prefix}{key}")
    return differing


def _short(value, limit: int = 40) -> str:
    text = "absent" if value is _ABSENT else repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def refuse_another_config(cfg: Dict, hypes_yaml: str, run_dir) -> None:
    """Raise a one-line ConfigError when ``run_dir`` holds a config.yaml that ``cfg`` (resolved
    from ``hypes_yaml`` and its ``--set`` overrides) differs from in other than schedule keys."""
    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file():
        return                                     # a new run folder (or one never started)
    saved = load_config(saved_path)
    differing = [key for key in config_differences(saved, cfg) if key not in SCHEDULE_KEYS]
    if not differing:
        return
    raise ConfigError(
        f"--hypes_yaml {hypes_yaml} is not the config of run folder {run_dir} ({saved_path}: "
        f"{_differences_line(saved, cfg, differing)}): give another --model_dir to start a new "
        f"run, or leave out --hypes_yaml to resume this one")


def _differences_line(saved: Mapping, cfg: Mapping, differing: list) -> str:
    """'key A there, B here; ...' of the first DIFFERENCES_SHOWN keys, and how many more."""
    shown = "; ".join(f"{key} {_short(get_key(saved, key, _ABSENT))} there, "
                      f"{_short(get_key(cfg, key, _ABSENT))} here"
                      for key in differing[:DIFFERENCES_SHOWN])
    more = len(differing) - DIFFERENCES_SHOWN
    return f"{shown}{f'; and {more} more keys' if more > 0 else ''}"


def refuse_training_changes(cfg: Dict, run_dir) -> None:
    """Raise a one-line ConfigError when ``cfg`` (the run folder's config.yaml with a resume's
    ``--set`` overrides) changes a ``train_params`` key that is not a schedule key."""
    saved_path = Path(run_dir) / "config.yaml"
    saved = load_config(saved_path)
    differing = [key for key in config_differences(saved, cfg)
                 if key.startswith("train_params.") and key not in SCHEDULE_KEYS]
    if differing:
        raise ConfigError(
            f"--set changes how run folder {run_dir} trains ({saved_path}: "
            f"{_differences_line(saved, cfg, differing)}): a resume may change only the "
            f"schedule ({', '.join(key.split('.')[1] for key in SCHEDULE_KEYS)}); give another "
            f"--model_dir to start a new run")


def record_schedule(run_dir, cfg: Dict) -> list:
    """Write ``cfg``'s schedule keys into RUN/config.yaml where they differ (a resume with
    ``--set train_params.epoches=N``); returns the keys written. Rank 0, when it saves a
    checkpoint: a resume that fails before its first save leaves the folder as it was."""
    saved_path = Path(run_dir) / "config.yaml"
    if not saved_path.is_file():
        return []
    saved = load_config(saved_path)
    changed = [key for key in SCHEDULE_KEYS if get_key(saved, key) != get_key(cfg, key)]
    for key in changed:
        logger.info("%s: %s %s -> %s (set on resume)", saved_path, key, get_key(saved, key),
                    get_key(cfg, key))
    if changed:
        save_config(replaced(saved, {key: get_key(cfg, key) for key in changed},
                             str(saved_path)), saved_path)
    return changed


def say_if_finished(run_dir, epoch: int, step: int, epochs: int, total_steps: int) -> bool:
    """Log one line when a resumed run has nothing left to train; returns whether it has not."""
    if step < total_steps and epoch < epochs:
        return False
    logger.info("run %s already finished (epoch %d of %d, step %d of %d): nothing to train; "
                "--set train_params.epoches (or max_steps) higher to train on", run_dir, epoch,
                epochs, step, total_steps)
    return True
