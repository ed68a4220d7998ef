"""A new fusion model is one python file plus its yaml (docs/extending.md "Adding a fusion model").

The page's example file is written into a copy of the ``opencood`` package and its yaml beside
a copy of ``hypes_yaml/synthetic/base.yaml``; ``tools/train.py`` then trains it for one epoch in
a subprocess whose PYTHONPATH holds only the copy (the same interpreter first refuses a
misspelt argument of the new module). Nothing else of the package is edited, so the
run shows that the registry finds the file, that the config loader checks and completes its
arguments from the dataclass it registered, and that the detector builds and trains it.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from opencood.utils.checkpoint import load_checkpoint
from opv2v_factory import frame_stamps, write_simple_split

REPO_ROOT = Path(__file__).resolve().parents[1]
EXTENDING_PAGE = REPO_ROOT / "docs" / "extending.md"
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"


def page_example() -> tuple[str, str]:
    """The python file and the yaml of docs/extending.md's "Adding a fusion model" section."""
    text = EXTENDING_PAGE.read_text()
    start = text.index("## Adding a fusion model")
    end = text.find("\n## ", start + 1)
    section = text[start:] if end < 0 else text[start:end]     # the page's last section
    python, = re.findall(r"```python\n(.*?)```", section, re.S)
    config, = re.findall(r"```yaml\n(.*?)```", section, re.S)
    return python, config


def package_with_new_file(root: Path, python: str) -> Path:
    """``root/opencood``: a copy of the package plus ``models/my_fusion.py``; returns root."""
    shutil.copytree(REPO_ROOT / "opencood", root / "opencood",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (root / "opencood" / "models" / "my_fusion.py").write_text(python)
    return root


def smoke_config(folder: Path, config: str) -> Path:
    """The page's yaml beside base.yaml, and smoke.yaml's tiny geometry on top of it."""
    shutil.copy(SMOKE_YAML.parent / "base.yaml", folder / "base.yaml")
    (folder / "point_pillar_my_fusion.yaml").write_text(config)
    smoke = yaml.safe_load(SMOKE_YAML.read_text())
    smoke.update({"_base_": "point_pillar_my_fusion.yaml", "name": "my_fusion_smoke"})
    path = folder / "my_fusion_smoke.yaml"
    path.write_text(yaml.safe_dump(smoke))
    return path


@pytest.fixture(scope="module")
def new_model(tmp_path_factory):
    """(package root, smoke yaml, data overrides) with the page's file and yaml in place."""
    root = tmp_path_factory.mktemp("new_fusion")
    python, config = page_example()
    package_with_new_file(root / "pkg", python)
    configs = root / "configs"
    configs.mkdir()
    write_simple_split(root / "data" / "train", num_cavs=2, timestamps=frame_stamps(2))
    data = (f"root_dir={root / 'data' / 'train'}", "validate_dir=null", "test_dir=null",
            "train_params.epoches=1")
    return root / "pkg", smoke_config(configs, config), data


# One interpreter for both runs (the misspelt yaml's first, so it meets a fresh process as a
# user's would): each runs tools/train.py as __main__ with its arguments, its exit status and
# the interpreter's message of a SystemExit go to stderr, then a line closing its section.
DRIVER = """
import json, runpy, sys
script, jobs = sys.argv[1], json.loads(sys.argv[2])
for argv in jobs:
    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 0 if exit_.code is None else 1
        if status == 1 and not isinstance(exit_.code, int):
            print(exit_.code, file=sys.stderr)
    print(f"{END} {status}", file=sys.stderr, flush=True)
"""
END = "--- train.py exited with"


def train_argv(hypes_yaml: Path, run_dir: Path, overrides) -> list:
    argv = ["--hypes_yaml", str(hypes_yaml), "--model_dir", str(run_dir)]
    for override in overrides:
        argv += ["--set", override]
    return argv


@pytest.fixture(scope="module")
def runs(new_model, tmp_path_factory) -> dict:
    """{"misspelt" | "trained": (exit status, its stderr, its run folder)}: ``tools/train.py``
    in a fresh interpreter that imports ``opencood`` from the copy, once with a misspelt
    argument of the new module, then with the page's yaml."""
    package_root, hypes_yaml, data = new_model
    folder = tmp_path_factory.mktemp("runs")
    misspelt = folder / "misspelt.yaml"
    misspelt.write_text(yaml.safe_dump({"_base_": str(hypes_yaml), "model": {
        "args": {"fusion": {"args": {"mixx": False}}}}}))
    jobs = {"misspelt": (misspelt, folder / "misspelt_run"),
            "trained": (hypes_yaml, folder / "run")}
    env = dict(os.environ, PYTHONPATH=str(package_root), CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-c", DRIVER.replace("{END}", END), str(REPO_ROOT / "tools" / "train.py"),
         json.dumps([train_argv(path, run_dir, data) for path, run_dir in jobs.values()])],
        cwd=package_root, env=env, capture_output=True, text=True, timeout=600)
    sections = re.split(rf"{re.escape(END)} (\d+)\n", result.stderr)
    assert len(sections) == 2 * len(jobs) + 1, result.stderr[-3000:]
    return {name: (int(sections[2 * k + 1]), sections[2 * k], jobs[name][1])
            for k, name in enumerate(jobs)} | {"misspelt_yaml": misspelt}


def test_readme_fusion_file_and_yaml_train_one_epoch(runs):
    status, stderr, run_dir = runs["trained"]
    assert status == 0, stderr[-3000:]
    fusion = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["args"]["fusion"]
    # The registered dataclass completed the arguments the yaml left out.
    assert fusion == {"core_method": "my_fusion", "args": {"mix": True, "bytes_per_value": 4},
                      "stage": None}
    state = load_checkpoint(run_dir / "last.pth")
    assert state["epoch"] == 1
    assert state["model"]["fusion.mix.weight"].shape == (96, 96, 1, 1)   # 3 x 32 channels


def test_an_unknown_argument_of_the_new_module_is_one_line_naming_file_and_key(runs):
    status, stderr, run_dir = runs["misspelt"]
    assert status == 1
    assert stderr.strip().splitlines()[-1] == (
        f"error: {runs['misspelt_yaml']}: unknown key 'model.args.fusion.args.mixx' (did you "
        f"mean 'mix'? known in model.args.fusion.args: mix, bytes_per_value)")
    assert not run_dir.exists()
