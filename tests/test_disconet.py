"""DiscoNet (issue 14, item 2): the learned collaboration graph and its distillation from a frozen
early-fusion teacher.

Model properties on test_models' hand-made 32x32 pillar batches; the teacher's input from the
dataset; then real runs of tools/train.py on tiny OPV2V-format data (smoke geometry): a teacher
trained by the trainer, a student trained with it straight and resumed, under 2 gloo ranks, and
the one-line errors of a missing or mismatched teacher.
"""
from __future__ import annotations

import copy
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from opencood.config import load_config, resolve_section
from opencood.config_schema import to_plain
from opencood.engine import recipe, trainer
from opencood.engine.hooks import TrainHooks
from opencood.engine.teacher import FrozenTeacher
from opencood.errors import ConfigError
from opencood.losses import DetectionLoss
from opencood.losses.distillation import feature_distillation_loss
from opencood.models import build_model
from opencood.strategies import choose_strategy
from opencood.utils.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dist_helpers import free_port, run_on_ranks
from opv2v_factory import frame_stamps, write_simple_split
from process_state import preserved_opencood_logger
from test_models import (BACKBONE_CHANNELS, H, W, intermediate_cfg, make_batch, make_targets,
                         model_args, permute_non_ego)
from test_train import _two_rank_body, fusion_yaml

CPU = torch.device("cpu")
STUDENT_CFG = intermediate_cfg("disconet", hidden=[16, 8])
TEACHER_CFG = {"core_method": "point_pillar", "args": model_args()}


def frozen_teacher(weight=1.0, seed=1):
    torch.manual_seed(seed)
    return FrozenTeacher(build_model(TEACHER_CFG), weight, "teacher.pth")


def early_batch(batch_size, seed):
    """A teacher input: one merged cloud (here random pillars) per sample."""
    return make_batch([1] * batch_size, seed=seed)


# ---------------------------------------------------------------------------------------------
# The fusion module
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("record_len", [[1, 1], [2, 2], [5]], ids=["1", "2", "5"])
def test_forward_backward_with_distillation_reaches_every_student_parameter(record_len):
    torch.manual_seed(0)
    student, teacher = build_model(STUDENT_CFG), frozen_teacher()
    teacher_before = copy.deepcopy(teacher.model.state_dict())
    batch = make_batch(record_len)
    outputs = student(batch)
    assert outputs["fused_features"].shape == (len(record_len), BACKBONE_CHANNELS, H, W)
    detection, _ = DetectionLoss()(outputs, make_targets(len(record_len)))
    kd_loss = teacher.distillation_loss(outputs["fused_features"],
                                        early_batch(len(record_len), seed=7))
    assert torch.isfinite(kd_loss) and kd_loss > 0
    (detection + kd_loss).backward()
    missing = [key for key, param in student.named_parameters() if param.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(torch.isfinite(param.grad).all() for param in student.parameters())
    assert all(param.grad is None for param in teacher.model.parameters())
    assert not teacher.model.training
    for key, value in teacher.model.state_dict().items():   # BatchNorm statistics included
        assert torch.equal(value, teacher_before[key]), key


def test_ego_output_ignores_the_order_of_non_ego_agents():
    torch.manual_seed(0)
    model = build_model(STUDENT_CFG).eval()
    record_len = [4, 1, 3]
    batch = make_batch(record_len, seed=3)
    shuffled = permute_non_ego(batch, record_len, [[0, 3, 1, 2], [0], [0, 2, 1]])
    with torch.no_grad():
        reference, permuted = model(batch), model(shuffled)
    for key in ("cls_preds", "reg_preds", "dir_preds", "comm_bytes", "fused_features"):
        torch.testing.assert_close(permuted[key], reference[key], atol=1e-5, rtol=1e-5)
    # Control, on unit-scale maps (an untrained backbone's are near zero, which makes every
    # edge weight nearly equal): the ego is special, it scores every edge, so another agent
    # first changes the result; the order of the others does not.
    features = torch.randn(4, BACKBONE_CHANNELS, 6, 6)
    with torch.no_grad():
        fused = model.fusion(features, torch.tensor([4])).features
        reordered = model.fusion(features[[0, 2, 3, 1]], torch.tensor([4])).features
        other_ego = model.fusion(features[[1, 0, 2, 3]], torch.tensor([4])).features
    torch.testing.assert_close(reordered, fused, atol=1e-5, rtol=1e-5)
    assert (other_ego - fused).abs().amax() > 1e-2


def test_edge_weights_are_a_softmax_over_each_samples_agents():
    torch.manual_seed(0)
    fusion = build_model(STUDENT_CFG).fusion.eval()
    features = torch.randn(6, BACKBONE_CHANNELS, 5, 7)
    with torch.no_grad():
        result = fusion(features, torch.tensor([1, 3, 2]))
    weights = result.aux["edge_weights"]                         # (3, 3, 5, 7)
    assert weights.shape == (3, 3, 5, 7)
    torch.testing.assert_close(weights.sum(dim=1), torch.ones(3, 5, 7))
    assert (weights[0, 1:] == 0).all() and (weights[2, 2] == 0).all()   # padding slots
    # The weights vary per cell and per agent: a learned graph, not a fixed average.
    assert weights[1].std(dim=(1, 2)).min() > 0
    expected = (weights[1, :, None] * features[1:4]).sum(dim=0)
    torch.testing.assert_close(result.features[1], expected)
    # A lone ego has weight 1: its own map, bit for bit.
    assert torch.equal(result.features[0], features[0])


def test_non_ego_agents_send_their_whole_map():
    model = build_model(STUDENT_CFG).eval()
    with torch.no_grad():
        comm_bytes = model(make_batch([1, 3]))["comm_bytes"]
    assert comm_bytes.tolist() == [0.0, float(BACKBONE_CHANNELS * H * W * 4)]


def test_distillation_loss_is_zero_only_on_the_teachers_distribution():
    teacher_map = torch.randn(2, 6, 4, 5)
    assert feature_distillation_loss(teacher_map.clone(), teacher_map) == 0
    # A softmax ignores a per-cell offset shared by all channels.
    shifted = teacher_map + torch.randn(2, 1, 4, 5)
    torch.testing.assert_close(feature_distillation_loss(shifted, teacher_map),
                               torch.tensor(0.0), atol=1e-6, rtol=0)
    assert feature_distillation_loss(torch.randn(2, 6, 4, 5), teacher_map) > 0.01


def test_a_teacher_map_of_another_shape_is_a_one_line_config_error():
    teacher = frozen_teacher()
    student_map = torch.zeros(2, BACKBONE_CHANNELS + 8, H, W)
    with pytest.raises(ConfigError, match=r"kd.teacher teacher.pth: its BEV map .* does not "
                                          r"match the student's fused map") as info:
        teacher.distillation_loss(student_map, early_batch(2, seed=1))
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# The teacher's input
# ---------------------------------------------------------------------------------------------

AUGMENT = [{"NAME": "random_world_flip", "ALONG_AXIS_LIST": ["x"]},
           {"NAME": "random_world_rotation", "WORLD_ROT_ANGLE": [-0.4, 0.4]},
           {"NAME": "random_world_scaling", "WORLD_SCALE_RANGE": [0.9, 1.1]}]
RANGE = [-25.6, -12.8, -3.0, 25.6, 12.8, 1.0]


def test_dataset_yields_the_early_fusion_cloud_of_the_same_sample(tmp_path):
    from opencood.data.collate import collate_samples
    from opencood.data.datasets import EarlyFusionDataset, IntermediateFusionDataset
    from opencood.data.pipeline import BatchPreparer
    from opencood.data.wild import WildSetting
    split = write_simple_split(tmp_path / "split", num_cavs=3)
    options = dict(lidar_range=RANGE, gt_range=RANGE, train=True, augment_cfg=AUGMENT, seed=4)
    student_set = IntermediateFusionDataset(split, with_early_fusion=True, **options)
    early_set = EarlyFusionDataset(split, **options)
    for dataset in (student_set, early_set):
        dataset.set_epoch(3)
    samples = [student_set[i] for i in range(3)]
    for index, sample in enumerate(samples):
        merged = early_set[index]["agent_points"][0]
        assert len(merged) > 100
        assert np.array_equal(sample["early_fusion_points"], merged)      # same augmentation
        assert np.array_equal(np.concatenate(sample["agent_points"]), merged)
    assert "early_fusion_points" not in IntermediateFusionDataset(split, **options)[0]

    # Pose noise moves what the student's agents report, not the teacher's view.
    noisy = IntermediateFusionDataset(split, with_early_fusion=True, **options,
                                      wild=WildSetting(loc_err=True, xyz_std=1.0, yaw_std=1.0))
    noisy.set_epoch(3)
    assert np.array_equal(noisy[1]["early_fusion_points"], samples[1]["early_fusion_points"])
    assert not np.array_equal(noisy[1]["agent_points"][1], samples[1]["agent_points"][1])

    batch = collate_samples(samples[:2])
    teacher_batch = batch["early_fusion"]
    assert teacher_batch["record_len"].tolist() == [1, 1]
    assert torch.equal(teacher_batch["points"][:, :3], batch["points"][:, :3])
    smoke = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"
    preparer = BatchPreparer.from_config(load_config(smoke), "cpu")      # RANGE, 0.8 m pillars
    inputs = preparer.model_inputs(teacher_batch)
    assert set(inputs["voxel_coords"][:, 0].tolist()) == {0, 1}       # one canvas per sample


# ---------------------------------------------------------------------------------------------
# Building the teacher
# ---------------------------------------------------------------------------------------------

def smoke_cfg(tmp_path, name, *overrides):
    return load_config(fusion_yaml(tmp_path, name), list(overrides))


def save_fake_run(path: Path, cfg) -> Path:
    """A checkpoint as tools/train.py writes it (model + config), of an untrained model."""
    torch.manual_seed(0)
    save_checkpoint(path, {"model": build_model(cfg["model"]).state_dict(),
                           "config": to_plain(cfg)})
    return path


def test_build_teacher_loads_a_frozen_model_and_refuses_mismatches(tmp_path):
    student = smoke_cfg(tmp_path, "point_pillar_disconet")
    early = smoke_cfg(tmp_path, "point_pillar_early_fusion")
    good = save_fake_run(tmp_path / "early.pth", early)
    cfg = to_plain(student)
    cfg["kd"] = {"teacher": str(good), "weight": 3.0}
    teacher = recipe.build_teacher(cfg, CPU)
    assert teacher.weight == 3.0 and not teacher.model.training
    assert not any(param.requires_grad for param in teacher.model.parameters())
    saved = load_checkpoint(good)["model"]
    assert all(torch.equal(value, saved[key])
               for key, value in teacher.model.state_dict().items())
    assert recipe.build_teacher({**student, "kd": None}, CPU) is None

    def refused(kd, error=ConfigError):
        with pytest.raises(error) as info:
            recipe.build_teacher({**student, "kd": resolve_section("kd", kd)}, CPU)
        message = str(info.value)
        assert "\n" not in message
        return message

    attfuse = save_fake_run(tmp_path / "attfuse.pth", smoke_cfg(tmp_path, "point_pillar_attfuse"))
    assert "holds a 'point_pillar_intermediate' model trained with 'intermediate' fusion" in \
        refused({"teacher": str(attfuse)})
    assert "does not exist" in refused({"teacher": str(tmp_path / "nowhere")})
    assert "holds no best.pth or last.pth" in refused({"teacher": str(tmp_path)})
    # The section itself is the schema's to check, once, when the config is resolved.
    for kd, expected in (({"techer": str(good)}, "unknown key 'kd.techer'"),
                         ({"weight": 1.0}, "missing required key 'kd.teacher'"),
                         ({"teacher": str(good), "weight": 0}, "'kd.weight' must be > 0"),
                         ({"teacher": str(good), "weight": "lots"},
                          "'kd.weight' must be a number")):
        with pytest.raises(ConfigError, match=expected):
            resolve_section("kd", kd)
    other_grid = save_fake_run(tmp_path / "grid.pth", smoke_cfg(
        tmp_path, "point_pillar_early_fusion", "preprocess.args.voxel_size=[0.4,0.4,4.0]"))
    assert "preprocess.args.voxel_size" in refused({"teacher": str(other_grid)})
    # An early-fusion config with weights of other widths: the state-dict check names the file.
    lying = copy.deepcopy(load_checkpoint(good))
    lying["model"] = build_model(TEACHER_CFG).state_dict()
    save_checkpoint(tmp_path / "lying.pth", lying)
    assert "lying.pth does not fit the model" in refused({"teacher": str(tmp_path / "lying.pth")},
                                                         CheckpointError)
    with pytest.raises(ConfigError, match="key 'kd' is for an intermediate-fusion student"):
        choose_strategy(load_config(fusion_yaml(tmp_path, "point_pillar_disconet"),
                                    ["fusion.core_method=early"]))


# ---------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("disconet_data")
    write_simple_split(root / "train4", num_cavs=2, timestamps=frame_stamps(4))
    return root


def train_args(root: Path, *extra):
    return ["--set", f"root_dir={root / 'train4'}", "--set", "validate_dir=null",
            "--set", "train_params.batch_size=2", *extra]


@pytest.fixture(scope="module")
def teacher_run(data_root, tmp_path_factory) -> Path:
    """An early-fusion teacher trained by tools/train.py (2 steps, smoke geometry)."""
    work = tmp_path_factory.mktemp("teacher")
    with pytest.MonkeyPatch.context() as patch, preserved_opencood_logger():
        patch.setattr(torch.cuda, "is_available", lambda: False)
        trainer.main(["--hypes_yaml", str(fusion_yaml(work, "point_pillar_early_fusion")),
                      "--model_dir", str(work / "run"),
                      *train_args(data_root, "--set", "train_params.epoches=1")])
    return work / "run"


def student_argv(folder: Path, data_root: Path, teacher: Path, *extra):
    return ["--hypes_yaml", str(fusion_yaml(folder, "point_pillar_disconet")),
            "--set", f"kd.teacher={teacher}", *train_args(data_root, *extra)]


@pytest.fixture(scope="module")
def straight_run(data_root, teacher_run, tmp_path_factory):
    """2 epochs of 2 steps with EMA, spying on the teacher and on what the optimizer holds."""
    work = tmp_path_factory.mktemp("student")
    seen = {}

    def parts_spy(parts, info):       # before the first step
        teacher = parts.task.teacher
        seen["teacher"] = teacher
        seen["teacher_at_start"] = copy.deepcopy(teacher.model.state_dict())
        seen["optimized"] = [param for group in parts.optimizer.param_groups
                             for param in group["params"]]

    with pytest.MonkeyPatch.context() as patch, preserved_opencood_logger():
        patch.setattr(torch.cuda, "is_available", lambda: False)
        result = trainer.main([*student_argv(work, data_root, teacher_run,
                                             "--set", "train_params.epoches=2",
                                             "--set", "train_params.save_freq=1",
                                             "--set", "ema.enabled=true", "--set", "ema.tau=2"),
                               "--model_dir", str(work / "run")],
                              hooks=TrainHooks(on_parts=parts_spy))
    return work / "run", result, seen


def test_teacher_is_frozen_and_unchanged_by_training(straight_run, teacher_run):
    run_dir, result, seen = straight_run
    assert result["step"] == 4
    teacher = seen["teacher"]
    assert not teacher.model.training
    assert not any(param.requires_grad or param.grad is not None
                   for param in teacher.model.parameters())
    saved = load_checkpoint(teacher_run / "last.pth")["model"]
    for key, value in teacher.model.state_dict().items():      # running statistics included
        assert torch.equal(value, seen["teacher_at_start"][key]), key
        assert torch.equal(value, saved[key]), key
    assert f"feature distillation from the frozen teacher {teacher_run / 'last.pth'}" in \
        (run_dir / "train.log").read_text()
    # Control: the student did train.
    student = load_checkpoint(run_dir / "last.pth")["model"]
    initial = load_checkpoint(run_dir / "epoch_1.pth")["model"]
    assert any(not torch.equal(student[key], initial[key]) for key in student)


def test_checkpoint_and_optimizer_hold_no_teacher_tensor(straight_run):
    run_dir, _, seen = straight_run
    teacher_ids = {id(param) for param in seen["teacher"].model.parameters()}
    assert not teacher_ids & {id(param) for param in seen["optimized"]}
    cfg = load_config(run_dir / "config.yaml")
    student_state = build_model(cfg["model"]).state_dict()
    checkpoint = load_checkpoint(run_dir / "last.pth")
    assert set(checkpoint["model"]) == set(student_state)
    assert set(checkpoint["ema"]["module"]) == set(student_state)
    parameters = sum(1 for _ in build_model(cfg["model"]).parameters())
    assert len(seen["optimized"]) == parameters
    assert len(checkpoint["optimizer"]["param_groups"][0]["params"]) == parameters
    assert len(checkpoint["optimizer"]["state"]) == parameters
    # The run's config names the teacher: a resume loads it again from there.
    assert Path(seen["teacher"].source) == Path(cfg["kd"]["teacher"]) / "last.pth"


def test_distillation_term_is_in_tensorboard(straight_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run_dir, _, _ = straight_run
    events = EventAccumulator(str(run_dir))
    events.Reload()
    kd = events.Scalars("train/kd_loss")
    assert [event.step for event in kd] == [1, 2, 3, 4]
    assert all(np.isfinite(event.value) and event.value > 0 for event in kd)
    # total_loss is the detection terms plus the distillation term.
    total = {event.step: event.value for event in events.Scalars("train/total_loss")}
    parts = [events.Scalars(f"train/{name}") for name in ("cls_loss", "reg_loss", "dir_loss")]
    for index, event in enumerate(kd):
        detection = sum(series[index].value for series in parts)
        assert total[event.step] == pytest.approx(detection + event.value, rel=1e-4)


def test_resume_matches_uninterrupted_training(straight_run, tmp_path, monkeypatch):
    """Epoch 1 + resume (--model_dir) for epoch 2 == 2 epochs straight, the teacher reloaded
    from kd.teacher of the saved config."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    straight_dir, _, _ = straight_run
    resume_dir = tmp_path / "resumed"
    resume_dir.mkdir()
    shutil.copy(straight_dir / "config.yaml", resume_dir / "config.yaml")
    shutil.copy(straight_dir / "epoch_1.pth", resume_dir / "last.pth")
    with preserved_opencood_logger():
        resumed = trainer.main(["--model_dir", str(resume_dir)])
    assert resumed["step"] == 4
    after, straight = load_checkpoint(resume_dir / "last.pth"), \
        load_checkpoint(straight_dir / "last.pth")
    for part in ("model",):
        for key, value in straight[part].items():
            assert torch.equal(after[part][key], value), key
    for key, value in straight["ema"]["module"].items():
        assert torch.equal(after["ema"]["module"][key], value), f"ema {key}"
    for index, state in straight["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.equal(after["optimizer"]["state"][index][name], value), (index, name)
    assert after["scheduler"] == straight["scheduler"]


def test_two_rank_ddp_training_with_the_teacher(data_root, teacher_run, tmp_path):
    """2 gloo ranks, 2 steps each: DDP without unused-parameter search around the student
    only (a student parameter without gradient makes the second step raise)."""
    argv = [*student_argv(tmp_path, data_root, teacher_run, "--set", "train_params.epoches=1",
                          "--set", "train_params.max_micro_batch=1"),
            "--runs_root", str(tmp_path / "runs")]
    ranks = run_on_ranks(_two_rank_body, world_size=2, init_group=False, timeout_s=300,
                         args=([("disconet", free_port(), argv)],))
    for rank, outcome in enumerate(rank["disconet"] for rank in ranks):
        assert "result" in outcome, f"rank {rank}: {outcome}"
        assert outcome["result"]["step"] == 2
        assert outcome["model"]["is_ddp"] and outcome["model"]["wraps_bare_model"]
        assert outcome["model"]["find_unused_parameters"] is False
    [run_dir] = list((tmp_path / "runs").iterdir())
    checkpoint = load_checkpoint(run_dir / "last.pth")
    assert all(not key.startswith("module.") for key in checkpoint["model"])


def test_a_missing_teacher_stops_before_any_file_in_one_line(data_root, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    missing = tmp_path / "no_teacher_run"
    argv = [*student_argv(tmp_path, data_root, missing), "--runs_root", str(tmp_path / "runs")]
    with pytest.raises(SystemExit) as info, preserved_opencood_logger():
        trainer.main(argv)
    message = str(info.value.code)
    assert message.startswith(f"error: kd.teacher: {missing} does not exist") and \
        "\n" not in message
    assert not (tmp_path / "runs").exists()


def test_a_teacher_of_another_model_is_a_one_line_error(data_root, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    other = save_fake_run(tmp_path / "fcooper.pth",
                          smoke_cfg(tmp_path, "point_pillar_fcooper"))
    with pytest.raises(SystemExit) as info, preserved_opencood_logger():
        trainer.main([*student_argv(tmp_path, data_root, other),
                      "--runs_root", str(tmp_path / "runs")])
    message = str(info.value.code)
    assert f"error: kd.teacher: {other} holds a 'point_pillar_intermediate' model" in message
    assert "\n" not in message
