"""Feature-level knowledge distillation (DiscoNet): the student's fused BEV map is pulled towards
a teacher's BEV map of the same sample."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def feature_distillation_loss(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the per-cell channel distributions.

    student, teacher (B, C, H, W) -> scalar. At every cell each map's C values become a
    distribution by a softmax over channels; the divergence is averaged over all B*C*H*W
    elements, as DiscoNet's code and HEAL do (``KLDivLoss`` with element mean), which is why
    the configs weight it by 1e4. A mean over equal-sized samples, so accumulated micro-batches
    give the same value as the whole batch. Computed in fp32 (under AMP the maps may be bf16).
    """
    if student.shape != teacher.shape:
        raise ValueError(f"student map {tuple(student.shape)} and teacher map "
                         f"{tuple(teacher.shape)} differ")
    log_student = F.log_softmax(student.float(), dim=1)
    log_teacher = F.log_softmax(teacher.float(), dim=1)
    # Written out rather than F.kl_div(reduction="mean"), whose meaning torch plans to change;
    # log-probabilities on both sides, so no log(0) where a softmax underflows.
    return (log_teacher.exp() * (log_teacher - log_student)).mean()
