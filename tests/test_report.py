"""opencood/eval/report.py: the arithmetic and cells the evaluator, tools/results_table.py and
tools/robustness_table.py share, on hand-computed numbers (their tables: test_eval.py,
test_results_table.py, test_robustness_table.py)."""
import math

import pytest

from opencood.eval import report


def test_mean_std_is_the_sample_std():
    # 0.3 and 0.5: mean 0.4, sample std sqrt((0.1^2 + 0.1^2) / 1) = 0.1414.
    assert report.mean_std([0.3, 0.5]) == {"mean": pytest.approx(0.4),
                                           "std": pytest.approx(math.sqrt(0.02))}
    assert report.mean_std([0.7]) == {"mean": 0.7, "std": 0.0}


def test_mean_of_known_leaves_out_unknown_values():
    assert report.mean_of_known([100, None, 300]) == 200.0
    assert report.mean_of_known([None]) is None


def test_pose_error_spread_keeps_only_stages_every_run_has():
    def summary(median_m, pairs_after):
        stats = {"median_translation_m": median_m, "median_yaw_deg": 2 * median_m,
                 "mean_translation_m": median_m, "mean_yaw_deg": median_m, "pairs": 3}
        return {"before": stats, "after": {**stats, "pairs": pairs_after}}

    spread = report.pose_error_spread([summary(0.5, 3), summary(0.7, 0)])
    assert list(spread) == ["before"]            # the second run corrected no pair
    assert spread["before"]["median_yaw_deg"] == {"mean": pytest.approx(1.2),
                                                  "std": pytest.approx(0.4 / math.sqrt(2))}


def test_cells():
    assert report.mean_std_cell({"mean": 0.6, "std": 0.0104}) == "0.600 ± 0.010"
    assert report.mean_std_cell({"mean": 0.6, "std": 0.0104}, 2) == "0.60 ± 0.01"
    assert report.count_cell(1234.6) == "1,235" and report.count_cell(None) == "n/a"
    assert report.number_cell(10.56, 1) == "10.6"
    assert report.ap_cell(None) == "       –" and report.ap_cell(0.25) == "  0.2500"


def test_format_pose_spread_prefers_the_corrected_stage():
    def stage(metres, degrees):
        return {"median_translation_m": {"mean": metres, "std": 0.01},
                "median_yaw_deg": {"mean": degrees, "std": 0.02}}

    row = {"pose_error": {"before": stage(0.6, 0.58), "after": stage(0.1, 0.12)}}
    assert report.format_pose_spread(row) == "0.100 ± 0.010 m  0.12 ± 0.02 deg"
    assert report.format_pose_spread({"runs": 1}) == ""


def test_markdown_table():
    assert report.markdown_table(["model", "AP@0.5"], [["a", "0.5"], ["b", "–"]]) == [
        "| model | AP@0.5 |", "| --- | --- |", "| a | 0.5 |", "| b | – |"]


def test_the_table_of_two_classes_prints_the_class_mean_and_each_class():
    """tests/test_ap.py's hand-computed 2-class case: class mean 7/12, 7/12, 3/8 first, then a
    row per class (car 1/2 everywhere; pedestrian 2/3, 2/3, 1/4), then the bins' class means."""
    from test_ap import accumulate_classes
    metrics = {**accumulate_classes().compute(), "bytes_per_agent": 0.0, "frames_per_s": 1.0}
    lines = report.format_metrics("test", metrics).splitlines()
    assert lines[2].split() == ["class", "mean", "0.5833", "0.5833", "0.3750", "4"]
    assert lines[3].split() == ["car", "0.5000", "0.5000", "0.5000", "2"]
    assert lines[4].split() == ["pedestrian", "0.6667", "0.6667", "0.2500", "2"]
    assert lines[5].split()[:2] == ["0-30", "m"] and lines[5].split()[3] == "0.7500"
    single = {key: value for key, value in metrics.items() if key not in ("per_class",
                                                                          "class_mean")}
    assert report.format_metrics("test", single).splitlines()[2].split()[0] == "overall"
    assert len(report.format_metrics("test", single).splitlines()) == len(lines) - 2
