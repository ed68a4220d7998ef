"""Bad input to each command-line tool is one ``error: ...`` line naming the file, key or value,
with a non-zero exit and no traceback (tools/bench.py and tools/profile_model.py: test_tools.py).

Each case runs the real script as a fresh interpreter would, in this process
(``tool_modules.run_script``: ``__main__``, ``sys.argv``, start-up logging, the interpreter's
exit status), from its own working folder and cache: one process for all the cases instead of an
interpreter and a torch import per case. An exception other than SystemExit escapes the tool and
fails the test, as its traceback would in a subprocess.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from opencood.config import load_config, save_config
from tool_modules import run_script

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOLS = REPO_ROOT / "tools"
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
BAD_MODEL = "model.core_method=no_such_model"


@pytest.fixture
def run_tool(tmp_path, monkeypatch, capsys):
    """``run_tool([script, args...])``: tool_modules.run_script from ``tmp_path`` with its own
    cache -> ScriptResult."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))
    return lambda argv: run_script(argv[0], argv[1:], monkeypatch, capsys)


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


def test_train_missing_yaml(run_tool):
    result = run_tool([TOOLS / "train.py", "--hypes_yaml", "absent.yaml"])
    assert_one_line_error(result, "absent.yaml", "not found")


def test_train_unknown_model_writes_no_run_folder(run_tool, tmp_path):
    result = run_tool([TOOLS / "train.py", "--hypes_yaml", SMOKE_YAML, "--set", BAD_MODEL,
                       "--runs_root", "runs"])
    assert_one_line_error(result, "smoke.yaml", "model.core_method", "no_such_model",
                          "point_pillar")
    assert not (tmp_path / "runs").exists()


def test_eval_missing_run_folder(run_tool):
    result = run_tool([TOOLS / "eval.py", "--model_dir", "absent_run"])
    assert_one_line_error(result, "absent_run/config.yaml", "not found")


def test_eval_unknown_model(run_tool, run_folder):
    result = run_tool([TOOLS / "eval.py", "--model_dir", run_folder, "--set", BAD_MODEL])
    assert_one_line_error(result, "config.yaml", "model.core_method", "no_such_model")


def test_generate_synthetic_unknown_preset(run_tool):
    result = run_tool([TOOLS / "generate_synthetic.py", "--out", "data",
                       "--preset", "no_such_preset"])
    assert_one_line_error(result, "no_such_preset", "tiny")


def test_generate_synthetic_output_is_a_file(run_tool, tmp_path):
    (tmp_path / "taken").write_text("not a folder")
    result = run_tool([TOOLS / "generate_synthetic.py", "--out", "taken", "--preset", "tiny",
                       "--quiet"])
    assert_one_line_error(result, "taken")
    assert (tmp_path / "taken").read_text() == "not a folder"


def test_visualize_missing_data_folder(run_tool):
    result = run_tool([TOOLS / "visualize.py", "--data", "absent/train", "--out", "a.png"])
    assert_one_line_error(result, "absent/train", "not found")


def test_visualize_index_past_the_split(run_tool, empty_data):
    result = run_tool([TOOLS / "visualize.py", "--data", empty_data / "train", "--index", "3",
                       "--out", "a.png"])
    assert_one_line_error(result, str(empty_data / "train"))


def test_results_table_missing_config(run_tool):
    result = run_tool([TOOLS / "results_table.py", "--configs", "absent.yaml", "--dry_run"])
    assert_one_line_error(result, "absent.yaml", "not found")


def test_results_table_unknown_model(run_tool, empty_data):
    result = run_tool([TOOLS / "results_table.py", "--configs", SMOKE_YAML, "--data", empty_data,
                       "--set", BAD_MODEL, "--dry_run"])
    assert_one_line_error(result, "smoke.yaml", "model.core_method", "no_such_model")


def test_quickstart_missing_config_stops_before_any_work(tmp_path):
    """A shell script: a real subprocess (it stops before starting Python)."""
    env = dict(os.environ, CONFIG="absent.yaml", RUN=str(tmp_path / "run"))
    result = subprocess.run(["bash", str(TOOLS / "quickstart.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert_one_line_error(result, "CONFIG", "absent.yaml", "not found")
    assert result.stdout == "" and not (tmp_path / "run").exists()
