"""tools/train.py end to end (docs/DESIGN.md §6): real runs of ``tools/train.py``'s ``main`` on
tiny OPV2V-format data, single process and 2 gloo ranks on CPU.

Spawned ranks each import torch (seconds on a loaded machine), so all 2-rank runs share one
session (``two_rank_runs``) whose parts are checked by separate tests.
"""
from __future__ import annotations

import ast
import dataclasses
import math
import os
import shutil
import traceback
from pathlib import Path

import pytest
import torch
import yaml

from opencood import config as config_io
from opencood.config import resolve_section
from opencood.engine import recipe, state as train_state, trainer
from opencood.engine.hooks import NO_HOOKS, TrainHooks
from opencood.engine.optim import build_optimizer, build_scheduler, lr_factor
from opencood.engine.task import DetectionTask
from opencood.errors import ConfigError
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import history_path, load_checkpoint
from opencood.utils.dist import DistInfo
from dist_helpers import free_port, run_on_ranks
from process_state import TORCH_SWITCHES, preserved_opencood_logger, preserved_torch_switches
from opv2v_factory import frame_stamps, write_simple_split

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "hypes_yaml" / "synthetic"
SMOKE_YAML = CONFIG_DIR / "smoke.yaml"
# The fast step path (docs/gpu_and_speed.md); 2048 pillar slots: every cell of the smoke grid (64 x 32).
FAST_STEP = ["--set", "performance.static_pillars=2048",
             "--set", "performance.sync_free_step=true"]
FUSION_CONFIGS = sorted(path.stem for path in CONFIG_DIR.glob("point_pillar_*.yaml"))
# attfuse is smoke.yaml's own base: the 2-rank end-to-end run trains it.
FAST_DDP_CONFIGS = ["point_pillar_where2comm", "point_pillar_early_fusion"]
# DiscoNet needs a trained teacher: tests/test_disconet.py trains it under DDP with one.
SLOW_DDP_CONFIGS = [name for name in FUSION_CONFIGS if name not in
                    FAST_DDP_CONFIGS + ["point_pillar_attfuse", "point_pillar_disconet"]]
TRAIN_SCALARS = ("loss", "lr", "grad_norm", "samples_per_s")
VAL_SCALARS = ("loss", "ap_50")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_process_state():
    """Undo what an in-process run changes globally: the logger, and on GPU machines the TF32
    and cudnn.benchmark switches that configure_cuda sets from the yaml."""
    with preserved_torch_switches(), preserved_opencood_logger():
        yield


@pytest.mark.parametrize("script, module", [("train", "opencood.engine.trainer"),
                                            ("eval", "opencood.engine.evaluator")])
def test_flow_scripts_only_call_the_library_flow(script, module):
    """tools/train.py and tools/eval.py hold no flow of their own: a docstring, ``from <flow>
    import main`` and the ``__main__`` guard. The loader workers' forkserver preloads the main
    script (docs/DESIGN.md §6.13), so importing it must start nothing."""
    tree = ast.parse((REPO_ROOT / "tools" / f"{script}.py").read_text())
    assert [type(node).__name__ for node in tree.body] == ["Expr", "ImportFrom", "If"]
    _, imported, guard = tree.body
    assert imported.module == module and [alias.name for alias in imported.names] == ["main"]
    assert ast.unparse(guard.test) == "__name__ == '__main__'"
    assert ast.unparse(guard.body[0]) == "main()" and len(guard.body) == 1


def test_torch_switches_are_restored_after_a_change():
    before = [getattr(owner, name) for owner, name in TORCH_SWITCHES]
    with preserved_torch_switches():
        for owner, name in TORCH_SWITCHES:
            setattr(owner, name, not getattr(owner, name))
    assert [getattr(owner, name) for owner, name in TORCH_SWITCHES] == before


@pytest.fixture
def cpu_only(monkeypatch):
    """In-process runs of the CPU contract stay on CPU on a machine with a GPU, too (the spawned
    ranks of dist_helpers hide GPUs themselves)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """train16 (2 steps of global batch 8), train4 (2 steps of batch 2), validate3, test2."""
    root = tmp_path_factory.mktemp("synthetic")
    for split, count in (("train16", 16), ("train4", 4), ("validate3", 3), ("test2", 2)):
        write_simple_split(root / split, num_cavs=2, timestamps=frame_stamps(count))
    return root


def data_args(root: Path, train="train4", validate="validate3"):
    return ["--set", f"root_dir={root / train}",
            "--set", f"validate_dir={root / validate}" if validate else "validate_dir=null",
            "--set", f"test_dir={root / 'test2'}"]


def fusion_yaml(folder: Path, name: str) -> Path:
    """``name``'s config with the smoke geometry (smoke.yaml's body on top of it)."""
    smoke = yaml.safe_load(SMOKE_YAML.read_text())
    smoke["_base_"] = str(CONFIG_DIR / f"{name}.yaml")
    smoke["name"] = name
    path = folder / f"{name}_smoke.yaml"
    path.write_text(yaml.safe_dump(smoke))
    return path


# ----------------------------------------------------------------------------------------------
# 2-rank session
# ----------------------------------------------------------------------------------------------

def _describe_prepared_model(model, bare, info) -> dict:
    """What prepare_model built, as plain data for the test process."""
    from torch.nn.parallel import DistributedDataParallel
    is_ddp = isinstance(model, DistributedDataParallel)
    return {
        "device": str(info.device), "backend": info.backend, "is_ddp": is_ddp,
        "find_unused_parameters": model.find_unused_parameters if is_ddp else None,
        "gradient_as_bucket_view": model.gradient_as_bucket_view if is_ddp else None,
        "device_ids": model.device_ids if is_ddp else None,
        "wraps_bare_model": (model.module is bare) if is_ddp else (model is bare),
        "sync_bn": sum(isinstance(m, torch.nn.SyncBatchNorm) for m in bare.modules()),
        "plain_bn": sum(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                        and not isinstance(m, torch.nn.SyncBatchNorm) for m in bare.modules()),
        "param_devices": sorted({str(p.device) for p in bare.parameters()}),
    }


def _main_on_rank(rank, world_size, port, argv, hooks: TrainHooks = NO_HOOKS):
    """trainer.main as torchrun would start it on ``rank``, with spies on what it writes and on
    the model it prepares (``hooks``: more callbacks for the run; its on_parts is the spy's)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    written = []  # files this rank's trainer asked to write (both ranks share the folder)
    prepared = {}
    save_checkpoint, atomic_write = train_state.save_checkpoint, config_io.atomic_write
    save_with_history = train_state.save_with_history

    def checkpoint_spy(path, state):
        written.append(Path(path).name)
        return save_checkpoint(path, state)

    def history_spy(run_dir, state, step, keep):
        written.append("last.pth")
        return save_with_history(run_dir, state, step, keep)

    def config_spy(path):     # what opencood.config.save_config writes through
        written.append(Path(path).name)
        return atomic_write(path)

    def describe_spy(parts, info):
        prepared.update(_describe_prepared_model(parts.model, parts.model_without_ddp, info))

    train_state.save_checkpoint, config_io.atomic_write = checkpoint_spy, config_spy
    train_state.save_with_history = history_spy
    spied = dataclasses.replace(hooks, on_parts=describe_spy)
    try:
        return {"result": trainer.main(argv, spied), "written": written, "model": prepared}
    except SystemExit as error:
        return {"exit": str(error.code), "written": written}
    except BaseException:  # reported by the test that owns this part
        return {"error": traceback.format_exc()}
    finally:
        train_state.save_checkpoint, config_io.atomic_write = save_checkpoint, atomic_write
        train_state.save_with_history = save_with_history


def _two_rank_body(rank, world_size, jobs):
    return {name: _main_on_rank(rank, world_size, port, argv) for name, port, argv in jobs}


def _session_jobs(root: Path, work: Path, configs):
    jobs = [
        # First: an error run, so its log line cannot land in the end-to-end run's train.log.
        ("bad_split", ["--hypes_yaml", str(SMOKE_YAML), "--runs_root", str(work / "bad_split"),
                       "--set", "train_params.batch_size=3", *data_args(root)]),
        ("end_to_end", ["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(work / "e2e"),
                        "--set", "train_params.batch_size=8",
                        "--set", "train_params.max_micro_batch=2",
                        "--set", "train_params.epoches=2", "--set", "train_params.eval_freq=1",
                        "--set", "train_params.save_freq=1",
                        *data_args(root, train="train16")]),
    ]
    for name in configs:
        jobs.append((name, ["--hypes_yaml", str(fusion_yaml(work, name)),
                            "--runs_root", str(work / name),
                            "--set", "train_params.batch_size=2",
                            "--set", "train_params.max_micro_batch=1",
                            "--set", "train_params.epoches=1",
                            *data_args(root, validate=None)]))
    return [(name, free_port(), argv) for name, argv in jobs]


@pytest.fixture(scope="module")
def two_rank_runs(data_root, tmp_path_factory):
    work = tmp_path_factory.mktemp("runs_2rank")
    # HEAL's backward alignment (train_params.fix_modules, tests/test_freeze.py): the backbone
    # and heads frozen, the encoder trained; 2 epochs of 2 steps.
    frozen = ("frozen", free_port(), [
        "--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(work / "frozen"),
        "--set", "train_params.fix_modules=[backbone, head]", "--set", "train_params.epoches=2",
        "--set", "train_params.max_micro_batch=1", *data_args(root=data_root, validate=None)])
    results = run_on_ranks(_two_rank_body, world_size=2, init_group=False, timeout_s=300,
                           args=(_session_jobs(data_root, work, FAST_DDP_CONFIGS) + [frozen],))
    return work, results


def expected_steps(name: str) -> int:
    """Steps of the two-step DDP runs: late fusion trains on (sample, CAV) pairs, twice as many
    examples on the two-agent data (the stage-1 config of CoAlign is late fusion too)."""
    from opencood.config import load_config
    cfg = load_config(CONFIG_DIR / f"{name}.yaml")
    return 4 if cfg["fusion"]["core_method"] in ("late", "late_box_align") else 2


def _finished(results, name):
    outcomes = [rank_results[name] for rank_results in results]
    for rank, outcome in enumerate(outcomes):
        if "error" in outcome or "exit" in outcome:
            pytest.fail(f"{name}: rank {rank} failed:\n{outcome.get('error') or outcome['exit']}")
    return [outcome["result"] for outcome in outcomes]


def test_two_rank_run_writes_exactly_the_expected_files(two_rank_runs):
    work, results = two_rank_runs
    ranks = _finished(results, "end_to_end")
    run_dir = work / "e2e"
    assert all(Path(rank["run_dir"]) == run_dir for rank in ranks)
    names = sorted(path.name for path in run_dir.iterdir())
    events = [name for name in names if name.startswith("events.out.tfevents.")]
    assert len(events) == 1, names  # rank 0's writer only
    assert sorted(set(names) - set(events)) == sorted(
        ["config.yaml", "train.log", "last.pth", "epoch_1.pth", "epoch_2.pth", "best.pth",
         "checkpoints", "train_cost.yaml"])
    # No temp files left; the history holds one file per save (step 2 and step 4).
    assert all(path.is_file() for path in run_dir.iterdir() if path.name != "checkpoints")
    assert sorted(path.name for path in (run_dir / "checkpoints").iterdir()) == [
        "step_000000002.pth", "step_000000004.pth"]
    written = [rank_results["end_to_end"]["written"] for rank_results in results]
    assert written[1] == []  # rank 1 writes nothing, not even identical copies
    assert written[0][:4] == ["config.yaml", "last.pth", "epoch_1.pth", "best.pth"]
    assert written[0].count("last.pth") == 2 and written[0].count("config.yaml") == 1

    last = load_checkpoint(run_dir / "last.pth")
    assert last["epoch"] == 2 and last["step"] == 4  # 16 samples / global batch 8, 2 epochs
    assert not any(key.startswith("module.") for key in last["model"])  # model_without_ddp
    assert all(tensor.device.type == "cpu" for tensor in last["model"].values())
    assert ranks[0]["step"] == ranks[1]["step"] == 4
    # Validation loss is all-reduced: the same number on both ranks; AP lives on rank 0.
    assert ranks[0]["history"][2]["loss"] == ranks[1]["history"][2]["loss"]
    assert "ap_50" in ranks[0]["history"][2]


def test_train_log_states_the_batch_split(two_rank_runs):
    work, _ = two_rank_runs
    log = (work / "e2e" / "train.log").read_text()
    assert "global batch 8 = micro 2 x world 2 x accum 2" in log
    assert "backend gloo" in log
    assert "[rank 1]" not in log  # only rank 0 writes the log file
    assert "epoch 2 validation (3 samples)" in log  # each sample once across ranks


def test_tensorboard_holds_the_promised_scalars(two_rank_runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    work, _ = two_rank_runs
    accumulator = EventAccumulator(str(work / "e2e"))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert {f"train/{n}" for n in TRAIN_SCALARS} | {f"val/{n}" for n in VAL_SCALARS} <= tags
    # Every validation GT of this tiny split is seen by the ego: the ego-occluded AP is
    # undefined (None) and not logged as a misleading 0 (test_eval checks a logged one).
    assert "val/ap_50_ego_occluded" not in tags
    for name in TRAIN_SCALARS:
        steps = [event.step for event in accumulator.Scalars(f"train/{name}")]
        assert steps == [1, 2, 3, 4], f"train/{name}"
    for name in VAL_SCALARS:
        steps = [event.step for event in accumulator.Scalars(f"val/{name}")]
        assert steps == [2, 4], f"val/{name}"  # eval_freq 1: after each epoch's last step
    lrs = [event.value for event in accumulator.Scalars("train/lr")]
    assert lrs[1] > lrs[0] and lrs[3] < lrs[1]  # warm-up epoch, then cosine decay
    assert all(event.value > 0 for event in accumulator.Scalars("train/samples_per_s"))
    # A BEV picture of the first validation sample each time AP is computed.
    pictures = accumulator.Images("val/bev")
    assert [event.step for event in pictures] == [2, 4]
    assert pictures[0].width > 100 and pictures[0].height > 50


def test_impossible_global_batch_fails_on_every_rank(two_rank_runs):
    work, results = two_rank_runs
    rank0, rank1 = (rank_results["bad_split"] for rank_results in results)
    message = rank0.get("exit", "")
    assert message.startswith("error: ") and "\n" not in message, rank0
    assert "global batch 3 cannot be split over world size 2" in message
    assert "2 or 4" in message  # the fix is named
    assert rank1 == {"exit": "1", "written": []}  # the same error: rank 0 prints it for the job
    assert not (work / "bad_split").exists()  # failed before writing a run folder


def test_trainer_wraps_ddp_without_unused_parameter_search(two_rank_runs):
    """docs/DESIGN.md §6.4/6.10: the model the 2-rank run trained was DDP-wrapped with
    find_unused_parameters off and gradient_as_bucket_view on, around model_without_ddp;
    on CPU, BatchNorm stays plain (SyncBN is for CUDA)."""
    _, results = two_rank_runs
    _finished(results, "end_to_end")
    for rank_results in results:
        seen = rank_results["end_to_end"]["model"]
        assert seen["is_ddp"] and seen["wraps_bare_model"]
        assert seen["find_unused_parameters"] is False
        assert seen["gradient_as_bucket_view"] is True
        assert seen["device_ids"] is None and seen["backend"] == "gloo"
        assert seen["sync_bn"] == 0 and seen["plain_bn"] > 0
        assert seen["param_devices"] == ["cpu"]


def test_a_frozen_part_trains_under_ddp_without_unused_parameter_search(two_rank_runs):
    """DDP without find_unused_parameters raises at a step's forward if the last backward left
    a parameter it reduces without gradient: frozen parameters (requires_grad off before DDP
    wraps the model) are not among them. Between the epochs' checkpoints the frozen weights and
    BatchNorm statistics stay exact while the encoder moves."""
    work, results = two_rank_runs
    assert [rank["step"] for rank in _finished(results, "frozen")] == [4, 4]
    assert all(rank["frozen"]["model"]["find_unused_parameters"] is False for rank in results)
    epoch_1 = load_checkpoint(work / "frozen" / "epoch_1.pth")["model"]
    epoch_2 = load_checkpoint(work / "frozen" / "epoch_2.pth")["model"]
    changed = {key for key in epoch_1 if not torch.equal(epoch_1[key], epoch_2[key])}
    assert "encoder.vfe.layers.0.norm.running_mean" in changed
    assert not any(key.startswith(("backbone.", "head.")) for key in changed), changed


@pytest.mark.parametrize("name", FAST_DDP_CONFIGS)
def test_fusion_config_trains_under_ddp(two_rank_runs, name):
    """Two optimiser steps per rank: DDP without find_unused_parameters raises at the second
    forward if the first backward left a parameter without gradient."""
    _, results = two_rank_runs
    ranks = _finished(results, name)
    assert [rank["step"] for rank in ranks] == [expected_steps(name)] * 2


@pytest.mark.slow
def test_remaining_fusion_configs_train_under_ddp(data_root, tmp_path):
    results = run_on_ranks(_two_rank_body, world_size=2, init_group=False, timeout_s=300,
                           args=(_session_jobs(data_root, tmp_path, SLOW_DDP_CONFIGS)[2:],))
    for name in SLOW_DDP_CONFIGS:
        ranks = _finished(results, name)
        assert [rank["step"] for rank in ranks] == [expected_steps(name)] * 2, name


# ----------------------------------------------------------------------------------------------
# Single process
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FUSION_CONFIGS)
def test_every_parameter_receives_a_gradient(name, data_root, tmp_path):
    from opencood.config import load_config
    from opencood.data.collate import collate_samples
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    from opencood.data.pipeline import BatchPreparer
    from opencood.losses import build_loss
    cfg = load_config(fusion_yaml(tmp_path, name),
                      [arg for arg in data_args(data_root, validate=None) if arg != "--set"])
    info = DistInfo(0, 1, 0, False, None, CPU)
    model, model_without_ddp, _ = recipe.prepare_model(cfg, info, None, None)
    assert model is model_without_ddp  # no DDP wrapper in one process
    dataset = build_dataset(cfg, "train", train=True, strategy=choose_strategy(cfg))
    task = DetectionTask(BatchPreparer.from_config(cfg, CPU), build_loss(cfg["loss"]))
    loss, _, count = task.training_loss(model, collate_samples([dataset[0], dataset[1]]))
    loss.backward()
    assert count == 2 and torch.isfinite(loss)
    missing = [key for key, param in model.named_parameters() if param.grad is None]
    assert not missing, f"{name}: parameters without gradient: {missing}"


def test_model_summary_does_not_change_the_model(data_root):
    from opencood.config import load_config
    from opencood.data.pipeline import BatchPreparer
    cfg = load_config(SMOKE_YAML, [arg for arg in data_args(data_root, validate=None)
                                   if arg != "--set"])
    info = DistInfo(0, 1, 0, False, None, CPU)
    from opencood.data.collate import collate_samples
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    loader = torch.utils.data.DataLoader(build_dataset(cfg, "train", train=True,
                                                       strategy=choose_strategy(cfg)), batch_size=2,
                                         collate_fn=collate_samples)
    model, _, _ = recipe.prepare_model(cfg, info, None, None)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    assert any("running_mean" in key for key in before)  # the summary's forward would move them
    recipe.log_model_summary(model, BatchPreparer.from_config(cfg, CPU), loader)
    changed = [key for key, value in model.state_dict().items()
               if not torch.equal(value, before[key])]
    assert not changed
    assert model.training


def _resume_args(root: Path):
    # A checkpoint after every step (kept), so mid-epoch resumes can start from any of them;
    # saving must not change the run (the straight run is the reference of every resume).
    return ["--set", "train_params.epoches=4", "--set", "train_params.eval_freq=4",
            "--set", "ema.enabled=true", "--set", "ema.tau=2",
            "--set", "train_params.save_freq=2",
            "--set", "train_params.checkpoint_every_steps=1",
            "--set", "train_params.keep_checkpoints=20", *data_args(root)]


def _interrupted_copy(run_dir: Path, epoch: int, target: Path) -> Path:
    """The folder a job killed right after epoch ``epoch`` leaves: config.yaml and last.pth."""
    target.mkdir()
    shutil.copy(run_dir / "config.yaml", target / "config.yaml")
    shutil.copy(run_dir / f"epoch_{epoch}.pth", target / "last.pth")
    return target


def _assert_same_training_state(resumed: dict, straight: dict):
    assert resumed["epoch"] == straight["epoch"] == 4
    assert resumed["step"] == straight["step"] == 8
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key
    opt_resumed, opt_straight = resumed["optimizer"], straight["optimizer"]
    assert opt_resumed["param_groups"] == opt_straight["param_groups"]
    for index, state in opt_straight["state"].items():
        for name, value in state.items():
            assert torch.equal(opt_resumed["state"][index][name], value), (index, name)
    assert resumed["scheduler"] == straight["scheduler"]
    assert resumed["best_val_loss"] == straight["best_val_loss"]
    assert resumed["ema"]["updates"] == straight["ema"]["updates"] == 8
    for key, value in straight["ema"]["module"].items():
        assert torch.equal(resumed["ema"]["module"][key], value), f"ema {key}"
    assert torch.equal(resumed["rng"]["torch"], straight["rng"]["torch"])


@pytest.fixture(scope="module")
def straight_run(data_root, tmp_path_factory):
    """4 epochs without interruption (0 loader workers)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    with pytest.MonkeyPatch.context() as patch, preserved_opencood_logger():
        patch.setattr(torch.cuda, "is_available", lambda: False)
        result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                               *_resume_args(data_root)])
    return run_dir, result, load_checkpoint(run_dir / "last.pth")


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_matches_uninterrupted_training(straight_run, tmp_path, workers, cpu_only):
    """2 epochs + resume (--model_dir) for 2 more == 4 epochs straight. The resumed part may use
    loader workers: they are seeded per epoch and samples depend on (seed, epoch, index) only."""
    straight_dir, straight, straight_state = straight_run
    initial = load_checkpoint(straight_dir / "epoch_2.pth")
    assert initial["epoch"] == 2
    assert any(not torch.equal(value, straight_state["model"][key])
               for key, value in initial["model"].items())  # epochs 3-4 did train

    resume_dir = _interrupted_copy(straight_dir, 2, tmp_path / "resumed")
    resumed = trainer.main(["--model_dir", str(resume_dir),
                            "--set", f"train_params.num_workers={workers}"])
    assert resumed["step"] == 8
    assert sorted(resumed["history"]) == [3, 4]  # only the missing epochs ran
    assert resumed["history"][4] == straight["history"][4]
    _assert_same_training_state(load_checkpoint(resume_dir / "last.pth"), straight_state)
    assert "resumed from" in (resume_dir / "train.log").read_text()


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_resume_from_inside_an_epoch_matches_uninterrupted_training(straight_run, tmp_path,
                                                                    workers, cpu_only):
    """A job killed after step 5 (the first of epoch 3's two steps) resumes from that step's
    checkpoint and ends exactly where the uninterrupted run does: the same batches, augmentations
    and random draws. TensorBoard drops what the killed job logged after step 5."""
    straight_dir, straight, straight_state = straight_run
    mid_epoch = load_checkpoint(history_path(straight_dir, 5))
    assert (mid_epoch["epoch"], mid_epoch["epoch_steps_done"], mid_epoch["step"]) == (2, 1, 5)
    assert "epoch_steps_done" not in load_checkpoint(history_path(straight_dir, 6))

    resume_dir = tmp_path / "resumed"
    shutil.copytree(straight_dir, resume_dir)           # events of steps 1-8 included
    shutil.copy(history_path(straight_dir, 5), resume_dir / "last.pth")
    resumed = trainer.main(["--model_dir", str(resume_dir),
                            "--set", f"train_params.num_workers={workers}"])
    assert resumed["step"] == 8 and sorted(resumed["history"]) == [3, 4]
    assert resumed["history"][4] == straight["history"][4]
    _assert_same_training_state(load_checkpoint(resume_dir / "last.pth"), straight_state)
    assert "epoch 3 continues after its first 1 of 2 steps" in \
        (resume_dir / "train.log").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(resume_dir))
    events.Reload()
    assert [event.step for event in events.Scalars("train/loss")] == list(range(1, 9))


def test_fast_step_switches_train_to_the_weights_of_the_default_path(data_root, tmp_path,
                                                                     cpu_only):
    """performance.static_pillars + sync_free_step in the real flow: 2 SGD steps end where the
    default path's do, up to float32 rounding (SGD: weight differences are lr x gradient
    differences, which Adam's normalisation would blow up where a gradient is near 0)."""
    weights = {}
    # performance.cuda_graph on CPU: the graph step's eager fallback, through the trainer.
    graph = [*FAST_STEP, "--set", "performance.cuda_graph=true"]
    for name, switches in (("default", []), ("fast", FAST_STEP), ("graph", graph)):
        with preserved_opencood_logger():
            result = trainer.main([
                "--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / name),
                "--set", "train_params.epoches=1", "--set", "optimizer.core_method=SGD",
                *data_args(data_root, validate=None), *switches])
        assert result["step"] == 2
        weights[name] = load_checkpoint(tmp_path / name / "last.pth")["model"]
    for key, value in weights["default"].items():
        torch.testing.assert_close(weights["fast"][key], value, rtol=1e-4, atol=1e-6,
                                   msg=lambda text, key=key: f"{key}: {text}")
        assert torch.equal(weights["graph"][key], weights["fast"][key]), key


def test_checkpoint_schedule_by_steps_and_refusal_of_negative_values():
    every_two = train_state.MidEpochCheckpoints(every_steps=2, every_minutes=0)
    assert [step for step in range(1, 8) if every_two.due(step)] == [2, 4, 6]
    assert not any(train_state.MidEpochCheckpoints(0, 0).due(step) for step in range(1, 8))
    overdue = train_state.MidEpochCheckpoints(every_steps=0, every_minutes=1e-9)
    assert overdue.due(1)
    with pytest.raises(ConfigError, match="checkpoint_every_steps"):
        train_state.MidEpochCheckpoints(-1, 0)


def test_restore_grad_scaler_loads_skips_or_ignores():
    saved = torch.amp.GradScaler("cpu", init_scale=1024.0).state_dict()
    enabled = torch.amp.GradScaler("cpu")
    train_state.restore_grad_scaler(enabled, saved)
    assert enabled.get_scale() == 1024.0
    fresh = torch.amp.GradScaler("cpu", init_scale=4096.0)
    train_state.restore_grad_scaler(fresh, {})    # saved without fp16: torch would raise here
    assert fresh.get_scale() == 4096.0
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    train_state.restore_grad_scaler(disabled, saved)  # an fp16 run resumed without fp16
    assert not disabled.is_enabled() and disabled.state_dict() == {}


def test_training_batches_come_through_the_device_prefetcher(data_root, tmp_path, cpu_only,
                                                             monkeypatch):
    """Every epoch's batches pass DevicePrefetcher (on CUDA it overlaps the next batch's copy
    with the step; on CPU it hands the loader's batches over unchanged)."""
    from opencood.data.collate import DevicePrefetcher
    devices, real_iter = [], DevicePrefetcher.__iter__

    def recording_iter(prefetcher):
        devices.append(prefetcher.device)
        return real_iter(prefetcher)

    monkeypatch.setattr(DevicePrefetcher, "__iter__", recording_iter)
    result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
                           "--set", "train_params.epoches=2", *data_args(data_root,
                                                                         validate=None)])
    assert result["step"] == 4 and devices == [torch.device("cpu")] * 2


def test_fp16_resume_of_a_run_saved_without_a_scaler(data_root, tmp_path, cpu_only):
    """An fp32 run resumed with fp16 (an enabled GradScaler, which CPU training does not
    otherwise get) continues, loss scaling from the default scale."""
    run_dir = tmp_path / "run"
    trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                  "--set", "train_params.epoches=1", *data_args(data_root, validate=None)])
    assert load_checkpoint(run_dir / "last.pth")["scaler"] == {}

    def enable_loss_scaling(parts, info):   # before the resume restores the scaler's state
        parts.scaler = torch.amp.GradScaler("cpu")

    result = trainer.main(["--model_dir", str(run_dir), "--set", "train_params.epoches=2"],
                          hooks=TrainHooks(on_parts=enable_loss_scaling))
    assert result["step"] == 4  # 2 epochs of 2 steps
    scaler = load_checkpoint(run_dir / "last.pth")["scaler"]
    assert scaler["scale"] == 2.0 ** 16  # torch's default initial scale, no overflow on CPU
    assert "loss scaling starts afresh" in (run_dir / "train.log").read_text()


def test_resume_past_a_truncated_last_pth_loses_nothing(data_root, tmp_path, cpu_only):
    run_dir = tmp_path / "run"
    trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                  "--set", "train_params.epoches=2", *data_args(data_root, validate=None)])
    last = run_dir / "last.pth"
    last.write_bytes(last.read_bytes()[:1000])            # a torn copy
    result = trainer.main(["--model_dir", str(run_dir), "--set", "train_params.epoches=3"])
    assert result["step"] == 6                             # epochs 1-2 kept, epoch 3 trained
    log = (run_dir / "train.log").read_text()
    assert "skipping" in log and "last.pth" in log and "step_000000004.pth" in log
    assert load_checkpoint(last)["epoch"] == 3


def test_a_full_disk_stops_training_in_one_line_and_keeps_the_last_checkpoint(
        data_root, tmp_path, monkeypatch, cpu_only):
    from opencood.utils import checkpoint as ckpt
    real_save = ckpt.torch.save
    saves = []

    def full_on_second_save(obj, stream):
        saves.append(1)
        if len(saves) > 1:   # epoch 1's history file and last.pth are written; the next meets
            # a full disk (epoch_1.pth)
            stream.write(b"PK half")
            raise OSError(28, "No space left on device")
        return real_save(obj, stream)

    monkeypatch.setattr(ckpt.torch, "save", full_on_second_save)
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                      "--set", "train_params.epoches=2", *data_args(data_root, validate=None)])
    message = str(info.value.code)
    assert message.startswith("error: cannot write checkpoint") and "\n" not in message
    assert "No space left on device" in message
    monkeypatch.undo()
    assert load_checkpoint(run_dir / "last.pth")["epoch"] == 1


@pytest.fixture
def nan_at_step_3(monkeypatch):
    """The training loss of the 3rd optimizer step (epoch 2's first: 2 steps per epoch) is NaN."""
    real_loss, calls = DetectionTask.training_loss, []

    def poisoned(task, model, batch):
        loss, terms, count = real_loss(task, model, batch)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), terms, count

    monkeypatch.setattr(DetectionTask, "training_loss", poisoned)


@pytest.mark.parametrize("switches", [[], FAST_STEP], ids=["default", "fast_step"])
def test_a_nan_stops_training_naming_the_step_with_the_last_checkpoint_intact(
        data_root, tmp_path, nan_at_step_3, cpu_only, switches):
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                      "--set", "train_params.epoches=3", *data_args(data_root, validate=None),
                      *switches])
    message = str(info.value.code)
    assert "non-finite loss (nan) at epoch 2 step 3" in message and "\n" not in message
    assert load_checkpoint(run_dir / "last.pth")["step"] == 2


@pytest.mark.parametrize("switches", [[], FAST_STEP], ids=["default", "fast_step"])
def test_skip_nonfinite_steps_skips_and_counts(data_root, tmp_path, nan_at_step_3, cpu_only,
                                               switches):
    run_dir = tmp_path / "run"
    result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                           "--set", "train_params.epoches=3",
                           "--set", "train_params.skip_nonfinite_steps=1",
                           *data_args(data_root, validate=None), *switches])
    assert result["step"] == 6 and result["skipped_steps"] == 1
    last = load_checkpoint(run_dir / "last.pth")
    assert last["skipped_steps"] == 1
    assert all(torch.isfinite(value).all() for value in last["model"].values()
               if value.is_floating_point())
    assert "skipped step 3: non-finite loss (nan)" in (run_dir / "train.log").read_text()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir))
    events.Reload()
    counts = [(event.step, event.value) for event in events.Scalars("train/skipped_steps")]
    assert counts == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 1.0), (5, 1.0), (6, 1.0)]


def test_slurm_environment_runs_a_one_rank_process_group(data_root, tmp_path, monkeypatch,
                                                         cpu_only):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    seen = {}

    def spy(parts, info):
        seen.update(initialized=dist_utils.is_dist_initialized(), info=info)

    result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
                           "--set", "train_params.epoches=1",
                           *data_args(data_root, validate=None)], hooks=TrainHooks(on_parts=spy))
    assert seen["initialized"]
    info = seen["info"]
    assert (info.rank, info.world_size, info.local_rank, info.distributed, info.backend) == \
        (0, 1, 0, True, "gloo")
    assert result["step"] == 2
    assert "micro 2 x world 1 x accum 1" in (tmp_path / "run" / "train.log").read_text()
    assert not dist_utils.is_dist_initialized()  # the session destroyed its group


# ----------------------------------------------------------------------------------------------
# Command line and configuration errors
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content", [None, "train_params: [unclosed\n"], ids=["missing", "invalid"])
def test_broken_yaml_gives_a_one_line_error(tmp_path, content):
    path = tmp_path / "broken.yaml"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as raised:
        trainer.main(["--hypes_yaml", str(path), "--runs_root", str(tmp_path / "runs")])
    message = str(raised.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert str(path) in message
    assert not (tmp_path / "runs").exists()


def test_batch_larger_than_the_split_is_a_one_line_error(data_root, tmp_path, cpu_only):
    with pytest.raises(SystemExit) as raised:
        trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
                      "--set", "train_params.batch_size=8",
                      "--set", "train_params.max_micro_batch=8",
                      *data_args(data_root, validate=None)])
    message = str(raised.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert "4 samples" in message and "micro-batch of 8" in message


def test_model_dir_without_config_is_a_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: .*config\.yaml: not found"):
        trainer.main(["--model_dir", str(tmp_path)])


# ----------------------------------------------------------------------------------------------
# Learning-rate schedules
# ----------------------------------------------------------------------------------------------

def test_cosine_with_warmup_hand_values():
    cfg = resolve_section("lr_scheduler", {"core_method": "cosine", "warmup_epochs": 1,
                                           "warmup_start_ratio": 0.1, "min_lr_ratio": 0.2})
    # 4 steps per epoch, 3 epochs: warm-up steps 0-3, cosine over the remaining 8 steps.
    factors = [lr_factor(step, 12, 4, cfg) for step in range(13)]
    warmup = [0.1, 0.325, 0.55, 0.775]
    cosine = [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(9)]
    assert factors == pytest.approx(warmup + cosine, abs=1e-12)
    assert factors[4] == pytest.approx(1.0) and factors[8] == pytest.approx(0.6)
    assert factors[12] == pytest.approx(0.2)
    assert lr_factor(40, 12, 4, cfg) == pytest.approx(0.2)  # clamped past the end


def test_multistep_with_warmup_hand_values():
    cfg = resolve_section("lr_scheduler", {"core_method": "multistep", "warmup_epochs": 0.5,
                                           "warmup_start_ratio": 0.0, "step_size": [2, 3],
                                           "gamma": 0.5})
    factors = [lr_factor(step, 20, 4, cfg) for step in range(16)]
    expected = [0.0, 0.5] + [1.0] * 6 + [0.5] * 4 + [0.25] * 4  # milestones at steps 8 and 12
    assert factors == pytest.approx(expected, abs=1e-12)


def test_constant_and_unknown_schedules():
    constant = resolve_section("lr_scheduler", {"core_method": "constant"})
    assert lr_factor(7, 10, 2, constant) == 1.0
    assert lr_factor(0, 10, 2, resolve_section("lr_scheduler")) == 1.0
    with pytest.raises(ConfigError, match="'lr_scheduler.core_method' is 'poly'"):
        resolve_section("lr_scheduler", {"core_method": "poly"})
    # Checked once, by the schema; that the code knows exactly those names:
    # tests/test_config_schema.py (the schema's literals equal OPTIMIZERS and SCHEDULES).


def test_scheduler_steps_per_optimiser_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = build_optimizer([param], resolve_section("optimizer", {
        "core_method": "AdamW", "lr": 0.5, "args": {"weight_decay": 0.0}}))
    scheduler = build_scheduler(optimizer, resolve_section("lr_scheduler", {
        "core_method": "cosine", "warmup_epochs": 1, "warmup_start_ratio": 0.5,
        "min_lr_ratio": 0.0}), 4, 2)
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.25, 0.375, 0.5, 0.25])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)


# ----------------------------------------------------------------------------------------------
# GPU (run where a GPU is lent; skipped on CPU-only machines)
# ----------------------------------------------------------------------------------------------

def _cuda_main_on_rank(rank, world_size, visible_devices, port, argv):
    # dist_helpers hides GPUs from its ranks; nothing has touched CUDA yet, so undo that here.
    if visible_devices is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices
    return _main_on_rank(rank, world_size, port, argv)


@pytest.mark.cuda
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
def test_two_rank_cuda_run_with_sync_batchnorm(data_root, tmp_path):
    """2 ranks on CUDA: nccl with 2+ GPUs, else gloo with CUDA tensors on one shared GPU."""
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus >= 2 else "gloo"
    argv = ["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
            "--set", "train_params.epoches=1",  # global batch 2: micro 1 x world 2, 2 steps
            "--set", f"distributed.backend={backend}", *data_args(data_root)]
    results = run_on_ranks(_cuda_main_on_rank, world_size=2, init_group=False, timeout_s=300,
                           args=(os.environ.get("CUDA_VISIBLE_DEVICES"), free_port(), argv))
    for rank, outcome in enumerate(results):
        assert "result" in outcome, f"rank {rank}: {outcome.get('error') or outcome.get('exit')}"
        seen = outcome["model"]
        expected_device = f"cuda:{rank if gpus >= 2 else 0}"
        assert seen["device"] == expected_device and seen["backend"] == backend
        assert seen["param_devices"] == [expected_device]
        assert seen["sync_bn"] > 0 and seen["plain_bn"] == 0  # every BatchNorm converted
        assert seen["is_ddp"] and seen["device_ids"] == [int(expected_device[-1])]
        assert outcome["result"]["step"] == 2
    assert results[0]["result"]["history"][1]["loss"] == results[1]["result"]["history"][1]["loss"]
    last = load_checkpoint(tmp_path / "run" / "last.pth")
    assert all(t.device.type == "cpu" for t in last["model"].values())  # loads without a GPU


@pytest.mark.cuda
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_amp_training_on_cuda(data_root, tmp_path, dtype):
    result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
                           "--set", "train_params.epoches=1", "--set", "amp.enabled=true",
                           "--set", f"amp.dtype={dtype}", *data_args(data_root)])
    assert result["step"] == 2
    assert math.isfinite(result["history"][1]["loss"])
    last = load_checkpoint(tmp_path / "run" / "last.pth")
    if dtype == "fp16":  # fp16 needs a loss scale, saved for resuming; bf16 does not
        assert last["scaler"].get("scale", 0) > 0
    else:
        assert not last["scaler"]
    assert all(t.dtype != torch.float16 for t in last["model"].values())


def test_corrupt_pcd_in_a_worker_is_a_one_line_error(tmp_path):
    """A file the loader cannot parse stops training with one line naming the file, even when
    the error is raised inside a DataLoader worker process."""
    from tests.opv2v_factory import write_simple_split
    main = trainer.main

    split = write_simple_split(tmp_path / "data" / "train", num_cavs=2)
    broken = sorted(split.rglob("*.pcd"))[1]
    broken.write_text("# .PCD v0.7\nFIELDS x y z\nnot a pcd\n")
    with pytest.raises(SystemExit) as info:
        main(["--hypes_yaml", "hypes_yaml/synthetic/smoke.yaml", "--model_dir",
              str(tmp_path / "run"), "--set", f"root_dir={split}", "--set", "validate_dir=",
              "--set", "train_params.num_workers=1", "--set", "train_params.epoches=1"])
    message = str(info.value)
    assert message.startswith("error: ") and str(broken) in message and "\n" not in message


def test_amp_is_used_on_cuda_only():
    """The opv2v yamls enable bf16 for GPUs; on CPU training stays fp32 (autocast there is
    slower than fp32), and fp16 gets a GradScaler only on CUDA."""
    from opencood.engine.recipe import amp_settings

    dtype, scaler = amp_settings(resolve_section("amp", {"enabled": True, "dtype": "bf16"}),
                                 torch.device("cpu"))
    assert dtype is None and not scaler.is_enabled()
    dtype, scaler = amp_settings(resolve_section("amp", {"enabled": False}), torch.device("cpu"))
    assert dtype is None and not scaler.is_enabled()


def test_unknown_model_name_is_a_one_line_error_listing_models(tmp_path):
    from tests.opv2v_factory import write_simple_split
    main = trainer.main

    split = write_simple_split(tmp_path / "data" / "train", num_cavs=2)
    with pytest.raises(SystemExit) as info:
        main(["--hypes_yaml", "hypes_yaml/synthetic/smoke.yaml", "--model_dir",
              str(tmp_path / "run"), "--set", f"root_dir={split}", "--set", "validate_dir=",
              "--set", "model.core_method=pointpillar"])
    message = str(info.value)
    assert message == ("error: hypes_yaml/synthetic/smoke.yaml: model.core_method: unknown model "
                       "'pointpillar'; registered models: heter_model_late, heter_pyramid_collab, "
                       "heter_pyramid_single, point_pillar, point_pillar_intermediate")
    assert not (tmp_path / "run").exists()   # refused before any file is written


def _late_rank_main(rank, world_size, port, argv, rank_0_done):
    """trainer.main where rank 1 gets stuck after its last step of epoch 1 (step 2: train4 in
    global batches of 2) until rank 0 has ended (the file ``rank_0_done``), at most 20 s."""
    import time as time_module

    def stuck_after_the_epoch(step, stats):
        stuck_since = time_module.monotonic()
        while rank == 1 and step == 2 and not Path(rank_0_done).exists() and \
                time_module.monotonic() - stuck_since < 20:
            time_module.sleep(0.05)

    start = time_module.monotonic()
    outcome = _main_on_rank(rank, world_size, port, argv,
                            TrainHooks(after_step=stuck_after_the_epoch))
    outcome["seconds"] = time_module.monotonic() - start
    if rank == 0:
        Path(rank_0_done).touch()
    return outcome


def test_a_stuck_rank_is_named_and_the_job_ends_within_the_timeout(data_root, tmp_path):
    argv = ["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(tmp_path / "run"),
            "--set", "train_params.epoches=1", "--set", "distributed.timeout_minutes=0.05",
            *data_args(data_root, validate=None)]
    rank0, _ = run_on_ranks(_late_rank_main, world_size=2, init_group=False, timeout_s=120,
                            args=(free_port(), argv, str(tmp_path / "rank0.done")))
    assert rank0.get("exit", "").startswith("error: rank(s) 1 did not reach the end of epoch 1 "
                                            "within 3 s"), rank0
    assert not (tmp_path / "run" / "last.pth").exists()   # stopped before saving the epoch


class _ParamOn:
    """A stand-in for a parameter on ``device`` (the choice reads only the device)."""

    def __init__(self, device: str):
        self.device = torch.device(device)


def test_the_optimizer_is_fused_on_cuda_unless_args_choose():
    from opencood.engine.optim import implementation_args
    on_gpu = [_ParamOn("cuda"), _ParamOn("cuda:1")]
    assert implementation_args(on_gpu, {"weight_decay": 0.01}) == {"fused": True}
    assert implementation_args([{"params": on_gpu}], {}) == {"fused": True}   # param groups
    assert implementation_args(on_gpu, {"foreach": True}) == {}               # the user's choice
    assert implementation_args(on_gpu, {"fused": False}) == {}
    assert implementation_args([_ParamOn("cuda"), _ParamOn("cpu")], {}) == {}
    assert implementation_args([_ParamOn("cpu")], {}) == {}                   # CPU: unchanged
    optimizer = build_optimizer([torch.nn.Parameter(torch.zeros(2))], resolve_section(
        "optimizer", {"core_method": "AdamW", "lr": 0.1}))
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"] is None


@pytest.mark.cuda
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_fused_optimizer_on_cuda_steps_as_the_foreach_one(name):
    torch.manual_seed(0)
    start = [torch.randn(5, 3, device="cuda"), torch.randn(7, device="cuda")]
    args = {"weight_decay": 0.01, **({"momentum": 0.9} if name == "SGD" else {})}
    section = resolve_section("optimizer", {"core_method": name, "lr": 0.01, "args": args})
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    foreach = [torch.nn.Parameter(t.clone()) for t in start]
    fused_opt = build_optimizer(fused, section)
    foreach_opt = build_optimizer(foreach, {**section, "args": {**args, "foreach": True}})
    assert fused_opt.defaults["fused"] and not foreach_opt.defaults.get("fused")
    for step in range(3):
        for params, optimizer in ((fused, fused_opt), (foreach, foreach_opt)):
            sum((p * (step + 1)).square().sum() for p in params).backward()
            optimizer.step()
            optimizer.zero_grad()
    for a, b in zip(fused, foreach):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
