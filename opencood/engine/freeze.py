"""Frozen parts of a model (``train_params.fix_modules``): HEAL's backward alignment as a config.

HEAL's stage two trains a new agent type's encoder, backbone and aligner against the fusion
network and heads of a trained base, which stay fixed: ``HeterPyramidSingle.fix_modules`` (its
pyramid fusion, shrink header and heads) get ``requires_grad`` off and their BatchNorm layers
``eval()`` (``fix_bn``), re-applied by its train scripts after every ``model.train()``
(``model_train_init``). Here the list is a config key of any model, naming parameter-name
prefixes on module boundaries (``pyramid``, ``head``, ``branches.m1``; see
docs/heterogeneous.md for HEAL's list in our names):

* frozen parameters get ``requires_grad`` False before DDP wraps the model, so DDP neither
  reduces them nor looks for them (no ``find_unused_parameters``), and they are left out of the
  optimizer (no moments, no weight decay);
* BatchNorm layers inside a frozen part run in eval mode (running statistics used, never
  updated): :func:`train_keeping_frozen` is the trainer's ``model.train()``;
* a resumed run reads the same list from its folder's config.yaml, so it freezes the same set;
* a new run starts from the base's weights with ``init.checkpoint`` (:func:`load_base_weights`:
  HEAL's stage two loads the base's checkpoint non-strictly); every tensor of a frozen part must
  come from it, or the run would keep freshly initialised weights fixed.
"""
from __future__ import annotations

import logging
from typing import List, Sequence

import torch

from opencood.config import ConfigError
from opencood.utils.checkpoint import CheckpointError, load_checkpoint

logger = logging.getLogger("opencood")

FIX_MODULES_KEY = "train_params.fix_modules"


def under_prefix(name: str, prefix: str) -> bool:
    """Whether the dotted ``name`` is ``prefix`` or lies inside it (``head`` holds
    ``head.cls_conv.weight``, not ``heads.x``)."""
    return name == prefix or name.startswith(prefix + ".")


def freeze_parameters(model: torch.nn.Module, prefixes: Sequence[str]) -> List[str]:
    """Turn ``requires_grad`` off for every parameter under one of ``prefixes`` and return
    their names; a prefix matching no parameter is a ConfigError naming it and the key, and so
    is a list that freezes everything (nothing would be left to train)."""
    names = [name for name, _ in model.named_parameters()]
    for prefix in prefixes:
        if not any(under_prefix(name, prefix) for name in names):
            raise ConfigError(f"{FIX_MODULES_KEY}: {prefix!r} matches no parameter of the "
                              f"model (its parts: {', '.join(top_level_parts(names))})")
    frozen = [name for name in names if any(under_prefix(name, prefix) for prefix in prefixes)]
    if prefixes and len(frozen) == len(names):
        raise ConfigError(f"{FIX_MODULES_KEY}: {list(prefixes)} freezes every parameter of the "
                          "model, nothing is left to train")
    frozen_set = set(frozen)
    for name, param in model.named_parameters():
        if name in frozen_set:
            param.requires_grad_(False)
    return frozen


def top_level_parts(names: Sequence[str]) -> List[str]:
    """The first two name levels of ``names``, sorted: what a prefix usually names."""
    return sorted({".".join(name.split(".")[:2]) for name in names})


def frozen_batchnorms(model: torch.nn.Module, prefixes: Sequence[str]):
    """The BatchNorm layers (SyncBN included) of ``model`` inside a frozen part."""
    return [module for name, module in model.named_modules()
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            and any(under_prefix(name, prefix) for prefix in prefixes)]


def train_keeping_frozen(model: torch.nn.Module, bare_model: torch.nn.Module,
                         prefixes: Sequence[str]) -> None:
    """``model.train()`` (``model`` may be DDP- or compile-wrapped around ``bare_model``), then
    the frozen parts' BatchNorm layers back to eval: HEAL's ``model_train_init`` after train()."""
    model.train()
    for batchnorm in frozen_batchnorms(bare_model, prefixes):
        batchnorm.eval()


def load_base_weights(model: torch.nn.Module, path: str, prefixes: Sequence[str]) -> None:
    """Load every tensor of checkpoint ``path`` (``init.checkpoint``) that ``model`` has, by name
    (HEAL's non-strict load of the base for its stage two); tensors only the model has keep their
    initialisation. One line (CheckpointError) for a shape that differs or a frozen part's
    (``prefixes``) tensor the checkpoint lacks."""
    saved = load_checkpoint(path)["model"]
    own = model.state_dict()
    mismatched = [f"{key} {tuple(saved[key].shape)} vs model {tuple(tensor.shape)}"
                  for key, tensor in own.items()
                  if key in saved and tuple(saved[key].shape) != tuple(tensor.shape)]
    if mismatched:
        raise CheckpointError(f"init.checkpoint {path}: {len(mismatched)} tensors of another "
                              f"shape: {', '.join(mismatched[:3])}")
    unfilled = [key for key in own if key not in saved
                and any(under_prefix(key, prefix) for prefix in prefixes)]
    if unfilled:
        raise CheckpointError(f"init.checkpoint {path} lacks {len(unfilled)} tensors of the "
                              f"parts {FIX_MODULES_KEY} freezes: {', '.join(unfilled[:3])}")
    model.load_state_dict({key: saved[key] for key in own if key in saved}, strict=False)
    logger.info("init.checkpoint %s: %d tensors loaded, %d initialised afresh, %d of the file "
                "not in the model", path, sum(key in saved for key in own),
                sum(key not in saved for key in own), sum(key not in own for key in saved))
