"""Parameter and FLOP counts for logs and docs/results.md's model table."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def count_parameters(model: nn.Module) -> Tuple[int, int]:
    """-> (total, trainable) number of parameter elements."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable


def count_flops(model: nn.Module, batch) -> int:
    """FLOPs of one forward pass on ``batch`` (a multiply-add counts 2), by torch's
    FlopCounterMode: matmul/conv/attention-style ops only (elementwise ops, norms, scatters are
    not counted). Forward only and under no_grad; training costs roughly 3x this.
    """
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(batch)
    return int(counter.get_total_flops())


def format_model_summary(model: nn.Module, batch) -> str:
    """One line: parameters in millions and forward GFLOPs on ``batch``."""
    total, trainable = count_parameters(model)
    gflops = count_flops(model, batch) / 1e9
    return (f"{type(model).__name__}: {total / 1e6:.3f} M params ({trainable / 1e6:.3f} M "
            f"trainable), {gflops:.3f} GFLOPs per forward")
