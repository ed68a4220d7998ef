"""Experiment configs ("hypes yaml"): load, inherit, override, validate, resolve, save.

* The schema (``opencood.config_schema``: one frozen dataclass per section) is closed: unknown
  keys, wrong types and bad enumerations are one-line ConfigErrors (``opencood.errors``) naming
  the file and the dotted key. The arguments of a model, fusion module or loss
  (``model.args``, ``model.args.fusion.args``, ``loss.args``) have the schema that component
  registered next to its class (``opencood.registry``). :func:`load_config` returns the
  *resolved* config, typed (``config_schema.Config``, every default filled in), which the
  program carries: code reads it by attribute (``cfg.train_params.eval_freq``) or indexes it
  as the plain dict it once was (``cfg["train_params"]["eval_freq"]``: sections read as
  read-only mappings, lists as lists). It is never changed in place: :func:`replaced` and
  :func:`apply_overrides` give a changed copy. Plain data (``config_schema.to_plain``) only
  where it leaves the program: the run folder's ``config.yaml`` (:func:`save_config`, which
  reloads to an equal config), checkpoints, evaluation records and their hashes.

* Files are parsed with ``yaml.safe_load`` semantics only (never ``eval`` of strings).
* ``_base_: other.yaml`` (or a list of files) inherits from files resolved relative to the
  including file; later bases override earlier ones and the including file overrides them all.
  Mappings merge key by key; any other value (lists included) is replaced whole. A key whose
  value is ``{_delete_: true, ...}`` replaces the base mapping instead of merging into it.
* ``--set a.b=value`` overrides are parsed as yaml scalars (``3`` -> int, ``1e-3`` -> float,
  ``true`` -> bool, ``[1, 2]`` -> list); the key must already exist unless ``allow_new=True``
  (with :func:`load_config`: exist in the schema, defaults included).
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from opencood import config_schema as schema
from opencood.errors import ConfigError
from opencood.registry import registered_schemas
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


def apply_overrides(cfg: Mapping, overrides: Iterable[str], source: str = "--set",
                    allow_new: bool = False) -> dict:
    """Return a plain copy of ``cfg`` (plain data or a resolved config) with ``key.path=value``
    overrides applied (:func:`resolve` it for a config again)."""
    cfg = copy.deepcopy(schema.to_plain(cfg))
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
        node[keys[-1]] = _yes_no_word_for_text_key(node.get(keys[-1]), value,
                                                   text.split("=", 1)[1])
    return cfg


def _yes_no_word_for_text_key(current: Any, value: Any, raw_value: str) -> Any:
    """``value``, or the word itself where yaml read a yes/no/on/off word as a boolean and the
    key holds a string (``--set fusion.core_method=no``): such a key never takes a boolean, and
    the shell strips the quotes a user would put around the word."""
    word = raw_value.strip()
    yaml_boolean_words = {form for base in ("yes", "no", "on", "off")
                          for form in (base, base.capitalize(), base.upper())}
    if isinstance(value, bool) and isinstance(current, str) and word in yaml_boolean_words:
        return word
    return value


def get_key(cfg: Mapping, dotted: str, default: Any = KeyError) -> Any:
    """Value at a dotted key; ``default`` when absent (raises KeyError if no default given)."""
    node: Any = cfg
    for key in dotted.split("."):
        if not isinstance(node, Mapping) or key not in node:
            if default is KeyError:
                raise KeyError(dotted)
            return default
        node = node[key]
    return node


def _schema_config(cfg: Mapping, source: str) -> schema.Config:
    try:
        return schema.parse(schema.Config, schema.to_plain(cfg), registered=registered_schemas())
    except schema.SchemaError as error:
        raise ConfigError(f"{source}: {error}") from None


def resolve(cfg: Mapping, source: str) -> schema.Config:
    """The complete, typed config: ``cfg`` (plain data or a resolved config) validated against
    the schema (unknown keys, types and enumerations refused with a ConfigError naming
    ``source`` and the dotted key), every default filled in and the derived geometry
    (:func:`opencood.config_schema.derive`) added.

    Idempotent: resolving a resolved config (or its plain form, a saved ``config.yaml``) gives
    an equal config, so a saved config reloads unchanged."""
    return schema.derive(_schema_config(cfg, source))


def validate_config(cfg: Mapping, source: str) -> None:
    """Raise ConfigError naming ``source`` and the key if ``cfg`` breaks the schema."""
    _schema_config(cfg, source)


def resolve_section(name: str, section: Mapping | None = None, source: str = "config") -> Any:
    """One top-level section, complete and typed: ``resolve_section("optimizer", {"lr": 0.1})``
    gives every optimizer key. For code (and tests) that build one part from a partial mapping."""
    try:
        return schema.convert(schema.section_schema(name), schema.to_plain(section), name,
                              registered_schemas())
    except schema.SchemaError as error:
        raise ConfigError(f"{source}: {error}") from None


def replaced(cfg: Mapping, changes: Mapping[str, Any], source: str = "config") -> schema.Config:
    """A resolved copy of ``cfg`` with the dotted keys of ``changes`` set to their (python)
    values: ``replaced(cfg, {"train_params.epoches": 1})``. The loaded config is read-only;
    this is how code and tests change it. Derived values are kept as they are (as for
    ``--set`` on a resolved config): change the model's own keys along with the geometry."""
    plain = schema.to_plain(cfg)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = plain
        for depth, key in enumerate(parents):
            if not isinstance(node.get(key), dict):
                raise ConfigError(f"{source}: {'.'.join(parents[:depth + 1])!r} is not a "
                                  f"section of the config")
            node = node[key]
        node[last] = schema.to_plain(value)
    return resolve(plain, source)


def load_config(path, overrides: Iterable[str] = ()) -> schema.Config:
    """Load ``path`` with its ``_base_`` chain and return the resolved, typed config
    (:func:`resolve`); its sections read as read-only mappings too (``cfg["model"]["args"]``).

    ``--set`` overrides may name any key of the schema, present in the file or not: they apply
    to the config with its defaults filled in, before the derived values are."""
    path = Path(path)
    cfg = _load_with_bases(path, chain=())
    if not overrides:
        return resolve(cfg, str(path))
    defaults_filled = schema.to_plain(_schema_config(cfg, str(path)))
    source = f"{path} (--set)"
    return resolve(apply_overrides(defaults_filled, overrides, source=source), source)


def save_config(cfg: Mapping, path) -> None:
    """Write the resolved config (no ``_base_`` left) as plain yaml, atomically."""
    text = yaml.dump(schema.to_plain(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=None)
    with atomic_write(path) as stream:
        stream.write(text)
