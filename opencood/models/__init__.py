"""Pillar encoder, BEV backbone, fusion modules, heads and detectors.

Importing this package registers every model (MODELS), backbone, fusion module and head.
"""
from opencood.models import backbone, detectors, fusion, heads, pillar_vfe, scatter  # noqa: F401
from opencood.models import cobevt, disconet, v2vnet, v2xvit  # noqa: F401  (fusions)
from opencood.models.build import build_model  # noqa: F401
