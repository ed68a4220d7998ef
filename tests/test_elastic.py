"""Fault tolerance under real launchers: a killed worker restarts and the run ends exactly where
an uninterrupted one does; restarted workers find their run folder again."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import torch

from opencood.errors import ConfigError
from opencood.engine.recipe import new_run_folder_name
from opencood.utils.checkpoint import load_checkpoint
from opv2v_factory import frame_stamps, write_simple_split

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
NOW = datetime(2026, 11, 23, 9, 30, 5)


@pytest.mark.parametrize("env,expected", [
    ({}, "smoke_2026_11_23_09_30_05"),
    ({"TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "abc"},
     "smoke_2026_11_23_09_30_05"),
    ({"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RUN_ID": "5f1c"}, "smoke_5f1c"),
    ({"SLURM_JOB_ID": "4242", "TORCHELASTIC_MAX_RESTARTS": "2"}, "smoke_slurm4242"),
])
def test_a_restartable_job_names_its_folder_after_the_job(env, expected):
    assert new_run_folder_name("smoke", env, NOW) == expected


def test_restarts_without_a_run_id_need_model_dir():
    with pytest.raises(ConfigError, match="--max-restarts needs --model_dir"):
        new_run_folder_name("smoke", {"TORCHELASTIC_MAX_RESTARTS": "1",
                                      "TORCHELASTIC_RUN_ID": "none"}, NOW)


# ---- kill -9 of a worker under torchrun --max-restarts=1 -------------------------------------

EPOCHS = 2
TIMESTAMPS = 24          # 12 optimizer steps per epoch on 2 ranks (global batch 2)


def torchrun_command(run_dir: Path, data: Path) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            "--max-restarts=1", str(REPO_ROOT / "tools" / "train.py"),
            "--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
            "--set", f"root_dir={data}", "--set", "validate_dir=null",
            "--set", f"train_params.epoches={EPOCHS}", "--set", "train_params.save_freq=100",
            "--set", "train_params.checkpoint_every_steps=1"]


def launch(run_dir: Path, data: Path, tmp_path: Path) -> subprocess.Popen:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               OPENCOOD_CACHE=str(tmp_path / f"cache_{run_dir.name}"))   # jobs run side by side
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    log = open(tmp_path / f"{run_dir.name}.log", "w")
    return subprocess.Popen(torchrun_command(run_dir, data), env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def worker_pids(agent_pid: int) -> list:
    """The training processes torchrun's agent started (its children)."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


def saved_position(run_dir: Path) -> tuple:
    """(last whole epoch, steps done in the next) of the run's last.pth; (0, 0) before one."""
    try:
        checkpoint = load_checkpoint(run_dir / "last.pth")
    except Exception:            # absent, or being replaced at this very moment
        return 0, 0
    return int(checkpoint["epoch"]), int(checkpoint.get("epoch_steps_done", 0))


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_kill_9_of_a_worker_mid_epoch_restarts_and_ends_with_the_uninterrupted_weights(
        tmp_path):
    """A checkpoint every step; one worker killed inside the first epoch. The restarted workers
    resume inside that epoch and end bit-identical to an uninterrupted run."""
    data = write_simple_split(tmp_path / "data" / "train", num_cavs=2,
                              timestamps=frame_stamps(TIMESTAMPS))
    # The two jobs run side by side (own folders, caches and ports): each one's start-up and
    # rendezvous waits overlap the other's steps.
    straight = launch(tmp_path / "straight", data, tmp_path)
    killed = launch(tmp_path / "killed", data, tmp_path)
    try:
        deadline = time.monotonic() + 240
        while saved_position(tmp_path / "killed") < (0, 3) and time.monotonic() < deadline:
            time.sleep(0.02)
        victims = worker_pids(killed.pid)
        assert saved_position(tmp_path / "killed")[0] == 0 and len(victims) == 2, \
            "the first epoch ended before a worker could be killed"
        os.kill(victims[1], signal.SIGKILL)
        assert killed.wait(timeout=300) == 0, (tmp_path / "killed.log").read_text()
        assert straight.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()
    finally:
        for job in (straight, killed):      # a failed check leaves no job running
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()

    assert "exitcode: -9" in (tmp_path / "killed.log").read_text()   # torchrun saw the kill
    log = (tmp_path / "killed" / "train.log").read_text()
    assert "resumed from" in log and "epoch 1 continues after its first" in log
    final_killed = load_checkpoint(tmp_path / "killed" / "last.pth")
    final_straight = load_checkpoint(tmp_path / "straight" / "last.pth")
    assert final_killed["epoch"] == final_straight["epoch"] == EPOCHS
    for key, value in final_straight["model"].items():
        assert torch.equal(final_killed["model"][key], value), key   # max abs difference 0
