"""The detection head's output layout: the contract between the head, the loss and the decoder.

For a head map of H x W cells (H along y, W along x) with A anchors per cell and K classes
(``postprocess.classes``, K = 1 without; then A = K x yaws, class-major, docs/DESIGN.md §5.1):

* ``cls_preds`` (B, K * A, H, W): channel ``a * K + c`` is the logit of class ``c`` at anchor
  ``a`` (K = 1: channel ``a`` is anchor ``a``'s one logit);
* ``reg_preds`` (B, BOX_CODE_SIZE * A, H, W): channel ``a * BOX_CODE_SIZE + k`` is residual ``k``
  of anchor ``a`` (see :class:`opencood.postprocess.box_coder.ResidualBoxCoder`);
* ``dir_preds`` (B, NUM_DIR_BINS * A, H, W): channel ``a * NUM_DIR_BINS + j`` is the logit of
  direction bin ``j`` of anchor ``a``.

:func:`flatten_anchor_maps` turns any of them into per-anchor rows: row
``n = (i_y * W + i_x) * A + a`` lines up with ``anchors.reshape(-1, 7)`` of anchors laid out
(H, W, A, 7) (:func:`opencood.postprocess.anchors.generate_anchors`).
"""
from __future__ import annotations

import torch

BOX_CODE_SIZE = 7       # residuals of x, y, z, the three sizes (in the box order) and yaw
YAW_CODE = 6            # position of the yaw residual in a box code
NUM_DIR_BINS = 2        # direction classifier bins over the full circle: forward / backward
# Where the direction bins start (radians): pi/4 keeps the bin borders away from the 0 and 90
# degree yaws that most cars have relative to a lane.
DIR_OFFSET = 0.7854


def flatten_anchor_maps(maps: torch.Tensor, values_per_anchor: int) -> torch.Tensor:
    """(B, K*A, H, W) -> (B, H*W*A, K), or (B, H*W*A) for K = 1; anchor order (H, W, A).

    The one flatten of head outputs (loss, target assignment and decoding all use it); the dtype
    is kept, callers cast where they need to.
    """
    batch = maps.shape[0]
    flat = maps.permute(0, 2, 3, 1).reshape(batch, -1, values_per_anchor)
    return flat.squeeze(-1) if values_per_anchor == 1 else flat
