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

# The data and evaluation packages receive the strategy object from the engine and never look
# one up (nor compare strategy names): they import nothing from this package
# (tests/test_import_graph.py).


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
    # Reads own-frame samples (fusion.args.proj_first: false): features warped to the ego.
    supports_own_frame = False
    # Corrects the agents' poses itself from its own per-agent boxes (late_box_align).
    corrects_poses = False
    # Late merges: (the strategy as is, the same with pose correction), evaluated side by side
    # when the run corrects poses; None for the others.
    late_variants: tuple | None = None

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
        """Head outputs -> per-sample ``FrameDetections`` (boxes, scores, bytes sent, classes)
        via the postprocessor."""
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


def choose_strategy(cfg: Dict, name: str | None = None) -> FusionStrategy:
    """The engine's choice, made once per run or evaluated setting and handed to the data and
    evaluation code: strategy ``name`` (default: the config's ``fusion.core_method``),
    configured from the resolved ``cfg``. The config's own strategy must read what its
    ``fusion.args.proj_first`` asks for (own-frame data is intermediate fusion's); another one
    (eval's ``--fusion_method late`` of an own-frame model) reads its samples as they always
    are."""
    fusion = cfg["fusion"]
    strategy = get_strategy(name or fusion["core_method"]).configure(cfg)
    own = name is None or name == fusion["core_method"]
    if own and not fusion["args"]["proj_first"] and not strategy.supports_own_frame:
        raise ConfigError(f"fusion.args.proj_first: false is for intermediate fusion (features "
                          f"warped to the ego before fusing); fusion.core_method "
                          f"{strategy.name!r} reads {strategy.dataset_name!r} samples")
    if own and cfg.get("kd") is not None and not strategy.needs_fusing_model:
        raise ConfigError(f"key 'kd' is for an intermediate-fusion student (distillation "
                          f"trains its fused map on the teacher's); fusion.core_method is "
                          f"{strategy.name!r}")
    return strategy
