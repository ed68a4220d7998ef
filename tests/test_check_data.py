"""tools/check_data.py and the index build: every data problem reported at once."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from opencood.data.check import check_folder
from opencood.data.opv2v import OPV2VFormatError, OPV2VSplit
from opv2v_factory import write_simple_split
from tool_modules import run_script

REPO_ROOT = Path(__file__).resolve().parents[1]
SCENARIO = "2021_01_01_00_00_00"


@pytest.fixture(scope="module")
def clean_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("data")
    for split in ("train", "validate"):
        write_simple_split(root / split, num_cavs=2)
    return root


def three_faults(clean_data: Path, tmp_path: Path) -> Path:
    """A copy with a missing timestamp, a yaml without lidar_pose and a truncated PCD."""
    root = tmp_path / "broken"
    shutil.copytree(clean_data, root)
    cav = root / "train" / SCENARIO / "1001"
    (cav / "000004.yaml").unlink()
    (cav / "000004.pcd").unlink()
    ego_yaml = root / "train" / SCENARIO / "1000" / "000002.yaml"
    params = yaml.safe_load(ego_yaml.read_text())
    del params["lidar_pose"]
    ego_yaml.write_text(yaml.safe_dump(params))
    pcd = root / "validate" / SCENARIO / "1000" / "000000.pcd"
    pcd.write_text("\n".join(pcd.read_text().splitlines()[:-3]) + "\n")
    return root


def test_a_clean_folder_has_no_problem(clean_data):
    report = check_folder(clean_data, progress=False)
    assert report.problems == []
    assert (report.splits, report.scenarios, report.cav_folders, report.frames) == (
        ["train", "validate"], 2, 4, 12)
    assert report.points > 0


def test_every_fault_is_listed(clean_data, tmp_path):
    report = check_folder(three_faults(clean_data, tmp_path), progress=False)
    assert len(report.problems) == 3, report.problems
    missing, no_pose, truncated = sorted(report.problems, key=lambda p: ("validate" in p,
                                                                         "lidar_pose" in p))
    assert "1001" in missing and "000004" in missing and "ego folder" in missing
    assert "1000/000002.yaml" in no_pose and "'lidar_pose' is missing" in no_pose
    assert "validate" in truncated and "000000.pcd" in truncated and "truncated" in truncated


@pytest.fixture
def run_check_data(monkeypatch, capsys):
    """``python tools/check_data.py FOLDER --quiet`` as a fresh interpreter runs it, in this
    process (tool_modules.run_script) -> ScriptResult."""
    return lambda folder: run_script(REPO_ROOT / "tools" / "check_data.py", [folder, "--quiet"],
                                     monkeypatch, capsys)


def test_the_tool_prints_each_problem_and_exits_1(clean_data, tmp_path, run_check_data):
    result = run_check_data(three_faults(clean_data, tmp_path))
    lines = result.stdout.splitlines()
    assert result.returncode == 1
    assert sum(line.startswith("problem: ") for line in lines) == 3
    assert lines[-1].endswith("3 problem(s)") and "12 frames" not in lines[-1]


def test_the_tool_on_a_missing_folder(tmp_path, run_check_data):
    result = run_check_data(tmp_path / "absent")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip() == f"error: {tmp_path / 'absent'}: folder not found"


def test_the_index_build_reports_every_yaml_problem_in_one_error(tmp_path):
    split = write_simple_split(tmp_path / "train", num_cavs=2)
    for cav in ("1000", "1001"):
        (split / SCENARIO / cav / "000002.yaml").write_text("vehicles: {}\n")
    with pytest.raises(OPV2VFormatError) as info:
        OPV2VSplit(split, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert "2 problems" in message and "\n" not in message
    assert message.count("'lidar_pose' is missing") == 2
    assert "tools/check_data.py" in message
