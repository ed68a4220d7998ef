"""Data set formats are declared once (opencood.data.formats): every registered reader keeps the
SplitReader contract, which holds exactly what the datasets call, and every other place that
needs the format list (config schema, checker, generator, benchmark) asks the registry."""
import ast
import inspect
from pathlib import Path

import pytest

from opencood.config import load_config
from opencood.data import datasets
from opencood.data.check import check_folder
from opencood.data.formats import (SplitReader, format_names, get_format, reader_problems,
                                   writer_formats)
from opencood.data.synthetic import generate_dataset
from opencood.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
FORMAT_NAMES = {"opv2v", "v2xset", "v2v4real", "dairv2x", "v2xreal"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The tiny synthetic data set in every format the world writes: {format: root}."""
    roots = {}
    for name in writer_formats():
        root = tmp_path_factory.mktemp(name)
        generate_dataset(root, preset="tiny", seed=0, progress=False, data_format=name)
        roots[name] = root
    return roots


def methods_the_datasets_call():
    """Every ``self.split.<name>`` the fusion datasets use (read from their source)."""
    tree = ast.parse(inspect.getsource(datasets))
    called = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "split" and isinstance(node.value.value, ast.Name)
                and node.value.value.id == "self"):
            called.add(node.attr)
    return called


def test_the_protocol_holds_exactly_what_the_datasets_call():
    protocol = {name for name in dir(SplitReader) if not name.startswith("_")}
    # len(self.split) is the dataset's length: __len__ is in the protocol too.
    assert methods_the_datasets_call() == protocol


def test_the_formats_are_the_known_five_and_four_are_written():
    assert format_names() == ["opv2v", "v2xset", "v2v4real", "dairv2x", "v2xreal"]
    assert writer_formats() == ["opv2v", "v2v4real", "dairv2x", "v2xreal"]


def test_every_reader_keeps_the_contract_on_its_own_synthetic_files(written):
    for name in format_names():
        data_format = get_format(name)
        root = written["opv2v" if name == "v2xset" else name]
        for split_path in data_format.split_paths(root):
            assert split_path.exists(), split_path
        reader = data_format.open_split(data_format.split_paths(root)[0],
                                        cache_dir=root / "cache")
        assert isinstance(reader, SplitReader), name
        assert reader_problems(data_format.reader_class(), reader) == {}, name
        info = reader.info(0)
        points = reader.load_points(info.scenario, info.ego_id, info.timestamp)
        assert points.ndim == 2 and points.shape[1] == 4
        ids, boxes = reader.sample_gt(0, data_format.gt_range)
        assert boxes.shape == (len(ids), 7)


def test_a_reader_missing_a_method_is_named():
    class Partial:
        def __len__(self):
            return 0

    problems = reader_problems(Partial, Partial())
    assert problems["load_points"] == "missing"
    assert "static method" in problems["reader_options"]


def test_every_format_checks_its_own_files_clean(written):
    for name, root in written.items():
        report = check_folder(get_format(name).base(root), progress=False, dataset=name)
        assert not report.problems, (name, report.problems[:3])


def test_the_config_refuses_an_unknown_format_listing_the_registered(tmp_path):
    with pytest.raises(ConfigError, match="fusion.dataset.*expected one of dairv2x, opv2v, "
                                          "v2v4real, v2xreal, v2xset"):
        load_config(REPO / "hypes_yaml/synthetic/smoke.yaml", ["fusion.dataset=kitti"])


def test_no_other_module_lists_the_formats():
    """The format names appear as a list nowhere but in the registry (a new format is one
    registration, not five edits)."""
    offenders = []
    for path in sorted([*(REPO / "opencood").rglob("*.py"), *(REPO / "tools").glob("*.py")]):
        if path.name == "formats.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
                elements = node.keys if isinstance(node, ast.Dict) else node.elts
                names = {e.value for e in elements if isinstance(e, ast.Constant)}
                # AP protocols and checkpoint codebases are named after some data sets too:
                # a list of formats holds format names only
                if len(names & FORMAT_NAMES) >= 2 and names <= FORMAT_NAMES:
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not offenders, offenders
