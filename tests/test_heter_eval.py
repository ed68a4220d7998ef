"""HEAL's evaluations of heterogeneous runs (issue 37 point 6, opencood.eval.heter_order):
which agents take which modality and which are kept at each in-order step, the per-modality
settings, the rows' record, and the training cost a run folder keeps."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opencood.data.heter import in_order_assignment, in_order_modalities
from opencood.errors import ConfigError
from opencood.eval import heter_order
from opencood.eval.records import matching_records

HETER = {"mapping_dict": {"m1": "m1", "m2": "m2", "m3": "m3", "m4": "m3"},
         "modality_setting": {"m1": {}, "m2": {}, "m3": {}}}


def _override(setting, key):
    """The value text of ``key=...`` among a setting's overrides."""
    (value,) = [o.split("=", 1)[1] for o in setting["overrides"] if o.startswith(key + "=")]
    return value


def test_in_order_assignment_and_the_agents_of_each_step(tmp_path):
    # HEAL's assign_modality_4_in_order: string order, a first folder -1 (an RSU) moved last,
    # the names in turn, cycling
    assert in_order_modalities(["650", "-1", "12"], ["m1", "m2", "m3", "m4"]) == {
        "12": "m1", "650": "m2", "-1": "m3"}
    assert in_order_modalities(["7", "5", "9", "8"], ["m1", "m3"]) == {
        "5": "m1", "7": "m3", "8": "m1", "9": "m3"}
    for scenario, agents in (("b", ["30", "10", "20"]), ("a", ["-1", "4"])):
        for cav_id in agents:
            (tmp_path / "test" / scenario / cav_id).mkdir(parents=True)
    (tmp_path / "test" / "a" / "notes.txt").write_text("not an agent")
    assignment = in_order_assignment(tmp_path / "test", ("m2", "m1"))
    assert assignment == {"a": {"4": "m2", "-1": "m1"},
                          "b": {"10": "m2", "20": "m1", "30": "m2"}}
    # step k keeps the first k agents: m1; m1+m2; m1+m2+m3, the first name the ego's, each
    # name mapped to itself
    steps = heter_order.in_order_settings(["m1", "m2", "m3"], tmp_path / "order.json")
    assert [(s["use_cav"], s["label"], s["tag"]) for s in steps] == [
        (1, "m1", "in_order1"), (2, "m1+m2", "in_order2"), (3, "m1+m2+m3", "in_order3")]
    assert _override(steps[2], "heter.mapping_dict") == "{m1: m1, m2: m2, m3: m3}"
    assert _override(steps[0], "heter.ego_modality") == "m1"
    assert _override(steps[1], "heter.assignment_path") == str(tmp_path / "order.json")
    assert steps[1]["agents"] == {"in_order": ["m1", "m2", "m3"], "use_cav": 2}
    # per modality: every assigned name to one modality, the ego alone
    per_modality = heter_order.modality_settings(["m2", "m3"], HETER)
    assert [(s["use_cav"], s["label"]) for s in per_modality] == [(1, "m2"), (1, "m3")]
    assert _override(per_modality[0], "heter.mapping_dict") == "{m1: m2, m2: m2, m3: m2, m4: m2}"
    assert _override(per_modality[1], "heter.ego_modality") == "m3"
    # frames of 2, 3 and 4 agents: step 3 fuses 2, 3, 3
    assert heter_order.agents_per_frame([2, 3, 4], 3) == pytest.approx(8 / 3)
    assert heter_order.agents_per_frame([2, 3, 4], 1) == 1.0


@pytest.mark.parametrize("names, heter, expected", [
    (["m1"], None, "--heter_in_order: the run has no heter section"),
    (["m1", "m4"], HETER, "'m4' is not a modality of the run (heter.modality_setting has "
                          "m1, m2, m3)"),
    (["m1", "m1"], HETER, "a modality is named twice"),
])
def test_a_bad_modality_list_is_one_line(names, heter, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        heter_order.check_modalities(names, heter, "--heter_in_order")


def test_the_rows_record_and_the_table_leave_them_out(tmp_path):
    steps = heter_order.in_order_settings(["m1", "m2"], "order.json")
    results = [{"ap_30": 0.5, "ap_50": 0.4, "ap_70": 0.1, "num_gt": 20, "agents_per_frame": 1.0,
                "name": "test_intermediate_in_order1_aaaa"},
               {"ap_30": 0.7, "ap_50": 0.6, "ap_70": 0.2, "num_gt": 20,
                "agents_per_frame": 1.75, "name": "test_intermediate_in_order2_bbbb"}]
    rows = heter_order.summary_rows(steps, results)
    path = heter_order.write_summary(tmp_path, "in_order", "test", "intermediate",
                                     ["m1", "m2"], rows, "title")
    assert path.parent == tmp_path / "evals" / "heter"
    saved = yaml.safe_load(path.read_text())
    assert saved["modalities"] == ["m1", "m2"] and saved["kind"] == "in_order"
    assert [(r["agents"], r["use_cav"], r["ap_50"], r["agents_per_frame"], r["record"])
            for r in saved["rows"]] == [
        ("m1", 1, 0.4, 1.0, "test_intermediate_in_order1_aaaa"),
        ("m1+m2", 2, 0.6, 1.75, "test_intermediate_in_order2_bbbb")]
    table = heter_order.format_summary("title", rows).splitlines()
    assert table[4] == "| m1+m2 | 0.700 | 0.600 | 0.200 | 20 | 1.75 |"
    # a step's record is not the results table's (clean = every agent)
    record = {"data": {"split": "test", "folder": "/d"},
              "settings": {"fusion": "intermediate", "protocol": "ours",
                           "wild_setting": {}, "agents": steps[0]["agents"]}}
    plain = {**record, "settings": {**record["settings"], "agents": None}}
    found = matching_records([("a", record), ("b", plain)], clean=True)
    assert [path for path, _ in found] == ["b"]


def test_heal_table_reads_each_rows_ap_and_cost_against_the_base(tmp_path):
    from tool_modules import load_tool
    heal_table = load_tool("heal_table")
    steps = heter_order.in_order_settings(["m1", "m2"], "order.json")
    chains = []
    for seed, (ap_base, ap_both) in enumerate(((0.40, 0.50), (0.44, 0.60))):
        base, aligned = tmp_path / f"base{seed}", tmp_path / f"align{seed}"
        for run, steps_done, seconds, trainable in ((base, 80, 600.0, 1000),
                                                    (aligned, 20, 90.0, 300)):
            run.mkdir()
            (run / "train_cost.yaml").write_text(yaml.safe_dump({
                "steps": steps_done, "train_seconds": seconds,
                "trainable_parameters": trainable}))
        results = [{"ap_30": 0.0, "ap_50": ap, "ap_70": ap / 2, "num_gt": 9, "name": f"r{k}"}
                   for k, ap in enumerate((ap_base, ap_both))]
        heter_order.write_summary(aligned, "in_order", "test", "intermediate", ["m1", "m2"],
                                  heter_order.summary_rows(steps, results), "t")
        chains.append([str(base), str(aligned)])
    rows = heal_table.chain_rows([Path(r) for r in chains[0]], "test")
    # the aligned type: 20 of the base's 80 steps, 90 of its 600 seconds
    assert [(r["agents"], r["ap_50"], r["steps"], r["step_fraction"], r["time_fraction"])
            for r in rows] == [("m1", 0.40, 80, 1.0, 1.0), ("m1+m2", 0.50, 20, 0.25, 0.15)]
    table = heal_table.format_table([heal_table.chain_rows([Path(r) for r in chain], "test")
                                     for chain in chains]).splitlines()
    # two seeds: 0.50 and 0.60 -> 0.550 ± 0.071 (sample std)
    assert table[3].startswith("| m1+m2 | 0.550 ± 0.071 | 0.275 ± 0.035 |")
    assert table[3].endswith("| 20 | 1.5 | 300 | 0.25 | 0.15 |")
    assert heal_table.main(["--chain", chains[0][0]]) == 2       # no rows: one line, status 2
