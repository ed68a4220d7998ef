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

from opencood.config import ConfigError, load_config, save_config
from opencood.data.opv2v import OPV2VSplit
from opencood.errors import OpencoodError, run_cli
from opencood.models.build import build_model
from opencood.utils import dist as dist_utils
from opencood.utils.checkpoint import save_checkpoint
from dist_helpers import free_port, run_on_ranks
from opv2v_factory import frame_stamps, write_simple_split
from process_state import preserved_opencood_logger, preserved_torch_switches
from tool_modules import load_tool

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO_ROOT / "hypes_yaml" / "synthetic"
SMOKE_YAML = CONFIG_DIR / "smoke.yaml"
trainer = load_tool("train")


@pytest.fixture(autouse=True)
def _cpu_and_process_state(monkeypatch):
    """In-process runs stay on CPU, and the logger and torch switches they change come back."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with preserved_torch_switches(), preserved_opencood_logger():
        yield


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


def test_schedule_changes_resume_are_recorded_and_a_finished_run_says_so(run_copy, data_root):
    """The same config with more epochs resumes (2 more steps), and config.yaml then says 2
    epochs; resumed again, the run has nothing to train and says so in one line."""
    saved = load_config(run_copy / "config.yaml")
    result = trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_copy),
                           *data_sets(data_root), "--set", "train_params.epoches=2"])
    assert result["step"] == 4
    recorded = load_config(run_copy / "config.yaml")
    assert recorded["train_params"]["epoches"] == 2
    recorded["train_params"]["epoches"] = 1
    assert recorded == saved                          # nothing else was written
    result = trainer.main(["--model_dir", str(run_copy)])
    assert result["step"] == 4
    finished = [line for line in (run_copy / "train.log").read_text().splitlines()
                if "already finished" in line]
    assert len(finished) == 1 and "epoch 2 of 2, step 4 of 4" in finished[0]
