"""tools/pose_graph_study.py: the pose graph's accuracy by stage-1 box accuracy, on constructed
scenes (exact boxes recover the poses; errors grow with the box noise)."""
import importlib.util
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "pose_graph_study.py"
spec = importlib.util.spec_from_file_location("pose_graph_study", SCRIPT)
study = importlib.util.module_from_spec(spec)
spec.loader.exec_module(study)


def test_exact_boxes_recover_the_poses_and_errors_grow_with_box_noise(capsys):
    rows = study.main(["--box_noise", "0", "0.05", "0.2", "--heading_noise", "0",
                       "--scenes", "20"])
    exact, fine, coarse = rows
    assert exact["before_m"] > 0.3 and exact["before_deg"] > 0.1          # the noise is real
    assert exact["after_m"] < 1e-6 and exact["after_deg"] < 1e-6
    assert 0 < fine["after_m"] < coarse["after_m"] < coarse["before_m"]
    assert fine["after_deg"] < coarse["after_deg"]
    # Two boxes with independent N(0, s^2) errors per axis are s sqrt(2) sqrt(2 ln 2) apart
    # (median of a Rayleigh distance).
    assert fine["box_pair_distance_m"] == pytest.approx(0.05 * 2 * math.sqrt(math.log(2)))
    assert "boxes apart" in capsys.readouterr().out


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        study.main(["--agents", "1"])
