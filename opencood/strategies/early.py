"""Early fusion: every CAV's raw points, moved into the ego frame, as one cloud."""
from opencood.registry import STRATEGIES
from opencood.strategies import FusionStrategy


@STRATEGIES.register("early")
class EarlyFusion(FusionStrategy):
    name = dataset_name = "early"
