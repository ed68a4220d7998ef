"""Fusion datasets, augmentation, pose noise, latency, collate and loader determinism."""
import numpy as np
import pytest
import torch

from opencood.data.augment import augment_sample
from opencood.data.collate import WORKER_PRELOAD, collate_samples, seed_worker, worker_context
from opencood.data.datasets import (EarlyFusionDataset, IntermediateFusionDataset,
                                    LateFusionDataset, NoFusionDataset, build_dataset)
from opencood.data.wild import WildSetting
from opencood.strategies import choose_strategy
from opencood.ops.transforms import points_in_boxes_mask
from tests.opv2v_factory import write_road_rsu, write_simple_split

RANGE = [-60.0, -60.0, -3.0, 60.0, 60.0, 1.0]  # square: rotated cars stay inside
AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x", "y"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-3.1416, 3.1416]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.9, 1.1]}]


@pytest.fixture(scope="module")
def road(tmp_path_factory):
    return write_simple_split(tmp_path_factory.mktemp("road") / "train", num_cavs=5, spacing=8.0)


@pytest.fixture(scope="module")
def road_with_rsu(tmp_path_factory):
    """Two vehicle CAVs 20 m apart and a roadside unit 4.5 m up at (10, -8)."""
    split_dir = tmp_path_factory.mktemp("road_rsu") / "train"
    write_simple_split(split_dir, num_cavs=2, spacing=20.0)
    return write_road_rsu(split_dir)


def make(cls, split_dir, **kwargs):
    kwargs.setdefault("lidar_range", RANGE)
    kwargs.setdefault("gt_range", RANGE)
    return cls(split_dir, cache_dir=split_dir.parent / "cache", **kwargs)


def test_augmentation_keeps_points_inside_their_boxes():
    rng = np.random.default_rng(0)
    boxes = np.array([[5.0, 2.0, -1.0, 1.5, 2.0, 4.5, 0.3],
                      [-10.0, -4.0, -0.8, 1.6, 1.8, 4.0, -2.0]])
    inside = [b[:3] + rng.uniform(-0.5, 0.5, (20, 3)) * [1, 1, 0.5] for b in boxes]
    cloud_a = np.concatenate([np.c_[inside[0], np.ones(20)], rng.uniform(-30, 30, (50, 4))])
    cloud_b = np.c_[inside[1], np.zeros(20)]
    before = [points_in_boxes_mask(c, boxes) for c in (cloud_a, cloud_b)]
    assert before[0][0].sum() >= 20 and before[1][1].sum() == 20
    for seed in range(10):
        (aug_a, aug_b), aug_boxes, params = augment_sample(
            [cloud_a.astype(np.float32), cloud_b.astype(np.float32)], boxes, AUGMENT,
            np.random.default_rng(seed))
        after = [points_in_boxes_mask(c, aug_boxes, margin=1e-4) for c in (aug_a, aug_b)]
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
        assert np.all(np.abs(aug_boxes[:, 6]) <= np.pi + 1e-9)
    assert "rotation" in params and "scale" in params


def test_augmented_dataset_boxes_contain_the_car_points(road):
    dataset = make(EarlyFusionDataset, road, train=True, augment_cfg=AUGMENT)
    for epoch in range(3):
        dataset.set_epoch(epoch)
        sample = dataset[1]
        inside = points_in_boxes_mask(sample["agent_points"][0], sample["gt_boxes"], margin=0.05)
        # Every GT car is one cluster of points from each of the 5 CAVs (30 points each).
        assert len(sample["gt_boxes"]) == 4
        assert (inside.sum(axis=1) == 5 * 30).all()


@pytest.mark.parametrize("num_cavs", [1, 2, 3, 4, 5])
def test_collate_shapes_with_1_to_5_cavs(road, num_cavs):
    dataset = make(IntermediateFusionDataset, road, max_cav=num_cavs)
    batch = collate_samples([dataset[0], dataset[2]])
    assert batch["record_len"].tolist() == [num_cavs, num_cavs]
    assert batch["transforms_to_ego"].shape == (2 * num_cavs, 4, 4)
    assert batch["points"].shape == (2 * num_cavs * 4 * 30, 4)
    assert batch["agent_index"].unique().tolist() == list(range(2 * num_cavs))
    assert batch["gt_boxes"].shape == (2, 4, 7) and batch["gt_mask"].all()
    assert batch["sample_keys"][1][1] == "000004"


def test_no_early_late_agent_counts(road):
    assert make(NoFusionDataset, road)[0]["agent_ids"] == ["1000"]
    early = make(EarlyFusionDataset, road)[0]
    # each of the 4 non-ego CAVs sent its 4 cars x 30 points
    assert len(early["agent_points"]) == 1 and early["shared_points"] == 4 * 30
    late_test = make(LateFusionDataset, road)[0]
    assert len(late_test["agent_points"]) == 5
    late_train = make(LateFusionDataset, road, train=True)
    assert len(late_train) == 3 * 5
    one_cav = late_train[7]                           # sample 1, CAV "1002" in its own frame
    assert one_cav["sample_key"] == ("2021_01_01_00_00_00", "000002", "1002")
    np.testing.assert_allclose(one_cav["gt_boxes"][:, 0],
                               np.array([5.0, 17.0, 29.0, 41.0]) - 16.0, atol=1e-4)


def test_pose_noise_changes_non_ego_transforms_only(road):
    clean = make(IntermediateFusionDataset, road)[0]
    noisy_ds = make(IntermediateFusionDataset, road,
                    wild=WildSetting(seed=3, loc_err=True, xyz_std=0.5, yaw_std=1.0))
    noisy = noisy_ds[0]
    np.testing.assert_array_equal(noisy["transforms_to_ego"][0], np.eye(4, dtype=np.float32))
    for agent in range(1, 5):
        assert not np.allclose(noisy["transforms_to_ego"][agent], clean["transforms_to_ego"][agent])
    np.testing.assert_array_equal(noisy["agent_points"][0], clean["agent_points"][0])
    np.testing.assert_array_equal(noisy["gt_boxes"], clean["gt_boxes"])
    # Reproducible: the same seed repeats the draws, another seed does not.
    np.testing.assert_array_equal(noisy_ds[0]["transforms_to_ego"], noisy["transforms_to_ego"])
    other = make(IntermediateFusionDataset, road,
                 wild=WildSetting(seed=4, loc_err=True, xyz_std=0.5, yaw_std=1.0))[0]
    assert not np.allclose(other["transforms_to_ego"][1], noisy["transforms_to_ego"][1])


def test_latency_delays_non_ego_points(road):
    fresh = make(IntermediateFusionDataset, road)
    delayed = make(IntermediateFusionDataset, road, wild=WildSetting(latency_frames=1))
    now, late = delayed[2], fresh[1]
    np.testing.assert_array_equal(delayed[2]["agent_points"][0], fresh[2]["agent_points"][0])
    for agent in range(1, 5):   # non-ego clouds come from timestamp 000002 instead of 000004
        np.testing.assert_array_equal(now["agent_points"][agent], late["agent_points"][agent])
    np.testing.assert_array_equal(now["gt_boxes"], fresh[2]["gt_boxes"])
    # At the first frame the delay is clamped to the first frame.
    np.testing.assert_array_equal(delayed[0]["agent_points"][1], fresh[0]["agent_points"][1])


def _loader(dataset, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True, num_workers=2,
                                       collate_fn=collate_samples, worker_init_fn=seed_worker,
                                       generator=generator,
                                       multiprocessing_context=worker_context(2))


def test_same_seed_same_batches(road):
    def run(seed, epoch):
        dataset = make(IntermediateFusionDataset, road, train=True, augment_cfg=AUGMENT, seed=7)
        dataset.set_epoch(epoch)
        return [(b["sample_keys"], b["points"]) for b in _loader(dataset, seed)]

    first, again, next_epoch = run(0, 0), run(0, 0), run(0, 1)
    for (keys_a, pts_a), (keys_b, pts_b) in zip(first, again):
        assert keys_a == keys_b and torch.equal(pts_a, pts_b)
    assert not all(torch.equal(a[1], b[1]) for a, b in zip(first, next_epoch)
                   if a[0] == b[0] and a[1].shape == b[1].shape)


def test_empty_cloud_and_no_vehicles_frames_load(tmp_path):
    split = write_simple_split(tmp_path / "train", num_cavs=2, empty_cloud_at="000000",
                               no_vehicles_at="000002")
    dataset = make(IntermediateFusionDataset, split, train=True, augment_cfg=AUGMENT)
    empty, no_gt = dataset[0], dataset[1]
    assert empty["agent_points"][0].shape == (0, 4)
    assert no_gt["gt_boxes"].shape == (0, 7)
    batch = collate_samples([empty, no_gt])
    assert batch["gt_mask"].sum() == len(empty["gt_boxes"])


def test_build_dataset_errors_are_clear(road):
    from opencood.config import load_config
    cfg = load_config("hypes_yaml/synthetic/smoke.yaml", [f"root_dir={road}", "validate_dir=null"])
    with pytest.raises(ValueError, match="validate_dir"):
        build_dataset(cfg, "validate", train=False, strategy=choose_strategy(cfg))
    with pytest.raises(KeyError, match="registered fusion methods: early, intermediate, late, late_box_align, no"):
        choose_strategy(cfg, "mid")
    with pytest.raises(ValueError, match="unknown augmentation 'flip'"):
        make(EarlyFusionDataset, road, train=True, augment_cfg=[{"NAME": "flip"}])


@pytest.mark.parametrize("config", ["point_pillar_attfuse", "point_pillar_early_fusion",
                                    "point_pillar_where2comm"])
def test_empty_cloud_and_no_vehicles_train_a_step(tmp_path, config):
    """An empty ego cloud and a frame without vehicles go through pillars, targets, the model
    and the loss with a finite loss and finite gradients."""
    from opencood.config import load_config
    from opencood.data.pipeline import BatchPreparer
    from opencood.losses import build_loss
    from opencood.models.build import build_model

    split = write_simple_split(tmp_path / "train", num_cavs=2, empty_cloud_at="000000",
                               no_vehicles_at="000002")
    cfg = load_config(f"hypes_yaml/synthetic/{config}.yaml", [
        f"root_dir={split}", "preprocess.cav_lidar_range=[-25.6, -12.8, -3, 25.6, 12.8, 1]",
        "postprocess.gt_range=[-25.6, -12.8, -3, 25.6, 12.8, 3]"])
    dataset = build_dataset_for_test(cfg, split)
    empty, no_gt = dataset[0], dataset[1]
    if config == "point_pillar_early_fusion":
        # early fusion merges the other CAV's points into the ego cloud: empty the merged one
        empty["agent_points"] = [np.zeros((0, 4), np.float32)]
    batch = collate_samples([empty, no_gt])
    preparer = BatchPreparer.from_config(cfg, "cpu")
    model = build_model(cfg["model"])
    criterion = build_loss(cfg["loss"])
    inputs, targets = preparer(batch)
    assert (targets["labels"][1] == 1).sum() == 0        # no vehicles: no positive anchor
    loss, _ = criterion(model(inputs), targets)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def build_dataset_for_test(cfg, split):
    from opencood.data.datasets import build_dataset
    return build_dataset(cfg, "train", train=False, strategy=choose_strategy(cfg),
                         cache_dir=split.parent / "cache")


def test_gt_ego_points_count_the_egos_own_returns(road):
    # Every car is a 30-point cluster in each CAV's cloud (the road fixture), so the ego's count
    # per GT box is 30, whatever the fusion method feeds the model; training skips it (-1).
    for cls in (NoFusionDataset, EarlyFusionDataset, IntermediateFusionDataset, LateFusionDataset):
        sample = make(cls, road, train=False)[1]
        assert sample["gt_ego_points"].tolist() == [30] * len(sample["gt_boxes"]), cls.__name__
        trained = make(cls, road, train=True)[1]
        assert (trained["gt_ego_points"] == -1).all() and len(trained["gt_ego_points"]) > 0
        loss_only = make(cls, road, train=False, count_ego_points=False)[1]
        assert (loss_only["gt_ego_points"] == -1).all()
        np.testing.assert_array_equal(loss_only["gt_boxes"], sample["gt_boxes"])
    batch = collate_samples([make(NoFusionDataset, road, train=False)[i] for i in (0, 2)])
    assert [c.tolist() for c in batch["gt_ego_points"]] == [[30] * 4, [30] * 4]


def test_agent_types_mark_the_rsu_from_dataset_to_model_inputs(road_with_rsu):
    from opencood.config import load_config
    from opencood.data.pipeline import BatchPreparer
    from opencood.models.build import build_model

    intermediate = make(IntermediateFusionDataset, road_with_rsu)
    sample = intermediate[0]
    assert sample["agent_ids"] == ["1000", "1001", "-1"]          # the RSU sorts last
    assert sample["agent_types"].dtype == np.int64 and sample["agent_types"].tolist() == [0, 0, 1]
    # Its 4 cars x 30 points; the return in its own-body box is cropped, as for a vehicle.
    assert len(sample["agent_points"][2]) == 4 * 30
    assert make(EarlyFusionDataset, road_with_rsu)[0]["agent_types"].tolist() == [0]
    assert make(LateFusionDataset, road_with_rsu)[0]["agent_types"].tolist() == [0, 0, 1]
    late_train = make(LateFusionDataset, road_with_rsu, train=True)
    assert [late_train[k]["agent_types"].tolist() for k in range(3)] == [[0], [0], [1]]
    batch = collate_samples([sample, intermediate[1]])
    assert batch["agent_types"].tolist() == [0, 0, 1, 0, 0, 1]
    cfg = load_config("hypes_yaml/synthetic/point_pillar_attfuse.yaml", [
        "preprocess.cav_lidar_range=[-25.6, -25.6, -3, 51.2, 25.6, 1]"])
    inputs = BatchPreparer.from_config(cfg, "cpu").model_inputs(batch)
    assert inputs["agent_types"].tolist() == [0, 0, 1, 0, 0, 1]
    # Models that do not use the type still take the inputs that carry it.
    assert build_model(cfg["model"])(inputs)["cls_preds"].shape[0] == 2


class _ParentPid(torch.utils.data.Dataset):
    """Each sample: the pid of the process that started the worker loading it."""

    def __len__(self):
        return 4

    def __getitem__(self, index):
        import os
        return os.getppid()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this platform")
def test_loader_workers_are_not_forks_of_the_trainer():
    """CPython < 3.11.8 (gh-112275): a fork of the multi-threaded trainer can deadlock its child,
    so workers come from a forkserver that has imported torch and the datasets once."""
    import os
    context = worker_context(2)
    assert context.get_start_method() == "forkserver"
    assert {"torch", "opencood.data.datasets", "__main__"} <= set(WORKER_PRELOAD)
    assert worker_context(0) is None                 # DataLoader refuses a context without workers
    loader = torch.utils.data.DataLoader(_ParentPid(), batch_size=None, num_workers=2,
                                         multiprocessing_context=context)
    parents = set(loader) | set(loader)              # two epochs: workers started twice
    assert len(parents) == 1 and os.getpid() not in parents


def test_every_loader_is_built_by_build_loader_with_worker_context():
    """The project builds DataLoaders in one place (collate.build_loader), which passes
    multiprocessing_context=worker_context(...); every tool builds its loaders with it."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    built, callers = [], set()
    sources = [*root.joinpath("opencood").rglob("*.py"), *root.joinpath("tools").glob("*.py")]
    for path in sorted(sources):
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(getattr(node, "func", None), "attr", None) or \
                getattr(getattr(node, "func", None), "id", None)
            if isinstance(node, ast.Call) and name == "DataLoader":
                context = {k.arg: k.value for k in node.keywords}.get("multiprocessing_context")
                assert isinstance(context, ast.Call) and \
                    getattr(context.func, "id", None) == "worker_context", f"{path}:{node.lineno}"
                built.append(path.name)
            if isinstance(node, ast.Call) and name == "build_loader":
                callers.add(path.name)
    assert built == ["collate.py"]
    assert {"trainer.py", "recipe.py", "evaluator.py", "bench.py"} <= callers
