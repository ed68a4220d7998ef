"""No fusion: the ego's own cloud only (the lower bound every cooperative method must beat)."""
from opencood.registry import STRATEGIES
from opencood.strategies import FusionStrategy


@STRATEGIES.register("no")
class NoFusion(FusionStrategy):
    name = dataset_name = "no"
