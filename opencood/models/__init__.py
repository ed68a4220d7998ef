"""Model stages: pillars -> features -> fusion -> head.

``pillar_vfe.py`` (pillar encoder), ``scatter.py`` (to BEV), ``backbone.py`` (BEV backbone),
``fusion.py`` (AttFuse, F-Cooper, Where2comm), ``v2vnet.py``, ``v2xvit.py``, ``cobevt.py`` (one file
per baseline), ``heads.py`` (anchor head), ``detectors.py`` (the models that wire them).

Importing this package registers every model (MODELS), backbone, fusion module and head.
"""
from opencood.models import backbone, detectors, fusion, heads, pillar_vfe, scatter  # noqa: F401
from opencood.models import cobevt, disconet, v2vnet, v2xvit  # noqa: F401  (fusions)
from opencood.models.build import build_model  # noqa: F401
