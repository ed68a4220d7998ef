"""Intermediate fusion: each CAV's BEV features, fused by the model's fusion module."""
from opencood.registry import STRATEGIES
from opencood.strategies import FusionStrategy


@STRATEGIES.register("intermediate")
class IntermediateFusion(FusionStrategy):
    name = dataset_name = "intermediate"
    needs_fusing_model = True
    supports_own_frame = True
