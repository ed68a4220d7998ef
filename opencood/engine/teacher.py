"""DiscoNet's teacher: a frozen early-fusion detector whose BEV map of a sample (every agent's raw
points merged in the ego frame) is the distillation target of the student's fused map.

The teacher is a plain object holding a module, not a module itself, so that nothing that walks
the student (``parameters()``, ``state_dict()``, DDP, the EMA, checkpoints) can reach it. It is
loaded with ``weights_only=True``, frozen (``requires_grad_(False)``), kept in eval mode (its
BatchNorm statistics never move) and run under ``no_grad``.

yaml::

    kd:
      teacher: runs/point_pillar_early_fusion   # a run folder (best.pth, else last.pth) or a .pth
      weight: 10000                             # the distillation term's weight
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Mapping

import torch

from opencood.config import ConfigError
from opencood.losses.distillation import feature_distillation_loss
from opencood.models.build import build_model
from opencood.utils.checkpoint import (CheckpointError, check_state_dict_compatible,
                                       load_checkpoint)

TEACHER_FUSION = "early"
TRAIN_HINT = "train it first: python tools/train.py -y <early-fusion yaml> --model_dir <run>"


class FrozenTeacher:
    """A frozen early-fusion detector and the weight of its distillation term.

    Args:
        model: a detector with ``bev_features(inputs) -> (B, C, H, W)`` (``point_pillar``).
        weight: multiplies the distillation loss.
        source: the file it was loaded from, for messages.
    """

    def __init__(self, model: torch.nn.Module, weight: float, source: str):
        self.model = model.requires_grad_(False).eval()
        self.weight = float(weight)
        self.source = source

    @torch.no_grad()
    def bev_features(self, inputs: Dict) -> torch.Tensor:
        """Early-fusion model inputs (one merged cloud per sample) -> (B, C, H, W)."""
        return self.model.bev_features(inputs)

    def distillation_loss(self, student_map: torch.Tensor, teacher_inputs: Dict) -> torch.Tensor:
        """weight x KL(teacher map || student map): student_map (B, C, H, W) -> scalar."""
        teacher_map = self.bev_features(teacher_inputs)
        if teacher_map.shape != student_map.shape:
            # Same on every rank (shapes come from the configs): all ranks stop alike.
            raise ConfigError(f"kd.teacher {self.source}: its BEV map {tuple(teacher_map.shape)} "
                              f"does not match the student's fused map "
                              f"{tuple(student_map.shape)}; the teacher's backbone must have the "
                              f"student's output width and stride")
        return self.weight * feature_distillation_loss(student_map, teacher_map)


def teacher_checkpoint_path(source: str) -> Path:
    """kd.teacher -> the checkpoint file: a .pth as given, a run folder's best.pth else last.pth
    (what tools/eval.py evaluates)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"kd.teacher: {path} does not exist; DiscoNet needs a trained "
                          f"early-fusion teacher ({TRAIN_HINT})")
    if path.is_file():
        return path
    for name in ("best.pth", "last.pth"):
        if (path / name).is_file():
            return path / name
    raise ConfigError(f"kd.teacher: {path} holds no best.pth or last.pth; is it a finished "
                      f"run folder of tools/train.py? ({TRAIN_HINT})")


def _same_values(first, second) -> bool:
    return len(first) == len(second) and all(
        math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
        for a, b in zip(first, second))


def check_teacher_config(teacher_cfg: Mapping, student_preprocess: Mapping, path: Path) -> None:
    """One-line ConfigError unless ``teacher_cfg`` (the checkpoint's whole config) is an
    early-fusion model on the pillar grid of ``student_preprocess`` (the student's
    ``preprocess`` section: the teacher is fed pillars made with the student's settings)."""
    fusion = (teacher_cfg.get("fusion") or {}).get("core_method")
    model_name = (teacher_cfg.get("model") or {}).get("core_method")
    if fusion != TEACHER_FUSION:
        raise ConfigError(f"kd.teacher: {path} holds a {model_name!r} model trained with "
                          f"{fusion!r} fusion; DiscoNet distils from an early-fusion model")
    for key in ("cav_lidar_range", "args.voxel_size"):
        theirs, ours = teacher_cfg["preprocess"], student_preprocess
        for part in key.split("."):
            theirs, ours = theirs[part], ours[part]
        if not _same_values(theirs, ours):
            raise ConfigError(f"kd.teacher: {path} was trained with preprocess.{key} {theirs}, "
                              f"this config has {ours}; the teacher must share the student's "
                              f"pillar grid")


def load_teacher(source: str, weight: float, student_preprocess: Mapping,
                 device: torch.device) -> FrozenTeacher:
    """The teacher named by ``kd.teacher``, on ``device``, frozen. Its EMA weights when its run
    kept an EMA (those are what it validated and is evaluated with)."""
    path = teacher_checkpoint_path(source)
    checkpoint = load_checkpoint(path)                      # weights_only=True
    if "model" not in checkpoint or not isinstance(checkpoint.get("config"), dict):
        raise CheckpointError(f"kd.teacher: {path} is not a checkpoint of tools/train.py (it "
                              f"needs 'model' and 'config' entries)")
    teacher_cfg = checkpoint["config"]
    check_teacher_config(teacher_cfg, student_preprocess, path)
    model = build_model(teacher_cfg["model"])
    state = (checkpoint.get("ema") or {}).get("module") or checkpoint["model"]
    check_state_dict_compatible(model, state, path)
    model.load_state_dict(state)
    return FrozenTeacher(model.to(device), weight, str(path))
