"""The detection task: forward + loss of a collated batch, the one thing a training step runs.

It owns what turns a batch into a loss: the batch preparers (pillars capped by
``max_voxel_train`` for training steps, ``max_voxel_test`` for validation, as OpenCOOD does), the
criterion, and DiscoNet's frozen teacher when the yaml has a ``kd`` section. Its two methods are
the ``LossFn`` of ``opencood.engine.loop`` (``loss_fn(model, batch) -> (loss, terms, samples)``),
so the optimizer step and the exact validation loss stay independent of detection.
"""
from __future__ import annotations

import logging
from typing import Dict, Tuple

import torch

from opencood.data.pipeline import BatchPreparer
from opencood.engine.teacher import FrozenTeacher
from opencood.losses import build_loss

logger = logging.getLogger("opencood")


class DetectionTask:
    """Forward + loss of the detector on a batch.

    Args:
        preparer: batch -> (model inputs, targets) for training steps.
        criterion: the detection loss (``per_sample_losses`` for validation).
        teacher: DiscoNet's frozen early-fusion teacher, or None.
        host_terms: the loss terms as host floats (False with ``performance.sync_free_step``:
            detached device tensors, read in the step's one host read).
        eval_preparer: the preparer of validation batches (default ``preparer``).
        strategy: the run's fusion strategy (``opencood.strategies.choose_strategy``), which
            validation's AP hands to the evaluation.
    """

    def __init__(self, preparer: BatchPreparer, criterion: torch.nn.Module,
                 teacher: FrozenTeacher | None = None, host_terms: bool = True,
                 eval_preparer: BatchPreparer | None = None, strategy=None):
        self.preparer, self.criterion, self.teacher = preparer, criterion, teacher
        self.host_terms = host_terms
        self.eval_preparer = eval_preparer or preparer
        self.strategy = strategy

    @classmethod
    def from_config(cls, cfg: Dict, device: torch.device, teacher: FrozenTeacher | None = None,
                    strategy=None) -> "DetectionTask":
        """``strategy``: the run's (default: the config's own, chosen here)."""
        from opencood.strategies import choose_strategy
        if teacher is not None:
            logger.info("loss: detection + %g x feature distillation from the frozen teacher %s",
                        teacher.weight, teacher.source)
        return cls(BatchPreparer.from_config(cfg, device), build_loss(cfg["loss"]).to(device),
                   teacher, host_terms=not cfg["performance"]["sync_free_step"],
                   eval_preparer=BatchPreparer.from_config(cfg, device, training=False),
                   strategy=strategy or choose_strategy(cfg))

    def training_loss(self, model: torch.nn.Module,
                      batch: Dict) -> Tuple[torch.Tensor, Dict, int]:
        """(loss, per-term values, samples) of a training micro-batch.

        With a teacher the loss adds the weighted distillation term between the student's fused
        map and the teacher's map of the batch's early-fusion input, reported as ``kd_loss``
        (TensorBoard's train/kd_loss); ``total_loss`` includes it."""
        inputs, targets = self.preparer(batch)
        outputs = model(inputs)
        loss, terms = self.criterion(outputs, targets)
        if self.teacher is not None:
            teacher_inputs = self.preparer.model_inputs(batch["early_fusion"])
            kd_loss = self.teacher.distillation_loss(outputs["fused_features"], teacher_inputs)
            loss = loss + kd_loss
            terms = {**terms, "kd_loss": kd_loss.detach(), "total_loss": loss.detach()}
        if self.host_terms:
            terms = {name: float(value) for name, value in terms.items()}
        return loss, terms, len(batch["record_len"])

    def validation_loss(self, model: torch.nn.Module,
                        batch: Dict) -> Tuple[torch.Tensor, Dict, int]:
        """(mean per-sample loss, {}, samples) of a validation batch.

        The training loss is normalised per micro-batch; validation takes each sample's own
        normalisation (``per_sample_losses``, float64), so validation_loss's sum of loss x
        samples is the sum of per-sample losses and the split's mean does not depend on the
        micro-batch size or the number of ranks (``best.pth`` neither). Detection only: no
        teacher forward, comparable with the other models' validation loss."""
        inputs, targets = self.eval_preparer(batch)
        per_sample = self.criterion.per_sample_losses(model(inputs), targets)
        return per_sample.mean(), {}, per_sample.numel()
