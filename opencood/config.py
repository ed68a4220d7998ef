"""Experiment configs ("hypes yaml"): load, inherit, override, validate, save.

* Files are parsed with ``yaml.safe_load`` semantics only (never ``eval`` of strings).
* ``_base_: other.yaml`` (or a list of files) inherits from files resolved relative to the
  including file; later bases override earlier ones and the including file overrides them all.
  Mappings merge key by key; any other value (lists included) is replaced whole. A key whose
  value is ``{_delete_: true, ...}`` replaces the base mapping instead of merging into it.
* ``--set a.b=value`` overrides are parsed as yaml scalars (``3`` -> int, ``1e-3`` -> float,
  ``true`` -> bool, ``[1, 2]`` -> list); the key must already exist unless ``allow_new=True``.
* Validation errors are one line naming the file and the dotted key.
"""
from __future__ import annotations

import copy
import difflib
import re
from pathlib import Path
from typing import Any, Iterable

import yaml

from opencood.errors import OpencoodError
from opencood.utils.atomic import atomic_write

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class YamlLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """Safe loader (libyaml when present) that also reads ``1e-3`` as a float.

    YAML 1.1, which PyYAML implements, requires a dot in a float, so ``lr: 1e-3`` would load as
    the string "1e-3". The resolver is registered once here, on our own subclass, never per call.
    """


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."))


class ConfigError(OpencoodError, ValueError):
    """A config file or override is invalid; the message names the file and the key."""


def yaml_error_line(error: yaml.YAMLError) -> str:
    """``invalid yaml at line L, column C: problem``: a parser error on one line."""
    mark = getattr(error, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    return f"invalid yaml{where}: {problem}"


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
    try:
        data = yaml.load(text, Loader=YamlLoader)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: {yaml_error_line(err)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


def merge_configs(base: dict, override: dict) -> dict:
    """Deep-merge ``override`` into a copy of ``base`` (mappings merge, everything else replaces)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and value.get("_delete_"):
            merged[key] = {k: copy.deepcopy(v) for k, v in value.items() if k != "_delete_"}
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_configs(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _load_with_bases(path: Path, chain: tuple) -> dict:
    path = path.resolve()
    if path in chain:
        cycle = " -> ".join(str(p) for p in chain + (path,))
        raise ConfigError(f"{path}: _base_ cycle: {cycle}")
    data = _read_yaml(path)
    bases = data.pop("_base_", None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) for b in bases):
        raise ConfigError(f"{path}: _base_ must be a file name or a list of file names")
    merged: dict = {}
    for base in bases:
        base_path = (path.parent / base)
        if not base_path.exists():
            raise ConfigError(f"{path}: _base_ file {base!r} not found (looked at {base_path})")
        merged = merge_configs(merged, _load_with_bases(base_path, chain + (path,)))
    return merge_configs(merged, data)


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b=3"`` -> (["a", "b"], 3); the value is parsed as a yaml scalar/flow value."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key.path=value")
    key, raw_value = text.split("=", 1)
    keys = [k for k in key.strip().split(".")]
    if not key.strip() or any(not k for k in keys):
        raise ConfigError(f"--set {text!r}: empty key")
    try:
        value = yaml.load(raw_value, Loader=YamlLoader) if raw_value.strip() else ""
    except yaml.YAMLError:
        raise ConfigError(f"--set {text!r}: value is not valid yaml") from None
    return keys, value


def apply_overrides(cfg: dict, overrides: Iterable[str], source: str = "--set",
                    allow_new: bool = False) -> dict:
    """Return a copy of ``cfg`` with ``key.path=value`` overrides applied."""
    cfg = copy.deepcopy(cfg)
    for text in overrides or []:
        keys, value = parse_override(text)
        node = cfg
        for depth, key in enumerate(keys[:-1]):
            if key not in node and allow_new:
                node[key] = {}
            if not isinstance(node.get(key), dict):
                dotted = ".".join(keys[:depth + 1])
                raise ConfigError(f"{source}: {dotted!r} is not a section of the config")
            node = node[key]
        if keys[-1] not in node and not allow_new:
            raise ConfigError(
                f"{source}: unknown key {'.'.join(keys)!r} (existing here: "
                f"{', '.join(sorted(map(str, node))) or 'none'})")
        node[keys[-1]] = value
    return cfg


# Required keys and the types they must have: (dotted key, types, description).
_REQUIRED = [
    ("name", (str,), "a run name"),
    ("fusion.core_method", (str,), "no | early | late | intermediate"),
    ("model.core_method", (str,), "a registered model name"),
    ("train_params.batch_size", (int,), "the global batch size"),
    ("train_params.epoches", (int,), "the number of epochs"),
]
_POSITIVE_INTS = ["train_params.batch_size", "train_params.epoches", "train_params.max_cav",
                  "train_params.eval_freq", "train_params.save_freq"]
FUSION_METHODS = ("no", "early", "late", "intermediate")


def get_key(cfg: dict, dotted: str, default: Any = KeyError) -> Any:
    """Value at a dotted key; ``default`` when absent (raises KeyError if no default given)."""
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            if default is KeyError:
                raise KeyError(dotted)
            return default
        node = node[key]
    return node


def _refuse_misspelt_keys(cfg: dict, source: str) -> None:
    """A key one typo away from a known key beside it (``train_params.epochs`` for
    ``epoches``) is refused, even when the right key is inherited: it would be silently ignored."""
    known = {dotted for dotted, _, _ in _REQUIRED} | set(_POSITIVE_INTS)
    for dotted in sorted(known):
        section, _, name = dotted.rpartition(".")
        node = get_key(cfg, section, default=None) if section else cfg
        for key in node if isinstance(node, dict) else ():
            near = ".".join(filter(None, (section, str(key))))
            if near not in known and difflib.get_close_matches(str(key), [name], cutoff=0.8):
                raise ConfigError(f"{source}: unknown key {near!r} (did you mean {dotted!r}?)")


def validate_config(cfg: dict, source: str) -> None:
    """Check required keys and types; raise ConfigError naming ``source`` and the key."""
    _refuse_misspelt_keys(cfg, source)
    for dotted, types, description in _REQUIRED:
        value = get_key(cfg, dotted, default=None)
        if value is None:
            raise ConfigError(f"{source}: missing required key {dotted!r} ({description})")
        if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
            hint = " (yaml reads a bare no/yes/off as a boolean: quote it, 'no')" \
                if isinstance(value, bool) else ""
            raise ConfigError(f"{source}: key {dotted!r} must be {types[0].__name__}, "
                              f"got {value!r}{hint}")
    for dotted in _POSITIVE_INTS:
        value = get_key(cfg, dotted, default=None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value <= 0):
            raise ConfigError(f"{source}: key {dotted!r} must be a positive integer, "
                              f"got {value!r}")
    fusion = cfg["fusion"]["core_method"]
    if fusion not in FUSION_METHODS:
        raise ConfigError(f"{source}: key 'fusion.core_method' is {fusion!r}; expected one of "
                          f"{', '.join(FUSION_METHODS)}")
    for dotted in ("preprocess.cav_lidar_range", "postprocess.gt_range"):
        value = get_key(cfg, dotted, default=None)
        if value is not None and not _is_range(value):
            raise ConfigError(f"{source}: key {dotted!r} must be 6 numbers "
                              f"[xmin, ymin, zmin, xmax, ymax, zmax] with min < max, got {value!r}")


def _is_range(value: Any) -> bool:
    if not isinstance(value, list) or len(value) != 6:
        return False
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return False
    return all(value[i] < value[i + 3] for i in range(3))


def fill_derived(cfg: dict) -> dict:
    """Copy geometry the model needs from the data sections into ``model.args`` (computed here,
    never by ``eval`` of a yaml string): ``lidar_range`` and ``voxel_size`` from ``preprocess``,
    ``max_points_per_voxel``, and ``anchor_number`` from the anchor yaws. Explicit values win."""
    cfg = copy.deepcopy(cfg)
    preprocess = cfg.get("preprocess") or {}
    model_args = cfg.setdefault("model", {}).setdefault("args", {})
    if model_args is None:
        model_args = cfg["model"]["args"] = {}
    if "cav_lidar_range" in preprocess:
        model_args.setdefault("lidar_range", list(preprocess["cav_lidar_range"]))
    pre_args = preprocess.get("args") or {}
    for key in ("voxel_size", "max_points_per_voxel"):
        if key in pre_args:
            model_args.setdefault(key, pre_args[key])
    yaws = get_key(cfg, "postprocess.anchor_args.r", default=None)
    if yaws is not None:
        model_args.setdefault("anchor_number", len(yaws))
    return cfg


def load_config(path, overrides: Iterable[str] = (), validate: bool = True) -> dict:
    """Load ``path`` with its ``_base_`` chain, apply ``--set`` overrides, validate, and fill
    the derived model geometry (:func:`fill_derived`)."""
    path = Path(path)
    cfg = _load_with_bases(path, chain=())
    cfg = apply_overrides(cfg, overrides, source=f"{path} (--set)")
    if validate:
        validate_config(cfg, source=str(path))
    return fill_derived(cfg)


def save_config(cfg: dict, path) -> None:
    """Write the resolved config (no ``_base_`` left) as yaml, atomically."""
    text = yaml.dump(cfg, Dumper=_Dumper, sort_keys=False, default_flow_style=None)
    with atomic_write(path) as stream:
        stream.write(text)
