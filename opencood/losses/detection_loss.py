"""PointPillars detection loss: focal classification, sine-difference smooth-L1 boxes, direction.

Normalisation (training, ``forward``): every term is divided by the number of positive anchors in
the micro-batch (at least 1), the standard PointPillars/OpenPCDet choice. With gradient
accumulation or DDP the effective normaliser is therefore per micro-batch, not global: micro-batches
with few positives weigh a little more. This keeps the loss local (no collective in the loss) and
matches the published training recipes.

Normalisation (validation, ``per_sample_losses``): each sample is divided by its own positive
anchors (at least 1), i.e. each sample gets the loss a micro-batch holding it alone would have.
The mean of these over a split does not depend on how the split is cut into micro-batches or
ranks, so the validation loss (and ``best.pth``) is the same on 1 or 8 GPUs.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from opencood.config_schema import section
from opencood.losses.depth import DepthLossArgs, depth_term
from opencood.losses.uncertainty import UncertaintyLossArgs, uncertainty_loss_map
from opencood.postprocess.layout import (BOX_CODE_SIZE, DIR_OFFSET, NUM_DIR_BINS, YAW_CODE,
                                         flatten_anchor_maps)
from opencood.registry import LOSSES


def sigmoid_focal_loss(logits: torch.Tensor, targets: torch.Tensor, alpha: float = 0.25,
                       gamma: float = 2.0) -> torch.Tensor:
    """Element-wise focal loss (Lin et al.) of logits against 0 / 1 targets, the same formula as
    ``torchvision.ops.sigmoid_focal_loss(..., reduction="none")`` (``tests/test_loss_init_flops.py``
    compares them): importing torchvision.ops pulls in torch._dynamo, seconds of start-up for
    every tool that builds a loss. ``alpha < 0``: no class weighting."""
    probability = torch.sigmoid(logits)
    cross_entropy = F.binary_cross_entropy_with_logits(logits, targets, reduction="none")
    p_t = probability * targets + (1 - probability) * (1 - targets)
    loss = cross_entropy * ((1 - p_t) ** gamma)
    if alpha >= 0:
        loss = (alpha * targets + (1 - alpha) * (1 - targets)) * loss
    return loss


def flat_float(maps: torch.Tensor, values_per_anchor: int) -> torch.Tensor:
    """Head maps -> per-anchor rows (:func:`flatten_anchor_maps`) in float32, even under AMP:
    focal and smooth-L1 sums lose too much in half precision."""
    return flatten_anchor_maps(maps, values_per_anchor).float()


def sine_difference(pred: torch.Tensor, target: torch.Tensor):
    """Replace the yaw residuals by sin(p)cos(t) and cos(p)sin(t): their difference is
    sin(p - t), so a box off by pi costs nothing here (the direction classifier settles it)."""
    pred_yaw, target_yaw = pred[..., YAW_CODE:], target[..., YAW_CODE:]
    pred_sin = torch.sin(pred_yaw) * torch.cos(target_yaw)
    target_sin = torch.cos(pred_yaw) * torch.sin(target_yaw)
    return (torch.cat([pred[..., :YAW_CODE], pred_sin], dim=-1),
            torch.cat([target[..., :YAW_CODE], target_sin], dim=-1))


@section
class PointPillarLossArgs:
    """``loss.args`` of ``point_pillar_loss``: term weights and the focal / smooth-L1 shapes."""

    ALIASES = {"reg": "reg_weight"}                  # OpenCOOD's spelling
    cls_weight: float = 1.0
    reg_weight: float = 2.0
    dir_weight: float = 0.2
    conf_weight: float = 1.0                         # where2comm's confidence map
    focal_alpha: float = 0.25
    focal_gamma: float = 2.0
    smooth_l1_beta: float = 1.0 / 9.0
    code_weights: Optional[Tuple[float, ...]] = None    # None: every box code weighs 1
    # Read by the postprocessor's box coder, kept here where OpenCOOD's configs have it.
    dir_offset: float = DIR_OFFSET                   # direction-bin offset, radians
    # CoAlign's loss of the head's log variances (model.args.uncertainty_dim); None: off.
    uncertainty: Optional[UncertaintyLossArgs] = None
    # HEAL's depth supervision of a lift-splat encoder (opencood.losses.depth); None: off.
    depth: Optional[DepthLossArgs] = None


@LOSSES.register("point_pillar_loss", args=PointPillarLossArgs)
class DetectionLoss(nn.Module):
    """``forward(outputs, targets) -> (total, terms)``.

    outputs: head maps (layout in opencood.postprocess.layout): cls_preds (B, K*A, H, W) (K
      classes, read off the channel counts), reg_preds (B, 7A, H, W), dir_preds (B, 2A, H, W)
      (absent: no direction term), optional where2comm conf_preds (N_agents, A, H, W) with
      conf_sample_index (N_agents,).
    targets: labels (B, N) int64 in {-1 ignore, 0 negative, 1 positive}, reg_targets (B, N, 7),
      dir_targets (B, N) int64, reg_weights (B, N); N = H*W*A; with K > 1 class_targets (B, N)
      int64, the class a positive anchor learns (V2X-Real's loss: focal loss of each of the K
      sigmoid logits against the one-hot class, the same normaliser).
    terms: detached scalar tensors cls_loss, reg_loss, dir_loss, [conf_loss], [unc_loss],
      [depth_loss], total_loss (tensors, not floats, so logging does not force a device sync
      every step).
    With ``depth`` the outputs also carry the lift-splat encoder's depth_logits, depth_target,
    depth_valid (opencood.losses.depth); the validation loss (``per_sample_losses``) stays the
    detection loss.
    """

    def __init__(self, args: PointPillarLossArgs = PointPillarLossArgs()):
        super().__init__()
        self.cls_weight, self.reg_weight = args.cls_weight, args.reg_weight
        self.dir_weight, self.conf_weight = args.dir_weight, args.conf_weight
        self.focal_alpha, self.focal_gamma = args.focal_alpha, args.focal_gamma
        self.smooth_l1_beta = args.smooth_l1_beta
        code_weights = [1.0] * BOX_CODE_SIZE if args.code_weights is None \
            else list(args.code_weights)
        if len(code_weights) != BOX_CODE_SIZE:
            raise ValueError(f"code_weights needs {BOX_CODE_SIZE} entries, got {code_weights}")
        self.register_buffer("code_weights", torch.tensor(code_weights, dtype=torch.float32),
                             persistent=False)
        self.uncertainty = args.uncertainty
        self.depth = args.depth

    def focal_map(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, N) logits and labels -> (B, N) focal loss, 0 at ignored anchors."""
        cared = (labels >= 0).to(logits.dtype)
        positive = (labels == 1).to(logits.dtype)
        losses = sigmoid_focal_loss(logits, positive, alpha=self.focal_alpha,
                                    gamma=self.focal_gamma)
        return losses * cared

    def classification_map(self, outputs: dict, targets: dict) -> torch.Tensor:
        """(B, N) focal loss of the head's class logits, summed over the K classes, 0 at ignored
        anchors; K = 1: :meth:`focal_map` of the one logit."""
        labels = targets["labels"]
        anchors_per_cell = outputs["reg_preds"].shape[1] // BOX_CODE_SIZE
        num_classes = outputs["cls_preds"].shape[1] // anchors_per_cell
        if num_classes == 1:
            return self.focal_map(flat_float(outputs["cls_preds"], 1), labels)
        logits = flat_float(outputs["cls_preds"], num_classes)                   # (B, N, K)
        one_hot = F.one_hot(targets["class_targets"], num_classes).to(logits.dtype)
        one_hot = one_hot * (labels == 1).unsqueeze(-1).to(logits.dtype)
        losses = sigmoid_focal_loss(logits, one_hot, alpha=self.focal_alpha,
                                    gamma=self.focal_gamma).sum(dim=-1)
        return losses * (labels >= 0).to(logits.dtype)

    def focal_term(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, N) logits and labels -> sum of focal loss over non-ignored anchors / #positives."""
        positive = (labels == 1).to(logits.dtype)
        return self.focal_map(logits, labels).sum() / positive.sum().clamp(min=1.0)

    def regression_map(self, reg_preds, targets, positive) -> torch.Tensor:
        """(B, 7A, H, W) predictions -> (B, N, 7) weighted smooth-L1, 0 off the positives.
        Codes keep the box order, so ``code_weights`` follow ``postprocess.order``."""
        boxes_pred = flat_float(reg_preds, BOX_CODE_SIZE)
        boxes_pred, boxes_target = sine_difference(boxes_pred, targets["reg_targets"].float())
        per_code = F.smooth_l1_loss(boxes_pred, boxes_target, reduction="none",
                                    beta=self.smooth_l1_beta)
        weights = targets.get("reg_weights", positive).to(per_code.dtype) * positive
        code_weights = self.code_weights.to(device=per_code.device, dtype=per_code.dtype)
        return per_code * code_weights * weights.unsqueeze(-1)

    def regression_term(self, reg_preds, targets, positive, normaliser) -> torch.Tensor:
        return self.regression_map(reg_preds, targets, positive).sum() / normaliser

    def direction_map(self, dir_preds, targets, positive) -> torch.Tensor:
        """(B, bins*A, H, W) logits -> (B, N) direction cross-entropy, 0 off the positives."""
        dir_logits = flat_float(dir_preds, NUM_DIR_BINS)
        per_anchor = F.cross_entropy(dir_logits.reshape(-1, NUM_DIR_BINS),
                                     targets["dir_targets"].reshape(-1),
                                     reduction="none").view_as(positive)
        return per_anchor * positive

    def direction_term(self, dir_preds, targets, positive, normaliser) -> torch.Tensor:
        return self.direction_map(dir_preds, targets, positive).sum() / normaliser

    def uncertainty_map(self, outputs, targets, positive) -> torch.Tensor:
        """(B, N) CoAlign's weighted uncertainty loss per anchor (``weight`` applied), 0 off the
        positives; needs the head's ``unc_preds`` (B, dim * A, H, W)."""
        if "unc_preds" not in outputs:
            raise ValueError("loss.args.uncertainty needs a head with log variances: set "
                             "model.args.uncertainty_dim")
        log_var = flat_float(outputs["unc_preds"], self.uncertainty.dim)
        per_anchor = uncertainty_loss_map(flat_float(outputs["reg_preds"], BOX_CODE_SIZE),
                                          targets["reg_targets"].float(), log_var,
                                          self.uncertainty).sum(dim=-1)
        weights = targets.get("reg_weights", positive).to(per_anchor.dtype) * positive
        return self.uncertainty.weight * per_anchor * weights

    def forward(self, outputs: dict, targets: dict):
        labels = targets["labels"]
        positive = (labels == 1).to(torch.float32)
        normaliser = positive.sum().clamp(min=1.0)
        terms = {
            "cls_loss": self.cls_weight * (self.classification_map(outputs, targets).sum()
                                           / normaliser),
            "reg_loss": self.reg_weight * self.regression_term(outputs["reg_preds"], targets,
                                                               positive, normaliser),
        }
        # A head without a direction classifier (``use_dir: false``, OpenCOOD's) has no term.
        if outputs.get("dir_preds") is not None:
            terms["dir_loss"] = self.dir_weight * self.direction_term(
                outputs["dir_preds"], targets, positive, normaliser)
        if "conf_preds" in outputs:
            # Every agent's confidence map is in the ego frame: supervise it with its sample's
            # labels, so it learns "an object the ego cares about is here".
            agent_labels = labels[outputs["conf_sample_index"]]
            conf_logits = flat_float(outputs["conf_preds"], 1)
            terms["conf_loss"] = self.conf_weight * self.focal_term(conf_logits, agent_labels)
        if self.uncertainty is not None:
            terms["unc_loss"] = self.uncertainty_map(outputs, targets, positive).sum() / normaliser
        if self.depth is not None:
            terms["depth_loss"] = self.depth_loss(outputs)
        total = sum(terms.values())
        terms = {name: value.detach() for name, value in terms.items()}
        terms["total_loss"] = total.detach()
        return total, terms

    def depth_loss(self, outputs: dict) -> torch.Tensor:
        """The lift-splat encoder's depth term (``loss.args.depth``); a loss whose model
        supervises depth in several places overrides it."""
        return depth_term(outputs, self.depth)

    def per_sample_losses(self, outputs: dict, targets: dict) -> torch.Tensor:
        """(B,) float64: for each sample, the total ``forward`` gives a micro-batch of that
        sample alone (its terms over its own positives, at least 1; where2comm's confidence
        over its agents' anchors and positives). Summed in float64, so a sample's value does
        not depend on the samples batched with it. Same inputs as ``forward``."""
        labels = targets["labels"]
        positive = (labels == 1).to(torch.float32)
        positives = positive.sum(dim=1, dtype=torch.float64)                      # (B,)
        normaliser = positives.clamp(min=1.0)
        summed = (self.cls_weight * self.classification_map(outputs, targets).double().sum(dim=1)
                  + self.reg_weight * self.regression_map(outputs["reg_preds"], targets,
                                                          positive).double().sum(dim=(1, 2)))
        if outputs.get("dir_preds") is not None:
            summed = summed + self.dir_weight * self.direction_map(
                outputs["dir_preds"], targets, positive).double().sum(dim=1)
        total = summed / normaliser
        if self.uncertainty is not None:
            total = total + self.uncertainty_map(outputs, targets, positive).double().sum(
                dim=1) / normaliser
        if "conf_preds" in outputs:
            total = total + self.conf_weight * self.per_sample_confidence(outputs, labels,
                                                                          positives)
        return total

    def per_sample_confidence(self, outputs: dict, labels: torch.Tensor,
                              positives: torch.Tensor) -> torch.Tensor:
        """(B,) float64 where2comm confidence term per sample: its agents' focal sums over
        their positives (agents x the sample's positives), as ``forward`` on that sample alone."""
        sample_index = outputs["conf_sample_index"]                                # (N_agents,)
        conf_logits = flat_float(outputs["conf_preds"], 1)
        agent_sums = self.focal_map(conf_logits, labels[sample_index]).double().sum(dim=1)
        batch = labels.shape[0]
        sums = agent_sums.new_zeros(batch).index_add_(0, sample_index, agent_sums)
        agent_positives = positives[sample_index]
        normaliser = agent_positives.new_zeros(batch).index_add_(0, sample_index, agent_positives)
        return sums / normaliser.clamp(min=1.0)
