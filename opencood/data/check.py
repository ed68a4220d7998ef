"""Pre-flight check of an OPV2V-format folder: every problem at once, before a run starts.

A data set with one broken file otherwise fails in a loader worker halfway through an epoch, and
a user fixes problems one run at a time. :func:`check_folder` reads every file and lists every
problem; ``tools/check_data.py`` prints them.

Checked: split and scenario folders exist and hold CAV folders; every CAV folder of a scenario
has the same timestamps, each with a yaml and a pcd; every yaml parses, has a 6-number
``lidar_pose`` and well-formed ``vehicles``; every PCD parses with the point count its header
declares.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List

from tqdm import tqdm

from opencood.data.opv2v import SPLITS, OPV2VFormatError, load_frame_yaml, scenario_timestamps
from opencood.data.pcd import PcdError, read_pcd
from opencood.data.formats import format_names, get_format

DATASET_NAMES = tuple(format_names())        # the --dataset choices of tools/check_data.py


@dataclass
class CheckReport:
    """What :func:`check_folder` found: counts and one line per problem."""
    splits: List[str] = field(default_factory=list)
    scenarios: int = 0
    cav_folders: int = 0
    frames: int = 0
    points: int = 0
    problems: List[str] = field(default_factory=list)

    def summary(self) -> str:
        verdict = "no problems" if not self.problems else f"{len(self.problems)} problem(s)"
        return (f"{len(self.splits)} split(s) ({', '.join(self.splits)}), {self.scenarios} "
                f"scenarios, {self.cav_folders} CAV folders, {self.frames} frames, "
                f"{self.points:,} points: {verdict}")


def split_folders(root: Path) -> List[Path]:
    """The train/validate/test folders under ``root``, or ``root`` itself when it is a split."""
    present = [root / name for name in SPLITS if (root / name).is_dir()]
    return present or [root]


def check_folder(root, progress: bool = True, dataset: str = "opv2v") -> CheckReport:
    """Check a data set folder (holding train/validate/test) or one split folder with the
    checker of format ``dataset`` (opencood.data.formats); a missing folder raises the format's
    error (nothing to report on)."""
    return get_format(dataset).check(root, progress)


def check_opv2v_tree(root, progress: bool = True) -> CheckReport:
    """:func:`check_folder` of the OPV2V / V2XSet layout."""
    return check_frame_tree(root, progress, load_frame_yaml)


def check_v2v4real_tree(root, progress: bool = True) -> CheckReport:
    """:func:`check_folder` of V2V4Real: OPV2V's tree, frames parsed by its reader."""
    from opencood.data.v2v4real import load_v2v4real_yaml
    return check_frame_tree(root, progress, load_v2v4real_yaml)


def check_v2xreal_tree(root, progress: bool = True) -> CheckReport:
    """:func:`check_folder` of V2X-Real: its tree of ``.bin`` clouds (v2xreal.check_tree)."""
    from opencood.data.v2xreal import check_tree
    return check_tree(root, CheckReport(), progress)


def check_dairv2x_root(root, progress: bool = True) -> CheckReport:
    """:func:`check_folder` of DAIR-V2X-C: its own layout (dairv2x.check_root)."""
    from opencood.data.dairv2x import check_root
    return check_root(root, CheckReport())


def check_frame_tree(root, progress: bool, load_frame) -> CheckReport:
    """Every layout problem of an OPV2V-style tree and every frame parsed with ``load_frame``
    (a yaml path -> its parameters; raises OPV2VFormatError)."""
    root = Path(root)
    if not root.is_dir():
        raise OPV2VFormatError(f"{root}: folder not found")
    report = CheckReport()
    frame_files = []
    for split_dir in split_folders(root):
        report.splits.append(split_dir.name)
        frame_files += list(_layout_problems(split_dir, report))
    for yaml_path, pcd_path in tqdm(frame_files, desc="checking frames", unit="frame",
                                    disable=not progress, leave=False):
        _check_frame(yaml_path, pcd_path, report, load_frame)
    return report


def _layout_problems(split_dir: Path, report: CheckReport) -> Iterator[tuple]:
    """Record layout problems of one split; yield the (yaml, pcd) pairs that exist."""
    scenarios = sorted(p for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not scenarios:
        report.problems.append(f"{split_dir}: split folder contains no scenario folders")
    for scenario_dir in scenarios:
        report.scenarios += 1
        try:
            by_cav = scenario_timestamps(scenario_dir)
        except OPV2VFormatError as error:
            report.problems.append(str(error))
            continue
        report.cav_folders += len(by_cav)
        yield from _timestamp_problems(scenario_dir, by_cav, report)


def _timestamp_problems(scenario_dir: Path, by_cav: dict, report: CheckReport) -> Iterator:
    """Every CAV folder must hold the ego's timestamps, each as a yaml and a pcd."""
    ego_id = next(iter(by_cav))
    ego_stamps = by_cav[ego_id]["yaml"]
    for cav_id, files in by_cav.items():
        folder = scenario_dir / cav_id
        missing = sorted(ego_stamps - files["yaml"])
        extra = sorted(files["yaml"] - ego_stamps)
        if missing:
            report.problems.append(f"{folder}: no yaml for {_stamps(missing)} (the ego folder "
                                   f"{ego_id} has them)")
        if extra:
            report.problems.append(f"{folder}: yaml for {_stamps(extra)}, which the ego folder "
                                   f"{ego_id} lacks")
        for stamp in sorted(files["yaml"]):
            if stamp not in files["pcd"]:
                report.problems.append(f"{folder}: {stamp}.yaml has no {stamp}.pcd")
                continue
            yield folder / f"{stamp}.yaml", folder / f"{stamp}.pcd"


def _stamps(stamps: list) -> str:
    shown = ", ".join(stamps[:5])
    return shown + (f" and {len(stamps) - 5} more" if len(stamps) > 5 else "")


def _check_frame(yaml_path: Path, pcd_path: Path, report: CheckReport, load_frame) -> None:
    report.frames += 1
    try:
        load_frame(yaml_path)
    except OPV2VFormatError as error:
        report.problems.append(str(error))
    except OSError as error:
        report.problems.append(f"{yaml_path}: cannot read ({error.strerror})")
    try:
        report.points += int(read_pcd(pcd_path).shape[0])
    except PcdError as error:
        report.problems.append(str(error).splitlines()[0])
    except OSError as error:
        report.problems.append(f"{pcd_path}: cannot read ({error.strerror})")
