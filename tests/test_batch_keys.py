"""The batch layout is declared once (opencood.batch_keys): every sample, collated batch, fake
batch and model input carries only declared keys, and a sample may carry no points."""
import numpy as np
import pytest
import torch

from opencood import batch_keys
from opencood.data.collate import collate_samples
from opencood.data.datasets import (EarlyFusionDataset, IntermediateFusionDataset,
                                    LateFusionDataset, NoFusionDataset)
from opencood.data.pipeline import BatchPreparer
from opencood.ops.voxelize import PillarizeConfig
from opencood.utils.fake_batch import fake_collated_batch
from tests.opv2v_factory import write_simple_split

RANGE = [-48.0, -24.0, -3.0, 48.0, 24.0, 1.0]
VOXEL = [0.8, 0.8, 4.0]


@pytest.fixture(scope="module")
def road(tmp_path_factory):
    return write_simple_split(tmp_path_factory.mktemp("road") / "train", num_cavs=3, spacing=8.0)


def dataset_variants(split_dir):
    common = dict(lidar_range=RANGE, gt_range=RANGE, cache_dir=split_dir.parent / "cache")
    return {
        "no": NoFusionDataset(split_dir, **common),
        "early": EarlyFusionDataset(split_dir, **common),
        "intermediate": IntermediateFusionDataset(split_dir, **common),
        "intermediate_own_frame_teacher": IntermediateFusionDataset(
            split_dir, proj_first=False, with_early_fusion=True, **common),
        "late_train": LateFusionDataset(split_dir, train=True, **common),
        "late_test": LateFusionDataset(split_dir, **common),
    }


def preparer(static_pillars=0):
    pillarize = PillarizeConfig(lidar_range=RANGE, voxel_size=VOXEL, max_points_per_pillar=8,
                                static_pillars=static_pillars)
    return BatchPreparer(pillarize, postprocessor=None, device="cpu")


def test_every_dataset_sample_batch_and_model_input_uses_declared_keys(road):
    for name, dataset in dataset_variants(road).items():
        samples = [dataset[0], dataset[1]]
        for sample in samples:
            batch_keys.check_keys("sample", sample, f"{name} dataset")
        batch = collate_samples(samples)
        batch_keys.check_keys("batch", batch, f"collate of {name}")
        if "early_fusion" in batch:
            batch_keys.check_keys("batch", batch["early_fusion"], f"{name} early_fusion")
        for static in (0, 64):
            inputs = preparer(static).model_inputs(batch)
            batch_keys.check_keys("model input", inputs, f"preparer of {name}")
            assert ("voxel_valid" in inputs) == bool(static)


def test_fake_batch_has_the_collated_layout():
    cfg = {"preprocess": {"cav_lidar_range": RANGE, "args": {"voxel_size": VOXEL}}}
    fake = fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=2,
                               pillars_per_agent=20)
    batch_keys.check_keys("batch", fake, "fake_collated_batch")
    # The fake batch holds every common key a collated batch of a LiDAR sample has (a
    # heterogeneous batch has its agents' modalities too); the class ids only with classes (a
    # single-class batch is what it was before issue 38).
    declared_common = set(batch_keys.keys_of(batch_keys.BATCH, batch_keys.COMMON)) - set(
        batch_keys.HETER_KEYS)
    assert declared_common - set(fake) == {"gt_classes"}
    classes = fake_collated_batch(cfg["preprocess"], batch_size=2, pillars_per_agent=20,
                                  max_gt=3, num_classes=2)
    batch_keys.check_keys("batch", classes, "fake_collated_batch")
    assert declared_common <= set(classes)
    assert classes["gt_classes"].tolist() == [[0, 1, 0], [0, 1, 0]]


def test_an_undeclared_key_is_named():
    with pytest.raises(KeyError, match="collate emits batch keys not declared.*radar_points"):
        batch_keys.check_keys("batch", {"points": 0, "radar_points": 1}, "collate")


def test_the_model_docstrings_list_every_model_input_key():
    from opencood.models import detectors
    for name in batch_keys.MODEL_INPUT:
        assert f"    {name} " in detectors.__doc__, name


def camera_sample(agents: int, cameras: int = 4, height: int = 8, width: int = 16):
    generator = np.random.default_rng(agents)
    eye = np.eye(4, dtype=np.float32)
    return {
        "sample_key": ("s", f"{agents:06d}"), "agent_ids": list(range(agents)),
        "agent_types": np.zeros(agents, np.int64),
        "agent_latency": np.zeros(agents, np.int64),
        "transforms_to_ego": np.repeat(eye[None], agents, 0),
        "transforms_to_ego_clean": np.repeat(eye[None], agents, 0),
        "gt_boxes": np.zeros((1, 7), np.float32), "gt_ids": np.zeros(1, np.int64),
        "gt_ego_points": np.full(1, -1, np.int64), "shared_points": 0,
        "points_in_agent_frame": True,
        "images": generator.random((agents, cameras, 3, height, width), np.float32),
        "intrinsics": np.repeat(np.eye(3, dtype=np.float32)[None, None], agents, 0).repeat(
            cameras, 1),
        "extrinsics": np.repeat(eye[None, None], agents, 0).repeat(cameras, 1),
        "post_rots": np.repeat(np.eye(3, dtype=np.float32)[None, None], agents, 0).repeat(
            cameras, 1),
        "post_trans": np.zeros((agents, cameras, 3), np.float32),
    }


def test_a_sample_without_points_collates_and_prepares():
    samples = [camera_sample(2), camera_sample(3)]
    for sample in samples:
        batch_keys.check_keys("sample", sample, "camera sample")
    batch = collate_samples(samples)
    batch_keys.check_keys("batch", batch, "collate of camera samples")
    assert "points" not in batch and batch["record_len"].tolist() == [2, 3]
    assert batch["images"].shape == (5, 4, 3, 8, 16)
    assert torch.equal(batch["images"][2:], torch.from_numpy(samples[1]["images"]))
    inputs = preparer().model_inputs(batch)
    batch_keys.check_keys("model input", inputs, "preparer of camera samples")
    assert "voxel_features" not in inputs
    assert torch.equal(inputs["extrinsics"], batch["extrinsics"])


def test_keys_are_grouped_by_modality():
    assert batch_keys.keys_of(batch_keys.BATCH, batch_keys.LIDAR)[:2] == ("points",
                                                                         "agent_index")
    assert set(batch_keys.keys_of(batch_keys.MODEL_INPUT, batch_keys.CAMERA)) == {
        "images", "intrinsics", "extrinsics", "post_rots", "post_trans", "depth_maps",
        "modality_cameras"}
    assert batch_keys.CAMERA_TENSORS == ("images", "intrinsics", "extrinsics", "post_rots",
                                         "post_trans", "depth_maps")
    for table in batch_keys.STAGES.values():
        assert all(key.modality in batch_keys.MODALITIES for key in table.values())
