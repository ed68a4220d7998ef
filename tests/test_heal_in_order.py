"""``tools/eval.py --heter_in_order`` against HEAL's own ``inference_heter_in_order.py`` (issue 37
point 6), run on the same tiny OPV2V-H test split with the same model (ours, seeded, exported to
HEAL's layout): per step (m1; m1+m2; m1+m2+m3) and frame the agents in range and those fused
with their modalities, the GT (ids and boxes), the detections (BEV corners, z range, scores)
and the step's AP@0.3/0.5/0.7.

The fixture (tests/fixtures/heal_in_order/heal_in_order.npz) is what HEAL's script recorded in a
side environment (tools/reference/make_heal_in_order_fixture.py, whose functions regenerate the
folders and our run here): one scenario of three vehicles and a roadside unit ``-1`` (last in
HEAL's order: GT only). The run's own comm_range (15 m), ego modality, mapping and
post-processing caps are not HEAL's in-order ones, so the evaluation's overrides (180 m, ego m1,
every name to itself, HEAL's uncapped post-processing) are what makes the two agree.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.reference_fixtures import load_npz_fixture
from tests.tool_modules import load_tool

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "heal_in_order" / "heal_in_order.npz"
BOX_TOL, SCORE_TOL, AP_TOL = 1e-4, 1e-5, 1e-9
pytestmark = pytest.mark.usefixtures("private_point_cache")


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """Our in-order evaluation of the fixture's run: (per step the samples the data set gave,
    with the agents in range; the run folder). The data set class's ``__getitem__`` is wrapped
    while it runs to record them."""
    maker = load_tool("reference/make_heal_in_order_fixture")
    root = tmp_path_factory.mktemp("heal_in_order")
    maker.generate_data(root / "data")
    maker.write_run(root / "data", root / "run")
    from opencood.engine import evaluator
    steps = []
    build = evaluator.build_dataset

    def recording_build(*args, **kwargs):
        dataset = build(*args, **kwargs)
        samples = []
        steps.append(samples)
        get = type(dataset).__getitem__

        def recording_get(self, index):
            sample = get(self, index)
            samples.append({**sample, "in_range": list(self.split.info(index).cav_ids)})
            return sample

        patch.setattr(type(dataset), "__getitem__", recording_get)
        return dataset

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(evaluator, "build_dataset", recording_build)
        evaluator.main(["--model_dir", str(root / "run"), "--heter_in_order", *maker.NAMES,
                        "--batch_size", "1", "--num_workers", "0", "--save_detections"])
    return steps, root / "run"


def _frames(reference):
    """HEAL's frames, each a dict of its slices of the fixture's flat arrays."""
    frames = []
    for k, use_cav in enumerate(reference["use_cav"]):
        agents = slice(*reference["agent_start"][k:k + 2])
        gt = slice(*reference["gt_start"][k:k + 2])
        pred = slice(*reference["pred_start"][k:k + 2])
        modalities = reference["agent_modality"][agents]
        frames.append({"use_cav": int(use_cav), "in_range": reference["agent_ids"][agents],
                       "fused": reference["agent_ids"][agents][modalities != ""],
                       "modalities": modalities[modalities != ""],
                       "gt_ids": reference["gt_ids"][gt], "gt_boxes": reference["gt_boxes"][gt],
                       "bev": reference["pred_bev"][pred], "z": reference["pred_z"][pred],
                       "scores": reference["pred_scores"][pred]})
    return frames


def _our_detections(run_dir: Path, step: int, frame: int, gt_range):
    """Our detections of one frame of step ``step`` as HEAL's post-processing keeps them (8
    corners in the gt_range, z too): (BEV corners (K, 4, 2), z range (K, 2), scores (K,))."""
    from opencood.ops.transforms import boxes_to_corners_3d, corners_in_range_mask
    saved = np.load(run_dir / f"detections_test_intermediate_in_order{step}_heal.npz")
    rows = slice(*saved["frame_offsets"][frame:frame + 2])
    corners = np.asarray(boxes_to_corners_3d(torch.from_numpy(
        saved["boxes"][rows].astype(np.float64)), "hwl"))
    kept = corners_in_range_mask(corners, gt_range, min_corners=8)
    corners = corners[kept]
    z_range = np.stack([corners[..., 2].min(1), corners[..., 2].max(1)], 1)
    return corners[:, :4, :2], z_range, saved["scores"][rows][kept]


def test_in_order_steps_equal_heals_script(evaluated):
    reference, meta = load_npz_fixture(FIXTURE)
    maker = load_tool("reference/make_heal_in_order_fixture")
    steps, run_dir = evaluated
    gt_range = maker.LIDAR_RANGE
    heal_frames = _frames(reference)
    assert [f["use_cav"] for f in heal_frames] == [1, 1, 2, 2, 3, 3]
    matched = 0
    for heal, (step, frame) in zip(heal_frames, [(s, f) for s in (1, 2, 3) for f in (0, 1)]):
        ours = steps[step - 1][frame]
        where = f"step {step} frame {frame}"
        # every agent in HEAL's 180 m takes part in the GT; the first `step` of them fuse
        assert [int(a) for a in ours["in_range"]] == heal["in_range"].tolist(), where
        assert [int(a) for a in ours["agent_ids"]] == heal["fused"].tolist(), where
        assert list(ours["agent_modality"]) == heal["modalities"].tolist(), where
        # the GT: the union of every agent's labels, the same boxes
        order = np.argsort(heal["gt_ids"])
        assert ours["gt_ids"].tolist() == heal["gt_ids"][order].tolist(), where
        np.testing.assert_allclose(ours["gt_boxes"], heal["gt_boxes"][order], atol=BOX_TOL,
                                   err_msg=where)
        # the detections HEAL scored: ours kept as its post-processing keeps them, box by box
        bev, z_range, scores = _our_detections(run_dir, step, frame, gt_range)
        assert len(scores) == len(heal["scores"]) > 30, where
        centres = bev.mean(1)
        nearest = np.linalg.norm(centres[:, None] - heal["bev"].mean(1)[None], axis=2).argmin(0)
        assert sorted(nearest.tolist()) == list(range(len(scores))), where   # one to one
        np.testing.assert_allclose(bev[nearest], heal["bev"], atol=BOX_TOL, err_msg=where)
        np.testing.assert_allclose(z_range[nearest], heal["z"], atol=BOX_TOL, err_msg=where)
        np.testing.assert_allclose(scores[nearest], heal["scores"], atol=SCORE_TOL,
                                   err_msg=where)
        matched += len(scores)
    assert matched == len(reference["pred_scores"])
    # the rows: HEAL's AP per step, its GT count; and not a vacuous comparison
    rows_file, = (run_dir / "evals" / "heter").glob("test_intermediate_in_order_*.yaml")
    rows = yaml.safe_load(rows_file.read_text())["rows"]
    assert [row["agents"] for row in rows] == ["m1", "m1+m2", "m1+m2+m3"]
    for row, heal_step in zip(rows, meta["steps"]):
        assert [row["ap_30"], row["ap_50"], row["ap_70"]] == pytest.approx(heal_step["ap"],
                                                                           abs=AP_TOL)
        assert row["num_gt"] == heal_step["num_gt"]
    assert all(step["tp"][1] > 0 for step in meta["steps"])      # true positives at IoU 0.5
