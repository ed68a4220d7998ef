"""Heterogeneous agents, the data side (issue 37 points 1-2): HEAL's ``heter`` section in the
config schema, the modality assignment read as HEAL reads it, each agent loading what its
modality needs, and the batch carrying the agents' modalities (docs/DESIGN.md §4.4)."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from opencood.config import load_config
from opencood.errors import ConfigError

BACKBONE = {"layer_nums": [1], "layer_strides": [2], "num_filters": [16],
            "upsample_strides": [1], "num_upsample_filter": [16]}
# The heter section of HEAL's opv2v/MoreModality/3_modality_end2end_training/
# m1m2m3_pyramid.yaml (its anchors resolved, the preprocess shortened): a 64-beam PointPillar
# m1, a camera m2, a 32-beam SECOND m3; the assignment's m4 agents become m3.
HEAL_HETER = {
    "assignment_path": "opencood/logs/heter_modality_assign/opv2v_4modality.json",
    "ego_modality": "m1&m2&m3",
    "lidar_channels_dict": {"m3": 32},
    "mapping_dict": {"m1": "m1", "m2": "m2", "m3": "m2", "m4": "m3"},
    "modality_setting": {
        "m1": {"sensor_type": "lidar", "core_method": "point_pillar",
               "preprocess": {"core_method": "SpVoxelPreprocessor",
                              "args": {"voxel_size": [0.4, 0.4, 4], "max_points_per_voxel": 32,
                                       "max_voxel_train": 32000, "max_voxel_test": 70000},
                              "cav_lidar_range": [-102.4, -102.4, -3, 102.4, 102.4, 1]}},
        "m2": {"sensor_type": "camera", "core_method": "lift_splat_shoot",
               "grid_conf": {"xbound": [-51.2, 51.2, 0.4], "ybound": [-51.2, 51.2, 0.4],
                             "zbound": [-10, 10, 20.0], "ddiscr": [2, 50, 48], "mode": "LID"},
               "data_aug_conf": {"resize_lim": [0.65, 0.7], "final_dim": [384, 512],
                                 "rot_lim": [-3.6, 3.6], "H": 600, "W": 800,
                                 "rand_flip": False, "bot_pct_lim": [0.0, 0.05],
                                 "cams": ["camera0", "camera1", "camera2", "camera3"],
                                 "Ncams": 4}},
        "m3": {"sensor_type": "lidar", "core_method": "second",
               "preprocess": {"core_method": "SpVoxelPreprocessor",
                              "args": {"voxel_size": [0.1, 0.1, 0.1], "max_points_per_voxel": 5,
                                       "max_voxel_train": 32000, "max_voxel_test": 70000},
                              "cav_lidar_range": [-102.4, -102.4, -3, 102.4, 102.4, 1]}},
    },
}
MINIMAL = {
    "name": "heter",
    "fusion": {"core_method": "intermediate"},
    "input_source": ["lidar", "camera", "depth"],
    "label_type": "lidar",
    "heter": HEAL_HETER,
    "train_params": {"batch_size": 1, "epoches": 1},
    "preprocess": {"args": {"voxel_size": [0.8, 0.8, 4.0]}},
    "model": {"core_method": "point_pillar_intermediate", "args": {
        "point_pillar_scatter": {"num_features": 16}, "base_bev_backbone": BACKBONE,
        "fusion": {"core_method": "fcooper"}}},
    "loss": {"core_method": "point_pillar_loss"},
    "optimizer": {"lr": 0.002},
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _refusal(tmp_path: Path, data: dict) -> str:
    path = _write(tmp_path / "bad.yaml", data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    return message


def _with(path: str, value) -> dict:
    """MINIMAL with the dotted key ``path`` set to ``value`` (None deletes it)."""
    cfg = copy.deepcopy(MINIMAL)
    *parents, last = path.split(".")
    node = cfg
    for part in parents:
        node = node[part]
    if value is None:
        del node[last]
    else:
        node[last] = value
    return cfg


# -- the config section ------------------------------------------------------------------------

def test_heals_heter_section_resolves_complete_and_reloads_unchanged(tmp_path):
    cfg = load_config(_write(tmp_path / "heter.yaml", MINIMAL))
    heter = cfg["heter"]
    assert heter["ego_modality"] == "m1&m2&m3" and heter["mapping_dict"]["m4"] == "m3"
    assert heter["lidar_channels_dict"] == {"m3": 32} and heter["cav_preference"] is None
    m1, m2, m3 = (heter["modality_setting"][name] for name in ("m1", "m2", "m3"))
    # every modality's section complete: the defaults of its sensor's keys filled in
    assert m1["preprocess"]["args"]["voxel_size"] == [0.4, 0.4, 4.0]
    assert m1["data_aug_conf"] is None and m3["preprocess"]["args"]["max_points_per_voxel"] == 5
    assert m2["data_aug_conf"]["final_dim"] == [384, 512] and m2["preprocess"] is None
    assert m2["grid_conf"]["mode"] == "LID"
    assert cfg["input_source"] == ["lidar", "camera", "depth"] and cfg["camera"] is None
    # the resolved config is what a run folder saves and --model_dir reloads
    again = load_config(_write(tmp_path / "resolved.yaml", cfg))
    assert again == cfg
    # without the section: no heter, lidar labels
    plain = _with("heter", None)
    plain["input_source"] = ["lidar"]
    plain = load_config(_write(tmp_path / "plain.yaml", plain))
    assert plain["heter"] is None and plain["label_type"] == "lidar"


@pytest.mark.parametrize("key, value, expected", [
    ("heter.ego_modality", "m1&m4", "key 'heter.ego_modality' names 'm4'; modality_setting "
                                    "has m1, m2, m3"),
    ("heter.mapping_dict", {"m1": "m1", "m4": "m5"}, "key 'heter.mapping_dict.m4' is 'm5'"),
    ("heter.lidar_channels_dict", {"m3": 24}, "key 'heter.lidar_channels_dict.m3' is 24; "
                                              "OPV2V-H has LiDARs of 16, 32, 64 beams"),
    ("heter.lidar_channels_dict", {"m2": 32}, "'heter.lidar_channels_dict.m2' names a camera"),
    ("heter.cav_preference", {"m1": 0.5, "m7": 0.5}, "'heter.cav_preference.m7' is not a "
                                                     "modality"),
    ("heter.cav_preference", {"m1": 0.0}, "'heter.cav_preference' has no positive weight"),
    ("heter.modality_setting.m2.data_aug_conf", None, "'heter.modality_setting.m2."
                                                      "data_aug_conf' is missing"),
    ("heter.modality_setting.m1.sensor_type", "radar", "'heter.modality_setting.m1."
                                                       "sensor_type' is 'radar'"),
    ("heter.modality_setting.m1.data_aug_conf", {}, "'heter.modality_setting.m1.data_aug_conf'"
                                                    " is a camera setting"),
    ("heter.modality_setting", {}, "'heter.modality_setting' must not be empty"),
    ("heter.mapping_dict", None, "missing required key 'heter.mapping_dict'"),
    ("heter.assignment_path", None, "key 'heter.assignment_path' is not set"),
    ("input_source", ["lidar"], "key 'input_source' is ['lidar']; heter modality 'm2' is a "
                                "camera one"),
    ("input_source", ["lidar", "depth"], "has 'depth' (the cameras' depth images) without "
                                         "'camera'"),
    ("camera", {"data_aug_conf": {}}, "key 'camera' is set with heter"),
    ("fusion.dataset", "dairv2x", "key 'heter' reads the OPV2V layout (opv2v, v2xset); "
                                  "fusion.dataset is 'dairv2x'"),
    ("label_type", "camera", "key 'label_type' is 'camera': HEAL's camera labels need"),
])
def test_a_bad_heter_setting_is_one_line_naming_the_key(tmp_path, key, value, expected):
    assert expected in _refusal(tmp_path, _with(key, value))
