"""tools/eval.py (opencood.engine.evaluator) and opencood.eval.inference, docs/DESIGN.md §7 /
issue 6.

The run folders are built directly (config.yaml + a checkpoint), not trained: a randomly
initialised PointPillars whose box regression is zeroed (boxes = anchors) and whose class weights
are made non-negative, so on the ReLU features the score rises only where there are points, i.e.
near the cars. That gives a few dozen detections per frame and a non-zero AP in seconds, so the
multi-rank comparisons below compare real numbers, not zeros.
"""
from __future__ import annotations

import hashlib
import math
import os
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import torch
import yaml

from dist_helpers import free_port, run_on_ranks
from opv2v_factory import write_simple_split
from process_state import TORCH_SWITCHES, preserved_torch_switches
from opencood.config import load_config, save_config
from opencood.engine import evaluator
from opencood.eval import inference, report
from opencood.strategies import choose_strategy, get_strategy
from opencood.eval.ap import APAccumulator
from opencood.eval.detections import DetectionCollector, write_detections
from opencood.eval.pose_error import PoseErrorTally
from opencood.models.build import build_model
from opencood.ops.transforms import relative_transform
from opencood.postprocess import VoxelPostprocessor
from opencood.postprocess.voxel_postprocessor import boxes_to_ego
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import save_checkpoint
from opencood.utils.init import init_weights
from opencood.utils.samplers import shard_bounds

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "hypes_yaml" / "synthetic" / "smoke.yaml"
# 5 samples: divisible by neither 2 nor 3, so the shards are 3+2 and 2+2+1.
TIMESTAMPS = ("000000", "000002", "000004", "000006", "000008")
NUM_CAVS = 3
LATE = ["model.core_method=point_pillar", "model.args.fusion=null", "fusion.core_method=late"]
TIMING_KEYS = ("frames_per_s", "record")      # the record's path differs per run folder


# ----------------------------------------------------------------------------------------------
# run folders
# ----------------------------------------------------------------------------------------------

def _config(data_dir: Path, overrides=()) -> dict:
    split = str(data_dir)
    return load_config(SMOKE, [f"root_dir={split}", f"validate_dir={split}",
                               f"test_dir={split}", *overrides])


def _detector(cfg: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    model = init_weights(build_model(cfg["model"]), cls_prior=0.1)
    with torch.no_grad():
        head = model.head
        for conv in (head.reg_conv, head.dir_conv):
            conv.weight.zero_()
            conv.bias.zero_()
        head.cls_conv.weight.abs_()
    return model


def _make_run(run_dir: Path, data_dir: Path, overrides=()) -> Path:
    run_dir.mkdir(parents=True)
    # pre_nms_max 64 keeps the exact rotated-IoU NMS cheap on CPU
    cfg = _config(data_dir, [*overrides, "postprocess.pre_nms_max=64"])
    save_config(cfg, run_dir / "config.yaml")
    save_checkpoint(run_dir / "last.pth", {"model": _detector(cfg).state_dict(), "epoch": 1})
    return run_dir


def _copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("config.yaml", "last.pth"):
        shutil.copy(src / name, dst / name)
    return dst


def _argv(run_dir: Path, *extra) -> list:
    return ["--model_dir", str(run_dir), "--num_workers", "0", "--batch_size", "2", *extra]


def _without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in TIMING_KEYS}


def _record_of(metrics: dict) -> dict:
    """The evaluation record an evaluator result was written to."""
    return yaml.safe_load(Path(metrics["record"]).read_text())


def _setting_words(name: str) -> str:
    """A record name without its settings hash: "test_intermediate_noise0.5"."""
    return name.rsplit("_", 1)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    data = write_simple_split(root / "data" / "test", num_cavs=NUM_CAVS, timestamps=TIMESTAMPS)
    inter = _make_run(root / "run_intermediate", data)
    late = _make_run(root / "run_late", data, LATE)
    return SimpleNamespace(root=root, data=data, inter=inter, late=late)


@pytest.fixture(scope="module")
def reference(runs):
    """Single-process evaluation of each run (in copies, so other tests do not touch them)."""
    inter = _copy_run(runs.inter, runs.root / "ref_intermediate")
    late = _copy_run(runs.late, runs.root / "ref_late")
    (inter_metrics,) = evaluator.main(_argv(inter))
    (late_metrics,) = evaluator.main(_argv(late, "--save_vis", "--vis_count", "1"))
    return SimpleNamespace(inter=inter_metrics, late=late_metrics, inter_dir=inter, late_dir=late)


def test_reference_results_are_not_trivial(reference):
    """The comparisons below would prove little on an empty detector."""
    for metrics in (reference.inter, reference.late):
        assert metrics["num_frames"] == len(TIMESTAMPS)
        assert metrics["num_gt"] > 0 and metrics["num_det"] > 0
        assert metrics["ap_30"] > 0
    # Late fusion pictures draw every agent's cloud after moving it to the ego frame.
    assert len(list((reference.late_dir / "vis").glob("*.png"))) == 1


# ----------------------------------------------------------------------------------------------
# 1. multi-rank == single-rank, every sample exactly once
# ----------------------------------------------------------------------------------------------

def _eval_on_rank(rank, world_size, jobs):
    """Rank body: evaluator.main as torchrun would start it, once per (argv, port) job.

    Returns (results of each job, the sample keys each rank contributed to each gather).
    """
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1")
    gathered_keys = []
    real_gather = dist_utils.gather_object_to_main

    def spy(payload):
        gathered = real_gather(payload)
        if gathered is not None:
            gathered_keys.append([[tuple(f["key"]) for f in g["state"]["frames"]]
                                  for g in gathered])
        return gathered

    dist_utils.gather_object_to_main = spy
    results = []
    for argv, port in jobs:
        os.environ["MASTER_PORT"] = str(port)
        results.append(evaluator.main(argv))
    return results, gathered_keys


def _distinct_ports(count: int) -> list:
    ports = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)


@pytest.mark.parametrize("world_size", [2, 3])
def test_multi_rank_equals_single_rank(runs, reference, world_size, tmp_path):
    inter = _copy_run(runs.inter, tmp_path / "intermediate")
    late = _copy_run(runs.late, tmp_path / "late")
    ports = _distinct_ports(2)
    per_rank = run_on_ranks(_eval_on_rank, world_size=world_size, init_group=False,
                            timeout_s=120,
                            args=([(_argv(inter), ports[0]), (_argv(late), ports[1])],))
    (results, gathered_keys), others = per_rank[0], per_rank[1:]
    # Only rank 0 computes and returns metrics: the job really ran on world_size processes.
    assert all(other[0] == [[], []] and other[1] == [] for other in others)

    all_keys = sorted(("2021_01_01_00_00_00", t) for t in TIMESTAMPS)
    for shards in gathered_keys:                   # one gather per job
        assert len(shards) == world_size
        # Unpadded contiguous shards: 3+2 or 2+2+1 samples.
        assert [len(s) for s in shards] == [end - begin for begin, end in (
            shard_bounds(len(TIMESTAMPS), r, world_size) for r in range(world_size))]
        flat = [key for shard in shards for key in shard]
        assert sorted(flat) == all_keys            # every sample once: none lost, none twice

    for (metrics,), ref, run_dir, fusion in ((results[0], reference.inter, inter, "intermediate"),
                                             (results[1], reference.late, late, "late")):
        got, want = _without_timing(metrics), _without_timing(ref)
        # Exactly the same numbers: AP, distance table, counts (bytes summed in another order).
        assert got.pop("bytes_per_agent") == pytest.approx(want.pop("bytes_per_agent"), rel=1e-12)
        assert got == want
        assert metrics["num_frames"] == len(TIMESTAMPS)
        saved = _record_of(metrics)["results"]
        assert Path(metrics["record"]).parent == run_dir / "evals"
        assert saved["ap_30"] == ref["ap_30"] and saved["distance"] == ref["distance"]


def _accumulator_with(keys, gt_per_frame=1) -> APAccumulator:
    accumulator = APAccumulator()
    for i, key in enumerate(keys):
        gt = torch.tensor([[5.0 + i, 0.0, -1.0, 1.5, 1.8, 4.2, 0.0]] * gt_per_frame)
        accumulator.add_frame(gt, torch.ones(gt_per_frame), gt, sample_key=key)
    return accumulator


def _local(accumulator) -> dict:
    return {"accumulator": accumulator, "frames": len(accumulator), "seconds": 1.0,
            "bytes_sum": 0.0, "pose_errors": PoseErrorTally()}


def test_gather_results_refuses_a_duplicated_sample(monkeypatch):
    # Two "ranks" that both evaluated sample b: gathered payloads as rank 0 would receive them.
    payloads = []
    rank1 = _local(_accumulator_with([("s", "b"), ("s", "c")]))

    def fake_gather(payload):
        payloads.append(payload)
        return [payload, {"state": rank1["accumulator"].state_dict(), "frames": 2,
                          "seconds": 1.0, "bytes_sum": 0.0, "pose_errors": {}}]

    monkeypatch.setattr(dist_utils, "gather_object_to_main", fake_gather)
    with pytest.raises(RuntimeError, match="two ranks"):
        inference.gather_results(_local(_accumulator_with([("s", "a"), ("s", "b")])),
                                 expected_frames=3)


def test_gather_results_refuses_a_lost_sample(monkeypatch):
    rank1 = _accumulator_with([("s", "c")])
    monkeypatch.setattr(dist_utils, "gather_object_to_main", lambda payload: [
        payload, {"state": rank1.state_dict(), "frames": 1, "seconds": 1.0, "bytes_sum": 0.0,
                  "pose_errors": {}}])
    with pytest.raises(RuntimeError, match="lost or duplicated"):
        inference.gather_results(_local(_accumulator_with([("s", "a")])), expected_frames=3)
    # The same shards with the right count pass.
    metrics = inference.gather_results(_local(_accumulator_with([("s", "a")])), expected_frames=2)
    assert metrics["num_frames"] == 2


# ----------------------------------------------------------------------------------------------
# 2. bad checkpoints, run folders and fusion choices: one-line errors
# ----------------------------------------------------------------------------------------------

def _error_of(argv) -> str:
    with pytest.raises(SystemExit) as info:
        evaluator.main(argv)
    message = str(info.value.code)
    assert message.startswith("error: ") and "\n" not in message
    return message


@pytest.mark.parametrize("kind", ["truncated", "where2comm", "wider"])
def test_unusable_checkpoint_is_a_one_line_error(runs, tmp_path, kind):
    bad = tmp_path / f"{kind}.pth"
    if kind == "truncated":
        data = (runs.inter / "last.pth").read_bytes()
        bad.write_bytes(data[:len(data) // 2])
    else:
        extra = (["model.args.fusion.core_method=where2comm"] if kind == "where2comm" else
                 ["model.args.pillar_vfe.num_filters=[32]",
                  "model.args.point_pillar_scatter.num_features=32"])
        model = build_model(_config(runs.data, extra)["model"])
        save_checkpoint(bad, {"model": model.state_dict()})
    message = _error_of(_argv(runs.inter, "--checkpoint", str(bad)))
    assert str(bad) in message
    expected = "truncated" if kind == "truncated" else "does not fit the model"
    assert expected in message


def test_missing_run_folder_config_or_checkpoint(runs, tmp_path):
    missing = tmp_path / "no_such_run"
    assert str(missing / "config.yaml") in _error_of(_argv(missing))
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert "config.yaml" in _error_of(_argv(empty))
    no_ckpt = tmp_path / "no_checkpoint"
    no_ckpt.mkdir()
    shutil.copy(runs.inter / "config.yaml", no_ckpt / "config.yaml")
    assert "no best.pth or last.pth" in _error_of(_argv(no_ckpt))
    gone = tmp_path / "gone.pth"
    message = _error_of(_argv(runs.inter, "--checkpoint", str(gone)))
    assert str(gone) in message and "no such file" in message
    no_data = _copy_run(runs.inter, tmp_path / "no_data")
    cfg = yaml.safe_load((no_data / "config.yaml").read_text())
    cfg["test_dir"] = str(tmp_path / "no_such_split")
    (no_data / "config.yaml").write_text(yaml.safe_dump(cfg))
    message = _error_of(_argv(no_data))
    assert str(tmp_path / "no_such_split") in message and "not found" in message


def test_visibility_by_the_ego_cameras_is_a_setting_of_its_own(runs, tmp_path):
    """--visibility camera on a LiDAR run: the record names the setting (its own record, the
    default's name unchanged); this data set has no bev_visibility maps, so no split."""
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    (metrics,) = evaluator.main(_argv(run_dir, "--visibility", "camera"))
    record = _record_of(metrics)
    assert record["settings"]["visibility"] == "camera"
    assert "visibility" not in record["results"] and "visibility_rule" not in record["results"]
    (default,) = evaluator.main(_argv(run_dir))
    assert default["name"] != metrics["name"] and "visibility" not in _record_of(default)[
        "settings"]


def test_camera_labels_score_only_what_some_agents_map_shows(runs, tmp_path, capsys):
    """``--set label_type=camera``: the GT is the objects some agent's bev_visibility map
    shows; here each agent's map paints the cars up to 10 m ahead of it (0 < x < 10 in its own
    frame: the road's cars at 5, 29 and 41 m, not 17 m). The record and the table say so; the
    default is unchanged."""
    from opencood.data.camera_visibility import map_path, visibility_map, write_visibility_map
    from opencood.data.opv2v import OPV2VSplit
    data = tmp_path / "data" / "test"
    shutil.copytree(runs.data, data)
    split = OPV2VSplit(data)
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    gt_range = load_config(run_dir / "config.yaml")["postprocess"]["gt_range"]
    expected = 0
    for index in range(len(split)):
        info = split.info(index)
        ahead = set()
        for cav_id in info.cav_ids:
            ids, boxes = split.frame_boxes(info.scenario, cav_id, info.timestamp,
                                           [-1e5, -1e5, -1e5, 1e5, 1e5, 1e5])
            near = (boxes[:, 0] > 0) & (boxes[:, 0] < 10)
            write_visibility_map(map_path(data / info.scenario / cav_id, info.timestamp),
                                 visibility_map(boxes[near]))
            ahead |= set(ids[near].tolist())
        gt_ids, _ = split.sample_gt(index, gt_range=gt_range)
        expected += len(ahead & set(gt_ids.tolist()))
    (lidar,) = evaluator.main(_argv(run_dir, "--set", f"test_dir={data}"))
    capsys.readouterr()
    (camera,) = evaluator.main(_argv(run_dir, "--set", f"test_dir={data}",
                                     "--set", "label_type=camera"))
    assert 0 < camera["num_gt"] == expected < lidar["num_gt"]
    assert _record_of(camera)["results"]["labels"].startswith("camera: ")
    assert "labels" not in _record_of(lidar)["results"]
    assert "GT labels: camera: " in capsys.readouterr().out


def test_fusion_method_that_does_not_fit_the_model(runs):
    message = _error_of(_argv(runs.inter, "--fusion_method", "late"))
    assert "'late'" in message and "point_pillar_intermediate" in message
    message = _error_of(_argv(runs.late, "--fusion_method", "intermediate"))
    assert "'intermediate'" in message and "single-agent" in message


# ----------------------------------------------------------------------------------------------
# 3. outputs: yaml, printed table, TensorBoard, pictures
# ----------------------------------------------------------------------------------------------

def test_outputs_yaml_table_tensorboard_and_pictures(runs, reference, tmp_path, capsys):
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    capsys.readouterr()
    (metrics,) = evaluator.main(_argv(run_dir, "--save_vis", "--vis_count", "2"))
    printed = capsys.readouterr().out

    saved = _record_of(metrics)["results"]
    for key in ("ap_30", "ap_50", "ap_70", "distance", "bytes_per_agent", "frames_per_s",
                "num_gt", "num_frames"):
        assert key in saved
    assert set(saved["distance"]) == {"0-30", "30-50", "50-100"}
    assert all({"ap_30", "ap_50", "ap_70", "num_gt"} <= set(row)
               for row in saved["distance"].values())
    assert saved["bytes_per_agent"] > 0 and saved["frames_per_s"] > 0
    # Every GT is either seen by the ego's own LiDAR or occluded for it.
    groups = saved["visibility"]
    assert set(groups) == {"ego-visible", "ego-occluded"}
    assert groups["ego-visible"]["num_gt"] + groups["ego-occluded"]["num_gt"] == saved["num_gt"]
    # the rule that made the split, in the record and the table (a camera ego's: its cameras)
    assert saved["visibility_rule"] == "lidar: ego LiDAR returns inside the box"
    assert "ego-visible by lidar: ego LiDAR returns inside the box" in printed
    assert _without_timing(saved) == _without_timing(reference.inter)

    assert metrics["name"] in printed and "AP@0.5" in printed
    assert f"record: {metrics['record']}" in printed
    overall = next(line for line in printed.splitlines() if line.strip().startswith("overall"))
    assert overall.split()[1:4] == [f"{metrics[k]:.4f}" for k in ("ap_30", "ap_50", "ap_70")]
    assert any(line.strip().startswith("0-30 m") for line in printed.splitlines())
    occluded = next(line for line in printed.splitlines() if "ego-occluded" in line)
    assert occluded.split()[-1] == str(groups["ego-occluded"]["num_gt"])
    assert f"{metrics['bytes_per_agent']:.0f}" in printed

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir))
    events.Reload()
    for key in ("ap_30", "ap_50", "ap_70"):
        (scalar,) = events.Scalars(f"eval/{metrics['name']}/{key}")
        assert scalar.value == pytest.approx(metrics[key], abs=1e-6)
    logged_groups = {tag.rsplit("ap_50_", 1)[1] for tag in events.Tags()["scalars"]
                     if tag.startswith(f"eval/{metrics['name']}/ap_50_ego_")}
    # A group without GT has no AP (None): nothing to log for it.
    assert logged_groups == {name.replace("-", "_") for name, row in groups.items()
                             if row["num_gt"] > 0}
    for name in logged_groups:
        (scalar,) = events.Scalars(f"eval/{metrics['name']}/ap_50_{name}")
        assert scalar.value == pytest.approx(groups[name.replace("_", "-")]["ap_50"], abs=1e-6)

    pictures = sorted((run_dir / "vis").glob("*.png"))
    assert len(pictures) == 2
    for picture in pictures:
        image = cv2.imread(str(picture))
        assert image is not None and image.ndim == 3 and image.shape[0] > 0 and image.std() > 0


# ----------------------------------------------------------------------------------------------
# 4. pose noise / latency sweeps
# ----------------------------------------------------------------------------------------------

@pytest.fixture
def wild_settings_built(monkeypatch) -> list:
    """The WildSetting of every data set the evaluator builds, in order."""
    settings = []
    real_build = evaluator.build_dataset

    def recording_build(*args, **kwargs):
        dataset = real_build(*args, **kwargs)
        settings.append(dataset.wild)
        return dataset

    monkeypatch.setattr(evaluator, "build_dataset", recording_build)
    return settings


def test_sweeps_write_their_own_files_and_leave_the_clean_result(runs, reference, tmp_path,
                                                                wild_settings_built):
    settings = wild_settings_built
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    results = evaluator.main(_argv(run_dir, "--pose_noise", "0.5", "--latency", "1"))
    names = [_setting_words(m["name"]) for m in results]
    assert names == ["test_intermediate", "test_intermediate_noise0.5",
                     "test_intermediate_latency1"]
    saved = {_setting_words(m["name"]): _record_of(m)["results"] for m in results}
    clean = _without_timing(saved["test_intermediate"])
    assert clean == _without_timing(reference.inter)

    # Each setting reached the data set, and only its own: the clean one has neither.
    clean_wild, noise_wild, latency_wild = settings
    assert not clean_wild.has_pose_noise and clean_wild.latency_frames == 0
    assert noise_wild.has_pose_noise and (noise_wild.xyz_std, noise_wild.yaw_std) == (0.5, 0.5)
    assert noise_wild.latency_frames == 0
    assert not latency_wild.has_pose_noise and latency_wild.latency_frames == 1
    # Noisy poses move the other agents' features: the result changes; the GT does not.
    noisy = _without_timing(saved["test_intermediate_noise0.5"])
    assert noisy["num_gt"] == clean["num_gt"] and noisy["num_frames"] == clean["num_frames"]
    assert noisy["ap_30"] != clean["ap_30"]


# ----------------------------------------------------------------------------------------------
# 5. late fusion: box projection and bytes
# ----------------------------------------------------------------------------------------------

def test_boxes_to_ego_hand_computed():
    # Agent rotated +90 deg and shifted (5, 5) from the ego: agent (x, y) -> ego (5 - y, 5 + x).
    transform = torch.tensor([[0.0, -1.0, 0.0, 5.0],
                              [1.0, 0.0, 0.0, 5.0],
                              [0.0, 0.0, 1.0, 0.0],
                              [0.0, 0.0, 0.0, 1.0]])
    boxes = torch.tensor([[10.0, 0.0, -1.0, 1.5, 1.8, 4.2, 0.0],
                          [0.0, 2.0, -0.5, 1.6, 2.0, 5.0, 0.3]], dtype=torch.float64)
    out = boxes_to_ego(boxes, transform)
    expected = torch.tensor([[5.0, 15.0, -1.0, 1.5, 1.8, 4.2, math.pi / 2],
                             [3.0, 5.0, -0.5, 1.6, 2.0, 5.0, 0.3 + math.pi / 2]],
                            dtype=torch.float64)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    # The same agent as the data pipeline builds its transform from lidar poses (yaw in deg).
    from_poses = torch.from_numpy(relative_transform([5, 5, 0, 0, 90, 0], [0, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(boxes_to_ego(boxes, from_poses), expected,
                               atol=1e-6, rtol=0)


def test_late_fusion_bytes_are_boxes_sent_times_32(monkeypatch):
    def boxes_at(xs):
        return torch.tensor([[x, 0.0, -1.0, 1.5, 1.8, 4.2, 0.0] for x in xs]).reshape(-1, 7)

    # Two samples: agents (ego, a, b) and (ego, c); boxes 10 m apart, so NMS keeps them all.
    per_agent = [boxes_at([0, 10]), boxes_at([20, 30, 40]), boxes_at([]),
                 boxes_at([0]), boxes_at([10, 20, 30, 40])]
    decoded = [(b, torch.linspace(0.9, 0.5, b.shape[0]),
                 torch.zeros(b.shape[0], dtype=torch.int64)) for b in per_agent]
    shift = torch.eye(4)
    shift[1, 3] = 100.0                       # agent b/c sees the world 100 m to the side
    transforms = torch.stack([torch.eye(4), torch.eye(4), shift, torch.eye(4), shift])
    postprocessor = VoxelPostprocessor.from_config(_config(Path("unused")), torch.device("cpu"))
    monkeypatch.setattr(postprocessor, "decode", lambda outputs: decoded)
    results = postprocessor.detections({}, torch.tensor([3, 2]), transforms, late=True)
    (boxes0, scores0, bytes0, _), (boxes1, scores1, bytes1, _) = results
    assert bytes0 == (3 * 32 + 0 * 32) / 2 and bytes1 == 4 * 32
    assert boxes0.shape[0] == 5 and boxes1.shape[0] == 5
    assert sorted(boxes1[:, 1].tolist()) == [0.0] + [100.0] * 4   # projected to the ego frame


def test_late_fusion_bytes_end_to_end_are_whole_boxes(reference):
    # Mean over frames and non-ego agents of 32 B per box: x frames x senders / 32 is a count.
    boxes_sent = reference.late["bytes_per_agent"] * len(TIMESTAMPS) * (NUM_CAVS - 1) / 32
    assert boxes_sent > 0 and boxes_sent == pytest.approx(round(boxes_sent), abs=1e-9)


def test_late_model_inputs_run_each_agent_alone():
    inputs = {"record_len": torch.tensor([3, 2]), "shared_points": torch.tensor([0, 0]),
              "voxel_coords": torch.zeros(1, 4)}
    model_inputs = get_strategy("late").model_inputs(inputs)
    assert model_inputs["record_len"].tolist() == [1] * 5
    assert inputs["record_len"].tolist() == [3, 2]       # grouping for the boxes is kept


# ----------------------------------------------------------------------------------------------
# 6. AP sanity end to end through gather_results
# ----------------------------------------------------------------------------------------------

def test_perfect_detections_give_ap_one_through_gather():
    accumulator = APAccumulator()
    rng = np.random.default_rng(0)
    for frame in range(4):
        distances = [10.0 + frame, 40.0 + frame, 70.0 + frame]
        gt = torch.tensor([[d * math.cos(a), d * math.sin(a), -1.0, 1.5, 1.8, 4.2, yaw]
                           for d, a, yaw in zip(distances, rng.uniform(-3, 3, 3),
                                                rng.uniform(-3, 3, 3))], dtype=torch.float64)
        accumulator.add_frame(gt, torch.ones(3), gt, sample_key=("s", f"{frame:06d}"))
    metrics = inference.gather_results(_local(accumulator), expected_frames=4)
    assert (metrics["ap_30"], metrics["ap_50"], metrics["ap_70"]) == (1.0, 1.0, 1.0)
    assert metrics["num_gt"] == metrics["num_det"] == 12
    for row in metrics["distance"].values():
        assert row["num_gt"] == 4 and (row["ap_30"], row["ap_50"], row["ap_70"]) == (1.0, 1.0, 1.0)



def test_run_inference_scores_each_class_from_the_detections_and_gt_class_ids(tmp_path):
    """run_inference on test_ap.py's hand-computed 2-class frames (a stand-in model whose
    detections carry ``classes``, batches with ``gt_classes``): the per-class APs and the class
    mean computed there by hand (car 1/2, pedestrian 2/3 @.5; mean 7/12); one padded GT row
    (class 1, masked out) must not count. Without class names: one class, no per_class. The
    detections file (--save_detections) keeps the class ids, and only for several classes."""
    from test_ap import CLASS_FRAMES
    frame_type = namedtuple("FrameDetections", "boxes scores sent classes")
    batches, detections = [], {}
    for key, (pred, scores, pred_classes, gt, gt_classes) in CLASS_FRAMES.items():
        padded_gt = torch.cat([torch.from_numpy(gt), torch.zeros(1, 7)])
        batches.append({"gt_boxes": padded_gt[None], "sample_keys": [("s", key)],
                        "gt_mask": torch.arange(len(padded_gt))[None] < len(gt),
                        "gt_classes": torch.tensor(list(gt_classes) + [1])[None]})
        detections[key] = frame_type(torch.from_numpy(pred), torch.tensor(scores), 0.0,
                                     torch.tensor(pred_classes))
    strategy = SimpleNamespace(
        model_inputs=lambda inputs: inputs,
        detections=lambda post, outputs, inputs: [detections[outputs["sample_keys"][0][1]]])

    def prepare(batch, with_targets):           # the preparer: the batch is the model input
        return batch, None
    prepare.postprocessor = SimpleNamespace(order="hwl")

    def run(class_names, collector=None):
        local = inference.run_inference(torch.nn.Identity(), batches, prepare,
                                        torch.device("cpu"), strategy, on_sample=collector,
                                        class_names=class_names)
        return local["accumulator"].compute()

    collector = DetectionCollector()
    result = run(["car", "pedestrian"], collector)
    assert result["per_class"]["car"]["ap_50"] == pytest.approx(0.5, abs=1e-12)
    assert result["per_class"]["pedestrian"]["ap_50"] == pytest.approx(2 / 3, abs=1e-12)
    assert result["ap_50"] == pytest.approx(7 / 12, abs=1e-12) and result["num_gt"] == 4
    saved = np.load(write_detections(tmp_path / "multi.npz", collector.frames, "hwl",
                                     ["car", "pedestrian"]))
    assert saved["classes"].tolist() == [0, 0, 1, 0, 1, 1, 0]           # frames a, b, c
    assert saved["class_names"].tolist() == ["car", "pedestrian"]
    single = DetectionCollector()
    assert "per_class" not in run(None, single)
    saved = np.load(write_detections(tmp_path / "single.npz", single.frames, "hwl"))
    assert sorted(saved.files) == ["box_order", "boxes", "frame_offsets", "sample_keys",
                                   "scores"]
    assert inference.detection_class_names({}) is None
    assert inference.detection_class_names(
        {"classes": [{"name": "car"}, {"name": "pedestrian"}]}) == \
        ["car", "pedestrian"]


def test_a_multi_class_record_round_trips_lists_and_logs_each_class(tmp_path, capsys):
    """The hand-computed 2-class results (test_ap.py) in a record: per_class / class_mean
    survive the yaml (a class without GT: null), --list says the AP is a class mean, the table
    prints a row per class, TensorBoard gets a scalar per class and threshold with an AP."""
    from opencood.eval.records import build_record, format_record_line, load_record
    from test_ap import accumulate_classes
    metrics = {**accumulate_classes(class_names=("car", "pedestrian", "truck")).compute(),
               "bytes_per_agent": 0.0, "frames_per_s": 1.0}
    record = build_record("test_late_0123abcd", {"sha256": None, "weights": "raw"},
                          {"split": "test", "test_is_validation": False}, {"fusion": "late"},
                          {}, {}, metrics)
    scalars = {}
    writer = SimpleNamespace(add_scalar=lambda tag, value, step: scalars.update({tag: value}))
    path = evaluator.report_results(record, tmp_path, writer)
    loaded = load_record(path)
    assert loaded["results"]["per_class"] == metrics["per_class"]
    assert loaded["results"]["per_class"]["truck"]["ap_50"] is None
    assert loaded["results"]["class_mean"]["classes"] == ["car", "pedestrian", "truck"]
    assert "AP@0.5 0.5833 (mean of 3 classes) | test" in format_record_line(path, loaded)
    assert "pedestrian   0.6667   0.6667   0.2500" in capsys.readouterr().out
    assert scalars["eval/test_late_0123abcd/pedestrian/ap_70"] == pytest.approx(0.25)
    assert scalars["eval/test_late_0123abcd/ap_50"] == pytest.approx(7 / 12)
    assert not any("truck" in tag for tag in scalars)

def test_pictures_draw_ego_occluded_gt_in_their_own_colour():
    from opencood.eval.vis import render_detection_sample
    from opencood.utils.vis_bev import GT_COLOR, OCCLUDED_GT_COLOR, BevCanvas
    boxes = torch.tensor([[[-10.0, 0.0, -1.0, 1.5, 2.0, 4.0, 0.0],
                           [10.0, 0.0, -1.0, 1.5, 2.0, 4.0, 0.0]]])
    batch = {"points": torch.zeros((0, 4)), "agent_index": torch.zeros(0, dtype=torch.int64),
             "record_len": torch.tensor([1]), "transforms_to_ego": torch.eye(4)[None],
             "gt_boxes": boxes, "gt_mask": torch.ones(1, 2, dtype=torch.bool),
             "gt_ego_points": [np.array([7, 0])]}
    bev_range = [-40, -20, -3, 40, 20, 1]
    image = render_detection_sample(batch, 0, torch.zeros((0, 7)), bev_range)
    canvas = BevCanvas(bev_range, pixels_per_meter=8.0)      # the picture's scale

    def pixels(color, x):
        """Pixels of ``color`` within 4 m of (x, 0)."""
        col, row = canvas.to_pixels(np.array([[x, 0.0]]))[0]
        window = image[row - 32:row + 33, col - 32:col + 33]
        return int(np.all(window == color, axis=2).sum())

    # The seen car (x = -10) is green, the occluded one (x = +10) lavender.
    assert pixels(GT_COLOR, -10) > 20 and pixels(OCCLUDED_GT_COLOR, -10) == 0
    assert pixels(OCCLUDED_GT_COLOR, 10) > 20 and pixels(GT_COLOR, 10) == 0


def test_table_prints_a_dash_for_a_bin_without_gt():
    from opencood.eval.report import format_metrics
    metrics = {"ap_30": 0.5, "ap_50": 0.25, "ap_70": 0.0, "num_gt": 4, "bytes_per_agent": 10.0,
               "frames_per_s": 2.0, "num_frames": 3,
               "distance": {"0-30": {"ap_30": 0.5, "ap_50": 0.25, "ap_70": 0.0, "num_gt": 4},
                            "50-100": {"ap_30": None, "ap_50": None, "ap_70": None,
                                       "num_gt": 0}}}
    near, far = format_metrics("test", metrics).splitlines()[3:5]
    assert near.split() == ["0-30", "m", "0.5000", "0.2500", "0.0000", "4"]
    assert far.split() == ["50-100", "m", "–", "–", "–", "0"]


def test_protocol_option_names_its_file_yaml_and_table(runs, reference, tmp_path, capsys):
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    (metrics,) = evaluator.main(_argv(run_dir, "--protocol", "opencood"))
    assert _setting_words(metrics["name"]) == "test_intermediate_opencood"
    record = _record_of(metrics)
    saved = record["results"]
    assert saved["protocol"]["name"] == "opencood" == record["settings"]["protocol"]
    assert reference.inter["protocol"]["name"] == "ours"
    out = capsys.readouterr().out
    assert f"{metrics['name']} (AP protocol: opencood)" in out
    # The table and the record say which GT range was scored: the protocol's, or the config's.
    assert "GT scored in x -140..140 y -40..40 z -3..1 m (protocol opencood)" in out
    assert saved["protocol"]["gt_range"] == [-140.0, -40.0, -3.0, 140.0, 40.0, 1.0]
    assert reference.inter["protocol"]["gt_range"] == [-25.6, -12.8, -3.0, 25.6, 12.8, 3.0]
    assert reference.inter["protocol"]["gt_range_of"] == "postprocess.gt_range"
    (ours,) = evaluator.main(_argv(run_dir))
    assert "GT scored in x -25.6..25.6 y -12.8..12.8 z -3..3 m (postprocess.gt_range)" in \
        capsys.readouterr().out
    assert ours["num_gt"] == reference.inter["num_gt"]
    # The protocol's +-140 x +-40 m GT range is wider than this run's LiDAR crop: as in
    # OpenCOOD's test set, the boxes beyond the crop count too (misses the model cannot see;
    # tests/test_e2e_parity.py matches OpenCOOD's GT count), so there are more than under ours.
    assert saved["num_gt"] > reference.inter["num_gt"]


def test_spread_by_group_by_hand():
    settings = [{"group": "clean"}, {"group": "noise0.2"}, {"group": "noise0.2"}]
    results = [{"ap_30": 0.5, "ap_50": 0.4, "ap_70": 0.1},
               {"ap_30": 0.4, "ap_50": 0.3, "ap_70": 0.1},
               {"ap_30": 0.2, "ap_50": 0.1, "ap_70": 0.1}]
    spread = report.spread_by_group(settings, results)
    assert spread["clean"]["runs"] == 1 and spread["clean"]["ap_50"] == {"mean": 0.4, "std": 0.0}
    noisy = spread["noise0.2"]
    assert noisy["runs"] == 2
    assert noisy["ap_50"]["mean"] == pytest.approx(0.2)
    assert noisy["ap_50"]["std"] == pytest.approx(0.1 * 2 ** 0.5)   # sample std of 0.3, 0.1
    assert noisy["ap_70"] == {"mean": pytest.approx(0.1), "std": pytest.approx(0.0)}


def test_noise_sweep_with_seeds_prints_and_writes_mean_and_std(runs, tmp_path,
                                                               wild_settings_built, capsys):
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    results = evaluator.main(_argv(run_dir, "--pose_noise", "0.5", "--seeds", "3"))
    assert [_setting_words(m["name"]) for m in results] == ["test_intermediate"] + [
        f"test_intermediate_noise0.5_seed{k}" for k in range(3)]
    assert [(wild.has_pose_noise, wild.seed) for wild in wild_settings_built] == [
        (False, 25), (True, 25), (True, 26), (True, 27)]
    (spread_path,) = (run_dir / "evals" / "spreads").glob("test_intermediate_*.yaml")
    spread = yaml.safe_load(spread_path.read_text())
    assert spread["seeds"] == 3 and list(spread["groups"]) == ["clean", "noise0.5"]
    assert spread["records"] == [m["name"] for m in results]
    values = np.array([m["ap_30"] for m in results[1:]])
    assert spread["groups"]["noise0.5"]["ap_30"]["mean"] == pytest.approx(values.mean())
    assert spread["groups"]["noise0.5"]["ap_30"]["std"] == pytest.approx(values.std(ddof=1))
    printed = capsys.readouterr().out
    assert "mean ± std over 3 noise seeds" in printed
    noise_line = next(line for line in printed.splitlines() if line.strip().startswith("noise0.5"))
    assert noise_line.split()[1] == "3" and "±" in noise_line


@pytest.mark.parametrize("tf32", [False, True])
def test_eval_uses_the_tf32_switches_training_validates_with(runs, tmp_path, tf32):
    """tools/eval.py sets TF32 and cudnn.benchmark from the run's config as training does, so
    one checkpoint scores the same in both (the switches are inert on CPU, visible anyway)."""
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    with preserved_torch_switches():
        for owner, name in TORCH_SWITCHES:
            setattr(owner, name, not tf32)
        evaluator.main(_argv(run_dir, "--set", f"performance.tf32={str(tf32).lower()}",
                             "--set", f"performance.cudnn_benchmark={str(tf32).lower()}"))
        assert [getattr(owner, name) for owner, name in TORCH_SWITCHES] == [tf32] * 3


def test_training_validation_and_eval_give_the_same_ap_on_one_checkpoint(runs, tmp_path):
    """The two AP paths: training's validation (recipe.validate, the validation loaders) and
    tools/eval.py --split validate, on the same weights."""
    from opencood.engine import recipe
    from opencood.engine.task import DetectionTask
    from opencood.utils.dist import DistInfo
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    (eval_metrics,) = evaluator.main(_argv(run_dir, "--split", "validate"))
    cfg = load_config(run_dir / "config.yaml", ["train_params.num_workers=0"])
    cpu = torch.device("cpu")
    info = DistInfo(rank=0, world_size=1, local_rank=0, distributed=False, backend=None,
                    device=cpu)
    model, _ = evaluator.load_eval_model(cfg["model"], run_dir / "last.pth", True, cpu)
    task = DetectionTask.from_config(cfg, cpu)
    loaders = recipe.build_validation_loaders(cfg, info, micro_batch=2,
                                              strategy=choose_strategy(cfg))
    results, count, _ = recipe.validate(model, loaders, task, info, None, cfg,
                                        cfg["train_params"]["eval_freq"])
    assert count == len(TIMESTAMPS) and eval_metrics["num_frames"] == len(TIMESTAMPS)
    assert eval_metrics["ap_50"] > 0
    for key in ("ap_30", "ap_50", "ap_70"):
        assert results[key] == eval_metrics[key], key


# ----------------------------------------------------------------------------------------------
# 8. evaluation records: self-describing, never overwriting each other (issue 27)
# ----------------------------------------------------------------------------------------------

def _run_with_step(runs, run_dir: Path, step: int) -> Path:
    """A copy of the intermediate run whose checkpoint says epoch 3, ``step``."""
    _copy_run(runs.inter, run_dir)
    checkpoint = torch.load(run_dir / "last.pth", weights_only=True)
    save_checkpoint(run_dir / "last.pth", {**checkpoint, "epoch": 3, "step": step})
    return run_dir


def test_two_data_folders_leave_two_records_naming_folder_step_and_checkpoint_hash(
        runs, tmp_path, capsys):
    from opencood.eval.records import file_sha256, load_record
    run_dir = _run_with_step(runs, tmp_path / "run", step=42)
    other_data = tmp_path / "other" / "test"
    shutil.copytree(runs.data, other_data)
    capsys.readouterr()
    (first,) = evaluator.main(_argv(run_dir))
    note = f"note: the test split is the validation folder {Path(runs.data).resolve()} "
    assert note in capsys.readouterr().out        # this config's test_dir is its validate_dir
    (second,) = evaluator.main(_argv(run_dir, "--set", f"test_dir={other_data}"))
    assert "note: the test split" not in capsys.readouterr().out
    assert first["record"] != second["record"] and Path(first["record"]).is_file()
    sha = file_sha256(run_dir / "last.pth")
    # The run's config names one folder as validate_dir and test_dir: the record says so.
    for metrics, folder, is_validation in ((first, runs.data, True),
                                           (second, other_data, False)):
        record = load_record(Path(metrics["record"]))
        assert record["data"] == {"split": "test", "folder": str(Path(folder).resolve()),
                                  "frames": len(TIMESTAMPS), "test_is_validation": is_validation}
        assert record["checkpoint"]["step"] == 42 and record["checkpoint"]["epoch"] == 3
        assert record["checkpoint"]["sha256"] == sha and record["checkpoint"]["weights"] == "raw"
        assert record["checkpoint"]["file"] == str((run_dir / "last.pth").resolve())
        assert record["settings"]["fusion"] == "intermediate"
        assert record["machine"]["world_size"] == 1 and record["date"]
        assert record["code"]["version"] and record["config_sha256"]
    assert load_record(Path(second["record"]))["settings"]["overrides"] == [
        f"test_dir={other_data}"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir))
    events.Reload()
    for metrics in (first, second):
        (scalar,) = events.Scalars(f"eval/{metrics['name']}/ap_50")
        assert scalar.value == pytest.approx(metrics["ap_50"], abs=1e-6)
    capsys.readouterr()
    listed = evaluator.main(["--list", str(run_dir)])
    lines = capsys.readouterr().out.splitlines()
    assert len(listed) == 2 and len(lines) == 2
    for metrics, folder in ((first, runs.data), (second, other_data)):
        line = next(line for line in lines if line.startswith(Path(metrics["record"]).name))
        assert f"AP@0.5 {metrics['ap_50']:.4f}" in line and str(Path(folder).resolve()) in line
        assert "step 42" in line and sha[:12] in line


def test_a_record_round_trips_and_a_new_checkpoint_gets_its_own_record(runs, tmp_path):
    from opencood.eval.records import load_record
    run_dir = _run_with_step(runs, tmp_path / "run", step=10)
    (before,) = evaluator.main(_argv(run_dir))
    record = load_record(Path(before["record"]))
    wild = load_config(run_dir / "config.yaml")["wild_setting"]
    assert record["settings"] == {"fusion": "intermediate", "protocol": "ours",
                                  "wild_setting": wild, "overrides": []}
    assert record["name"] == before["name"] and record["results"]["ap_50"] == before["ap_50"]
    # The same evaluation again names the same record (nothing piles up) ...
    (again,) = evaluator.main(_argv(run_dir))
    assert again["name"] == before["name"]
    # ... a changed checkpoint gets another record, and the first one stays.
    checkpoint = torch.load(run_dir / "last.pth", weights_only=True)
    weights = dict(checkpoint["model"])
    weights["head.cls_conv.bias"] = weights["head.cls_conv.bias"] + 0.5
    save_checkpoint(run_dir / "last.pth", {**checkpoint, "model": weights, "step": 20})
    (after,) = evaluator.main(_argv(run_dir))
    changed = load_record(Path(after["record"]))
    assert after["name"] != before["name"] and Path(before["record"]).is_file()
    assert changed["checkpoint"]["sha256"] != record["checkpoint"]["sha256"]
    assert changed["checkpoint"]["step"] == 20


def test_a_data_folder_reached_without_set_gets_its_own_record(runs, tmp_path, monkeypatch):
    # The folder is hashed as resolved, not only through --set: a run config naming the split
    # by a relative path reaches another folder from another working directory, and an edited
    # run config another folder; neither may overwrite the first record.
    from opencood.eval.records import load_record
    run_dir = _run_with_step(runs, tmp_path / "run", step=5)
    other_data = tmp_path / "other" / "test"
    shutil.copytree(runs.data, other_data)
    cfg = load_config(run_dir / "config.yaml")
    save_config({**cfg, "test_dir": "test"}, run_dir / "config.yaml")
    monkeypatch.chdir(runs.data.parent)
    (here,) = evaluator.main(_argv(run_dir))
    monkeypatch.chdir(other_data.parent)
    (there,) = evaluator.main(_argv(run_dir))
    save_config({**cfg, "test_dir": str(runs.data)}, run_dir / "config.yaml")
    (absolute,) = evaluator.main(_argv(run_dir))
    assert here["record"] != there["record"]
    assert [load_record(Path(m["record"]))["data"]["folder"] for m in (here, there)] == [
        str(runs.data.resolve()), str(other_data.resolve())]
    # The same folder by another spelling is the same evaluation: it replaces its record.
    assert absolute["record"] == here["record"] and Path(there["record"]).is_file()


def test_ema_and_raw_weights_of_one_checkpoint_leave_two_records(runs, tmp_path):
    from opencood.eval.records import load_record
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    checkpoint = torch.load(run_dir / "last.pth", weights_only=True)
    ema = dict(checkpoint["model"])
    ema["head.cls_conv.bias"] = ema["head.cls_conv.bias"] - 0.5
    save_checkpoint(run_dir / "last.pth", {**checkpoint, "ema": {"module": ema, "updates": 7}})
    (with_ema,) = evaluator.main(_argv(run_dir))
    (raw,) = evaluator.main(_argv(run_dir, "--no-ema"))
    assert with_ema["record"] != raw["record"] and Path(with_ema["record"]).is_file()
    records = [load_record(Path(m["record"])) for m in (with_ema, raw)]
    assert [r["checkpoint"]["weights"] for r in records] == ["ema", "raw"]
    assert records[0]["checkpoint"]["sha256"] == records[1]["checkpoint"]["sha256"]
    assert records[0]["settings"] == records[1]["settings"]


def test_checkpoint_sha256_covers_the_whole_file_past_the_first_chunk(tmp_path):
    from opencood.eval.records import file_sha256
    content = np.random.default_rng(0).bytes(3 * (1 << 20) + 17)   # 3 chunks and a bit
    first, last = tmp_path / "a.pth", tmp_path / "b.pth"
    first.write_bytes(content)
    last.write_bytes(content[:-1] + bytes([content[-1] ^ 1]))      # only the last byte differs
    assert file_sha256(first) == hashlib.sha256(content).hexdigest()
    assert file_sha256(last) != file_sha256(first)
    assert file_sha256(first, chunk_bytes=1000) == file_sha256(first)


def test_a_record_of_an_older_version_still_loads_and_lists(runs, tmp_path, capsys):
    from opencood.eval.records import load_record
    run_dir = _copy_run(runs.inter, tmp_path / "run")
    old = run_dir / "eval_test_intermediate.yaml"
    old.write_text(yaml.safe_dump({"ap_30": 0.5, "ap_50": 0.25, "ap_70": 0.125, "num_gt": 8,
                                   "name": "eval_test_intermediate"}))
    record = load_record(old)
    assert record["results"]["ap_50"] == 0.25 and record["format"] == 0
    assert record["checkpoint"]["step"] is None and record["data"]["folder"] is None
    capsys.readouterr()
    evaluator.main(["--list", str(run_dir)])
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("eval_test_intermediate.yaml: AP@0.5 0.2500")
    assert "unknown of unknown" in line and "step unknown" in line


def test_pose_correction_sweep_records_ap_and_pose_error_with_and_without(runs, tmp_path,
                                                                            capsys):
    """Late fusion with a ``box_align`` section: every setting is evaluated as is and
    corrected (``late_box_align``); records and the spread carry the relative pose error."""
    run_dir = _copy_run(runs.late, tmp_path / "late")
    results = evaluator.main(_argv(run_dir, "--pose_noise", "0.5", "--seeds", "2", "--set",
                                   "box_align={args: {min_landmarks: 0}}"))
    assert [_setting_words(m["name"]) for m in results] == [
        "test_late", "test_late_box_align_aligned",
        "test_late_noise0.5_seed0", "test_late_box_align_noise0.5_seed0_aligned",
        "test_late_noise0.5_seed1", "test_late_box_align_noise0.5_seed1_aligned"]
    clean, clean_aligned, noisy, noisy_aligned = results[:4]
    assert clean["pose_error"]["before"]["median_translation_m"] == pytest.approx(0, abs=1e-6)
    assert noisy["pose_error"]["before"]["pairs"] == len(TIMESTAMPS) * (NUM_CAVS - 1)
    assert noisy["pose_error"]["before"]["median_translation_m"] > 0.1
    assert "after" not in noisy["pose_error"]                 # not corrected
    assert "stage1_boxes" not in noisy["pose_error"]
    assert noisy_aligned["pose_error"]["stage1_boxes"]["pairs"] > 0     # what bounds it
    assert noisy_aligned["pose_error"]["before"] == noisy["pose_error"]["before"]
    assert set(noisy_aligned["pose_error"]["after"]) == set(noisy["pose_error"]["before"])
    assert "pose_correction" not in _record_of(noisy)["settings"]
    correction = _record_of(noisy_aligned)["settings"]["pose_correction"]
    assert correction["stage1"] == "own" and correction["box_align"]["args"]["min_landmarks"] == 0
    (spread_path,) = (run_dir / "evals" / "spreads").glob("test_late_*.yaml")
    groups = yaml.safe_load(spread_path.read_text())["groups"]
    assert list(groups) == ["clean", "clean_aligned", "noise0.5", "noise0.5_aligned"]
    assert set(groups["noise0.5_aligned"]["pose_error"]) == {"before", "after"}
    assert groups["noise0.5"]["pose_error"]["before"]["median_translation_m"]["mean"] == \
        pytest.approx(noisy["pose_error"]["before"]["median_translation_m"] / 2 + results[4][
            "pose_error"]["before"]["median_translation_m"] / 2)
    printed = capsys.readouterr().out
    assert "pose error, reported poses: median" in printed
    assert "pose error, corrected poses: median" in printed
    assert "stage-1 boxes of the ego and another agent, true poses: median" in printed


def test_own_frame_intermediate_run_corrects_with_a_stage1_run(runs, tmp_path):
    run_dir = _copy_run(runs.inter, tmp_path / "inter")
    results = evaluator.main(_argv(
        run_dir, "--pose_noise", "0.5", "--set", "fusion.args.proj_first=false", "--set",
        f"box_align={{stage1_model_dir: {runs.late}, args: {{min_landmarks: 0}}}}"))
    assert [_setting_words(m["name"]) for m in results] == [
        "test_intermediate", "test_intermediate_aligned", "test_intermediate_noise0.5",
        "test_intermediate_noise0.5_aligned"]
    noisy, noisy_aligned = results[2:]
    assert noisy_aligned["pose_error"]["before"] == noisy["pose_error"]["before"]
    assert noisy_aligned["pose_error"]["after"]["pairs"] == noisy["pose_error"]["before"]["pairs"]
    assert noisy_aligned["pose_error"]["stage1_boxes"]["pairs"] > 0
    assert _record_of(noisy_aligned)["settings"]["pose_correction"]["stage1"] == \
        "stage1_model_dir"
    with pytest.raises(SystemExit, match="proj_first"):
        evaluator.main(_argv(run_dir, "--set", f"box_align={{stage1_model_dir: {runs.late}}}"))
