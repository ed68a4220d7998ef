"""Bad input to each command-line tool is one ``error: ...`` line naming the file, key or value,
with a non-zero exit and no traceback (tools/bench.py and tools/profile_model.py: test_tools.py).

Each case runs the real script in a subprocess, as a user would.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from opencood.config import load_config, save_config

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
BAD_MODEL = "model.core_method=no_such_model"


def run_tool(argv: list, tmp_path: Path, env_extra: dict | None = None):
    env = dict(os.environ, OPENCOOD_CACHE=str(tmp_path / "cache"), CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    command = argv if argv[0] == "bash" else [sys.executable] + argv
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def assert_one_line_error(result, *needles: str) -> str:
    """Non-zero exit; stderr is exactly one non-empty line, ``error: ...`` holding ``needles``."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> Path:
    """A run folder holding only a resolved config (enough for the checks before any weights)."""
    run_dir = tmp_path_factory.mktemp("run")
    save_config(load_config(SMOKE_YAML), run_dir / "config.yaml")
    return run_dir


@pytest.fixture(scope="module")
def empty_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for split in ("train", "validate", "test"):
        (root / split).mkdir()
    return root


def test_train_missing_yaml(tmp_path):
    result = run_tool([str(REPO_ROOT / "tools/train.py"), "--hypes_yaml", "absent.yaml"],
                      tmp_path)
    assert_one_line_error(result, "absent.yaml", "not found")


def test_train_unknown_model_writes_no_run_folder(tmp_path):
    result = run_tool([str(REPO_ROOT / "tools/train.py"), "--hypes_yaml", str(SMOKE_YAML),
                       "--set", BAD_MODEL, "--runs_root", "runs"], tmp_path)
    assert_one_line_error(result, "smoke.yaml", "model.core_method", "no_such_model",
                          "point_pillar")
    assert not (tmp_path / "runs").exists()


def test_eval_missing_run_folder(tmp_path):
    result = run_tool([str(REPO_ROOT / "tools/eval.py"), "--model_dir", "absent_run"], tmp_path)
    assert_one_line_error(result, "absent_run/config.yaml", "not found")


def test_eval_unknown_model(tmp_path, run_folder):
    result = run_tool([str(REPO_ROOT / "tools/eval.py"), "--model_dir", str(run_folder),
                       "--set", BAD_MODEL], tmp_path)
    assert_one_line_error(result, "config.yaml", "model.core_method", "no_such_model")


def test_generate_synthetic_unknown_preset(tmp_path):
    result = run_tool([str(REPO_ROOT / "tools/generate_synthetic.py"), "--out", "data",
                       "--preset", "no_such_preset"], tmp_path)
    assert_one_line_error(result, "no_such_preset", "tiny")


def test_generate_synthetic_output_is_a_file(tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    result = run_tool([str(REPO_ROOT / "tools/generate_synthetic.py"), "--out", "taken",
                       "--preset", "tiny", "--quiet"], tmp_path)
    assert_one_line_error(result, "taken")
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_visualize_missing_data_folder(tmp_path):
    result = run_tool([str(REPO_ROOT / "tools/visualize.py"), "--data", "absent/train",
                       "--out", "a.png"], tmp_path)
    assert_one_line_error(result, "absent/train", "not found")


def test_visualize_index_past_the_split(tmp_path, empty_data):
    result = run_tool([str(REPO_ROOT / "tools/visualize.py"), "--data",
                       str(empty_data / "train"), "--index", "3", "--out", "a.png"], tmp_path)
    assert_one_line_error(result, str(empty_data / "train"))


def test_results_table_missing_config(tmp_path):
    result = run_tool([str(REPO_ROOT / "tools/results_table.py"), "--configs", "absent.yaml",
                       "--dry_run"], tmp_path)
    assert_one_line_error(result, "absent.yaml", "not found")


def test_results_table_unknown_model(tmp_path, empty_data):
    result = run_tool([str(REPO_ROOT / "tools/results_table.py"), "--configs", str(SMOKE_YAML),
                       "--data", str(empty_data), "--set", BAD_MODEL, "--dry_run"], tmp_path)
    assert_one_line_error(result, "smoke.yaml", "model.core_method", "no_such_model")


def test_quickstart_missing_config_stops_before_any_work(tmp_path):
    result = run_tool(["bash", str(REPO_ROOT / "tools/quickstart.sh")], tmp_path,
                      {"CONFIG": "absent.yaml", "RUN": str(tmp_path / "run")})
    assert_one_line_error(result, "CONFIG", "absent.yaml", "not found")
    assert result.stdout == "" and not (tmp_path / "run").exists()
