"""What a new user stumbles on (issue 30): a run folder that takes another config, errors
repeated by every rank, evaluation arguments refused late, relative data paths, ``--set
fusion.core_method=no``, and pictures that mislabel the roadside unit.

Runs are tiny: one 2-step epoch of smoke.yaml on a hand-made 4-frame split.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import yaml

from opencood.config import ConfigError, load_config, replaced, save_config
from opencood.data.opv2v import OPV2VSplit
from opencood.engine import trainer
from opencood.errors import OpencoodError, run_cli
from opencood.models.build import build_model
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import save_checkpoint
from dist_helpers import free_port, run_on_ranks
from opv2v_factory import frame_stamps, write_simple_split
from process_state import (cpu_and_process_state, preserved_opencood_logger,  # noqa: F401
                           preserved_torch_switches)
from tool_modules import load_tool

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "hypes_yaml" / "synthetic"
SMOKE_YAML = CONFIG_DIR / "smoke.yaml"


pytestmark = pytest.mark.usefixtures("cpu_and_process_state")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    write_simple_split(root / "train", num_cavs=2, timestamps=frame_stamps(4))
    return root


def data_sets(root: Path) -> list:
    return ["--set", f"root_dir={root / 'train'}", "--set", "validate_dir=null",
            "--set", f"test_dir={root / 'train'}", "--set", "train_params.epoches=1"]


@pytest.fixture(scope="module")
def finished_run(data_root, tmp_path_factory) -> Path:
    """smoke.yaml trained for its one epoch (2 steps): config.yaml, last.pth, train.log, ..."""
    run_dir = tmp_path_factory.mktemp("runs") / "smoke"
    with preserved_torch_switches(), preserved_opencood_logger(), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                      *data_sets(data_root)])
    return run_dir


@pytest.fixture
def run_copy(finished_run, tmp_path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def file_hashes(folder: Path) -> dict:
    """{relative path: sha1} of every file under ``folder``, logs and events included."""
    return {str(path.relative_to(folder)): hashlib.sha1(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def fcooper_yaml(folder: Path) -> Path:
    """F-Cooper with smoke.yaml's geometry: another model for the same run folder."""
    smoke = yaml.safe_load(SMOKE_YAML.read_text())
    smoke.update({"_base_": str(CONFIG_DIR / "point_pillar_fcooper.yaml"),
                  "name": "point_pillar_fcooper"})
    path = folder / "fcooper_smoke.yaml"
    path.write_text(yaml.safe_dump(smoke))
    return path


# ----------------------------------------------------------------------------------------------
# 1. a run folder belongs to one config
# ----------------------------------------------------------------------------------------------

def test_another_config_for_a_run_folder_is_refused_leaving_its_files(finished_run, data_root,
                                                                     tmp_path):
    """What `CONFIG=...fcooper.yaml bash tools/quickstart.sh` did with a shared RUN: one line
    naming the differing keys and the two ways out; not one byte of the folder changes."""
    before = file_hashes(finished_run)
    with pytest.raises(SystemExit) as raised:
        trainer.main(["--hypes_yaml", str(fcooper_yaml(tmp_path)),
                      "--model_dir", str(finished_run), *data_sets(data_root)])
    message = raised.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert str(finished_run / "config.yaml") in message
    assert "name 'smoke' there, 'point_pillar_fcooper' here" in message
    assert "model.args.fusion" in message
    assert "another --model_dir" in message and "leave out --hypes_yaml" in message
    assert file_hashes(finished_run) == before


@pytest.mark.parametrize("key, value, there, here", [
    ("train_params.batch_size", "4", "2", "4"),
    ("train_params.grad_clip", "5.0", "10.0", "5.0"),
    ("train_params.max_cav", "2", "5", "2"),
    ("train_params.skip_nonfinite_steps", "3", "0", "3"),
])
@pytest.mark.parametrize("with_hypes_yaml", [True, False])
def test_a_resume_that_changes_a_training_key_is_refused_naming_it(
        finished_run, data_root, key, value, there, here, with_hypes_yaml):
    """Only schedule keys may change on resume: one that changes what a step does (its batch,
    clipping, agents, skipped steps) is refused in one line naming it, the folder untouched,
    whether the run is named by --hypes_yaml or resumed from its own config.yaml."""
    before = file_hashes(finished_run)
    hypes = ["--hypes_yaml", str(SMOKE_YAML), *data_sets(data_root)] if with_hypes_yaml else []
    with pytest.raises(SystemExit) as raised:
        trainer.main([*hypes, "--model_dir", str(finished_run), "--set", f"{key}={value}"])
    message = raised.value.code
    assert isinstance(message, str) and message.startswith("error: ") and "\n" not in message
    assert f"{key} {there} there, {here} here" in message
    assert file_hashes(finished_run) == before


def test_schedule_changes_resume_are_recorded_and_a_finished_run_says_so(run_copy, data_root):
    """The same config with more epochs resumes (2 more steps), and config.yaml then says 2
    epochs; resumed again, the run has nothing to train and says so in one line."""
    saved = load_config(run_copy / "config.yaml")
    result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_copy),
                           *data_sets(data_root), "--set", "train_params.epoches=2"])
    assert result["step"] == 4
    recorded = load_config(run_copy / "config.yaml")
    assert recorded["train_params"]["epoches"] == 2
    assert replaced(recorded, {"train_params.epoches": 1}) == saved  # nothing else written
    result = trainer.main(["--model_dir", str(run_copy)])
    assert result["step"] == 4
    finished = [line for line in (run_copy / "train.log").read_text().splitlines()
                if "already finished" in line]
    assert len(finished) == 1 and "epoch 2 of 2, step 4 of 4" in finished[0]


# ----------------------------------------------------------------------------------------------
# 2. errors printed once per job
# ----------------------------------------------------------------------------------------------

OTHER_MODEL = ["--set", "model.args.pillar_vfe.num_filters=[32]",
               "--set", "model.args.point_pillar_scatter.num_features=32"]


def _fail_on_both_ranks_differently(argv):
    with dist_utils.distributed_session(backend="gloo", timeout_minutes=1) as info:
        dist_utils.run_together(_raise_for(info.rank, (0, 1)), "reading its shard")


def _fail_on_rank_1_alone(argv):
    with dist_utils.distributed_session(backend="gloo", timeout_minutes=1) as info:
        dist_utils.run_together(_raise_for(info.rank, (1,)), "reading its shard")


def _raise_for(rank, failing_ranks):
    def step():
        if rank in failing_ranks:
            raise OpencoodError(f"shard_{rank}.pcd: truncated")
    return step


def _tool(name):
    """A job's ``main(argv)``, looked up on the rank (tools/ is loaded there by file)."""
    from opencood.engine import evaluator
    return {"eval": evaluator.main, "train": trainer.main,
            "both_fail": lambda argv: run_cli(_fail_on_both_ranks_differently, argv),
            "rank_1_fails": lambda argv: run_cli(_fail_on_rank_1_alone, argv)}[name]


def _error_lines(rank, world_size, port, tool, argv):
    """The ``error:`` lines this rank prints running ``tool`` as torchrun starts it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            _tool(tool)(argv)
        except SystemExit as exit_request:
            # What the interpreter does with a SystemExit nobody catches: it prints a code that
            # is not an int (the exit status is then 1).
            if exit_request.code is not None and not isinstance(exit_request.code, int):
                print(exit_request.code, file=sys.stderr)
    return [line for line in stderr.getvalue().splitlines() if line.startswith("error:")]


PEER_TIMEOUT_S = 2.0


def _a_peer_that_never_joins_on_the_tcp_path(rank, world_size, port, signals: Path):
    """A SLURM environment handed to distributed_session as a mapping (the tcp:// start-up
    path, which a caller passing its own environment takes too): rank 0 all-reduces alone,
    rank 1 stays in the group without joining until rank 0 is done (or 5 x the timeout).
    On rank 0: {"waited": seconds in the lone all-reduce, "error": what ended it}."""
    import time
    env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size),
           "SLURM_LOCALID": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # Start together: the short timeout also bounds the rendezvous.
    (signals / f"ready_{rank}").touch()
    _wait_for(signals / f"ready_{1 - rank}", 60.0)
    outcome = {"error": None}
    try:
        with dist_utils.distributed_session(backend="gloo", timeout_minutes=PEER_TIMEOUT_S / 60,
                                            env=env):
            if rank == 1:
                _wait_for(signals / "done", 5 * PEER_TIMEOUT_S)
                return None
            start = time.monotonic()
            try:
                dist_utils.all_reduce_sum(torch.ones(1))
            finally:
                outcome["waited"] = time.monotonic() - start
                (signals / "done").touch()
    except dist_utils.CollectiveTimeoutError as error:
        outcome["error"] = str(error)
    return outcome


def _wait_for(path: Path, limit_s: float) -> None:
    import time
    deadline = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _two_rank_jobs(rank, world_size, jobs, tcp_port, signals):
    """{job: its outcome on this rank}: each tool job's error lines, then the stalled peer."""
    outcomes = {name: _error_lines(rank, world_size, port, tool, argv)
                for name, port, tool, argv in jobs}
    outcomes["stalled_peer"] = _a_peer_that_never_joins_on_the_tcp_path(rank, world_size,
                                                                        tcp_port, signals)
    return outcomes


@pytest.fixture(scope="module")
def two_rank_session(tmp_path_factory):
    """One spawn of 2 gloo ranks for every 2-rank test here (each spawn imports torch)."""
    work = tmp_path_factory.mktemp("errors_2rank")
    cfg = load_config(SMOKE_YAML)
    save_config(cfg, work / "run" / "config.yaml")
    save_checkpoint(work / "run" / "last.pth", {"model": build_model(cfg["model"]).state_dict()})
    jobs = [("eval_other_model", "eval",
             ["--model_dir", str(work / "run"), "--num_workers", "0", *OTHER_MODEL]),
            ("batch_3_on_2_ranks", "train",
             ["--hypes_yaml", str(SMOKE_YAML), "--runs_root", str(work / "runs"),
              "--set", "train_params.batch_size=3"]),
            ("missing_split", "train",
             ["--hypes_yaml", str(SMOKE_YAML), "--runs_root", str(work / "runs"),
              "--set", f"root_dir={work / 'absent' / 'train'}"]),
            ("both_fail", "both_fail", []), ("rank_1_fails", "rank_1_fails", [])]
    signals = work / "signals"
    signals.mkdir()
    return run_on_ranks(_two_rank_jobs, world_size=2, init_group=False, timeout_s=120,
                        args=([(name, free_port(), tool, argv) for name, tool, argv in jobs],
                              free_port(), signals))


@pytest.mark.parametrize("job, needle", [
    ("eval_other_model", "does not fit the model"),
    ("batch_3_on_2_ranks", "global batch 3 cannot be split over world size 2"),
    ("missing_split", "absent/train: split folder not found"),
    ("rank_1_fails", "error: rank 1 failed during reading its shard: OpencoodError: "
                     "shard_1.pcd: truncated")])
def test_an_error_is_printed_once_per_job(two_rank_session, job, needle):
    rank0, rank1 = (lines[job] for lines in two_rank_session)
    assert len(rank0) == 1 and needle in rank0[0], rank0
    assert rank1 == []


def test_a_ranks_own_error_names_its_rank(two_rank_session):
    rank0, rank1 = (lines["both_fail"] for lines in two_rank_session)
    assert rank0 == ["error: shard_0.pcd: truncated"]
    assert rank1 == ["error: rank 1: shard_1.pcd: truncated"]


# ----------------------------------------------------------------------------------------------
# 8. the process-group timeout on the tcp:// start-up path (SLURM, a caller's own environment)
# ----------------------------------------------------------------------------------------------

def test_the_process_group_timeout_holds_on_the_tcp_start_up_path(two_rank_session):
    """distributed.timeout_minutes bounds a collective of a group started through tcp://, as it
    does through torchrun's store (tests/test_flow_practices.py): without it rank 0 would wait
    until its peer leaves (5 x the timeout here, 30 minutes in a real job)."""
    rank0 = two_rank_session[0]["stalled_peer"]
    assert PEER_TIMEOUT_S - 0.5 < rank0["waited"] < PEER_TIMEOUT_S + 3.0, rank0
    assert "distributed.timeout_minutes" in rank0["error"], rank0


# ----------------------------------------------------------------------------------------------
# 3. bad evaluation arguments, refused before any work
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arguments, needle", [
    (["--pose_noise", "0.2", "-1"], "--pose_noise must be >= 0, got -1"),
    (["--latency", "-2"], "--latency must be >= 0, got -2"),
    (["--seeds", "3"], "--seeds 3 repeats each --pose_noise level"),
    (["--seeds", "3", "--latency", "1"], "give --pose_noise STD")])
def test_bad_evaluation_arguments_are_refused_before_any_work(tmp_path, capsys, arguments,
                                                              needle):
    """The run folder does not even exist: the arguments are refused before it is looked at."""
    from opencood.engine import evaluator
    with pytest.raises(SystemExit) as raised:
        evaluator.main(["--model_dir", str(tmp_path / "absent"), *arguments])
    assert raised.value.code == 2
    assert needle in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# 4. data paths
# ----------------------------------------------------------------------------------------------

def test_a_missing_relative_split_names_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OpencoodError) as raised:
        OPV2VSplit("data/synthetic_tiny/train")
    message = str(raised.value)
    assert "split folder not found" in message and "current directory" in message
    assert str(tmp_path) in message and str(tmp_path / "data/synthetic_tiny/train") in message


def test_visualize_given_a_data_root_says_so_in_one_line(data_root, tmp_path, capsys):
    root = Path(shutil.copytree(data_root, tmp_path / "root"))
    (root / "test").mkdir()
    code = load_tool("visualize").main(["--data", str(root), "--out", str(tmp_path / "a.png")])
    lines = capsys.readouterr().err.splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "a data root (it holds train, test)" in lines[0] and str(root / "train") in lines[0]


def test_the_readme_says_how_to_make_smoke_yamls_data():
    """smoke.yaml's data folder is one a README command writes."""
    data_dir = Path(load_config(SMOKE_YAML)["root_dir"]).parent
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"generate_synthetic.py --out {data_dir} --preset tiny" in readme


# ----------------------------------------------------------------------------------------------
# 5. --set of a yaml yes/no word on a string key
# ----------------------------------------------------------------------------------------------

def test_set_fusion_core_method_no_means_the_word():
    assert load_config(SMOKE_YAML, ["fusion.core_method=no"])["fusion"]["core_method"] == "no"
    assert load_config(SMOKE_YAML, ["name=Off"])["name"] == "Off"
    # Boolean keys keep yaml's reading, and "false" stays a boolean (no string key takes it).
    assert load_config(SMOKE_YAML, ["ema.enabled=no"])["ema"]["enabled"] is False
    with pytest.raises(ConfigError, match="'name' must be a string, got False"):
        load_config(SMOKE_YAML, ["name=false"])


# ----------------------------------------------------------------------------------------------
# 7. pictures
# ----------------------------------------------------------------------------------------------

def test_agent_colours_stay_clear_of_the_ground_truth_green():
    from opencood.utils.vis_bev import AGENT_COLORS, GT_COLOR
    hues = cv2.cvtColor(np.array([AGENT_COLORS + [GT_COLOR]], np.uint8), cv2.COLOR_BGR2HSV)[0]
    green = 2 * int(hues[-1, 0])                                    # OpenCV hue is degrees / 2
    for color, (hue, saturation, _) in zip(AGENT_COLORS, hues[:-1]):
        distance = abs(2 * int(hue) - green)
        assert saturation < 60 or min(distance, 360 - distance) >= 45, color


def test_pictures_name_the_rsu_and_write_the_frame():
    from opencood.eval.vis import render_detection_sample, sample_agent_points
    points = torch.tensor([[5.0, 0.0, -1.0, 1.0], [-5.0, 0.0, -1.0, 1.0], [0.0, 5.0, -1.0, 1.0]])
    batch = {"points": points, "agent_index": torch.tensor([0, 1, 2]),
             "record_len": torch.tensor([3]), "agent_types": torch.tensor([0, 0, 1]),
             "transforms_to_ego": torch.eye(4).repeat(3, 1, 1),
             "gt_boxes": torch.zeros((1, 0, 7)), "gt_mask": torch.zeros((1, 0), dtype=bool)}
    assert list(sample_agent_points(batch, 0)) == ["ego", "cav 1", "RSU 2"]
    bev_range = [-40, -20, -3, 40, 20, 1]
    plain = render_detection_sample(batch, 0, torch.zeros((0, 7)), bev_range)
    titled = render_detection_sample(batch, 0, torch.zeros((0, 7)), bev_range,
                                     "2021_01_01_00_00_00 000068")
    changed_rows, changed_cols = np.nonzero(np.any(plain != titled, axis=2))
    assert len(changed_rows) > 100
    assert changed_rows.max() < 30 and changed_cols.min() > plain.shape[1] // 2   # top right

