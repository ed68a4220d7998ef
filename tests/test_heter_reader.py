"""OPV2V-H read exactly: our heterogeneous datasets against HEAL's own heterogeneous data set,
sample by sample, on our synthetic OPV2V-H folders (docs/DESIGN.md §4.4).

The fixture (tests/fixtures/heter_reader/heter.npz, made by
tools/reference/compare_heter_reader.py in a side environment) holds what HEAL's
``IntermediateheterFusionDataset`` over ``OPV2VBaseDataset`` reads in evaluation, for two heter
settings (its m1m2m3 yaml with the generator's assignment; ego m1 with an unmatched modality
and a hand-made assignment): per sample the agents, ego first, and their modalities; per LiDAR
agent the cloud of its modality's file (own body removed); per agent its transform to the ego;
per camera agent its images' channel sums, depth channel and matrices; the GT. Also HEAL's own
assignment files of the folders, which the generator's must equal byte for byte. We regenerate
the folders and read them through a config holding HEAL's heter section and ``build_dataset``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from opencood.config import load_config
from opencood.data.datasets import build_dataset
from opencood.data.synthetic.writer import ASSIGNMENT_FILES, ASSIGNMENT_FOLDER
from opencood.strategies import choose_strategy
from tests.reference_fixtures import load_npz_fixture
from tests.tool_modules import load_tool

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "heter_reader" / "heter.npz"
MATRIX_TOL, SUM_TOL, BOX_TOL = 1e-6, 1e-6, 1e-3
pytestmark = pytest.mark.usefixtures("private_point_cache")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The folders the fixture was made from (the script's own generation, deterministic)."""
    root = tmp_path_factory.mktemp("heter_reader")
    load_tool("reference/compare_heter_reader").generate_folders(root)
    return root


@pytest.fixture(scope="module")
def fixture():
    return load_npz_fixture(FIXTURE)


def _config(root: Path, split: str, heter: dict, meta: dict, tmp_path: Path) -> dict:
    """Our intermediate own-frame config with HEAL's heter section, ranges, order, comm range
    and max_cav (no augmentation, no noise: HEAL's evaluation)."""
    import yaml
    heter = {**heter, "assignment_path": str(root / heter["assignment_path"])}
    cfg = {"name": "heal_heter", "root_dir": str(root / split), "test_dir": str(root / split),
           "fusion": {"core_method": "intermediate", "args": {"proj_first": False}},
           "input_source": ["lidar", "camera", "depth"], "heter": heter,
           "comm_range": meta["comm_range"],
           "train_params": {"batch_size": 1, "epoches": 1, "max_cav": meta["max_cav"]},
           "preprocess": {"args": {"voxel_size": [0.4, 0.4, 4.0]},
                          "cav_lidar_range": meta["gt_range"]},
           "postprocess": {"gt_range": meta["gt_range"], "order": meta["order"],
                           "max_num": 150},
           "model": {"core_method": "point_pillar_intermediate", "args": {
               "point_pillar_scatter": {"num_features": 16},
               "base_bev_backbone": {"layer_nums": [1], "layer_strides": [2],
                                     "num_filters": [16], "upsample_strides": [1],
                                     "num_upsample_filter": [16]},
               "fusion": {"core_method": "fcooper"}}},
           "loss": {"core_method": "point_pillar_loss"}, "optimizer": {"lr": 0.002}}
    path = tmp_path / f"{split}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return load_config(path)


def test_the_generators_assignments_are_heals(folders, fixture):
    _, meta = fixture
    for name, function in zip(ASSIGNMENT_FILES, ("assign_modality_4",
                                                 "assign_modality_4_in_order")):
        assert (folders / ASSIGNMENT_FOLDER / name).read_text() == meta["assignments"][function]


def test_each_agent_reads_what_heal_reads(folders, fixture, tmp_path):
    reference, meta = fixture
    agent_start, box_start, camera_start = (reference[key] for key in (
        "agent_start", "box_start", "camera_start"))
    datasets = {}
    for sample, (variant, split, index) in enumerate(zip(
            reference["sample_variant"], reference["sample_split"], reference["sample_index"])):
        if (variant, split) not in datasets:
            cfg = _config(folders, str(split), meta["heter"][str(variant)], meta, tmp_path)
            datasets[variant, split] = build_dataset(cfg, "test", False, choose_strategy(cfg))
        dataset = datasets[variant, split]
        ours = dataset[int(index)]
        agents = slice(agent_start[sample], agent_start[sample + 1])
        where = f"{variant} {split}[{index}]"
        # the agents taking part, ego first (HEAL's reorder, unmatched agents left out), and
        # each one's modality
        assert [int(a) for a in ours["agent_ids"]] == reference["agent_ids"][agents].tolist(), \
            where
        assert ours["agent_modality"] == reference["agent_modality"][agents].tolist(), where
        np.testing.assert_allclose(ours["transforms_to_ego"], reference["agent_to_ego"][agents],
                                   atol=MATRIX_TOL, err_msg=where)
        # each LiDAR agent reads its modality's file (64, 32 or 16 beams)
        scenario, timestamp = ours["sample_key"]
        for cav_id, modality, count, sums in zip(
                ours["agent_ids"], ours["agent_modality"], reference["agent_points"][agents],
                reference["agent_sums"][agents]):
            if count < 0:
                continue
            points = dataset.split.load_points(scenario, cav_id, timestamp,
                                               channels=dataset.plan.channels(modality))
            assert len(points) == count, (where, cav_id)
            np.testing.assert_allclose(points.astype(np.float64).sum(axis=0), sums,
                                       rtol=SUM_TOL, err_msg=f"{where} {cav_id}")
        # each camera agent's images, depth and matrices, by modality in agent order
        cameras = slice(camera_start[sample], camera_start[sample + 1])
        rows = {}
        for cav_id, modality in zip(ours["agent_ids"], ours["agent_modality"]):
            if modality in ours["modality_cameras"]:
                rows.setdefault(modality, []).append(cav_id)
        ours_flat = [(modality, row) for modality, ids in rows.items()
                     for row in range(len(ids))]
        assert [int(c) for ids in rows.values() for c in ids] == \
            reference["camera_agent"][cameras].tolist(), where
        for k, (modality, row) in enumerate(ours_flat):
            group = ours["modality_cameras"][modality]
            theirs = camera_start[sample] + k
            np.testing.assert_allclose(group["images"][row].astype(np.float64).sum(axis=(2, 3)),
                                       reference["rgb_sums"][theirs], rtol=SUM_TOL, atol=1e-3,
                                       err_msg=where)
            assert np.array_equal(group["depth_maps"][row], reference["depth"][theirs]), where
            for key in ("intrinsics", "extrinsics", "post_rots", "post_trans"):
                np.testing.assert_allclose(group[key][row], reference[key][theirs],
                                           atol=MATRIX_TOL, err_msg=f"{where} {key}")
        # the GT: every agent's LiDAR labels in the ego frame
        boxes = slice(box_start[sample], box_start[sample + 1])
        order = np.argsort(reference["box_ids"][boxes])
        assert ours["gt_ids"].tolist() == reference["box_ids"][boxes][order].tolist(), where
        theirs = reference["boxes"][boxes][order]
        np.testing.assert_allclose(ours["gt_boxes"][:, :6], theirs[:, :6], atol=BOX_TOL,
                                   err_msg=where)
        yaw_gap = np.angle(np.exp(1j * (ours["gt_boxes"][:, 6] - theirs[:, 6])))
        assert np.abs(yaw_gap).max(initial=0) < BOX_TOL, where
