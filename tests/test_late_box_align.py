"""The late_box_align strategy: late fusion whose merge uses the pose graph's corrected
transforms (the correction itself: tests/test_pose_graph.py)."""
from pathlib import Path

import torch

import opencood.eval.pose_correction as pose_correction
from opencood.config import load_config
from opencood.postprocess import build_postprocessor
from opencood.strategies import get_strategy

SMOKE = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"


def head_outputs(agents, seed=0, uncertainty=False):
    gen = torch.Generator().manual_seed(seed)
    cls = torch.randn(agents, 2, 16, 32, generator=gen) - 2.5       # ~13 % above threshold
    outputs = {"cls_preds": cls, "reg_preds": torch.randn(agents, 14, 16, 32, generator=gen) * 0.3,
               "dir_preds": torch.randn(agents, 4, 16, 32, generator=gen)}
    if uncertainty:
        outputs["unc_preds"] = torch.zeros(agents, 6, 16, 32)
    return outputs


def test_merges_with_the_corrected_transforms(monkeypatch):
    postprocessor = build_postprocessor(load_config(SMOKE), torch.device("cpu"))
    transforms = torch.eye(4).repeat(3, 1, 1)
    transforms[1, 0, 3] = 10.0
    shifted = transforms.clone()
    shifted[1, :2, 3] += torch.tensor([0.7, -0.4])
    seen = {}

    def fake_correction(transforms_to_ego, boxes, log_vars, record_len, args):
        seen.update(boxes=[len(b) for b in boxes], log_vars=log_vars, record_len=record_len)
        return shifted

    monkeypatch.setattr(pose_correction, "box_align_transforms_to_ego", fake_correction)
    inputs = {"record_len": torch.tensor([2, 1]), "transforms_to_ego": transforms}
    outputs = head_outputs(3, uncertainty=True)
    aligned = get_strategy("late_box_align").detections(postprocessor, outputs, inputs)
    late = get_strategy("late").detections(postprocessor, outputs,
                                           {**inputs, "transforms_to_ego": shifted})
    for (boxes, scores, sent, _), (ref_boxes, ref_scores, ref_sent, _) in zip(aligned, late):
        torch.testing.assert_close(boxes, ref_boxes)
        torch.testing.assert_close(scores, ref_scores)
        assert sent == ref_sent
    assert seen["record_len"] == [2, 1] and min(seen["boxes"]) > 0
    assert [v.shape[1] for v in seen["log_vars"]] == [3, 3, 3]


def test_without_correction_it_is_late_fusion():
    # Random boxes rarely meet within 1.5 m four times: the pose graph keeps the transforms.
    postprocessor = build_postprocessor(load_config(SMOKE), torch.device("cpu"))
    inputs = {"record_len": torch.tensor([2]), "transforms_to_ego": torch.eye(4).repeat(2, 1, 1)}
    inputs["transforms_to_ego"][1, 1, 3] = 60.0                    # far apart: no overlap
    outputs = head_outputs(2, seed=1)
    aligned = get_strategy("late_box_align").detections(postprocessor, outputs, inputs)
    late = get_strategy("late").detections(postprocessor, outputs, inputs)
    torch.testing.assert_close(aligned[0][0], late[0][0])
