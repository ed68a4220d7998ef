"""A new fusion model is one python file plus its yaml (docs/extending.md "Adding a fusion model").

The page's example file is written into a copy of the ``opencood`` package and its yaml beside
a copy of ``hypes_yaml/synthetic/base.yaml``; ``tools/train.py`` then trains it for one epoch in
a subprocess whose PYTHONPATH holds only the copy. Nothing else of the package is edited, so the
run shows that the registry finds the file, that the config loader checks and completes its
arguments from the dataclass it registered, and that the detector builds and trains it.
"""
from __future__ import annotations

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


def train(package_root: Path, hypes_yaml: Path, run_dir: Path, *overrides: str):
    """``tools/train.py`` in a fresh interpreter that imports ``opencood`` from the copy."""
    env = dict(os.environ, PYTHONPATH=str(package_root), CUDA_VISIBLE_DEVICES="")
    argv = [sys.executable, str(REPO_ROOT / "tools" / "train.py"), "--hypes_yaml",
            str(hypes_yaml), "--model_dir", str(run_dir)]
    for override in overrides:
        argv += ["--set", override]
    return subprocess.run(argv, cwd=package_root, env=env, capture_output=True, text=True,
                          timeout=600)


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


def test_readme_fusion_file_and_yaml_train_one_epoch(new_model, tmp_path):
    package_root, hypes_yaml, data = new_model
    run_dir = tmp_path / "run"
    result = train(package_root, hypes_yaml, run_dir, *data)
    assert result.returncode == 0, result.stderr[-3000:]
    fusion = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["args"]["fusion"]
    # The registered dataclass completed the arguments the yaml left out.
    assert fusion == {"core_method": "my_fusion", "args": {"mix": True, "bytes_per_value": 4},
                      "stage": None}
    state = load_checkpoint(run_dir / "last.pth")
    assert state["epoch"] == 1
    assert state["model"]["fusion.mix.weight"].shape == (96, 96, 1, 1)   # 3 x 32 channels


def test_an_unknown_argument_of_the_new_module_is_one_line_naming_file_and_key(new_model,
                                                                               tmp_path):
    package_root, hypes_yaml, data = new_model
    misspelt = tmp_path / "misspelt.yaml"
    misspelt.write_text(yaml.safe_dump({"_base_": str(hypes_yaml), "model": {
        "args": {"fusion": {"args": {"mixx": False}}}}}))
    result = train(package_root, misspelt, tmp_path / "run", *data)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {misspelt}: unknown key 'model.args.fusion.args.mixx' (did you mean 'mix'? "
        f"known in model.args.fusion.args: mix, bytes_per_value)")
    assert not (tmp_path / "run").exists()
