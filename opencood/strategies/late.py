"""Late fusion: a single-agent detector on every CAV's own cloud, boxes merged in the ego frame
(NMS over all CAVs' boxes; each non-ego CAV sends its boxes)."""
from typing import Dict

from opencood.registry import STRATEGIES
from opencood.strategies import FusionStrategy


@STRATEGIES.register("late")
class LateFusion(FusionStrategy):
    name = dataset_name = "late"
    merges_late = True
    needs_fusing_model = False
    late_variants = ("late", "late_box_align")

    def loss_dataset_args(self) -> Dict:
        # Training examples are per CAV; so is the validation loss (AP uses whole samples).
        return {"per_cav": True}

    def model_inputs(self, inputs: Dict) -> Dict:
        """Each agent is its own sample for the model (record_len all ones); ``inputs`` keeps
        the per-sample record_len that groups the agents' boxes afterwards."""
        num_agents = int(inputs["record_len"].sum())
        model_inputs = {k: v for k, v in inputs.items() if k != "shared_points"}
        model_inputs["record_len"] = inputs["record_len"].new_ones(num_agents)
        return model_inputs
