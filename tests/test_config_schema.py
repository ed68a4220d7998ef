"""The closed config schema (opencood.config_schema): every section refuses unknown keys and bad
enumerations in one line naming the file and the dotted key; a minimal yaml resolves to every
default; a run folder's saved config.yaml reloads to exactly the resolved config."""
from __future__ import annotations

import copy
import math
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Union, get_args, get_origin, get_type_hints

import pytest
import torch
import yaml

from opencood import config_schema as schema
from opencood.config import load_config, resolve, resolve_section
from opencood.config_schema import to_plain
from opencood.errors import ConfigError
from opencood.utils.checkpoint import load_checkpoint
from opv2v_factory import write_simple_split
from process_state import preserved_opencood_logger, preserved_torch_switches

REPO_ROOT = Path(__file__).resolve().parents[1]
SMOKE_YAML = REPO_ROOT / "hypes_yaml" / "synthetic" / "smoke.yaml"
BACKBONE = {"layer_nums": [1, 1], "layer_strides": [2, 2], "num_filters": [16, 32],
            "upsample_strides": [1, 2], "num_upsample_filter": [32, 32]}
MINIMAL = {
    "name": "run",
    "fusion": {"core_method": "intermediate"},
    "train_params": {"batch_size": 4, "epoches": 2},
    "preprocess": {"args": {"voxel_size": [0.8, 0.8, 4.0]}},
    "model": {"core_method": "point_pillar_intermediate", "args": {
        "point_pillar_scatter": {"num_features": 16}, "base_bev_backbone": BACKBONE,
        "fusion": {"core_method": "where2comm"}}},
    "loss": {"core_method": "point_pillar_loss"},
    "optimizer": {"lr": 0.002},
}
OPV2V_RANGE = [-140.8, -40.0, -3.0, 140.8, 40.0, 1.0]
# Every default of every section but the model's: the values the read sites used to default to.
DEFAULTS = {
    "root_dir": None, "validate_dir": None, "test_dir": None, "seed": 0, "comm_range": 70.0,
    "train_params": {"batch_size": 4, "epoches": 2, "max_steps": 0, "max_micro_batch": None,
                     "eval_freq": 1, "save_freq": 1, "keep_checkpoints": 3,
                     "skip_nonfinite_steps": 0, "checkpoint_every_steps": 0,
                     "checkpoint_every_minutes": 0.0, "max_cav": 5, "num_workers": 2,
                     "grad_clip": None, "fix_modules": []},
    "preprocess": {"core_method": "SpVoxelPreprocessor",
                   "args": {"voxel_size": [0.8, 0.8, 4.0], "max_points_per_voxel": 32,
                            "max_voxel_train": None, "max_voxel_test": None},
                   "cav_lidar_range": OPV2V_RANGE},
    "data_augment": [],
    "postprocess": {"core_method": "VoxelPostprocessor", "gt_range": OPV2V_RANGE,
                    "anchor_args": {"l": 3.9, "w": 1.6, "h": 1.56, "z": -1.0, "r": [0.0, 90.0],
                                    "feature_stride": 2, "placement": "cell_centre"},
                    "target_args": {"pos_threshold": 0.6, "neg_threshold": 0.45,
                                    "score_threshold": 0.2}, "classes": None,
                    "order": "hwl", "max_num": 100, "nms_thresh": 0.15, "pre_nms_max": 500,
                    "filters": "ours"},
    "loss": {"core_method": "point_pillar_loss",
             "args": {"cls_weight": 1.0, "reg_weight": 2.0, "dir_weight": 0.2,
                      "conf_weight": 1.0, "focal_alpha": 0.25, "focal_gamma": 2.0,
                      "smooth_l1_beta": 1.0 / 9.0, "code_weights": None, "dir_offset": 0.7854,
                      "uncertainty": None, "depth": None}},
    "optimizer": {"core_method": "Adam", "lr": 0.002, "args": {}},
    "lr_scheduler": {"core_method": "constant", "warmup_epochs": 0.0, "warmup_start_ratio": 0.01,
                     "min_lr_ratio": 0.0, "step_size": [], "gamma": 0.1},
    "init": {"method": "xavier_uniform", "cls_prior": 0.01, "checkpoint": None},
    "ema": {"enabled": False, "decay": 0.999, "tau": 200.0},
    "amp": {"enabled": False, "dtype": "bf16"},
    "distributed": {"backend": None, "timeout_minutes": 30.0, "find_unused_parameters": False},
    "performance": {"tf32": True, "cudnn_benchmark": True, "static_pillars": 0,
                    "sync_free_step": False, "compile": False,
                    "channels_last": False, "cuda_graph": False,
                    "cuda_graph_max_points": 0, "cuda_graph_max_gt": 0},
    "wild_setting": {"seed": 25, "loc_err": False, "xyz_std": 0.0, "yaw_std": 0.0,
                     "latency_frames": 0},
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _refusal(tmp_path: Path, data: dict) -> str:
    """The one-line message load_config refuses ``data`` with; it starts with the file."""
    path = _write(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def _sections(node, prefix=""):
    """Dotted paths of every mapping of a resolved config (list entries as ``key[i]``)."""
    for key, value in node.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield dotted
            yield from _sections(value, dotted)
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for index, entry in enumerate(value):
                yield f"{dotted}[{index}]"
                yield from _sections(entry, f"{dotted}[{index}]")


def _node(cfg: dict, dotted: str) -> dict:
    node = cfg
    for part in dotted.replace("]", "").split("."):
        name, _, index = part.partition("[")
        node = node[name]
        if index:
            node = node[int(index)]
    return node


# -- every default --------------------------------------------------------------------------

def test_minimal_yaml_resolves_to_every_default(tmp_path):
    cfg = load_config(_write(tmp_path / "minimal.yaml", MINIMAL))
    for key, value in DEFAULTS.items():
        assert cfg[key] == value, key
    args = cfg["model"]["args"]
    # Derived from the data sections; the model's own defaults filled in.
    assert args["lidar_range"] == OPV2V_RANGE and args["voxel_size"] == [0.8, 0.8, 4.0]
    assert (args["max_points_per_voxel"], args["anchor_number"], args["num_class"]) == (32, 2, 1)
    assert args["pillar_vfe"] == {"in_channels": 4, "num_filters": [64], "with_distance": False,
                                  "padded_slots": "ignore"}
    assert args["bn_momentum"] is None and args["shrink_header"] is None
    assert args["use_dir"] is True
    assert args["fusion"] == {"core_method": "where2comm", "stage": None, "args": {
        "threshold": 0.01, "max_bytes_per_agent": None, "fusion_mode": "attention",
        "bytes_per_value": 4, "confidence": "own_conv", "smoothing": None}}
    # The resolved config is complete: it resolves to itself and lists every schema key.
    assert resolve(cfg, "resolved") == cfg
    assert list(cfg) == [item.name for item in fields(schema.Config)]


def test_every_shipped_config_is_complete_and_resolves_to_itself():
    for path in sorted(REPO_ROOT.glob("hypes_yaml/*/*.yaml")):
        cfg = load_config(path)
        assert resolve(cfg, str(path)) == cfg, path
        assert yaml.safe_load(yaml.safe_dump(to_plain(cfg))) == cfg, path


def test_resolve_section_completes_one_section():
    assert resolve_section("ema", {"enabled": True}) == dict(DEFAULTS["ema"], enabled=True)
    assert resolve_section("lr_scheduler") == DEFAULTS["lr_scheduler"]
    with pytest.raises(ConfigError, match="unknown key 'emma'"):
        resolve_section("emma")


# -- unknown keys, types, enumerations ------------------------------------------------------

SECTIONS = sorted(_sections(to_plain(load_config(SMOKE_YAML))))


def test_the_unknown_key_cases_cover_every_section():
    expected = {"fusion", "train_params", "preprocess", "preprocess.args", "data_augment[0]",
                "postprocess", "postprocess.anchor_args", "postprocess.target_args", "model",
                "model.args", "model.args.pillar_vfe", "model.args.point_pillar_scatter",
                "model.args.base_bev_backbone", "model.args.fusion", "model.args.fusion.args",
                "loss", "loss.args", "optimizer", "optimizer.args", "lr_scheduler", "init",
                "ema", "amp", "distributed", "performance", "wild_setting"}
    assert expected <= set(SECTIONS)


@pytest.mark.parametrize("section", ["<top level>"] + SECTIONS)
def test_an_unknown_key_in_each_section_is_refused_naming_file_and_key(section, tmp_path):
    cfg = to_plain(load_config(SMOKE_YAML))         # the loaded config is read-only
    if section == "<top level>":
        cfg["bogus_key"], dotted = 1, "bogus_key"
    else:
        _node(cfg, section)["bogus_key"], dotted = 1, f"{section}.bogus_key"
    assert f"'{dotted}'" in _refusal(tmp_path, cfg)


def test_a_misspelt_key_gets_a_suggestion(tmp_path):
    cfg = copy.deepcopy(MINIMAL)
    cfg["train_params"]["epochs"] = 3
    message = _refusal(tmp_path, cfg)
    assert "unknown key 'train_params.epochs'" in message and "did you mean 'epoches'" in message


BAD_ENUMERATIONS = [
    ("postprocess.order", "xyz"), ("amp.dtype", "fp8"), ("lr_scheduler.core_method", "poly"),
    ("optimizer.core_method", "Adamax"), ("fusion.core_method", "mid"),
    ("init.method", "he"), ("distributed.backend", "mpi"),
    ("preprocess.core_method", "BevPreprocessor"), ("data_augment[0].NAME", "flip"),
    ("model.args.fusion.stage", "head"), ("model.args.fusion.args.fusion_mode", "mean"),
    ("data_augment[0].ALONG_AXIS_LIST[0]", "z"),
]


@pytest.mark.parametrize("dotted, value", BAD_ENUMERATIONS, ids=[k for k, _ in BAD_ENUMERATIONS])
def test_a_bad_enumeration_is_refused_naming_file_and_key(dotted, value, tmp_path):
    cfg = to_plain(load_config(REPO_ROOT / "hypes_yaml" / "synthetic" /
                               "point_pillar_where2comm.yaml"))
    parent, _, leaf = dotted.rpartition(".")
    name, _, index = leaf.partition("[")
    if index:
        _node(cfg, parent)[name][int(index[:-1])] = value
    else:
        _node(cfg, parent)[name] = value
    message = _refusal(tmp_path, cfg)
    assert f"'{dotted}'" in message and "expected one of" in message


@pytest.mark.parametrize("dotted, value, expected", [
    ("train_params.epoches", "two", "must be an integer"),
    ("train_params.batch_size", 0, "must be > 0"),
    ("ema.enabled", "yes", "must be a boolean"),
    ("optimizer.lr", "fast", "must be a number"),
    ("preprocess.cav_lidar_range", [0, 0, 0, 1, 1], "must be 6 numbers"),
    ("preprocess.args.voxel_size", [0.4, 0.4], "must be a list of 3"),
    ("postprocess.target_args.neg_threshold", 0.9, "must be <= pos_threshold"),
    ("model.args.base_bev_backbone.num_filters", [16], "one entry per layer_nums"),
    ("optimizer.args.betass", [0.9, 0.99], "not an argument of torch.optim.AdamW"),
    ("wild_setting.xyz_std", -0.1, "must be >= 0"),
    ("model.args.fusion", None, "is required by point_pillar_intermediate"),
])
def test_a_wrong_type_or_value_is_refused_naming_file_and_key(dotted, value, expected,
                                                              tmp_path):
    cfg = to_plain(load_config(SMOKE_YAML))
    parent, _, leaf = dotted.rpartition(".")
    _node(cfg, parent)[leaf] = value
    message = _refusal(tmp_path, cfg)
    assert f"'{dotted}'" in message and expected in message


def test_a_bare_no_gets_the_quoting_hint(tmp_path):
    path = tmp_path / "no.yaml"
    path.write_text(yaml.safe_dump(MINIMAL).replace("core_method: intermediate",
                                                    "core_method: no"))
    with pytest.raises(ConfigError, match="quote it"):
        load_config(path)


def test_aliases_are_rewritten_to_one_spelling(tmp_path):
    cfg = copy.deepcopy(MINIMAL)
    cfg["loss"]["args"] = {"reg": 3}
    backbone = cfg["model"]["args"]["base_bev_backbone"]
    backbone["num_upsample_filters"] = backbone.pop("num_upsample_filter")
    resolved = load_config(_write(tmp_path / "alias.yaml", cfg))
    assert resolved["loss"]["args"]["reg_weight"] == 3.0 and "reg" not in resolved["loss"]["args"]
    assert resolved["model"]["args"]["base_bev_backbone"]["num_upsample_filter"] == [32, 32]
    cfg["loss"]["args"]["reg_weight"] = 2
    assert "are the same setting" in _refusal(tmp_path, cfg)


def test_single_agent_model_refuses_a_fusion_module(tmp_path):
    cfg = copy.deepcopy(MINIMAL)
    cfg["model"]["core_method"] = "point_pillar"
    assert "'model.args.fusion' must be null" in _refusal(tmp_path, cfg)


def test_a_model_without_a_schema_keeps_open_args_with_the_derived_geometry(tmp_path):
    cfg = copy.deepcopy(MINIMAL)
    cfg["model"] = {"core_method": "some_baseline", "args": {"depth": 3}}
    args = load_config(_write(tmp_path / "baseline.yaml", cfg))["model"]["args"]
    assert args == {"lidar_range": OPV2V_RANGE, "voxel_size": [0.8, 0.8, 4.0],
                    "max_points_per_voxel": 32, "anchor_number": 2, "num_class": 1, "depth": 3,
                    "bev_range": OPV2V_RANGE, "bev_cell_size": [0.8, 0.8]}


def test_bev_grid_defaults_to_the_pillar_grid_and_can_be_set_apart(tmp_path):
    cfg = load_config(_write(tmp_path / "minimal.yaml", MINIMAL))
    assert cfg["bev_grid"] == {"range": OPV2V_RANGE, "cell_size": [0.8, 0.8]}
    camera = copy.deepcopy(MINIMAL)
    camera["bev_grid"] = {"range": [-51.2, -51.2, -3, 51.2, 51.2, 1], "cell_size": [0.4, 0.4]}
    resolved = load_config(_write(tmp_path / "camera.yaml", camera))
    assert resolved["model"]["args"]["bev_range"] == [-51.2, -51.2, -3, 51.2, 51.2, 1]
    assert resolved["model"]["args"]["bev_cell_size"] == [0.4, 0.4]
    assert resolved["model"]["args"]["lidar_range"] == OPV2V_RANGE      # pillars unchanged


# -- --set ------------------------------------------------------------------------------------

def test_set_reaches_keys_the_file_leaves_to_the_defaults(tmp_path):
    path = _write(tmp_path / "minimal.yaml", MINIMAL)
    cfg = load_config(path, ["ema.enabled=true", "preprocess.args.max_voxel_train=500",
                             "preprocess.cav_lidar_range=[-8, -8, -3, 8, 8, 1]"])
    assert cfg["ema"]["enabled"] is True
    assert cfg["preprocess"]["args"]["max_voxel_train"] == 500
    # Derived values follow the overridden range.
    assert cfg["model"]["args"]["lidar_range"] == cfg["postprocess"]["gt_range"] == \
        [-8.0, -8.0, -3.0, 8.0, 8.0, 1.0]
    with pytest.raises(ConfigError, match=r"\(--set\): unknown key 'ema.enable'"):
        load_config(path, ["ema.enable=true"])
    with pytest.raises(ConfigError, match=r"\(--set\): key 'postprocess.order' is 'xyz'"):
        load_config(path, ["postprocess.order=xyz"])


# -- the schema's names are the implementations' names ---------------------------------------

def _literal(section: str, key: str) -> set:
    hint = get_type_hints(schema.section_schema(section))[key]
    while get_origin(hint) is Union:
        hint = [h for h in get_args(hint) if h is not type(None)][0]
    return set(get_args(hint))


def test_schema_enumerations_match_the_implementations():
    import opencood.data.datasets  # noqa: F401  (registers the data sets)
    import opencood.losses  # noqa: F401
    import opencood.models  # noqa: F401
    from opencood.data.augment import AUGMENTATIONS
    from opencood.engine.optim import OPTIMIZERS, SCHEDULES
    from opencood.engine.recipe import AMP_DTYPES
    from opencood.registry import DATASETS, FUSIONS, LOSSES, MODELS
    from opencood.utils.init import INIT_METHODS
    assert _literal("optimizer", "core_method") == set(OPTIMIZERS)
    assert _literal("lr_scheduler", "core_method") == set(SCHEDULES)
    assert _literal("amp", "dtype") == set(AMP_DTYPES)
    assert _literal("init", "method") == set(INIT_METHODS)
    from opencood.strategies import get_strategy, strategy_names
    assert {get_strategy(name).dataset_name for name in strategy_names()} <= set(DATASETS.names())
    assert set(schema.AUGMENTATIONS) == set(AUGMENTATIONS)
    # Every model, fusion module and loss declares its arguments (registered with its class).
    for registry in (MODELS, FUSIONS, LOSSES):
        for name in registry.names():
            assert is_dataclass(registry.args_schema(name)), (registry.kind, name)


# -- a run folder's saved config -------------------------------------------------------------

def test_saved_config_of_a_run_reloads_to_the_same_resolved_config(tmp_path, monkeypatch):
    from opencood.engine import trainer
    data = tmp_path / "data"
    write_simple_split(data / "train", num_cavs=2, timestamps=("000000", "000002"))
    overrides = [f"root_dir={data / 'train'}", "validate_dir=null", "train_params.epoches=1",
                 "ema.enabled=true"]
    run_dir = tmp_path / "run"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with preserved_torch_switches(), preserved_opencood_logger():
        trainer.main(["--hypes_yaml", str(SMOKE_YAML), "--model_dir", str(run_dir),
                      *[arg for o in overrides for arg in ("--set", o)]])
    expected = load_config(SMOKE_YAML, overrides)
    saved = run_dir / "config.yaml"
    assert yaml.safe_load(saved.read_text()) == expected     # every default written out
    assert load_config(saved) == expected
    assert load_checkpoint(run_dir / "last.pth")["config"] == expected
    assert math.isclose(expected["loss"]["args"]["smooth_l1_beta"], 1 / 9, rel_tol=0)
