"""tools/results_table.py: epochs from steps, the markdown table (mean ± std over --seeds),
--skip_existing, bad input, and one real train + eval run on tiny hand-made data."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from opencood.eval import report
from opv2v_factory import write_simple_split
from tool_modules import load_tool, run_script

REPO_ROOT = Path(__file__).resolve().parents[1]
TOOL = REPO_ROOT / "tools" / "results_table.py"
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"


rt = load_tool("results_table")


def _metrics(ap30, ap50, ap70, bytes_per_agent, visibility=None, per_class=None) -> dict:
    metrics = {"ap_30": ap30, "ap_50": ap50, "ap_70": ap70, "num_gt": 992, "num_frames": 32,
               "distance": {"0-30": {"ap_30": 0.8, "ap_50": 0.6, "ap_70": 0.2, "num_gt": 657}},
               "frames_per_s": 17.5, "bytes_per_agent": bytes_per_agent,
               "name": "eval_test_x"}
    if visibility is not None:
        metrics["visibility"] = visibility
    if per_class is not None:
        metrics["per_class"] = per_class
    return metrics


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """train (4 samples x 2 CAVs), validate (2), test (2): the OPV2V layout --data expects."""
    root = tmp_path_factory.mktemp("table_data")
    for split, count in (("train", 4), ("validate", 2), ("test", 2)):
        write_simple_split(root / split, num_cavs=2,
                           timestamps=tuple(f"{2 * i:06d}" for i in range(count)))
    return root


@pytest.fixture(scope="module")
def late_smoke_yaml(tmp_path_factory) -> Path:
    """smoke.yaml turned into late fusion (single-agent model): trains per (sample, CAV)."""
    path = tmp_path_factory.mktemp("late_cfg") / "late_smoke.yaml"
    path.write_text(yaml.safe_dump({"_base_": str(SMOKE_YAML), "name": "late_smoke",
                                    "fusion": {"core_method": "late"},
                                    "model": {"core_method": "point_pillar",
                                              "args": {"fusion": None}}}))
    return path


# -- epochs from steps ------------------------------------------------------------------------

def test_steps_per_epoch_and_epochs_for_steps_hand_values():
    # docs/results.md: 112 samples, global batch 4 -> 28 steps/epoch; 3640 steps -> 130 epochs.
    assert rt.steps_per_epoch(112, 4, world_size=2, max_micro_batch=4) == 28
    assert rt.epochs_for_steps(3640, 28) == 130
    # Late fusion: 368 (sample, CAV) examples -> 92 steps/epoch -> ceil(3640 / 92) = 40 epochs.
    assert rt.steps_per_epoch(368, 4, world_size=2, max_micro_batch=4) == 92
    assert rt.epochs_for_steps(3640, 92) == 40
    # Accumulation does not change the count: batch 8 over 2 ranks, micro 2 -> accum 2.
    assert rt.steps_per_epoch(112, 8, world_size=2, max_micro_batch=2) == 14
    # Not divisible: the trainer drops the tail. 10 over 2 ranks = 5 each, micro 2 -> 2 steps.
    assert rt.steps_per_epoch(10, 4, world_size=2) == 2
    assert rt.epochs_for_steps(1, 28) == 1
    assert rt.epochs_for_steps(29, 28) == 2
    with pytest.raises(ValueError):
        rt.steps_per_epoch(112, 4, world_size=3)
    with pytest.raises(ValueError):
        rt.epochs_for_steps(10, 0)


def test_dry_run_plans_equal_steps_from_the_real_data_set(data_dir, late_smoke_yaml, tmp_path,
                                                          capsys):
    """4 samples x 2 CAVs, global batch 2 over 2 processes: smoke 2 steps/epoch, late 4."""
    code = rt.main(["--configs", str(SMOKE_YAML), str(late_smoke_yaml), "--data", str(data_dir),
                    "--runs_root", str(tmp_path / "runs"), "--steps", "8", "--nproc", "2",
                    "--dry_run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "smoke: 4 train examples, 2 steps/epoch -> 4 epochs, 8 steps" in out
    assert "late_smoke: 8 train examples, 4 steps/epoch -> 2 epochs, 8 steps" in out
    assert (f"--nproc_per_node=2 tools/train.py --hypes_yaml {SMOKE_YAML} --model_dir "
            f"{tmp_path / 'runs' / 'smoke'} --set train_params.epoches=4 "
            f"--set train_params.eval_freq=4 --set train_params.save_freq=4 "
            f"--set train_params.max_steps=8 --set root_dir={data_dir / 'train'}") in out
    assert f"eval.py --model_dir {tmp_path / 'runs' / 'late_smoke'} --split test" in out
    assert "seed=" not in out and "_seed" not in out      # one seed: the commands of old
    assert not (tmp_path / "runs").exists()


def test_dry_run_with_three_seeds_prints_every_seed_of_every_model(data_dir, late_smoke_yaml,
                                                                  tmp_path, capsys):
    root = tmp_path / "runs"
    code = rt.main(["--configs", str(SMOKE_YAML), str(late_smoke_yaml), "--data", str(data_dir),
                    "--runs_root", str(root), "--epochs", "1", "--nproc", "2", "--seeds", "3",
                    "--set", "seed=5", "--dry_run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "smoke: 4 train examples, 2 steps/epoch -> 1 epochs, 2 steps, training seeds 5..7" in out
    commands = [line for line in out.splitlines() if "tools/" in line]
    assert len(commands) == 12                         # 2 models x 3 seeds x (train, eval)
    trains = [c for c in commands if "train.py" in c]
    folders = [c.split("--model_dir ")[1].split()[0] for c in trains]
    assert folders == [str(root / name) for name in ("smoke", "smoke_seed1", "smoke_seed2",
                                                     "late_smoke", "late_smoke_seed1",
                                                     "late_smoke_seed2")]
    # The config's seed (here 5, from --set) is the base; each run's override comes last.
    assert [c.split("--set ")[-1] for c in trains] == ["seed=5", "seed=6", "seed=7"] * 2
    evals = [c for c in commands if "eval.py" in c]
    assert evals[1].endswith(f"eval.py --model_dir {root / 'smoke_seed1'} --split test")
    assert not root.exists()


def test_default_configs_are_the_six_models_of_the_preset_dir():
    args = rt.parse_args(["--preset_dir", str(REPO_ROOT / "hypes_yaml" / "opv2v")])
    paths = rt.config_paths(args)
    assert [p.stem for p in paths] == list(rt.DEFAULT_MODELS)
    assert all(p.is_file() and p.parent.name == "opv2v" for p in paths)
    assert [p.parent.name for p in rt.config_paths(rt.parse_args([]))] == ["synthetic"] * 6


# -- the table --------------------------------------------------------------------------------

def _write_record(run_dir: Path, metrics: dict, folder: Path, fusion: str = "intermediate",
                  step: int = 14, split: str = "test", protocol: str = "ours") -> Path:
    """An evaluation record as tools/eval.py writes it (opencood/eval/records.py)."""
    from opencood.eval.records import build_record, write_record
    folder = str(Path(folder).resolve())
    checkpoint = {"file": str(run_dir / "last.pth"), "epoch": 7, "step": step,
                  "sha256": "ab" * 32, "weights": "raw"}
    settings = {"fusion": fusion, "protocol": protocol,
                "wild_setting": {"loc_err": False, "latency_frames": 0}, "overrides": []}
    name = f"{split}_{fusion}_{abs(hash((folder, step, protocol))) % 10 ** 8:08d}"
    record = build_record(name, checkpoint, {"split": split, "folder": folder, "frames": 32},
                          settings, {"seed": 0}, {"device": "cpu", "world_size": 1},
                          {**metrics, "name": name})
    return write_record(run_dir, record)


def test_table_from_evaluation_records(tmp_path):
    from opencood.eval.records import load_record
    folder = tmp_path / "data" / "test"
    late = _write_record(tmp_path / "late", _metrics(0.6044106, 0.4646260, 0.1385834, 892.8333),
                         folder, fusion="late", step=3680)
    fcooper = _write_record(tmp_path / "fc", _metrics(0.7271, 0.5779, 0.2464, 1048576.0),
                            folder, step=3640)
    rows = [{"model": "point_pillar_late_fusion", "fusion": "late", "epochs": 40, "steps": 3680,
             "train_minutes": 10.62, "metrics": [rt.record_metrics(load_record(late))]},
            {"model": "point_pillar_fcooper", "fusion": "intermediate", "epochs": 130,
             "steps": 3640, "train_minutes": 14.2,
             "metrics": [rt.record_metrics(load_record(fcooper))]},
            {"model": "point_pillar_attfuse", "fusion": "intermediate", "epochs": 130,
             "steps": 3640, "train_minutes": None, "metrics": []}]
    lines = rt.format_table(rows).splitlines()
    assert lines[0] == ("| model | fusion | epochs | optimizer steps | AP@0.3 | AP@0.5 | AP@0.7 | "
                        "bytes per agent | train minutes | checkpoint step | data folder |")
    assert lines[1] == "|" + " --- |" * 11
    where = rt._rel(folder.resolve())
    assert lines[2] == ("| `point_pillar_late_fusion` | late | 40 | 3,680 | 0.604 | 0.465 | "
                        f"0.139 | 893 | 10.6 | 3680 | {where} |")
    assert lines[3] == ("| `point_pillar_fcooper` | intermediate | 130 | 3,640 | 0.727 | 0.578 | "
                        f"0.246 | 1,048,576 | 14.2 | 3640 | {where} |")
    assert lines[4] == ("| `point_pillar_attfuse` | intermediate | 130 | 3,640 | failed | n/a | "
                        "n/a | n/a | n/a | n/a | n/a |")
    assert "ego-occluded" not in rt.format_table(rows)
    rows[0]["resumed"] = True
    assert f"| 893 | 10.6 (resumed) | 3680 | {where} |" in rt.format_table(rows).splitlines()[2]


def test_occluded_column_present_only_with_visibility():
    group = {"ap_30": 0.5, "ap_50": 0.25, "ap_70": 0.05, "num_gt": 120}
    with_vis = _metrics(0.4, 0.2, 0.02, 1048576, visibility={"ego-occluded": group,
                                                              "ego-visible": dict(group)})
    other_groups = _metrics(0.3, 0.1, 0.01, 0, visibility={"ego-visible": group})
    rows = [{"model": "a", "fusion": "intermediate", "epochs": 1, "steps": 28,
             "train_minutes": 0.5, "metrics": [with_vis]},
            {"model": "b", "fusion": "no", "epochs": 1, "steps": 28, "train_minutes": 0.4,
             "metrics": [other_groups]}]
    lines = rt.format_table(rows).splitlines()
    assert lines[0] == ("| model | fusion | epochs | optimizer steps | AP@0.3 | AP@0.5 | AP@0.7 | "
                        "AP@0.5 ego-occluded | bytes per agent | train minutes | checkpoint step | "
                        "data folder |")
    assert lines[2] == ("| `a` | intermediate | 1 | 28 | 0.400 | 0.200 | 0.020 | 0.250 | "
                        "1,048,576 | 0.5 | n/a | n/a |")
    assert lines[3] == ("| `b` | no | 1 | 28 | 0.300 | 0.100 | 0.010 | n/a | 0 | 0.4 | n/a | "
                        "n/a |")
    assert rt.occluded_ap50({"visibility": None}) is None
    assert rt.occluded_ap50({"visibility": {"ego-occluded": {"num_gt": 0}}}) is None
    assert "ego-occluded" not in rt.format_table(rows[1:])



def test_per_class_columns_of_multi_class_results_by_hand():
    """Multi-class records add "AP@0.3/0.5/0.7 <class>" columns per class, mean ± std over
    seeds (AP@0.5 vehicle 0.6 and 0.8: 0.700 ± 0.141); single-class rows and classes a row lacks
    read "n/a"."""
    def classes(vehicle, pedestrian):
        return {"vehicle": {"ap_30": 0.9, "ap_50": vehicle, "ap_70": vehicle / 2},
                "pedestrian": {"ap_30": 0.3, "ap_50": pedestrian, "ap_70": None}}
    seed_a = _metrics(0.5, 0.4, 0.1, 0, per_class=classes(0.6, 0.2))
    seed_b = _metrics(0.5, 0.4, 0.1, 0, per_class=classes(0.8, None))
    rows = [{"model": "a", "fusion": "late", "epochs": 1, "steps": 4, "seeds": 2,
             "train_minutes": 1.0, "metrics": [seed_a, seed_b]},
            {"model": "b", "fusion": "no", "epochs": 1, "steps": 4, "seeds": 2,
             "train_minutes": 1.0, "metrics": [_metrics(0.3, 0.2, 0.1, 0)]}]
    lines = rt.format_table(rows).splitlines()
    assert ("| AP@0.7 | AP@0.3 vehicle | AP@0.5 vehicle | AP@0.7 vehicle | AP@0.3 pedestrian | "
            "AP@0.5 pedestrian | AP@0.7 pedestrian | bytes per agent |") in lines[0]
    # vehicle AP@0.7: 0.3 and 0.4 -> 0.350 ± 0.071
    assert ("| 0.100 ± 0.000 | 0.900 ± 0.000 | 0.700 ± 0.141 | 0.350 ± 0.071 | 0.300 ± 0.000 | "
            "0.200 | n/a | 0 |") in lines[2]
    assert "| 0.100 | n/a | n/a | n/a | n/a | n/a | n/a | 0 |" in lines[3]
    assert "vehicle" not in rt.format_table(rows[1:])


def test_mean_and_std_cells_over_seeds_by_hand():
    group = {"ap_30": 0.5, "ap_50": 0.25, "ap_70": 0.05, "num_gt": 120}
    seed_a = _metrics(0.3, 0.2, 0.1, 100, visibility={"ego-occluded": dict(group, ap_50=0.1)})
    seed_b = _metrics(0.5, 0.2, 0.2, 300, visibility={"ego-occluded": dict(group, ap_50=0.3)})
    rows = [{"model": "a", "fusion": "intermediate", "epochs": 2, "steps": 4, "seeds": 3,
             "train_minutes": 1.25, "metrics": [seed_a, seed_b]},
            {"model": "b", "fusion": "late", "epochs": 1, "steps": 4, "seeds": 3,
             "train_minutes": 0.5, "metrics": [seed_a]},
            {"model": "c", "fusion": "no", "epochs": 1, "steps": 4, "seeds": 3,
             "train_minutes": None, "metrics": []}]
    lines = rt.format_table(rows).splitlines()
    assert lines[0] == ("| model | fusion | epochs | optimizer steps | seeds | AP@0.3 | AP@0.5 | "
                        "AP@0.7 | AP@0.5 ego-occluded | bytes per agent | "
                        "train minutes per seed | checkpoint step | data folder |")
    # 0.3 and 0.5: mean 0.4, sample std sqrt(2 * 0.1^2 / 1) = 0.1414; bytes: mean of 100, 300.
    assert lines[2] == ("| `a` | intermediate | 2 | 4 | 2 of 3 | 0.400 ± 0.141 | 0.200 ± 0.000 | "
                        "0.150 ± 0.071 | 0.200 ± 0.141 | 200 | 1.2 | n/a | n/a |")
    assert lines[3] == ("| `b` | late | 1 | 4 | 1 of 3 | 0.300 | 0.200 | 0.100 | 0.100 | 100 | 0.5 | "
                        "n/a | n/a |")
    assert lines[4] == ("| `c` | no | 1 | 4 | 0 of 3 | failed | n/a | n/a | n/a | n/a | n/a | n/a | "
                        "n/a |")
    assert report.seeds_spread_cell([0.3, None, 0.5]) == "0.400 ± 0.141"
    assert report.seeds_spread_cell([None]) == "n/a"
    assert report.seeds_spread_cell([0.25, None]) == "0.250"


# -- --skip_existing, failures and bad input (no training) -------------------------------------

def _no_subprocess(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")
    monkeypatch.setattr(rt.subprocess, "call", refuse)


def test_skip_existing_reads_prepared_runs_without_training(data_dir, late_smoke_yaml, tmp_path,
                                                           monkeypatch, capsys):
    _no_subprocess(monkeypatch)
    root = tmp_path / "runs"
    # smoke: a run folder as a previous results_table run leaves it (with its .run.yaml).
    _write_record(root / "smoke", _metrics(0.5, 0.25, 0.125, 12345.6), data_dir / "test")
    (root / "smoke.run.yaml").write_text(yaml.safe_dump(
        {"model": "smoke", "epochs": 7, "steps": 14, "train_minutes": 2.26,
         "commands": ["torchrun ... smoke", "python tools/eval.py ... smoke"]}))
    # late_smoke: a bare tools/train.py run folder: epochs from its config.yaml, steps computed.
    _write_record(root / "late_smoke", _metrics(0.75, 0.5, 0.25, 96), data_dir / "test",
                  fusion="late")
    (root / "late_smoke" / "config.yaml").write_text(yaml.safe_dump(
        {"train_params": {"epoches": 3}}))
    code = rt.main(["--configs", str(SMOKE_YAML), str(late_smoke_yaml), "--data", str(data_dir),
                    "--runs_root", str(root), "--nproc", "2", "--skip_existing"])
    out = capsys.readouterr().out
    assert code == 0
    assert "smoke: evaluated (evals/test_intermediate_" in out and "not retrained" in out
    table = (root / "results.md").read_text()
    assert "| `smoke` | intermediate | 7 | 14 | 0.500 | 0.250 | 0.125 | 12,346 | 2.3 |" in table
    assert "| `late_smoke` | late | 3 | 12 | 0.750 | 0.500 | 0.250 | 96 | n/a |" in table
    assert "torchrun ... smoke" in table and "## Commands" in table
    assert "| `smoke` | intermediate | 7 | 14 |" in out   # the table is printed too


def _prepare_seed_run(root: Path, run: str, metrics: dict, minutes: float,
                      folder: Path) -> None:
    """A run folder and .run.yaml as an earlier results_table run leaves them."""
    _write_record(root / run, metrics, folder)
    (root / f"{run}.run.yaml").write_text(yaml.safe_dump(
        {"model": "smoke", "run": run, "epochs": 7, "steps": 14, "train_minutes": minutes,
         "commands": [f"torchrun ... {run}"]}))


def test_three_seeds_table_from_hand_made_eval_yamls(data_dir, tmp_path, monkeypatch, capsys):
    _no_subprocess(monkeypatch)
    root = tmp_path / "runs"
    test_folder = data_dir / "test"
    _prepare_seed_run(root, "smoke", _metrics(0.4, 0.25, 0.1, 100), 2.0, test_folder)
    _prepare_seed_run(root, "smoke_seed1", _metrics(0.5, 0.5, 0.1, 200), 3.0, test_folder)
    _prepare_seed_run(root, "smoke_seed2", _metrics(0.6, 0.75, 0.1, 300), 4.0, test_folder)
    code = rt.main(["--configs", str(SMOKE_YAML), "--data", str(data_dir), "--runs_root",
                    str(root), "--nproc", "2", "--seeds", "3", "--skip_existing"])
    assert code == 0
    table = (root / "results.md").read_text()
    assert table.startswith("# Results: mean ± std over 3 training seeds\n")
    assert "over the 3 training seeds of its model" in table
    # AP@0.3 0.4/0.5/0.6: std 0.1; AP@0.5 0.25/0.5/0.75: std 0.25; minutes: mean of 2, 3, 4.
    assert ("| `smoke` | intermediate | 7 | 14 | 3 | 0.500 ± 0.100 | 0.500 ± 0.250 | "
            "0.100 ± 0.000 | 200 | 3.0 |") in table
    per_seed = table.split("## Per seed")[1].split("## Commands")[0]
    assert "| model | fusion | epochs | optimizer steps | training seed | AP@0.3 |" in per_seed
    assert "| `smoke` | intermediate | 7 | 14 | 0 | 0.400 | 0.250 | 0.100 | 100 | 2.0 |" in per_seed
    assert "| `smoke_seed2` | intermediate | 7 | 14 | 2 | 0.600 | 0.750 | 0.100 | 300 | 4.0 |" in \
        per_seed
    assert "torchrun ... smoke_seed1" in table.split("## Commands")[1]


def _fake_training(calls: list, folder: Path, failing_run: str = None):
    """subprocess.call stand-in: records commands, fails ``failing_run``'s training, and makes
    each eval write its record of ``folder`` (AP@0.5 0.5)."""
    def fake_call(command, stdout, stderr):
        calls.append(command)
        run_dir = Path(command[command.index("--model_dir") + 1])
        if "train.py" in " ".join(command):
            return 1 if run_dir.name == failing_run else 0
        _write_record(run_dir, _metrics(0.75, 0.5, 0.25, 64), folder)
        return 0
    return fake_call


def test_skip_existing_per_seed_trains_only_the_missing_seed(data_dir, tmp_path, monkeypatch,
                                                            capsys):
    root = tmp_path / "runs"
    test_folder = data_dir / "test"
    _prepare_seed_run(root, "smoke", _metrics(0.75, 0.25, 0.25, 64), 2.0, test_folder)
    _prepare_seed_run(root, "smoke_seed2", _metrics(0.75, 0.75, 0.25, 64), 2.0, test_folder)
    calls = []
    monkeypatch.setattr(rt.subprocess, "call", _fake_training(calls, test_folder))
    code = rt.main(["--configs", str(SMOKE_YAML), "--data", str(data_dir), "--runs_root",
                    str(root), "--epochs", "1", "--nproc", "2", "--seeds", "3", "--skip_existing"])
    out = capsys.readouterr().out
    assert code == 0
    assert "[1/3] smoke: evaluated (evals/test_intermediate_" in out
    assert "[3/3] smoke_seed2: evaluated (evals/test_intermediate_" in out
    assert len(calls) == 2                             # smoke_seed1: train + eval, nothing else
    assert all(c[c.index("--model_dir") + 1] == str(root / "smoke_seed1") for c in calls)
    assert calls[0][-2:] == ["--set", "seed=1"]
    assert yaml.safe_load((root / "smoke_seed1.run.yaml").read_text())["seed"] == 1
    # AP@0.5 of the three seeds: 0.25, 0.5 (trained now), 0.75.
    assert "| 3 | 0.750 ± 0.000 | 0.500 ± 0.250 | 0.250 ± 0.000 | 64 |" in \
        (root / "results.md").read_text()


def test_failed_seed_is_reported_and_the_row_counts_the_others(data_dir, tmp_path, monkeypatch,
                                                               capsys):
    root = tmp_path / "runs"
    calls = []
    monkeypatch.setattr(rt.subprocess, "call",
                        _fake_training(calls, data_dir / "test", failing_run="smoke_seed1"))
    code = rt.main(["--configs", str(SMOKE_YAML), "--data", str(data_dir), "--runs_root",
                    str(root), "--epochs", "1", "--nproc", "2", "--seeds", "3"])
    captured = capsys.readouterr()
    assert code == 1
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: smoke_seed1: train exited with status 1; "
                      f"see {root / 'smoke_seed1.train.log'}"]
    assert len(calls) == 5                             # seed 1 is not evaluated
    table = (root / "results.md").read_text()
    assert "| `smoke` | intermediate | 1 | 2 | 2 of 3 | 0.750 ± 0.000 | 0.500 ± 0.000 |" in table
    assert "| `smoke_seed1` | intermediate | 1 | 2 | 1 | failed | n/a |" in table


def test_failing_model_is_one_line_and_the_others_go_on(data_dir, late_smoke_yaml, tmp_path,
                                                        monkeypatch, capsys):
    calls = []

    def fake_call(command, stdout, stderr):
        calls.append(command)
        if "train.py" in " ".join(command) and "late_smoke" not in " ".join(command):
            return 1
        if "eval.py" in " ".join(command):
            _write_record(Path(command[command.index("--model_dir") + 1]),
                          _metrics(0.5, 0.25, 0.125, 64), data_dir / "test", fusion="late")
        return 0

    monkeypatch.setattr(rt.subprocess, "call", fake_call)
    root = tmp_path / "runs"
    code = rt.main(["--configs", str(SMOKE_YAML), str(late_smoke_yaml), "--data", str(data_dir),
                    "--runs_root", str(root), "--epochs", "1", "--nproc", "2"])
    captured = capsys.readouterr()
    assert code == 1
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: smoke: train exited with status 1; see {root / 'smoke.train.log'}"]
    assert len(calls) == 3                            # smoke train; late_smoke train + eval
    assert calls[0][0].endswith("torchrun") or calls[0][1:3] == ["-m", "torch.distributed.run"]
    assert (root / "smoke.train.log").read_text().startswith("$ torchrun --standalone")
    table = (root / "results.md").read_text()
    assert "| `smoke` | intermediate | 1 | 2 | failed |" in table
    assert "| `late_smoke` | late | 1 | 4 | 0.500 | 0.250 | 0.125 | 64 |" in table
    assert yaml.safe_load((root / "late_smoke.run.yaml").read_text())["steps"] == 4


@pytest.mark.parametrize("argv,message", [
    (["--configs", "missing.yaml"], "error: missing.yaml: config file not found"),
    (["--set", "train_params.nope=1"], "unknown key 'train_params.nope'"),
    (["--data", "/no/such/folder"], "error: --data /no/such/folder: folder not found"),
    (["--preset_dir", "/no/such/dir"], "error: --preset_dir /no/such/dir: folder not found"),
    (["--seeds", "0"], "error: --seeds must be at least 1, got 0"),
])
def test_bad_input_is_a_one_line_error(argv, message, tmp_path, monkeypatch, capsys):
    _no_subprocess(monkeypatch)
    code = rt.main(argv + ["--runs_root", str(tmp_path / "runs"), "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert message in err


def test_seeds_vary_a_config_without_a_seed_key(data_dir, tmp_path, monkeypatch, capsys):
    """The schema gives every config a seed (default 0) that --set may change, written or not."""
    _no_subprocess(monkeypatch)
    cfg = yaml.safe_load(SMOKE_YAML.read_text())
    cfg.pop("seed", None)
    cfg["_base_"] = str(SMOKE_YAML.parent / cfg["_base_"])
    no_seed = tmp_path / "no_seed.yaml"
    no_seed.write_text(yaml.safe_dump(cfg))
    assert "seed" not in yaml.safe_load(no_seed.read_text())
    argv = ["--configs", str(no_seed), "--data", str(data_dir), "--runs_root",
            str(tmp_path / "runs"), "--nproc", "2", "--dry_run", "--seeds", "2"]
    assert rt.main(argv) == 0
    printed = capsys.readouterr().out
    assert "seed=0" in printed and "seed=1" in printed


def test_missing_training_folder_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    _no_subprocess(monkeypatch)
    code = rt.main(["--configs", str(SMOKE_YAML), "--set", f"root_dir={tmp_path / 'none'}",
                    "--runs_root", str(tmp_path / "runs"), "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"training folder {tmp_path / 'none'} (root_dir) not found" in err


# -- end to end -------------------------------------------------------------------------------

def test_end_to_end_smoke_one_epoch(data_dir, tmp_path, monkeypatch, capsys):
    """The real command: torchrun tools/train.py then tools/eval.py, then results.md (the
    script itself as a fresh interpreter runs it, in this process: tool_modules.run_script)."""
    for name, value in (("CUDA_VISIBLE_DEVICES", ""), ("OMP_NUM_THREADS", "1"),
                        ("OPENCOOD_CACHE", str(tmp_path / "cache"))):
        monkeypatch.setenv(name, value)            # the environment its launches inherit
    monkeypatch.chdir(REPO_ROOT)
    root = tmp_path / "runs"
    result = run_script(TOOL, ["--configs", SMOKE_YAML, "--data", data_dir, "--runs_root", root,
                               "--epochs", "1", "--nproc", "1"], monkeypatch, capsys)
    logs = "".join(p.read_text()[-3000:] for p in sorted(root.glob("*.log")))
    assert result.returncode == 0, result.stdout + result.stderr + logs
    assert "smoke: 4 train examples, 2 steps/epoch -> 1 epochs, 2 steps" in result.stdout
    from opencood.eval.records import list_records
    ((_, evaluated),) = list_records(root / "smoke")
    assert evaluated["data"]["folder"] == str((data_dir / "test").resolve())
    assert evaluated["checkpoint"]["step"] == 2
    assert (root / "smoke" / "last.pth").is_file()
    assert "tools/train.py" in (root / "smoke.train.log").read_text()
    record = yaml.safe_load((root / "smoke.run.yaml").read_text())
    assert record["epochs"] == 1 and record["steps"] == 2 and record["train_minutes"] > 0
    metrics = evaluated["results"]
    row = next(line for line in (root / "results.md").read_text().splitlines()
               if line.startswith("| `smoke`"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:4] == ["`smoke`", "intermediate", "1", "2"]
    assert cells[4:7] == [f"{metrics[k]:.3f}" for k in ("ap_30", "ap_50", "ap_70")]
    assert cells[-4] == f"{round(metrics['bytes_per_agent']):,}"
    assert cells[-2:] == ["2", rt._rel((data_dir / "test").resolve())]
    assert row in result.stdout


def test_a_record_of_other_settings_is_refused_in_one_line_not_mixed_in(data_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """A run evaluated on another data folder, or under another AP protocol, has no record of
    the table's setting: the row says failed and one line says why."""
    root = tmp_path / "runs"
    elsewhere = tmp_path / "elsewhere" / "test"
    calls = []
    monkeypatch.setattr(rt.subprocess, "call", _fake_training(calls, elsewhere))
    _write_record(root / "smoke", _metrics(0.9, 0.9, 0.9, 1), data_dir / "test",
                  protocol="opencood")
    code = rt.main(["--configs", str(SMOKE_YAML), "--data", str(data_dir), "--runs_root",
                    str(root), "--epochs", "1", "--nproc", "2"])
    captured = capsys.readouterr()
    assert code == 1
    (error,) = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: smoke: no evaluation record of the table's setting (test "
                            f"of {(data_dir / 'test').resolve()}, intermediate, protocol ours")
    assert str(elsewhere.resolve()) in error and "protocol opencood" in error
    assert "| `smoke` | intermediate | 1 | 2 | failed |" in (root / "results.md").read_text()


def test_protocol_skip_existing_evaluates_a_trained_run_again_without_training(
        data_dir, tmp_path, monkeypatch, capsys):
    """--protocol v2xreal --skip_existing on a run evaluated under ours: one eval call with
    --protocol v2xreal (no training); the table reads the v2xreal record, not ours."""
    root = tmp_path / "runs"
    test_folder = data_dir / "test"
    _prepare_seed_run(root, "smoke", _metrics(0.9, 0.9, 0.9, 64), 2.0, test_folder)
    calls = []

    def fake_eval(command, stdout, stderr):
        calls.append(command)
        _write_record(Path(command[command.index("--model_dir") + 1]),
                      _metrics(0.5, 0.25, 0.125, 64), test_folder,
                      protocol=command[command.index("--protocol") + 1])
        return 0
    monkeypatch.setattr(rt.subprocess, "call", fake_eval)
    code = rt.main(["--configs", str(SMOKE_YAML), "--data", str(data_dir), "--runs_root",
                    str(root), "--nproc", "2", "--protocol", "v2xreal", "--skip_existing"])
    assert code == 0
    (command,) = calls
    assert "eval.py" in " ".join(command) and command[-2:] == ["--protocol", "v2xreal"]
    assert "| `smoke` | intermediate | 7 | 14 | 0.500 | 0.250 | 0.125 | 64 | 2.0 |" in \
        (root / "results.md").read_text()
    assert "--protocol v2xreal" in (root / "results.md").read_text().split("## Commands")[1]
    assert rt.eval_command(root, "test") == rt.eval_command(root, "test", "ours")
