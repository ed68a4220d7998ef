"""Model stages: pillars -> features -> fusion -> head.

``pillar_vfe.py`` (pillar encoder), ``scatter.py`` (to BEV), ``backbone.py`` (BEV backbone),
``fusion.py`` (AttFuse, F-Cooper, Where2comm), ``v2vnet.py``, ``v2xvit.py``, ``cobevt.py``,
``disconet.py`` (one file per baseline), ``heads.py`` (anchor head), ``detectors.py`` (the models
that wire them).

Every module of this package is imported on the first lookup in ``MODELS`` or ``FUSIONS``
(``opencood.registry``): a file registering a model or fusion module needs no import line here.
"""
from opencood.models.build import build_model  # noqa: F401
