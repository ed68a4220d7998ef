"""The typed config reaches the code (issue 23, point 2): library code indexes the resolved config,
so a default lives once, in the schema. A read like ``args.get("max_points_per_voxel", 32)``
restates a schema default (and drifts from it); this scan fails when one comes back.

It flags every ``.get("<key>", <default>)`` in ``opencood/`` and ``tools/*.py`` whose key is a
field of the config schema or of a registered model / fusion / loss argument schema. Mappings
that are not our config but share a key name are listed below, each with the reason.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import opencood.config_schema as schema
from opencood.registry import registered_schemas

REPO = Path(__file__).resolve().parents[1]

# (file relative to the repo, key) -> what the mapping is instead of our config.
NOT_OUR_CONFIG = {
    ("opencood/eval/ap.py", "order"): "an APAccumulator state dict saved by an older version",
    ("opencood/eval/records.py", "name"): "an evaluation record of an older version",
    ("opencood/eval/report.py", "name"): "evaluation results (protocol of older ones)",
    ("opencood/models/lift_splat.py", "depth_supervision"): "HEAL's encoder args "
                                                            "(args_from_heal: HEAL's default)",
    ("tools/fingerprint.py", "input_source"): "configs of trees older than the camera "
                                              "readers (it fingerprints before/after trees)",
    ("tools/results_table.py", "seed"): "a table row, and a run folder's config.yaml read raw "
                                        "(folders of older versions)",
}
# Files that read other projects' configs (OpenCOOD's, HEAL's, V2V4Real's, V2X-Real's,
# QuantV2X's yaml), whose defaults are theirs.
PEER_CONFIG_READERS = {"opencood/interop/opencood_config.py", "opencood/interop/heal.py",
                       "opencood/interop/heal_heter.py", "opencood/interop/v2v4real.py",
                       "opencood/interop/v2xreal.py", "opencood/interop/quantv2x.py"}


def schema_keys() -> set:
    """Every field name of the config schema's sections and of the registered args schemas."""
    classes = [obj for obj in vars(schema).values()
               if isinstance(obj, type) and dataclasses.is_dataclass(obj)]
    for table in registered_schemas().values():
        classes += [cls for cls in table.values() if dataclasses.is_dataclass(cls)]
    return {field.name for cls in classes for field in dataclasses.fields(cls)}


def restated_defaults(path: Path, keys: set) -> list:
    """(line, key) of each ``.get(key, default)`` of a schema key in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and node.args):
            continue
        key = node.args[0]
        has_default = len(node.args) > 1 or any(k.arg == "default" for k in node.keywords)
        if isinstance(key, ast.Constant) and key.value in keys and has_default:
            found.append((node.lineno, key.value))
    return found


def test_no_read_site_restates_a_schema_default():
    keys = schema_keys()
    assert {"max_points_per_voxel", "nms_thresh", "decay", "num_iteration"} <= keys
    sources = sorted([*(REPO / "opencood").rglob("*.py"), *(REPO / "tools").glob("*.py")])
    offenders = []
    for path in sources:
        relative = path.relative_to(REPO).as_posix()
        if relative in PEER_CONFIG_READERS:
            continue
        offenders += [f"{relative}:{line}: .get({key!r}, ...)"
                      for line, key in restated_defaults(path, keys)
                      if (relative, key) not in NOT_OUR_CONFIG]
    assert not offenders, "index the resolved config instead:\n" + "\n".join(offenders)


def test_the_scan_finds_a_restated_default(tmp_path):
    """The guard can fail: the read this issue removed, written back."""
    source = tmp_path / "voxelize.py"
    source.write_text('points = int(args.get("max_points_per_voxel", 32))\n'
                      'other = record.get("not_a_schema_key", 1)\n')
    assert restated_defaults(source, schema_keys()) == [(1, "max_points_per_voxel")]
