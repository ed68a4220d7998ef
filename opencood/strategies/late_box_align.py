"""Late fusion with CoAlign's pose correction: every CAV detects in its own frame (stage 1), the
pose graph (``opencood.ops.pose_graph``) corrects the agent -> ego transforms from those boxes,
and the boxes are merged in the ego frame with the corrected transforms.

The correction uses the authors' settings (``BoxAlignArgs`` defaults; no ``box_align`` config
section yet) and the head's log variances when the model has the uncertainty head
(``model.args.uncertainty_dim``), unit weights otherwise.
"""
from typing import Dict, List

from opencood.ops.pose_graph import BoxAlignArgs, box_align_transforms_to_ego
from opencood.postprocess.uncertain_detections import detections_with_uncertainty
from opencood.registry import STRATEGIES
from opencood.strategies.late import LateFusion


@STRATEGIES.register("late_box_align")
class LateFusionBoxAlign(LateFusion):
    name = "late_box_align"
    dataset_name = "late"                # the same samples as late fusion
    box_align_args = BoxAlignArgs()

    def detections(self, postprocessor, outputs: Dict, inputs: Dict) -> List:
        """Per-agent own-frame outputs -> per sample (boxes, scores, bytes sent), merged with
        the corrected transforms (late fusion's merge otherwise)."""
        record_len = inputs["record_len"]
        decoded = postprocessor.decode(outputs)
        if "unc_preds" in outputs:
            stage1 = detections_with_uncertainty(postprocessor, outputs)
            boxes, log_vars = [d[0] for d in stage1], [d[2] for d in stage1]
        else:
            boxes, log_vars = [postprocessor.nms(*d)[0] for d in decoded], None
        corrected = box_align_transforms_to_ego(inputs["transforms_to_ego"], boxes, log_vars,
                                                record_len.tolist(), self.box_align_args)
        return postprocessor.merge_late(decoded, record_len, corrected)
