"""The fast per-sample pipeline (issue 28) builds the samples the old one built.

The old path is kept in ``tests/reference_pipeline.py``; on a small synthetic V2X scenario (two
vehicles and a roadside unit, real ray-cast clouds, crops that cut) every fusion dataset, with
augmentation on and off, pose noise and latency on, must give the same sample: the same keys,
agents, types and latencies, the same augmentation draws (hence the same GT ids and visibility
counts), points and boxes equal up to float32 rounding. The same holds on the tiny world
written as V2V4Real and as DAIR-V2X-C.
"""
import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from opencood.data.collate import build_loader
from opencood.data.datasets import (EarlyFusionDataset, IntermediateFusionDataset,
                                    LateFusionDataset, NoFusionDataset)
from opencood.data.opv2v import remove_own_body_points
from opencood.data.pcd import read_pcd, write_pcd
from opencood.data.synthetic import generate_dataset
from opencood.data.synthetic.presets import get_preset
from opencood.data.wild import WildSetting
from tests.reference_pipeline import reference_sample

# Narrower than the clouds (60 m LiDAR range) so the crop cuts in every direction.
LIDAR_RANGE = [-40.0, -20.0, -2.5, 40.0, 20.0, 0.5]
GT_RANGE = [-48.0, -24.0, -3.0, 48.0, 24.0, 1.0]
AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x", "y"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-3.1416, 3.1416]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.9, 1.1]}]
WILD = WildSetting(seed=7, loc_err=True, xyz_std=0.5, yaw_std=2.0, latency_frames=1)
DATASETS = {"no": NoFusionDataset, "early": EarlyFusionDataset,
            "intermediate": IntermediateFusionDataset, "late": LateFusionDataset}
# Points agree to float32 rounding of coordinates up to ~70 m (ulp 7.6e-6), a few roundings deep.
POINT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def v2x_split(tmp_path_factory):
    """One scenario of 3 frames: 2 vehicle CAVs and a roadside unit (~20k points each)."""
    out = tmp_path_factory.mktemp("pipeline_v2x")
    preset = dataclasses.replace(get_preset("v2x_small"), frames=3,
                                 scenarios={"train": 1, "validate": 0, "test": 0})
    generate_dataset(out, preset=preset, seed=0, workers=1, progress=False)
    return out / "train", tmp_path_factory.mktemp("pipeline_cache")


def make_dataset(split, fusion: str, augment: bool, **extra):
    split_dir, cache_dir = split
    return DATASETS[fusion](split_dir, lidar_range=LIDAR_RANGE, gt_range=GT_RANGE,
                            train=augment, augment_cfg=AUGMENT if augment else None, wild=WILD,
                            seed=3, cache_dir=cache_dir, count_ego_points=True, **extra)


def near_crop_bound(point: np.ndarray, limit_range) -> bool:
    """A point within the tolerance of a crop face: rounding may put it on either side."""
    return any(min(abs(point[axis] - limit_range[axis]), abs(point[axis] - limit_range[axis + 3]))
               < POINT_TOLERANCE for axis in range(3))


def assert_same_points(new: np.ndarray, reference: np.ndarray, limit_range) -> None:
    """(N, 4) float32 clouds equal up to rounding; a point only one of them kept must lie on a
    crop face (both keep the source order, so one walk pairs them)."""
    assert new.dtype == reference.dtype == np.float32 and new.shape[1] == 4
    if new.shape == reference.shape:
        np.testing.assert_allclose(new, reference, rtol=0, atol=POINT_TOLERANCE)
        return
    i = j = 0
    while i < len(new) or j < len(reference):
        if i < len(new) and j < len(reference) and np.allclose(new[i], reference[j], rtol=0,
                                                               atol=POINT_TOLERANCE):
            i, j = i + 1, j + 1
        elif i < len(new) and near_crop_bound(new[i], limit_range):
            i += 1
        elif j < len(reference) and near_crop_bound(reference[j], limit_range):
            j += 1
        else:
            raise AssertionError(f"clouds differ at new[{i}] / reference[{j}] "
                                 f"({len(new)} vs {len(reference)} points)")


def assert_same_sample(new: dict, reference: dict, limit_range) -> None:
    assert set(new) == set(reference)
    assert new["sample_key"] == reference["sample_key"]
    assert new["agent_ids"] == reference["agent_ids"]
    for key in ("agent_types", "agent_latency", "gt_ids", "gt_ego_points"):
        assert new[key].dtype == reference[key].dtype == np.int64, key
        np.testing.assert_array_equal(new[key], reference[key], err_msg=key)
    assert new["shared_points"] == reference["shared_points"]
    assert new["points_in_agent_frame"] == reference["points_in_agent_frame"]
    np.testing.assert_allclose(new["transforms_to_ego"], reference["transforms_to_ego"],
                               rtol=0, atol=1e-6)
    assert new["gt_boxes"].dtype == np.float32
    np.testing.assert_allclose(new["gt_boxes"], reference["gt_boxes"], rtol=0,
                               atol=POINT_TOLERANCE)
    assert len(new["agent_points"]) == len(reference["agent_points"])
    for new_points, reference_points in zip(new["agent_points"], reference["agent_points"]):
        assert_same_points(new_points, reference_points, limit_range)
    if "early_fusion_points" in reference:
        assert_same_points(new["early_fusion_points"], reference["early_fusion_points"],
                           limit_range)


def check_every_sample(dataset, epochs=(0,)) -> None:
    for epoch in epochs:
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            assert_same_sample(dataset[index], reference_sample(dataset, index), LIDAR_RANGE)


@pytest.mark.parametrize("augment", [True, False], ids=["augment", "plain"])
@pytest.mark.parametrize("fusion", list(DATASETS))
def test_samples_equal_the_reference_pipeline(v2x_split, fusion, augment):
    dataset = make_dataset(v2x_split, fusion, augment)
    assert len(dataset.split.info(0).cav_ids) == 3          # the RSU is one of the agents
    check_every_sample(dataset, epochs=(0, 1) if augment else (0,))


@pytest.mark.parametrize("augment", [True, False], ids=["augment", "plain"])
def test_distillation_cloud_equals_the_reference(v2x_split, augment):
    # DiscoNet's teacher input: every agent through its true pose, the student's augmentation.
    check_every_sample(make_dataset(v2x_split, "intermediate", augment, with_early_fusion=True))


def test_late_fusion_whole_samples_in_training_equal_the_reference(v2x_split):
    # Late fusion's AP view (every agent in its own frame) with augmentation drawn.
    check_every_sample(make_dataset(v2x_split, "late", True, per_cav=False))


@pytest.fixture(scope="module")
def real_format_splits(tmp_path_factory):
    """The tiny synthetic world written as V2V4Real (two CAVs) and as DAIR-V2X-C (a vehicle and
    a roadside unit): {dataset name: (train split, cache folder)}."""
    splits = {}
    for name, split in (("v2v4real", "train"), ("dairv2x",
                                                 "cooperative-vehicle-infrastructure/train.json")):
        out = tmp_path_factory.mktemp(f"pipeline_{name}")
        generate_dataset(out, preset="tiny", seed=0, progress=False, data_format=name)
        splits[name] = (out / split, tmp_path_factory.mktemp(f"pipeline_{name}_cache"))
    return splits


@pytest.mark.parametrize("augment", [True, False], ids=["augment", "plain"])
@pytest.mark.parametrize("fusion", list(DATASETS))
@pytest.mark.parametrize("data_format", ["v2v4real", "dairv2x"])
def test_real_world_formats_equal_the_reference_pipeline(real_format_splits, data_format, fusion,
                                                         augment):
    # Their readers give the datasets' per-key interface (4x4 poses, own-frame or world-corner
    # labels, own-body removal in their cache entries); the samples must be main's.
    dataset = make_dataset(real_format_splits[data_format], fusion, augment, dataset=data_format)
    assert len(dataset.split.info(0).cav_ids) == 2
    check_every_sample(dataset, epochs=(0, 1) if augment else (0,))


# Returns off a CAV's own body (inside opencood.data.opv2v's OWN_BODY box): the synthetic clouds
# have none, so the test below writes some into every cloud.
BODY_POINTS = np.array([[0.5, 0.3, -1.0, 40.0], [-1.5, -0.9, -0.5, 90.0]], dtype=np.float32)


def _add_body_points(tree: Path, data_format: str) -> None:
    """Every PCD under ``tree`` rewritten with BODY_POINTS appended, in its format's layout."""
    layout = ({"intensity_field": "intensity", "data": "binary"} if data_format == "dairv2x"
              else {"intensity_field": "rgb", "data": "ascii"})
    points = BODY_POINTS if data_format == "dairv2x" else BODY_POINTS / [1, 1, 1, 255]
    for path in tree.rglob("*.pcd"):
        write_pcd(path, np.concatenate([read_pcd(path), points]), **layout)


@pytest.mark.parametrize("data_format", ["v2v4real", "dairv2x"])
def test_real_world_formats_drop_own_body_returns_as_before(real_format_splits, data_format,
                                                            tmp_path):
    # main's datasets removed the own-body box from every format's agents (the roadside unit's
    # too); the readers' load_points must do it, in their own cache entries.
    split, _ = real_format_splits[data_format]
    root = split.parent                      # the data root (V2V4Real) or DAIR's folder
    copy = tmp_path / "data"
    shutil.copytree(root, copy)
    _add_body_points(copy, data_format)
    split_copy = copy / split.relative_to(root)
    for fusion in ("intermediate", "late"):
        dataset = make_dataset((split_copy, tmp_path / "cache"), fusion, True,
                               dataset=data_format)
        info = dataset.split.info(0)
        for cav_id in info.cav_ids:
            frame = (info.scenario, cav_id, info.timestamp)
            raw = dataset.split.load_cav_frame(*frame)["points"]
            kept = dataset.split.load_points(*frame)
            assert len(kept) == len(raw) - len(BODY_POINTS)
            np.testing.assert_array_equal(kept, remove_own_body_points(raw))
        check_every_sample(dataset)


def test_a_worker_collates_into_shared_memory_the_batches_made_in_process(v2x_split):
    # In a loader worker the big batch arrays are made in shared memory (no copy on the way to
    # the trainer); the batches must be those the process makes itself.
    dataset = make_dataset(v2x_split, "intermediate", True, with_early_fusion=True)
    in_process = list(build_loader(dataset, torch.device("cpu"), 0, batch_size=2))
    from_worker = list(build_loader(dataset, torch.device("cpu"), 1, batch_size=2))
    assert len(in_process) == len(from_worker) == 2
    for ours, theirs in zip(from_worker, in_process):
        assert ours["points"].is_shared() and ours["agent_index"].is_shared()
        for key in ("points", "agent_index", "record_len", "transforms_to_ego", "gt_boxes"):
            assert torch.equal(ours[key], theirs[key]), key
        for key in ("points", "agent_index"):
            assert torch.equal(ours["early_fusion"][key], theirs["early_fusion"][key]), key
