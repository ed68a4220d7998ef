"""The typed config carried through (issue 35 point 4): ``load_config`` returns the schema's
``Config``; its sections read as the plain dict they replace and refuse writes; plain data only
where the config leaves the program (config.yaml, hashes, records); ``model.args`` parsed once."""
import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from opencood import config_schema as schema
from opencood.config import load_config, replaced, save_config
from opencood.errors import ConfigError
from opencood.eval.records import config_sha256, record_name
from opencood.models.build import build_model
from opencood.models.detectors import PointPillarIntermediateArgs
from opencood.registry import MODELS

SMOKE = Path(__file__).resolve().parents[1] / "hypes_yaml" / "synthetic" / "smoke.yaml"


def _saved_plain(cfg, tmp_path: Path) -> dict:
    """What the run folder keeps: the plain dict ``load_config`` returned before the change."""
    save_config(cfg, tmp_path / "config.yaml")
    return yaml.safe_load((tmp_path / "config.yaml").read_text())


def _assert_reads_as(node, plain, where: str = "cfg") -> None:
    """Every key of ``node`` read by mapping access is the plain value: the same keys in the
    same order, a section (typed, not a dict) where the plain config has a dict, a new list
    where it has a list, and an equal scalar of the same type."""
    if isinstance(plain, dict):
        assert isinstance(node, Mapping) and not isinstance(node, dict), where
        assert list(node) == list(plain) and len(node) == len(plain), where
        for key, value in plain.items():
            _assert_reads_as(node[key], value, f"{where}[{key!r}]")
    elif isinstance(plain, list):
        assert type(node) is list and len(node) == len(plain), where
        for index, value in enumerate(plain):
            _assert_reads_as(node[index], value, f"{where}[{index}]")
    else:
        assert node == plain and type(node) is type(plain), where


def test_the_loaded_config_is_typed_and_reads_as_the_plain_dict(tmp_path):
    cfg = load_config(SMOKE, ["optimizer.args={weight_decay: 0.01, betas: [0.9, 0.99]}"])
    assert type(cfg) is schema.Config
    plain = _saved_plain(cfg, tmp_path)
    _assert_reads_as(cfg, plain)
    assert cfg == plain and plain == cfg                  # Mapping equality, both ways
    # Nested sections are typed; attribute access gives the typed values (tuples).
    assert isinstance(cfg["model"]["args"], PointPillarIntermediateArgs)
    assert cfg["model"]["args"] is cfg.model.args
    assert cfg.preprocess.cav_lidar_range == tuple(plain["preprocess"]["cav_lidar_range"])
    assert cfg["optimizer"]["args"]["betas"] == [0.9, 0.99]
    assert cfg.get("kd") is None and cfg.get("no_such_key", 3) == 3
    assert "model" in cfg and "no_such_key" not in cfg and "lr" in cfg["optimizer"]
    assert dict(cfg["train_params"]) == plain["train_params"]
    assert {**cfg["ema"]} == plain["ema"]


def test_the_loaded_config_refuses_writes_and_changes_through_a_copy(tmp_path):
    cfg = load_config(SMOKE)
    writes = [lambda: cfg.__setitem__("seed", 1),
              lambda: cfg["train_params"].__setitem__("epoches", 1),
              lambda: cfg["optimizer"]["args"].__setitem__("weight_decay", 1.0),
              lambda: cfg["data_augment"][0].__delitem__("NAME")]
    for write in writes:
        with pytest.raises(TypeError, match="read-only"):
            write()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train_params.epoches = 1
    # A list read is a new list: changing it leaves the config as it was.
    cfg["preprocess"]["cav_lidar_range"].append(0.0)
    assert len(cfg["preprocess"]["cav_lidar_range"]) == 6

    before = _saved_plain(cfg, tmp_path)
    changed = replaced(cfg, {"train_params.epoches": 7, "optimizer.args": {"eps": 1e-6}})
    expected = {**before, "train_params": {**before["train_params"], "epoches": 7},
                "optimizer": {**before["optimizer"], "args": {"eps": 1e-6}}}
    assert type(changed) is schema.Config and schema.to_plain(changed) == expected
    assert schema.to_plain(cfg) == before                # the original is untouched
    with pytest.raises(ConfigError, match=r"^config: 'seed' is not a section"):
        replaced(cfg, {"seed.value": 1})
    with pytest.raises(ConfigError, match=r"^config: key 'train_params.epoches' must be an int"):
        replaced(cfg, {"train_params.epoches": "many"})


def test_hashes_and_record_names_are_those_of_the_plain_config(tmp_path):
    cfg = load_config(SMOKE, ["train_params.epoches=3", "ema.enabled=true"])
    plain = _saved_plain(cfg, tmp_path)
    # The formula records used on the plain dict before the config was typed: the same hash.
    before = hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()
    assert config_sha256(cfg) == before == config_sha256(plain)
    checkpoint = {"sha256": "ab" * 32, "weights": "ema"}
    typed = {"wild_setting": cfg["wild_setting"], "box_align": {"args": schema.BoxAlignArgs()}}
    as_plain = {"wild_setting": plain["wild_setting"],
                "box_align": {"args": schema.to_plain(schema.BoxAlignArgs())}}
    assert record_name("test", "intermediate", "", "x", "x", typed, checkpoint) == \
        record_name("test", "intermediate", "", "x", "x", as_plain, checkpoint)


def test_model_args_are_parsed_once_by_the_loader(monkeypatch):
    cfg = load_config(SMOKE)
    parsed = []
    parse = schema.parse
    monkeypatch.setattr(schema, "parse",
                        lambda cls, *args, **kwargs: parsed.append(cls) or parse(cls, *args,
                                                                                  **kwargs))
    name = cfg["model"]["core_method"]
    assert MODELS.parse_args(name, cfg.model.args, "model.args") is cfg.model.args
    build_model(cfg["model"])
    assert parsed == []                                  # the builder parsed nothing again
    # A plain mapping (a checkpoint's config, a test's partial one) is still parsed.
    assert MODELS.parse_args(name, schema.to_plain(cfg.model.args), "model.args") == \
        cfg.model.args
    assert parsed[0] is PointPillarIntermediateArgs
