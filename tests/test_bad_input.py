"""The bad-input table (issue 13, deliverable 7): every row through the entry point a user runs.

Each error row asserts three things: the tool stops with ONE ``error: ...`` line (no newline, no
traceback), the line names the file, key or value at fault, and nothing already written is lost
(a config or data error leaves no run folder behind; a resume that fails leaves the run's
checkpoints and config byte for byte as they were). Two rows are not errors: a zero-point frame
trains, and more CAVs than ``max_cav`` trains on the nearest ones.

Entry points: tools/train.py's ``main`` in process, ``tools/eval.py``'s
``opencood.engine.evaluator.main`` in process, ``tools/check_data.py``'s ``main`` in process, and
a 2-rank world for the batch split. Data: tiny OPV2V folders (2 CAVs, 2 frames) from
``opv2v_factory``; model: ``hypes_yaml/synthetic/smoke.yaml``, 1 epoch, no validation.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from opencood.config import load_config, save_config
from opencood.config_schema import to_plain
from opencood.engine import evaluator, trainer
from opencood.engine.hooks import TrainHooks
from opencood.utils import dist as dist_utils
from opencood.utils.batching import split_global_batch
from opencood.utils.dist import DistInfo
from opv2v_factory import box_points, vehicle, write_frame, write_simple_split
from process_state import (cpu_and_process_state, preserved_opencood_logger,  # noqa: F401
                           preserved_torch_switches)
from tool_modules import load_tool

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
SCENARIO = "2021_01_01_00_00_00"
STAMPS = ("000000", "000002")
EGO, OTHER = "1000", "1001"          # the CAV folders write_simple_split makes (ego first)


check_data_tool = load_tool("check_data")


# ----------------------------------------------------------------------------------------------
# Fixtures and helpers
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """Point clouds and the OPV2V index are cached under $OPENCOOD_CACHE: keep them private."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPENCOOD_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


pytestmark = pytest.mark.usefixtures("cpu_and_process_state")


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """train/ and test/: one scenario, 2 CAVs 20 m apart, 2 frames."""
    root = tmp_path_factory.mktemp("data")
    for split in ("train", "test"):
        write_simple_split(root / split, num_cavs=2, timestamps=STAMPS)
    return root


def data_sets(train_dir: Path, test_dir: Path | None = None) -> list:
    test_dir = test_dir or train_dir
    return ["--set", f"root_dir={train_dir}", "--set", "validate_dir=null",
            "--set", f"test_dir={test_dir}"]


def train_argv(train_dir: Path, *sets: str, run_dir: Path | None = None,
               runs_root: Path | None = None, hypes: Path = SMOKE_YAML,
               one_epoch: bool = True) -> list:
    """A fresh 1-epoch smoke run on ``train_dir`` (global batch 2: one step on 2 frames)."""
    argv = ["--hypes_yaml", str(hypes)]
    argv += ["--model_dir", str(run_dir)] if run_dir else ["--runs_root", str(runs_root)]
    argv += data_sets(train_dir) + (["--set", "train_params.epoches=1"] if one_epoch else [])
    for item in sets:
        argv += ["--set", item]
    return argv


def one_line_error(main, argv) -> str:
    """Run a tool's ``main``; it must exit with exactly one ``error: ...`` line."""
    with pytest.raises(SystemExit) as raised:
        main(argv)
    message = raised.value.code
    assert isinstance(message, str), f"exit status {message!r}, not an error line"
    assert message.startswith("error: "), message
    assert "\n" not in message and "\r" not in message, message
    assert "Traceback" not in message, message
    return message


def assert_names(message: str, *needles) -> None:
    for needle in needles:
        assert str(needle) in message, f"{needle!r} not in: {message}"


def copy_split(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def snapshot(folder: Path) -> dict:
    """{relative path: sha1} of every file of a run except its logs (which a failed resume may
    extend with the reason it stopped)."""
    return {str(path.relative_to(folder)): hashlib.sha1(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*"))
            if path.is_file() and not path.name.startswith(("train.log", "events."))}


@pytest.fixture(scope="module")
def trained_run(data_root, tmp_path_factory) -> Path:
    """A finished 1-step smoke run (config.yaml, last.pth, checkpoints/): what a failed resume
    or eval must leave as it was."""
    run_dir = tmp_path_factory.mktemp("runs") / "smoke"
    with preserved_torch_switches(), preserved_opencood_logger(), \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        trainer.main(train_argv(data_root / "train", run_dir=run_dir))
    assert (run_dir / "last.pth").is_file()
    return run_dir


@pytest.fixture
def run_copy(trained_run, tmp_path) -> Path:
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


# ----------------------------------------------------------------------------------------------
# Rows 1-3: configuration (refused before any file is written)
# ----------------------------------------------------------------------------------------------

def _standalone_yaml(folder: Path, edit) -> Path:
    """smoke.yaml resolved into one file (no _base_), with ``edit(cfg)`` applied."""
    cfg = to_plain(load_config(SMOKE_YAML))        # a plain copy: the loaded one is read-only
    edit(cfg)
    path = folder / "experiment.yaml"
    save_config(cfg, path)
    return path


def _rename_epoches(cfg):
    cfg["train_params"]["epochs"] = cfg["train_params"].pop("epoches")


def _inherit_with_epochs(folder: Path) -> Path:
    """The usual way to write a config: inherit smoke.yaml and change a key (misspelt here)."""
    path = folder / "experiment.yaml"
    path.write_text(f"_base_: {SMOKE_YAML}\ntrain_params:\n  epochs: 5\n")
    return path


CONFIG_ROWS = {
    # row 1: unknown registry names; each message lists the registered names
    "unknown_model": (["model.core_method=pointpilar"], None,
                      ["smoke.yaml", "model.core_method", "'pointpilar'", "point_pillar"]),
    "unknown_fusion": (["fusion.core_method=middle"], None,
                       ["smoke.yaml", "fusion.core_method", "'middle'", "intermediate"]),
    "unknown_fusion_module": (["model.args.fusion.core_method=attn"], None,
                              ["smoke.yaml", "model.args.fusion.core_method", "'attn'", "att"]),
    "unknown_loss": (["loss.core_method=focal_l1"], None,
                     ["smoke.yaml", "loss.core_method", "'focal_l1'",
                      "registered losses: point_pillar_loss"]),
    # row 2: a missing key, a misspelt key (alone, and beside the inherited right one), and a
    # --set of a key that does not exist
    "missing_key": ([], lambda folder: _standalone_yaml(
        folder, lambda cfg: cfg["train_params"].pop("epoches")),
        ["experiment.yaml", "train_params.epoches"]),
    "misspelt_key": ([], lambda folder: _standalone_yaml(folder, _rename_epoches),
                     ["experiment.yaml", "train_params.epochs", "epoches"]),
    "misspelt_key_beside_base": ([], _inherit_with_epochs,
                                 ["experiment.yaml", "train_params.epochs", "epoches"]),
    "set_unknown_key": (["train_params.epochs=3"], None,
                        ["smoke.yaml", "--set", "train_params.epochs", "epoches"]),
    "set_unknown_section": (["optimiser.lr=0.1"], None, ["smoke.yaml", "--set", "optimiser"]),
}


@pytest.mark.parametrize("row", list(CONFIG_ROWS))
def test_config_error_is_one_line_and_writes_no_run_folder(row, data_root, tmp_path):
    sets, make_yaml, needles = CONFIG_ROWS[row]
    hypes = make_yaml(tmp_path) if make_yaml else SMOKE_YAML
    runs = tmp_path / "runs"
    message = one_line_error(trainer.main, train_argv(data_root / "train", *sets, runs_root=runs,
                                                       hypes=hypes, one_epoch=False))
    assert_names(message, *needles)
    assert not runs.exists(), list(runs.rglob("*"))


def test_unsafe_yaml_tag_is_refused_and_never_executed(data_root, tmp_path):
    """Row 3: ``!!python/object/apply`` would run a command under yaml.load's full loader."""
    marker = tmp_path / "executed"
    hypes = tmp_path / "unsafe.yaml"
    hypes.write_text(f"_base_: {SMOKE_YAML}\n"
                     f"name: !!python/object/apply:os.system [\"touch {marker}\"]\n")
    runs = tmp_path / "runs"
    message = one_line_error(trainer.main, train_argv(data_root / "train", runs_root=runs,
                                                       hypes=hypes))
    assert_names(message, hypes, "line 2", "python/object/apply:os.system")
    assert not marker.exists() and not runs.exists()


def test_unsafe_yaml_tag_in_a_data_file_is_refused_and_never_executed(data_root, tmp_path):
    """Row 3 in a CAV's frame yaml: the index build refuses it the same way."""
    marker = tmp_path / "executed"
    split = copy_split(data_root / "train", tmp_path / "train")
    frame = split / SCENARIO / OTHER / "000002.yaml"
    frame.write_text(frame.read_text() + f"hack: !!python/object/apply:os.system "
                                         f"[\"touch {marker}\"]\n")
    runs = tmp_path / "runs"
    message = one_line_error(trainer.main, train_argv(split, runs_root=runs))
    assert_names(message, frame, "python/object/apply:os.system")
    assert not marker.exists() and not runs.exists()


# ----------------------------------------------------------------------------------------------
# Rows 4-8: data (the index build reports before a run folder exists; PCDs are read in the loop)
# ----------------------------------------------------------------------------------------------

def _remove_frames(cav_dir: Path, stamps=STAMPS):
    for stamp in stamps:
        for suffix in ("yaml", "pcd"):
            (cav_dir / f"{stamp}.{suffix}").unlink()


def _empty_scenario(split: Path):
    empty = split / "2021_02_02_00_00_00"
    empty.mkdir()
    return empty


def _cav_without_frames(split: Path):
    cav = split / SCENARIO / OTHER
    _remove_frames(cav)
    return cav


def _shifted_timestamp(split: Path):
    """The second CAV recorded 000003 where the ego has 000002."""
    cav = split / SCENARIO / OTHER
    for suffix in ("yaml", "pcd"):
        (cav / f"000002.{suffix}").rename(cav / f"000003.{suffix}")
    return cav


def _no_lidar_pose(split: Path):
    frame = split / SCENARIO / OTHER / "000002.yaml"
    params = yaml.safe_load(frame.read_text())
    del params["lidar_pose"]
    frame.write_text(yaml.safe_dump(params))
    return frame


def _pcd_lines(split: Path):
    pcd = split / SCENARIO / OTHER / "000002.pcd"
    return pcd, pcd.read_text().splitlines()


def _pcd_missing_a_point(split: Path):
    """Header POINTS/WIDTH say 120, the body holds 119 rows."""
    pcd, lines = _pcd_lines(split)
    pcd.write_text("\n".join(lines[:-1]) + "\n")
    return pcd


def _pcd_non_numeric(split: Path):
    pcd, lines = _pcd_lines(split)
    fields = lines[-5].split()
    fields[1] = "1.2.3"
    lines[-5] = " ".join(fields)
    pcd.write_text("\n".join(lines) + "\n")
    return pcd


# row -> (break the copy and return the path at fault, words the line must hold,
#         read by the index build (no run folder) or only by the loop)
DATA_ROWS = {
    "data_folder_missing": (lambda split: split.parent / "no_such_split",
                            ["split folder not found"], "index"),
    "empty_scenario": (_empty_scenario, ["no CAV folders"], "index"),
    "cav_without_frames": (_cav_without_frames, ["missing 000000.yaml", EGO], "index"),
    "cav_timestamps_differ": (_shifted_timestamp, ["missing 000002.yaml", EGO], "index"),
    "pcd_point_count": (_pcd_missing_a_point, ["POINTS", "120", "119"], "loop"),
    "pcd_non_numeric": (_pcd_non_numeric, ["1.2.3"], "loop"),
    "yaml_without_lidar_pose": (_no_lidar_pose, ["'lidar_pose' is missing"], "index"),
}


@pytest.mark.parametrize("row", list(DATA_ROWS))
def test_data_error_is_one_line_naming_the_file(row, data_root, tmp_path):
    breaker, needles, stage = DATA_ROWS[row]
    split = copy_split(data_root / "train", tmp_path / "train")
    at_fault = breaker(split)
    train_dir = at_fault if row == "data_folder_missing" else split
    runs = tmp_path / "runs"
    message = one_line_error(trainer.main, train_argv(train_dir, runs_root=runs))
    assert_names(message, at_fault, *needles)
    if stage == "index":   # found before the run folder is made
        assert not runs.exists(), list(runs.rglob("*"))
    else:                  # found by the first batch: a run folder with no checkpoint, whose
        [run_dir] = list(runs.iterdir())      # log says why it stopped
        assert not list(run_dir.rglob("*.pth"))
        assert message[len("error: "):] in (run_dir / "train.log").read_text()


@pytest.mark.parametrize("row", ["pcd_point_count", "yaml_without_lidar_pose"])
def test_data_error_on_resume_leaves_the_run_as_it_was(row, run_copy, data_root, tmp_path):
    """Resuming a run on broken data stops in one line; its checkpoints and config stay."""
    breaker, needles, _ = DATA_ROWS[row]
    split = copy_split(data_root / "train", tmp_path / "train")
    at_fault = breaker(split)
    before = snapshot(run_copy)
    message = one_line_error(trainer.main, ["--model_dir", str(run_copy), *data_sets(split),
                                            "--set", "train_params.epoches=2"])
    assert_names(message, at_fault, *needles)
    assert snapshot(run_copy) == before


@pytest.mark.parametrize("row", [r for r in DATA_ROWS if r != "data_folder_missing"])
def test_check_data_lists_the_same_problem(row, data_root, tmp_path, capsys):
    """tools/check_data.py names the same file, one line per problem, exit status 1."""
    breaker, needles, _ = DATA_ROWS[row]
    root = tmp_path / "data"
    split = copy_split(data_root / "train", root / "train")
    at_fault = breaker(split)
    assert check_data_tool.main([str(root), "--quiet"]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("problem: ")]
    assert problems and any(str(at_fault) in line for line in problems), problems


def test_check_data_on_a_missing_folder_is_one_line(tmp_path):
    missing = tmp_path / "no_such_data"
    message = one_line_error(lambda argv: check_data_tool.run_cli(check_data_tool.main, argv),
                             [str(missing), "--quiet"])
    assert_names(message, missing, "not found")


# ----------------------------------------------------------------------------------------------
# Row 9: a zero-point frame trains; row 10: more CAVs than max_cav trains on the nearest
# ----------------------------------------------------------------------------------------------

def test_zero_point_frame_trains_with_a_finite_loss(tmp_path, capsys):
    """Row 9: a frame where no CAV has a single point is data, not an error. One step per
    sample (batch 1), so one step's whole input is empty."""
    split = write_simple_split(tmp_path / "train", num_cavs=2, timestamps=STAMPS)
    for cav in (EGO, OTHER):
        pcd = split / SCENARIO / cav / f"{STAMPS[0]}.pcd"
        params = yaml.safe_load(pcd.with_suffix(".yaml").read_text())
        write_frame(pcd.parent, STAMPS[0], np.zeros((0, 4), np.float32), params["lidar_pose"],
                    params["vehicles"])
    assert check_data_tool.main([str(split), "--quiet"]) == 0
    assert "no problems" in capsys.readouterr().out
    step_losses = []      # the loss of every optimiser step the run takes
    record_loss = TrainHooks(
        after_step=lambda step, stats: step_losses.append(float(stats["loss"])))
    result = trainer.main(train_argv(split, "train_params.batch_size=1",
                                     "train_params.max_micro_batch=1",
                                     run_dir=tmp_path / "run"), hooks=record_loss)
    assert result["step"] == 2 and len(step_losses) == 2
    assert all(math.isfinite(loss) for loss in step_losses), step_losses
    assert (tmp_path / "run" / "last.pth").is_file()


# CAV folder -> lidar x (m); the ego is the first folder. Folder order is not distance order.
FLEET = {"1000": 0.0, "1001": 60.0, "1002": 30.0, "1003": -8.0, "1004": 15.0}


def _write_fleet(split: Path) -> Path:
    cars = {100: (5.0, 3.5), 101: (22.0, -3.5)}
    for cav_id, x in FLEET.items():
        pose = [x, 0.0, 1.9, 0.0, 0.0, 0.0]
        for step, stamp in enumerate(STAMPS):
            points = np.concatenate([box_points(cx - x, cy, seed=actor + step)
                                     for actor, (cx, cy) in cars.items()])
            write_frame(split / SCENARIO / cav_id, stamp, points, pose,
                        {actor: vehicle(cx, cy) for actor, (cx, cy) in cars.items()})
    return split


def test_more_cavs_than_max_cav_trains_on_the_nearest(tmp_path):
    """Row 10: 5 CAVs, max_cav 3: the ego and the 2 CAVs nearest to it (8 m and 15 m), not the
    first folders (1001 at 60 m, 1002 at 30 m, both within com_range)."""
    split = _write_fleet(tmp_path / "train")
    built = []

    def keep_train_set(dataset):
        built.append(dataset)
        return dataset

    result = trainer.main(train_argv(split, "train_params.max_cav=3", run_dir=tmp_path / "run"),
                          hooks=TrainHooks(wrap_train_set=keep_train_set))
    assert result["step"] == 1
    [train_set] = built
    for index in range(len(train_set)):
        kept = train_set[index]["agent_ids"]       # what the model is fed, ego first
        assert kept[0] == "1000" and sorted(kept) == ["1000", "1003", "1004"], kept
        distances = [abs(FLEET[cav]) for cav in kept]
        assert max(distances) < min(abs(FLEET[c]) for c in FLEET if c not in kept)


# ----------------------------------------------------------------------------------------------
# Row 11: a global batch the world size cannot split
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_global_batch_the_world_cannot_split(rank, data_root, tmp_path, monkeypatch):
    """Row 11: global batch 3 on 2 ranks is refused, naming the key and the fix, on each rank
    before any collective or file (the session hands trainer.main a 2-rank world without a
    process group, so a collective would raise). The same with two real gloo processes:
    test_train.py::test_impossible_global_batch_fails_on_every_rank. A batch the ranks can share
    but that exceeds max_micro_batch accumulates instead: 4 on 2 ranks in micro-batches of 1."""
    assert split_global_batch(4, 2, max_micro_batch=1) == (1, 2)

    @contextlib.contextmanager
    def two_rank_session(**_):
        yield DistInfo(rank, 2, rank, True, "gloo", torch.device("cpu"))

    monkeypatch.setattr(dist_utils, "distributed_session", two_rank_session)
    runs = tmp_path / "runs"
    message = one_line_error(trainer.main, train_argv(data_root / "train",
                                                      "train_params.batch_size=3", runs_root=runs))
    assert_names(message, "train_params.batch_size", "global batch 3 cannot be split over world "
                 "size 2", "use a global batch of 2 or 4")
    assert not runs.exists()


# ----------------------------------------------------------------------------------------------
# Rows 12-13: checkpoints (resume and eval)
# ----------------------------------------------------------------------------------------------

# Wider pillar features (shapes differ), one backbone block more in the first stage and one
# fewer in the last (keys missing and unexpected).
OTHER_MODEL = ["model.args.pillar_vfe.num_filters=[32]",
               "model.args.point_pillar_scatter.num_features=32",
               "model.args.base_bev_backbone.layer_nums=[2,1,0]"]


def test_resume_with_a_checkpoint_of_another_model(run_copy):
    """Row 12 (resume): the run's checkpoint against another model: missing and unexpected keys
    and shape mismatches are listed in the line; the run is left as it was."""
    before = snapshot(run_copy)
    sets = sum((["--set", item] for item in OTHER_MODEL), [])
    message = one_line_error(trainer.main, ["--model_dir", str(run_copy), *sets,
                                            "--set", "train_params.epoches=2"])
    assert_names(message, run_copy / "last.pth", "does not fit the model", "missing keys",
                 "unexpected keys", "shape mismatches", "(16, 10) vs model (32, 10)")
    assert snapshot(run_copy) == before


def test_eval_with_a_checkpoint_of_another_model(run_copy, data_root):
    """Row 12 (eval): the same, through tools/eval.py."""
    before = snapshot(run_copy)
    sets = sum((["--set", item] for item in OTHER_MODEL), [])
    message = one_line_error(evaluator.main, ["--model_dir", str(run_copy), "--num_workers", "0",
                                              *sets])
    assert_names(message, run_copy / "last.pth", "does not fit the model", "missing keys",
                 "unexpected keys", "shape mismatches")
    assert snapshot(run_copy) == before


class Payload:
    """An object that runs code when it is unpickled (what weights_only=True refuses to do)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __setstate__(self, state):
        Path(state["marker"]).touch()


def _pickled_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"model": Payload(marker), "epoch": 1}, path)
    assert not marker.exists()
    return path


def test_resume_refuses_a_checkpoint_holding_a_pickled_object(run_copy, tmp_path):
    """Row 13 (resume): a run whose only checkpoint holds a pickled object stops in one line
    naming the file; the object is never built."""
    shutil.rmtree(run_copy / "checkpoints")
    marker = tmp_path / "unpickled"
    bad = _pickled_checkpoint(run_copy / "last.pth", marker)
    before = snapshot(run_copy)
    message = one_line_error(trainer.main, ["--model_dir", str(run_copy),
                                            "--set", "train_params.epoches=2"])
    assert_names(message, bad, "weights_only=True", "Unsupported global", "Payload")
    assert "add_safe_globals" not in message
    assert not marker.exists()
    assert snapshot(run_copy) == before


def test_eval_refuses_a_checkpoint_holding_a_pickled_object(run_copy, tmp_path):
    """Row 13 (eval): --checkpoint of such a file, same line, nothing built."""
    marker = tmp_path / "unpickled"
    bad = _pickled_checkpoint(tmp_path / "foreign.pth", marker)
    before = snapshot(run_copy)
    message = one_line_error(evaluator.main, ["--model_dir", str(run_copy), "--checkpoint",
                                              str(bad), "--num_workers", "0"])
    assert_names(message, bad, "weights_only=True", "Unsupported global", "Payload")
    assert "add_safe_globals" not in message
    assert not marker.exists()
    assert snapshot(run_copy) == before
