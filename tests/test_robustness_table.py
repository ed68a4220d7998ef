"""tools/robustness_table.py: spreads of evaluated runs -> docs/results.md's robustness table."""
import os
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import robustness_table  # noqa: E402


def ms(mean, std=0.0):
    return {"mean": mean, "std": std}


def row(ap50, pose=None):
    out = {"runs": 3, "ap_30": ms(ap50 + 0.1), "ap_50": ms(ap50, 0.01), "ap_70": ms(ap50 - 0.2)}
    if pose is not None:
        out["pose_error"] = pose
    return out


def pose(stage, metres, degrees):
    stats = {"median_translation_m": ms(metres), "median_yaw_deg": ms(degrees),
             "mean_translation_m": ms(metres), "mean_yaw_deg": ms(degrees)}
    return {stage: stats}


def write_spread(run_dir: Path, name: str, groups: dict, age: int = 0) -> Path:
    path = run_dir / "evals" / "spreads" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"seeds": 3, "groups": groups}))
    os.utime(path, (1000 + age, 1000 + age))
    return path


def test_table_from_spreads(tmp_path):
    plain, aligned = tmp_path / "attfuse", tmp_path / "late"
    write_spread(plain, "test_intermediate_0badc0de", {
        "clean": row(0.6), "noise0.6": row(0.3, pose("before", 0.61, 0.58)),
        "noise0.2": row(0.5, pose("before", 0.2, 0.2))}, age=1)
    write_spread(plain, "test_intermediate_opencood_12345678", {"clean": row(0.9)}, age=2)
    write_spread(plain, "test_intermediate_00000000", {"clean": row(0.1)}, age=0)   # older
    write_spread(aligned, "test_late_abcdef01", {
        "clean": row(0.5), "noise0.6": row(0.2, pose("before", 0.6, 0.6)),
        "clean_aligned": row(0.5), "noise0.6_aligned": row(0.45, pose("after", 0.1, 0.12))})
    text = robustness_table.main(["--run", f"AttFuse={plain}", "--run", f"Late={aligned}"])
    lines = text.splitlines()
    assert lines[1] == ("| model | clean | σ = 0.2 | σ = 0.6 | median pose error at σ = 0.6 |")
    assert lines[3] == ("| AttFuse | 0.600 ± 0.010 | 0.500 ± 0.010 | 0.300 ± 0.010 | "
                        "0.61 m / 0.58° |")
    assert lines[4] == "| Late | 0.500 ± 0.010 | – | 0.200 ± 0.010 | 0.60 m / 0.60° |"
    assert lines[5] == ("| Late + correction | 0.500 ± 0.010 | – | 0.450 ± 0.010 | "
                        "0.10 m / 0.12° |")
    opencood = robustness_table.main(["--run", f"A={plain}", "--protocol", "opencood"])
    assert "| A | 0.900 ± 0.010 |" in opencood


def test_a_run_without_spread_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as stop:
        robustness_table.main(["--run", f"A={tmp_path}"])
    message = str(stop.value.code)
    assert len(message.splitlines()) == 1
    assert "no test spread" in message and "--seeds 3" in message
    with pytest.raises(SystemExit):
        robustness_table.main(["--run", "no-equals-sign"])
