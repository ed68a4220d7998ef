"""Pose correction at evaluation (``opencood.eval.pose_correction``) and the relative pose error
it is judged by (``opencood.eval.pose_error``): hand-computed errors, the stage-1 corrector's
inputs and outputs, the correction modes of the evaluator, and the refusals."""
import math
from pathlib import Path

import pytest
import torch

import opencood.eval.pose_correction as pose_correction
from opencood.config import load_config, save_config
from opencood.engine.evaluator import correction_modes
from opencood.errors import ConfigError
from opencood.eval.pose_error import PoseErrorTally, stage1_box_offsets, transform_pose_errors
from opencood.postprocess import build_postprocessor
from opencood.strategies import get_strategy

CONFIGS = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic"


def planar_transform(x: float, y: float, yaw_deg: float) -> torch.Tensor:
    """(4, 4) agent -> ego transform of a planar pose."""
    yaw = math.radians(yaw_deg)
    matrix = torch.eye(4, dtype=torch.float64)
    matrix[:2, :2] = torch.tensor([[math.cos(yaw), -math.sin(yaw)],
                                   [math.sin(yaw), math.cos(yaw)]])
    matrix[0, 3], matrix[1, 3] = x, y
    return matrix


def test_transform_pose_errors_by_hand():
    # Sample 0: ego + one agent 0.3 / 0.4 m off (0.5 m) and 2 deg; sample 1: ego + two agents,
    # one exact, one 1 m off with a yaw error across the +-180 deg seam (179 vs -179: 2 deg).
    true = torch.stack([torch.eye(4, dtype=torch.float64), planar_transform(10, 0, 0),
                        torch.eye(4, dtype=torch.float64), planar_transform(-5, 3, 30),
                        planar_transform(0, 20, 179)])
    estimated = torch.stack([torch.eye(4, dtype=torch.float64), planar_transform(10.3, 0.4, 2),
                             torch.eye(4, dtype=torch.float64), planar_transform(-5, 3, 30),
                             planar_transform(1, 20, -179)])
    translation, yaw = transform_pose_errors(estimated, true, [2, 3])
    torch.testing.assert_close(translation, torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(yaw, torch.tensor([2.0, 0.0, 2.0], dtype=torch.float64))


@pytest.mark.parametrize("record_len", [[2, 3], [3, 2], [1, 2, 3], [3, 1, 2], [4], [1, 1]])
def test_transform_pose_errors_skip_exactly_each_samples_ego(record_len):
    # Every non-ego agent k (in agent order) is off by a distinct 0.1 (k + 1) m along y and k + 1
    # deg: skipping any row but the egos' (identities, error 0) changes the errors.
    true, estimated, expected = [], [], []
    for count in record_len:
        true.append(torch.eye(4, dtype=torch.float64))
        estimated.append(torch.eye(4, dtype=torch.float64))
        for agent in range(1, count):
            k = len(expected) + 1
            true.append(planar_transform(10.0 * agent, -4.0, 15.0 * agent))
            estimated.append(planar_transform(10.0 * agent, -4.0 + 0.1 * k, 15.0 * agent + k))
            expected.append(k)
    translation, yaw = transform_pose_errors(torch.stack(estimated), torch.stack(true),
                                             record_len)
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(translation, 0.1 * expected)
    torch.testing.assert_close(yaw, expected, rtol=0, atol=1e-5)   # planar_transform's float32


def test_tally_pools_ranks_and_reports_stages_it_saw():
    true = torch.stack([torch.eye(4), planar_transform(10, 0, 0).float()])
    reported = torch.stack([torch.eye(4), planar_transform(10.6, 0, 0).float()])
    corrected = torch.stack([torch.eye(4), planar_transform(10.1, 0, 0).float()])
    rank0, rank1 = PoseErrorTally(), PoseErrorTally()
    rank0.add([2], true, reported, corrected)
    rank1.add([2], true, reported.clone(), true.clone())
    rank1.add([1], true[:1], true[:1])                       # a lone ego: no pair
    rank0.merge(rank1.state_dict())
    summary = rank0.summary()
    assert summary["before"]["pairs"] == 2 and summary["after"]["pairs"] == 2
    assert summary["before"]["median_translation_m"] == pytest.approx(0.6, abs=1e-5)
    assert summary["after"]["mean_translation_m"] == pytest.approx(0.05, abs=1e-5)
    uncorrected = PoseErrorTally()
    uncorrected.add([2], true, reported)
    assert set(uncorrected.summary()) == {"before"}
    assert PoseErrorTally().summary() == {}


def box(x: float, y: float, yaw_deg: float) -> list:
    """A 7-number box [x, y, z, h, w, l, yaw] at a planar pose."""
    return [x, y, -1.0, 1.5, 1.6, 3.9, math.radians(yaw_deg)]


def test_stage1_box_offsets_by_hand():
    # Sample 0: the ego sees boxes at (10, 0) heading 0 and (20, 5) heading 10 deg; agent 1
    # stands at (5, 0) turned 90 deg, so its own-frame (x, y) = (y_ego, 5 - x_ego): it sees the
    # first 0.3 m off and back to front (+2 deg: 2 deg after folding the half turn), the second
    # 0.4 m off with heading 13 deg, and a box 3 m from anything (no match). Sample 1: a lone
    # ego (no pair) and an agent with no boxes.
    boxes = [torch.tensor([box(10, 0, 0), box(20, 5, 10)]),
             torch.tensor([box(0, -5.3, -90 + 182), box(5.4, -15, -90 + 13), box(-3, 0, 0)]),
             torch.tensor([box(1, 1, 0)]), torch.zeros(0, 7)]
    true = torch.stack([torch.eye(4, dtype=torch.float64), planar_transform(5, 0, 90),
                        torch.eye(4, dtype=torch.float64), planar_transform(3, 3, 0)])
    distance, heading = stage1_box_offsets(boxes, true, [2, 2])
    torch.testing.assert_close(distance, torch.tensor([0.3, 0.4], dtype=torch.float64),
                               atol=1e-5, rtol=0)
    torch.testing.assert_close(heading, torch.tensor([2.0, 3.0], dtype=torch.float64),
                               atol=1e-4, rtol=0)
    tally = PoseErrorTally()
    tally.add_stage1_boxes([2, 2], true.float(), boxes)
    summary = tally.summary()["stage1_boxes"]
    assert summary["pairs"] == 2
    assert summary["median_offset_m"] == pytest.approx(0.3, abs=1e-5)   # lower median
    assert summary["median_heading_deg"] == pytest.approx(2.0, abs=1e-4)


class Stage1Stub(torch.nn.Module):
    """A single-agent model whose head outputs are fixed; records what it was given."""

    def __init__(self, outputs):
        super().__init__()
        self.outputs, self.seen = outputs, {}

    def forward(self, batch):
        self.seen = batch
        return self.outputs


class PreparerStub:
    """Stage 1's own pillarisation: records the batch, returns fixed inputs."""

    def __init__(self, postprocessor):
        self.postprocessor, self.seen = postprocessor, None

    def model_inputs(self, batch):
        self.seen = batch
        return {"voxel_features": torch.zeros(1), "shared_points": torch.zeros(2),
                "record_len": batch["record_len"]}


def test_corrector_runs_stage1_per_agent_and_keeps_the_reported_transforms(monkeypatch):
    postprocessor = build_postprocessor(load_config(CONFIGS / "smoke.yaml"), torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    outputs = {"cls_preds": torch.randn(3, 2, 16, 32, generator=gen) - 2.5,
               "reg_preds": torch.randn(3, 14, 16, 32, generator=gen) * 0.3,
               "dir_preds": torch.randn(3, 4, 16, 32, generator=gen),
               "unc_preds": torch.zeros(3, 6, 16, 32)}
    reported = torch.eye(4).repeat(3, 1, 1)
    reported[1, 0, 3] = 7.0
    corrected = reported.clone()
    corrected[1, 0, 3] = 6.5
    seen = {}

    def fake_graph(transforms, boxes, log_vars, record_len, args):
        seen.update(boxes=len(boxes), log_vars=[v.shape[1] for v in log_vars],
                    record_len=record_len, radius=args.cluster_radius)
        return corrected

    monkeypatch.setattr(pose_correction, "box_align_transforms_to_ego", fake_graph)
    stage1, preparer = Stage1Stub(outputs), PreparerStub(postprocessor)
    args = pose_correction.BoxAlignArgs(cluster_radius=2.5)
    batch = {"record_len": torch.tensor([2, 1]), "transforms_to_ego": reported,
             "points_in_agent_frame": True}
    inputs = {"record_len": torch.tensor([2, 1]), "transforms_to_ego": reported}
    out = pose_correction.PoseCorrector(stage1, preparer, args)(batch, inputs)
    assert preparer.seen is batch                       # stage 1 pillarises the raw batch
    assert stage1.seen["record_len"].tolist() == [1, 1, 1]      # every agent on its own
    assert "shared_points" not in stage1.seen
    assert seen == {"boxes": 3, "log_vars": [3, 3, 3], "record_len": [2, 1], "radius": 2.5}
    assert out["transforms_to_ego"] is corrected
    assert out["transforms_to_ego_reported"] is reported
    assert out["record_len"].tolist() == [2, 1]                 # the fusion model's grouping
    assert inputs["transforms_to_ego"] is reported              # the caller's dict untouched
    with pytest.raises(ConfigError, match="own-frame data"):
        pose_correction.PoseCorrector(stage1, preparer, args)(
            {**batch, "points_in_agent_frame": False}, inputs)


def test_correction_modes():
    late = load_config(CONFIGS / "point_pillar_late_fusion.yaml")
    inter = load_config(CONFIGS / "point_pillar_attfuse.yaml")
    with_section = ["box_align={stage1_model_dir: runs/stage1}"]
    assert correction_modes(inter["box_align"], get_strategy("intermediate")) == [
        {"suffix": "", "fusion": "intermediate", "correct": False}]
    assert correction_modes(late["box_align"], get_strategy("late_box_align")) == [
        {"suffix": "", "fusion": "late", "correct": False},
        {"suffix": "_aligned", "fusion": "late_box_align", "correct": False}]
    late_aligned = load_config(CONFIGS / "point_pillar_late_fusion.yaml", with_section)
    late_modes = correction_modes(late_aligned["box_align"], get_strategy("late"))
    assert [m["fusion"] for m in late_modes] == ["late", "late_box_align"]
    inter_aligned = load_config(CONFIGS / "point_pillar_attfuse.yaml", with_section)
    intermediate = get_strategy("intermediate")
    inter_modes = correction_modes(inter_aligned["box_align"], intermediate)
    assert [m["correct"] for m in inter_modes] == [False, True]


def never_loaded(cfg, path):
    raise AssertionError("the stage-1 model must not be loaded")


def test_load_pose_corrector_refusals(tmp_path):
    proj_first = load_config(CONFIGS / "point_pillar_attfuse.yaml",
                             ["box_align={stage1_model_dir: runs/stage1}"])
    intermediate, late = get_strategy("intermediate"), get_strategy("late")
    assert pose_correction.load_pose_corrector(
        load_config(CONFIGS / "point_pillar_attfuse.yaml"), intermediate, "cpu",
        never_loaded) is None
    assert pose_correction.load_pose_corrector(proj_first, late, "cpu", never_loaded) is None
    with pytest.raises(ConfigError, match="proj_first"):
        pose_correction.load_pose_corrector(proj_first, intermediate, "cpu", never_loaded)
    own_frame = ["fusion.args.proj_first=false"]
    no_dir = load_config(CONFIGS / "point_pillar_attfuse.yaml",
                         own_frame + ["box_align={stage1_model_dir: null}"])
    with pytest.raises(ConfigError, match="box_align.stage1_model_dir: an intermediate run"):
        pose_correction.load_pose_corrector(no_dir, intermediate, "cpu", never_loaded)
    missing = load_config(CONFIGS / "point_pillar_attfuse.yaml",
                          own_frame + [f"box_align={{stage1_model_dir: {tmp_path / 'none'}}}"])
    with pytest.raises(ConfigError, match="config.yaml not found"):
        pose_correction.load_pose_corrector(missing, intermediate, "cpu", never_loaded)
    stage1_dir = tmp_path / "stage1"
    stage1_dir.mkdir()
    cfg = load_config(CONFIGS / "point_pillar_attfuse.yaml",
                      own_frame + [f"box_align={{stage1_model_dir: {stage1_dir}}}"])
    save_config(load_config(CONFIGS / "point_pillar_attfuse.yaml"), stage1_dir / "config.yaml")
    with pytest.raises(ConfigError, match="must be a single-agent run"):
        pose_correction.load_pose_corrector(cfg, intermediate, "cpu", never_loaded)


def test_clean_and_latency_settings_switch_training_noise_off():
    # CoAlign trains with 0.2 m / 0.2 deg pose noise in its wild_setting: "clean" must not
    # evaluate with it, the noise levels must use their own spread.
    from opencood.config import apply_overrides, resolve
    from opencood.engine.evaluator import settings_to_run
    cfg = load_config(CONFIGS / "point_pillar_coalign.yaml")
    assert cfg["wild_setting"]["loc_err"] and cfg["wild_setting"]["xyz_std"] == 0.2
    wild = {s["tag"]: resolve(apply_overrides(cfg, s["overrides"]), "test")["wild_setting"]
            for s in settings_to_run([0.6], [2], seeds=2)}
    assert not wild[""]["loc_err"] and not wild["latency2"]["loc_err"]
    assert wild["latency2"]["latency_frames"] == 2
    assert wild["noise0.6_seed1"]["loc_err"] and wild["noise0.6_seed1"]["xyz_std"] == 0.6
    assert wild["noise0.6_seed0"]["seed"] != wild["noise0.6_seed1"]["seed"]


def test_the_authors_box_align_args_load_as_written():
    # CoAlign's opv2v pointpillar_coalign.yaml box_align.args, every key theirs.
    theirs = ("{use_uncertainty: true, landmark_SE2: true, adaptive_landmark: false, "
              "normalize_uncertainty: false, abandon_hard_cases: true, drop_hard_boxes: true}")
    cfg = load_config(CONFIGS / "point_pillar_uncertainty.yaml", [f"box_align={{args: {theirs}}}"])
    assert pose_correction.box_align_args(cfg["box_align"]) == pose_correction.BoxAlignArgs()
    with pytest.raises(ConfigError, match="box_align.args.landmark_se2"):
        load_config(CONFIGS / "point_pillar_uncertainty.yaml",
                    ["box_align={args: {landmark_se2: false}}"])
