"""Anchor-based detection head: per-cell class score, box residuals and direction bin."""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from opencood.postprocess.layout import BOX_CODE_SIZE, NUM_DIR_BINS


def prior_bias(prior: float) -> float:
    """Bias whose sigmoid is ``prior``: -log((1 - pi) / pi) (RetinaNet), so the focal loss of the
    many negatives does not swamp the first steps."""
    return -math.log((1.0 - prior) / prior)


class AnchorHead(nn.Module):
    """(B, C, H, W) -> cls (B, K*A, H, W), reg (B, 7A, H, W), dir (B, 2A, H, W), in the channel
    layout of :mod:`opencood.postprocess.layout` (reg channel ``a * 7 + k`` is code k of anchor
    a; cls channel ``a * K + c`` is the logit of class c at anchor a), which lines up with the
    postprocessor's anchors (H, W, A, 7). ``num_classes`` K (None: 1): with K classes there are
    A = K x yaws anchors per cell, class-major, as V2X-Real's heads.

    ``use_dir=False``: no direction classifier (OpenCOOD's heads): no ``dir_preds``, so the
    decoder keeps the regressed yaw as it is and the loss has no direction term.
    """

    def __init__(self, in_channels: int, num_anchors: int = 2, cls_prior: float = 0.01,
                 use_dir: bool = True, uncertainty_dim: int = 0,
                 num_classes: Optional[int] = 1):
        super().__init__()
        self.num_anchors = num_anchors
        self.num_classes = num_classes or 1
        self.cls_conv = nn.Conv2d(in_channels, num_anchors * self.num_classes, 1)
        self.reg_conv = nn.Conv2d(in_channels, BOX_CODE_SIZE * num_anchors, 1)
        self.dir_conv = nn.Conv2d(in_channels, NUM_DIR_BINS * num_anchors, 1) if use_dir \
            else None
        # CoAlign: per anchor the log variances of the x, y (, yaw) targets (unc_preds,
        # (B, uncertainty_dim * A, H, W)), the pose graph's edge weights. Built last and only
        # when asked, so other heads' initialisation and checkpoints are unchanged.
        self.unc_conv = (nn.Conv2d(in_channels, uncertainty_dim * num_anchors, 1)
                         if uncertainty_dim else None)
        self.reset_cls_prior(cls_prior)

    @torch.no_grad()
    def reset_cls_prior(self, prior: float) -> None:
        """Called by ``init_weights`` after the generic initialisation."""
        self.cls_conv.bias.fill_(prior_bias(prior))

    def forward(self, features: torch.Tensor) -> dict:
        outputs = {"cls_preds": self.cls_conv(features), "reg_preds": self.reg_conv(features)}
        if self.dir_conv is not None:
            outputs["dir_preds"] = self.dir_conv(features)
        if self.unc_conv is not None:
            outputs["unc_preds"] = self.unc_conv(features)
        return outputs
