"""Weight initialisation run after build_model (docs/DESIGN.md §6.4: build -> init -> SyncBN
-> ...)."""
from __future__ import annotations

from torch import nn

_CONV_OR_LINEAR = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                   nn.ConvTranspose3d, nn.Linear)
_NORMS = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)

_WEIGHT_INITS = {
    "xavier_uniform": nn.init.xavier_uniform_,
    "xavier_normal": nn.init.xavier_normal_,
    "kaiming": lambda weight: nn.init.kaiming_normal_(weight, nonlinearity="relu"),
}
INIT_METHODS = (*_WEIGHT_INITS, "default")


def init_layer(module: nn.Module, method: str) -> None:
    """One conv/linear layer: ``default`` is PyTorch's own reset, the others zero the bias."""
    if method == "default":
        module.reset_parameters()
        return
    _WEIGHT_INITS[method](module.weight)
    if module.bias is not None:
        nn.init.zeros_(module.bias)


def init_weights(model: nn.Module, method: str = "xavier_uniform", cls_prior: float = 0.01):
    """Initialise every conv/linear weight with ``method`` (biases zero), norms to weight 1 and
    bias 0, then give classification logits the focal-loss prior: any submodule that defines
    ``reset_cls_prior`` (AnchorHead, where2comm's confidence conv) has its bias set so that
    sigmoid(bias) = ``cls_prior``. Returns the model.
    """
    if method not in INIT_METHODS:
        raise ValueError(f"unknown init method {method!r}; options: {', '.join(INIT_METHODS)}")
    for module in model.modules():
        if isinstance(module, _CONV_OR_LINEAR):
            init_layer(module, method)
        elif isinstance(module, _NORMS):
            if getattr(module, "weight", None) is not None:
                nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
    for module in model.modules():
        if hasattr(module, "reset_cls_prior"):
            module.reset_cls_prior(cls_prior)
    return model
