"""The training and evaluation recipe shared by the tools: what tools/train.py, tools/eval.py and
the benchmarks assemble, so none of them re-assembles it."""
from __future__ import annotations

from typing import Dict

from opencood.config import ConfigError, get_key
from opencood.registry import FUSIONS, LOSSES, MODELS, POSTPROCESSORS, RegistryError


def check_registered_names(cfg: Dict, source: str) -> None:
    """Every registry name of the config exists, checked before any file is written (a typo in
    ``model.core_method`` must not leave an empty run folder behind)."""
    import opencood.losses  # noqa: F401  (registers losses)
    import opencood.models  # noqa: F401  (registers models and fusion modules)
    import opencood.postprocess  # noqa: F401  (registers postprocessors)
    names = [("model.core_method", MODELS, get_key(cfg, "model.core_method", None)),
             ("model.args.fusion.core_method", FUSIONS,
              get_key(cfg, "model.args.fusion.core_method", None)),
             ("loss.core_method", LOSSES, get_key(cfg, "loss.core_method", None)),
             ("postprocess.core_method", POSTPROCESSORS,
              get_key(cfg, "postprocess.core_method", None))]
    for dotted, registry, name in names:
        if name is None:
            continue
        try:
            registry.get(name)
        except RegistryError as error:
            raise ConfigError(f"{source}: {dotted}: {error}") from None
