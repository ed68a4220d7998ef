"""Geometry kernels on tensors, shared by every stage: pillarisation (``voxelize.py``), rigid
transforms and points-in-boxes (``transforms.py``), rotated BEV IoU (``iou.py``) and NMS
(``nms.py``). Detection-specific conventions (anchors, box codes) live in ``opencood.postprocess``.
"""

