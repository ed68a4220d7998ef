"""CoAlign's pose correction at evaluation (the ``box_align`` config section).

Stage 1 detects in every agent's own frame; the pose graph (``opencood.ops.pose_graph``) turns
those boxes into corrected agent -> ego transforms, which then replace the reported (noisy)
ones for the rest of the sample's inference:

* late fusion (``late_box_align``): stage 1 is the run's own model, whose per-agent outputs the
  strategy already has (:func:`aligned_transforms`);
* intermediate fusion on own-frame data (``fusion.args.proj_first: false``): stage 1 is a
  separate single-agent run (``box_align.stage1_model_dir``), run on the same batch's own-frame
  points (pillarised with its own voxels) before the fusion model warps the agents' features
  with the corrected transforms (:class:`PoseCorrector`), as the authors feed their stage-1
  result to the fusion dataset.

After a correction the prepared inputs hold ``transforms_to_ego`` (the corrected transforms,
what the model and the merge use) and ``transforms_to_ego_reported`` (the noisy ones they
replaced), so the evaluation can measure the pose error before and after.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from opencood.config import load_config
from opencood.errors import ConfigError
from opencood.ops.pose_graph import BoxAlignArgs, box_align_transforms_to_ego
from opencood.data.pipeline import BatchPreparer
from opencood.postprocess.uncertain_detections import detections_with_uncertainty
from opencood.utils.checkpoint import run_checkpoint

def stage1_boxes(postprocessor, outputs: Dict[str, torch.Tensor]):
    """Per-agent own-frame head outputs -> (per agent (K, 7) boxes after NMS, per agent (K, dim)
    log variances, or None without the uncertainty head)."""
    if "unc_preds" in outputs:
        stage1 = detections_with_uncertainty(postprocessor, outputs)
        return [d[0] for d in stage1], [d[2] for d in stage1]
    return [postprocessor.nms(*d)[0] for d in postprocessor.decode(outputs)], None


def aligned_transforms(postprocessor, outputs: Dict[str, torch.Tensor],
                       transforms_to_ego: torch.Tensor, record_len: Sequence[int],
                       args: BoxAlignArgs) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Stage-1 outputs of N agents (each in its own frame), their reported (N, 4, 4) agent ->
    ego transforms and agents per sample -> (the (N, 4, 4) corrected transforms, per agent the
    (K_a, 7) stage-1 boxes in its own frame the pose graph was built from)."""
    boxes, log_vars = stage1_boxes(postprocessor, outputs)
    corrected = box_align_transforms_to_ego(transforms_to_ego, boxes, log_vars,
                                            [int(n) for n in record_len], args)
    return corrected, boxes


def mark_corrected(inputs: Dict, corrected: torch.Tensor,
                   boxes: Optional[List[torch.Tensor]] = None) -> Dict:
    """``inputs`` with ``transforms_to_ego`` replaced by ``corrected`` and the replaced ones kept
    as ``transforms_to_ego_reported`` (the pose error before correction is measured on them);
    ``boxes`` (per agent (K_a, 7), own frame), the stage-1 boxes behind the correction, are
    kept as ``stage1_boxes`` (the evaluation measures how well two agents' boxes agree)."""
    marked = {**inputs, "transforms_to_ego_reported": inputs["transforms_to_ego"],
              "transforms_to_ego": corrected}
    if boxes is not None:
        marked["stage1_boxes"] = boxes
    return marked


def box_align_args(section: Dict | None) -> BoxAlignArgs:
    """The resolved ``box_align`` section's ``args`` as :class:`BoxAlignArgs` (defaults without
    the section: None)."""
    return BoxAlignArgs(**section["args"]) if section is not None else BoxAlignArgs()


class PoseCorrector:
    """Stage 1 (a single-agent model on every agent's own-frame points, pillarised by its own
    ``preparer``: it need not share the fusion run's pillars) + the pose graph.

    ``__call__(batch, inputs)``: a collated own-frame batch (``points_in_agent_frame``) and the
    fusion run's prepared inputs (record_len (B,), transforms_to_ego (N, 4, 4), ...) -> the
    inputs with corrected transforms (:func:`mark_corrected`).
    """

    def __init__(self, stage1_model: torch.nn.Module, preparer, args: BoxAlignArgs):
        self.stage1_model = stage1_model.eval()
        self.preparer = preparer
        self.args = args

    @torch.no_grad()
    def __call__(self, batch: Dict, inputs: Dict) -> Dict:
        if not batch["points_in_agent_frame"]:
            raise ConfigError("box_align: the batch's points are in the ego frame already (through "
                              "the noisy poses); pose correction needs own-frame data "
                              "(fusion.args.proj_first: false, or late fusion)")
        stage1_inputs = self.preparer.model_inputs(batch)
        stage1_inputs.pop("shared_points", None)
        num_agents = batch["transforms_to_ego"].shape[0]
        stage1_inputs["record_len"] = inputs["record_len"].new_ones(num_agents)  # each alone
        outputs = self.stage1_model(stage1_inputs)
        corrected, boxes = aligned_transforms(self.preparer.postprocessor, outputs,
                                              inputs["transforms_to_ego"],
                                              inputs["record_len"].tolist(), self.args)
        return mark_corrected(inputs, corrected, boxes)


def check_stage1_model(stage1_model: Mapping, stage1_dir: Path) -> None:
    """ConfigError (one line) when the stage-1 run's ``model`` section is not single-agent (it
    detects in every agent's own frame, each agent on its own)."""
    if stage1_model["core_method"] != "point_pillar":
        raise ConfigError(f"{stage1_dir}: box_align.stage1_model_dir must be a single-agent run "
                          f"(model point_pillar, trained for late fusion); its model is "
                          f"{stage1_model['core_method']!r}")


def load_pose_corrector(cfg: Dict, strategy, device,
                        load_model: Callable[[Dict, Path], torch.nn.Module]
                        ) -> Optional[PoseCorrector]:
    """The stage-1 corrector of an intermediate run with a ``box_align`` section (None where
    there is nothing to load: no section, or late fusion, whose own model is stage 1).
    ``load_model(config, checkpoint_path)``: the evaluator's model loader.

    Refuses (ConfigError) what cannot be corrected: projected-first data (the points are
    already in the ego frame through the noisy poses) or a run without ``stage1_model_dir``.
    """
    section = cfg["box_align"]
    if section is None or strategy.merges_late:
        return None
    if not strategy.supports_own_frame or cfg["fusion"]["args"]["proj_first"]:
        raise ConfigError(f"box_align corrects own-frame data: fusion {strategy.name!r} with "
                          f"fusion.args.proj_first true has its points in the ego frame already "
                          f"(set fusion.args.proj_first: false, or use late_box_align)")
    if section["stage1_model_dir"] is None:
        raise ConfigError("box_align.stage1_model_dir: an intermediate run needs a stage-1 "
                          "run (a point_pillar trained for late fusion, ideally with "
                          "model.args.uncertainty_dim) to detect in every agent's own frame")
    stage1_dir = Path(section["stage1_model_dir"])
    config_path = stage1_dir / "config.yaml"
    if not config_path.exists():
        raise ConfigError(f"box_align.stage1_model_dir: {config_path} not found (a run folder "
                          f"written by tools/train.py)")
    stage1_cfg = load_config(config_path)
    check_stage1_model(stage1_cfg["model"], stage1_dir)
    model = load_model(stage1_cfg, run_checkpoint(stage1_dir, None))
    preparer = BatchPreparer.from_config(stage1_cfg, device, training=False)
    return PoseCorrector(model, preparer, box_align_args(cfg["box_align"]))


def correction_pairs(inputs: Dict) -> List[torch.Tensor]:
    """The transforms whose pose error a sample reports: [reported] or, after a correction,
    [reported, corrected] (each (N, 4, 4))."""
    if "transforms_to_ego_reported" in inputs:
        return [inputs["transforms_to_ego_reported"], inputs["transforms_to_ego"]]
    return [inputs["transforms_to_ego"]]
