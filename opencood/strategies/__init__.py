"""Fusion strategies: what ``fusion.core_method`` (no, early, late, intermediate) means, in one
object per strategy, one file each.

A strategy pairs
* its dataset (``dataset_name``, registered in ``DATASETS``) and the options of its training-loss
  dataset (late fusion trains per CAV, so its validation loss is per CAV too);
* its model-input adapter (late fusion runs a single-agent model on every CAV's own cloud);
* its postprocess merge (late fusion merges every CAV's boxes in the ego frame);
* its model-compatibility check (late needs a single-agent model, intermediate a fusing one).

A new strategy is one new file here: a subclass of :class:`FusionStrategy` registered in
``STRATEGIES`` (and, when it needs its own samples, a dataset registered in ``DATASETS``); the
registry imports every module of this package on its first lookup.
"""
from __future__ import annotations

from typing import Dict, List

import torch

from opencood.errors import ConfigError
from opencood.registry import STRATEGIES


def fuses_agents(model: torch.nn.Module) -> bool:
    """Whether ``model`` fuses several agents itself (it has a fusion module)."""
    return getattr(model, "fusion", None) is not None


class FusionStrategy:
    """The default behaviour: the model sees the batch as prepared and decodes per sample."""

    name = "base"
    dataset_name = "base"
    merges_late = False                  # detections merged from per-CAV boxes
    # True: needs a model with a fusion module; False: needs a single-agent one; None: either.
    needs_fusing_model: bool | None = None

    def configure(self, cfg: Dict) -> "FusionStrategy":
        """Read what the strategy takes from the resolved config (nothing by default)."""
        return self

    def loss_dataset_args(self) -> Dict:
        """Extra options of the dataset the validation loss reads."""
        return {}

    def model_inputs(self, inputs: Dict) -> Dict:
        """Prepared batch inputs -> what the model's forward takes."""
        return inputs

    def detections(self, postprocessor, outputs: Dict, inputs: Dict) -> List:
        """Head outputs -> per-sample (boxes, scores, bytes sent) via the postprocessor."""
        return postprocessor.detections(outputs, inputs["record_len"],
                                        inputs["transforms_to_ego"], self.merges_late)

    def check_model(self, model: torch.nn.Module, model_name: str) -> None:
        """ConfigError (one line) when ``model`` cannot run this strategy."""
        fusing = fuses_agents(model)
        if self.needs_fusing_model is None or fusing == self.needs_fusing_model:
            return
        if fusing:
            raise ConfigError(f"fusion method {self.name!r} needs a single-agent model "
                              f"(point_pillar); this run's model {model_name!r} fuses agents "
                              f"itself: use --fusion_method intermediate (or no), or evaluate a "
                              f"run trained for {self.name} fusion")
        raise ConfigError(f"fusion method {self.name!r} needs a model with a fusion module; this "
                          f"run's model {model_name!r} is single-agent: use --fusion_method "
                          f"late, early or no")


def strategy_names() -> List[str]:
    """Every registered fusion method, sorted."""
    return sorted(STRATEGIES.names())


def get_strategy(name: str) -> FusionStrategy:
    """The strategy registered as ``name`` (an unknown name lists the registered ones)."""
    return STRATEGIES.get(name)()
