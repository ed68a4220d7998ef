"""Late fusion with CoAlign's pose correction: every CAV detects in its own frame (stage 1), the
pose graph (``opencood.ops.pose_graph``) corrects the agent -> ego transforms from those boxes,
and the boxes are merged in the ego frame with the corrected transforms.

The correction uses the config's ``box_align.args`` (the authors' settings without the section,
:meth:`configure`) and the head's log variances when the model has the uncertainty head
(``model.args.uncertainty_dim``), unit weights otherwise.
"""
from typing import Dict, List

from opencood.eval.pose_correction import aligned_transforms, box_align_args, mark_corrected
from opencood.ops.pose_graph import BoxAlignArgs
from opencood.registry import STRATEGIES
from opencood.strategies.late import LateFusion


@STRATEGIES.register("late_box_align")
class LateFusionBoxAlign(LateFusion):
    name = "late_box_align"
    dataset_name = "late"                # the same samples as late fusion
    corrects_poses = True
    box_align_args = BoxAlignArgs()

    def configure(self, cfg: Dict) -> "LateFusionBoxAlign":
        self.box_align_args = box_align_args(cfg["box_align"])
        return self

    def detections(self, postprocessor, outputs: Dict, inputs: Dict) -> List:
        """Per-agent own-frame outputs -> per sample ``FrameDetections``, merged with
        the corrected transforms (late fusion's merge otherwise). The corrected transforms are
        recorded in ``inputs`` (``mark_corrected``): the evaluation measures the pose error
        before and after from them."""
        corrected, boxes = aligned_transforms(postprocessor, outputs,
                                              inputs["transforms_to_ego"],
                                              inputs["record_len"].tolist(), self.box_align_args)
        inputs.update(mark_corrected(inputs, corrected, boxes))
        return postprocessor.merge_late(postprocessor.decode(outputs), inputs["record_len"],
                                        corrected)
