"""The training and evaluation recipe shared by the tools: what tools/train.py, tools/eval.py and
the benchmarks assemble, so none of them re-assembles it."""
from __future__ import annotations

from typing import Dict

from opencood.config import ConfigError
from opencood.registry import FUSIONS, LOSSES, MODELS, RegistryError


def check_registered_names(cfg: Dict, source: str) -> None:
    """Every registry name of the config exists, checked before any file is written (a typo in
    ``model.core_method`` must not leave an empty run folder behind). ``cfg`` is resolved."""
    import opencood.losses  # noqa: F401  (registers losses)
    import opencood.models  # noqa: F401  (registers models and fusion modules)
    fusion = cfg["model"]["args"].get("fusion")     # model args are model-specific
    names = [("model.core_method", MODELS, cfg["model"]["core_method"]),
             ("model.args.fusion.core_method", FUSIONS,
              fusion["core_method"] if isinstance(fusion, dict) else None),
             ("loss.core_method", LOSSES, cfg["loss"]["core_method"])]
    for dotted, registry, name in names:
        if name is None:
            continue
        try:
            registry.get(name)
        except RegistryError as error:
            raise ConfigError(f"{source}: {dotted}: {error}") from None
