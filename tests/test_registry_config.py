"""Registry and config loader: duplicates, unknown names, _base_ inheritance, --set, errors."""
import pytest
import yaml

from opencood.config import apply_overrides, load_config, merge_configs, parse_override, save_config
from opencood.errors import ConfigError
from opencood.registry import Registry, RegistryError


def test_registry_refuses_duplicates_and_lists_known_names():
    reg = Registry("model")

    @reg.register("alpha")
    class Alpha:
        pass

    reg.add("beta", dict)
    assert reg.get("alpha") is Alpha
    assert reg.build("beta", {"a": 1}, "model.args") == {"a": 1}     # no schema: the mapping
    with pytest.raises(RegistryError, match="already registered"):
        reg.add("alpha", list)
    with pytest.raises(RegistryError) as info:
        reg.get("gamma")
    assert "unknown model 'gamma'" in str(info.value)
    assert "alpha, beta" in str(info.value)


def test_registry_discovers_its_package_and_builds_from_the_registered_schema(tmp_path,
                                                                              monkeypatch):
    from opencood.config_schema import SchemaError
    package = tmp_path / "toy_parts"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "wide.py").write_text(
        "from opencood.config_schema import positive, section, spec\n"
        "from toy_registry import PARTS\n"
        "@section\n"
        "class WideArgs:\n"
        "    width: int = spec(8, check=positive)\n"
        "@PARTS.register('wide', args=WideArgs)\n"
        "class Wide:\n"
        "    def __init__(self, args, depth):\n"
        "        self.width, self.depth = args.width, depth\n")
    (tmp_path / "toy_registry.py").write_text(
        "from opencood.registry import Registry\n"
        "PARTS = Registry('part', package='toy_parts')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from toy_registry import PARTS
    assert PARTS.names() == ["wide"]              # no import of toy_parts.wide anywhere
    assert PARTS.args_schema("wide").__name__ == "WideArgs"
    part = PARTS.build("wide", {}, "model.args", depth=2)
    assert (part.width, part.depth) == (8, 2)     # the default comes from the dataclass
    assert PARTS.build("wide", {"width": 3}, "model.args", depth=1).width == 3
    with pytest.raises(SchemaError, match="'model.args.width' must be > 0"):
        PARTS.build("wide", {"width": 0}, "model.args", depth=1)
    with pytest.raises(SchemaError, match="unknown key 'model.args.wdth'.*did you mean 'width'"):
        PARTS.build("wide", {"wdth": 3}, "model.args", depth=1)


MINIMAL = {
    "name": "run",
    "fusion": {"core_method": "intermediate"},
    "train_params": {"batch_size": 4, "epoches": 2},
    "preprocess": {"args": {"voxel_size": [0.8, 0.8, 4.0]}},
    "model": {"core_method": "point_pillar_intermediate", "args": {
        "point_pillar_scatter": {"num_features": 16},
        "base_bev_backbone": {"layer_nums": [1, 1], "layer_strides": [2, 2],
                              "num_filters": [16, 32], "upsample_strides": [1, 2],
                              "num_upsample_filter": [32, 32]},
        "fusion": {"core_method": "attfuse"}}},
    "loss": {"core_method": "point_pillar_loss"},
    "optimizer": {"lr": 0.002},
}


def _write(path, data):
    path.write_text(yaml.safe_dump(data))
    return path


def test_base_inheritance_relative_to_including_file(tmp_path):
    (tmp_path / "bases").mkdir()
    _write(tmp_path / "bases" / "root.yaml", MINIMAL)
    _write(tmp_path / "bases" / "mid.yaml",
           {"_base_": "root.yaml", "train_params": {"epoches": 5, "eval_freq": 3}})
    child = _write(tmp_path / "child.yaml", {
        "_base_": "bases/mid.yaml", "name": "child",
        "model": {"args": {"base_bev_backbone": {"num_filters": [8, 8]}}}})
    cfg = load_config(child)
    assert cfg["name"] == "child"
    params = cfg["train_params"]
    assert (params["batch_size"], params["epoches"], params["eval_freq"]) == (4, 5, 3)
    # Lists are replaced, not merged, and sibling keys from the base survive.
    backbone = cfg["model"]["args"]["base_bev_backbone"]
    assert backbone["num_filters"] == [8, 8] and backbone["layer_nums"] == [1, 1]
    assert cfg["model"]["args"]["fusion"]["core_method"] == "attfuse"
    assert "_base_" not in cfg


def test_base_list_order_and_delete(tmp_path):
    _write(tmp_path / "a.yaml", {**MINIMAL, "wild_setting": {"xyz_std": 1, "yaw_std": 2}})
    _write(tmp_path / "b.yaml", {"wild_setting": {"yaw_std": 3}})
    child = _write(tmp_path / "c.yaml", {"_base_": ["a.yaml", "b.yaml"]})
    wild = load_config(child)["wild_setting"]
    assert (wild["xyz_std"], wild["yaw_std"]) == (1.0, 3.0)
    assert merge_configs({"s": {"x": 1}}, {"s": {"_delete_": True, "z": 0}}) == {"s": {"z": 0}}


def test_base_cycle_and_missing_base_are_named(tmp_path):
    _write(tmp_path / "a.yaml", {"_base_": "b.yaml"})
    _write(tmp_path / "b.yaml", {"_base_": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    _write(tmp_path / "c.yaml", {"_base_": "nope.yaml"})
    with pytest.raises(ConfigError, match=r"c\.yaml.*nope\.yaml"):
        load_config(tmp_path / "c.yaml")


def test_set_overrides_are_typed():
    cfg = apply_overrides(MINIMAL, ["train_params.batch_size=16",
                                    "model.args.point_pillar_scatter.num_features=8",
                                    "name=other", "train_params.epoches=3"])
    assert cfg["train_params"]["batch_size"] == 16
    assert cfg["model"]["args"]["point_pillar_scatter"]["num_features"] == 8
    assert cfg["name"] == "other"
    assert parse_override("a.b=1e-3") == (["a", "b"], 1e-3)
    assert parse_override("a=true") == (["a"], True)
    assert MINIMAL["train_params"]["batch_size"] == 4  # the input is not modified


def test_set_unknown_key_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="train_params.bach_size"):
        apply_overrides(MINIMAL, ["train_params.bach_size=3"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        apply_overrides(MINIMAL, ["batch_size"])
    assert apply_overrides(MINIMAL, ["new.key=1"], allow_new=True)["new"] == {"key": 1}


def test_validation_names_file_and_key(tmp_path):
    bad = dict(MINIMAL, train_params={"batch_size": "eight", "epoches": 2})
    path = _write(tmp_path / "bad.yaml", bad)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and "train_params.batch_size" in str(info.value)
    missing = {k: v for k, v in MINIMAL.items() if k != "model"}
    with pytest.raises(ConfigError, match="model.core_method"):
        load_config(_write(tmp_path / "missing.yaml", missing))
    with pytest.raises(ConfigError, match="fusion.core_method"):
        load_config(_write(tmp_path / "fusion.yaml", dict(MINIMAL, fusion={"core_method": "x"})))
    with pytest.raises(ConfigError, match="preprocess.cav_lidar_range"):
        load_config(_write(tmp_path / "rng.yaml",
                           dict(MINIMAL, preprocess={**MINIMAL["preprocess"],
                                                     "cav_lidar_range": [1, 0, 0, 0, 1, 1]})))


def test_broken_yaml_and_missing_file_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\nmodel: {\n")
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    message = str(info.value)
    assert message.startswith(str(broken)) and "\n" not in message and "line" in message
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "absent.yaml")
    # A python object tag is refused by the safe loader instead of being executed.
    evil = tmp_path / "evil.yaml"
    evil.write_text("name: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(ConfigError):
        load_config(evil)


def test_save_config_round_trip(tmp_path):
    resolved = load_config(_write(tmp_path / "minimal.yaml", MINIMAL))
    path = tmp_path / "saved.yaml"
    save_config(resolved, path)
    assert load_config(path) == resolved
    assert yaml.safe_load(path.read_text()) == resolved     # nothing left to fill in
    assert not list(tmp_path.glob("*.tmp"))
