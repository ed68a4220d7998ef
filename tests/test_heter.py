"""Heterogeneous agents, the data side (issue 37 points 1-2): HEAL's ``heter`` section in the
config schema, the modality assignment read as HEAL reads it, each agent loading what its
modality needs, and the batch carrying the agents' modalities (docs/DESIGN.md §4.4)."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import yaml

from opencood.config import load_config
from opencood.config_schema import to_plain
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
    again = load_config(_write(tmp_path / "resolved.yaml", to_plain(cfg)))
    assert again == cfg
    # without the section: no heter, lidar labels
    plain = _with("heter", None)
    plain["input_source"] = ["lidar"]
    plain = load_config(_write(tmp_path / "plain.yaml", plain))
    assert plain["heter"] is None and plain["label_type"] == "lidar"


@pytest.mark.parametrize("key, value, expected", [
    ("heter.ego_modality", "m1&m4", "key 'heter.ego_modality' names 'm4'; modality_setting "
                                    "has m1, m2, m3"),
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
    ("label_type", "radar", "key 'label_type' is 'radar'"),
])
def test_a_bad_heter_setting_is_one_line_naming_the_key(tmp_path, key, value, expected):
    assert expected in _refusal(tmp_path, _with(key, value))


# -- OPV2V-H's files -------------------------------------------------------------------------

def test_opv2v_h_files_are_where_heal_looks_for_them():
    from opencood.data.heter import depth_files, hetero_path, lidar_file
    cav = Path("dataset/OPV2V/train/2021_08_16_22_26_54/641")
    # HEAL's switch_lidar_channels: OPV2V -> OPV2V_Hetero, .pcd -> _32.pcd / _16.pcd
    assert lidar_file(cav, "000069", 32) == Path(
        "dataset/OPV2V_Hetero/train/2021_08_16_22_26_54/641/000069_32.pcd")
    assert lidar_file(cav, "000069", 16).name == "000069_16.pcd"
    assert lidar_file(cav, "000069", 64) == lidar_file(cav, "000069", None) == \
        cav / "000069.pcd"
    assert depth_files(cav, "000069", 4)[3] == Path(
        "dataset/OPV2V_Hetero/train/2021_08_16_22_26_54/641/000069_depth3.png")
    # a folder whose path does not say OPV2V holds them beside the others
    assert lidar_file("data/synthetic/test/s/1", "000002", 32) == Path(
        "data/synthetic/test/s/1/000002_32.pcd")
    assert hetero_path("a/b.png") == Path("a/b.png")


CAMERA_SIZE = (32, 24)                      # W, H of the tiny heter data's images


@pytest.fixture(scope="module")
def heter_data(tmp_path_factory):
    """Tiny OPV2V-H folders (generate_synthetic.py --heter --cameras --depth, one frame): the
    test split of seed 0 (one scenario, CAVs 7127, 8616, 9883) and the train split."""
    import dataclasses

    from opencood.data.synthetic import generate_dataset, get_preset
    from opencood.data.synthetic.camera import CameraConfig
    root = tmp_path_factory.mktemp("opv2v_h")
    width, height = CAMERA_SIZE
    preset = dataclasses.replace(get_preset("tiny"), frames=1, hetero_lidars=(32, 16),
                                 cameras=CameraConfig(width=width, height=height, depth=True))
    generate_dataset(root, preset=preset, seed=0, progress=False, splits=("train", "test"))
    return root


def _elevations_deg(points):
    return np.degrees(np.arctan2(points[:, 2], np.hypot(points[:, 0], points[:, 1])))


def test_the_generator_writes_opv2v_h_beside_opv2v(heter_data, tmp_path):
    import dataclasses
    import json

    from opencood.data.pcd import read_pcd
    from opencood.data.synthetic import generate_dataset, get_preset
    from opencood.data.synthetic.writer import ASSIGNMENT_FILES, ASSIGNMENT_FOLDER
    tiny = get_preset("tiny")
    (scenario,) = (heter_data / "test").iterdir()
    cav_ids = sorted(p.name for p in scenario.iterdir())
    for cav_id in cav_ids:
        frame = scenario / cav_id
        (timestamp,) = [p.stem for p in frame.glob("*.yaml")]
        for beams in (32, 16):
            # every return on one of the beams' elevations: the rays keep their direction
            points = read_pcd(frame / f"{timestamp}_{beams}.pcd")
            beam_angles = np.linspace(*tiny.lidar.fov_deg, beams)
            gap = np.abs(_elevations_deg(points)[:, None] - beam_angles[None]).min(axis=1)
            assert gap.max() < 1e-3 and len(points) > 1000
            assert len(np.unique(np.round(_elevations_deg(points), 2))) > beams // 2
        for camera in range(4):
            assert (frame / f"{timestamp}_depth{camera}.png").is_file()
    # OPV2V's own LiDAR byte for byte that of a data set without the extras (and cameras)
    plain = tmp_path / "plain"
    generate_dataset(plain, preset=dataclasses.replace(tiny, frames=1), seed=0,
                     progress=False, splits=("test",))
    for path in (plain / "test").rglob("*.*"):
        written = heter_data / path.relative_to(plain)
        if path.suffix == ".pcd":
            assert path.read_bytes() == written.read_bytes(), path
        else:
            with_cameras = yaml.safe_load(written.read_text())
            assert yaml.safe_load(path.read_text()) == {
                key: value for key, value in with_cameras.items() if "camera" not in key}
    assert not (plain / ASSIGNMENT_FOLDER).exists()
    # HEAL's two assignments: every scenario of the written splits, m1..m4
    random, in_order = (json.loads((heter_data / ASSIGNMENT_FOLDER / name).read_text())
                        for name in ASSIGNMENT_FILES)
    scenarios = sorted(p.name for split in ("train", "test") for p in (heter_data / split)
                       .iterdir())
    assert sorted(random) == scenarios and list(in_order) == [scenario.name]
    assert in_order[scenario.name] == dict(zip(cav_ids, ("m1", "m2", "m3")))
    assert set(random[scenario.name]) == set(cav_ids)
    assert len(set(random[scenario.name].values())) == 3     # a permutation of m1..m4


# -- each agent reads what its modality needs ------------------------------------------------

TEST_AGENTS = ("7127", "8616", "9883")      # the tiny test scenario's agents, folder order


def _heter_config(tmp_path, data_root, assignment, split="test", **heter):
    """MINIMAL for the tiny OPV2V-H folders: m1 LiDAR (64: <ts>.pcd), m2 camera (the images'
    size, evaluation crop = the whole image), m3 LiDAR (32 beams); own-frame clouds."""
    import json
    path = tmp_path / "assignment.json"
    path.write_text(json.dumps(assignment))
    cfg = copy.deepcopy(MINIMAL)
    crop = [-51.2, -51.2, -3, 51.2, 51.2, 1]
    width, height = CAMERA_SIZE
    setting = cfg["heter"]["modality_setting"]
    setting["m2"]["data_aug_conf"].update(H=height, W=width, final_dim=[height, width],
                                          bot_pct_lim=[0.0, 0.0])
    for name, cell in (("m1", 0.4), ("m3", 0.8)):       # (m3 keeps 5 points per pillar)
        setting[name]["preprocess"]["cav_lidar_range"] = crop
        setting[name]["preprocess"]["args"]["voxel_size"] = [cell, cell, 4]
    cfg["heter"].update({"assignment_path": str(path), "ego_modality": "m1",
                         "mapping_dict": {"m1": "m1", "m2": "m2", "m3": "m3", "m4": "m3"},
                         **heter})
    cfg["preprocess"]["cav_lidar_range"] = crop
    cfg["fusion"]["args"] = {"proj_first": False}
    cfg["root_dir"] = cfg["test_dir"] = str(data_root / split)
    return load_config(_write(tmp_path / "heter.yaml", cfg))


def _dataset(cfg, split="test", train=False):
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    return build_dataset(cfg, split, train, choose_strategy(cfg))


def _scenario(root, split="test"):
    (scenario,) = [p for p in (root / split).iterdir()] if split == "test" else \
        [sorted((root / split).iterdir())[0]]
    return scenario


def _own_cloud(path, crop):
    """What an own-frame agent's input is: the file's points, own body removed, cropped."""
    from opencood.data.opv2v import remove_own_body_points
    from opencood.data.pcd import read_pcd
    points = remove_own_body_points(read_pcd(path))
    inside = np.all((points[:, :3] > crop[:3]) & (points[:, :3] < crop[3:]), axis=1)
    return points[inside]


def test_each_agent_reads_what_its_modality_needs(heter_data, tmp_path, private_point_cache):
    from PIL import Image

    from opencood import batch_keys
    from opencood.data.collate import collate_samples
    from opencood.data.pipeline import BatchPreparer
    scenario = _scenario(heter_data)
    # the first folder's m4 (-> m3) is not the ego modality m1: the first agent of the json
    # mapping to m1 (9883) becomes the ego (HEAL's reorder_cav_list), the others keep order
    assignment = {scenario.name: {"7127": "m4", "8616": "m2", "9883": "m1"}}
    cfg = _heter_config(tmp_path, heter_data, assignment)
    sample = _dataset(cfg)[0]
    batch_keys.check_keys("sample", sample, "heter dataset")
    assert sample["agent_ids"] == ["9883", "7127", "8616"]
    assert sample["agent_modality"] == ["m1", "m3", "m2"]
    (timestamp,) = [p.stem for p in (scenario / "9883").glob("*.yaml")]
    crop = np.asarray(cfg["preprocess"]["cav_lidar_range"], dtype=np.float32)
    ego, m3_agent, camera_agent = sample["agent_points"]
    # m1: OPV2V's <ts>.pcd; m3: its 32-beam LiDAR; the camera agent reads no cloud
    assert np.array_equal(ego, _own_cloud(scenario / "9883" / f"{timestamp}.pcd", crop))
    assert np.array_equal(m3_agent, _own_cloud(scenario / "7127" / f"{timestamp}_32.pcd",
                                               crop))
    assert camera_agent.shape == (0, 4)
    assert (sample["gt_ego_points"] >= 0).all() and sample["gt_ego_points"].sum() > 0
    # only the camera agent's images; its depth maps are the depth images' metres (the
    # evaluation's augmentation is the identity here: the whole image at its own size)
    (group,) = sample["modality_cameras"].values()
    assert list(sample["modality_cameras"]) == ["m2"]
    assert group["images"].shape == (1, 4, 3, CAMERA_SIZE[1], CAMERA_SIZE[0])
    for camera in range(4):
        depth = np.asarray(Image.open(scenario / "8616" / f"{timestamp}_depth{camera}.png"))
        assert np.array_equal(group["depth_maps"][0, camera], depth.astype(np.float32))
    assert group["depth_maps"].max() > 5
    # a batch of two: modalities over the batch's agents, each LiDAR modality pillarised on
    # its own grid with the agents ranked within it
    batch = collate_samples([sample, sample])
    batch_keys.check_keys("batch", batch, "heter collate")
    assert batch["agent_modality"] == ["m1", "m3", "m2"] * 2
    assert batch["modality_cameras"]["m2"]["images"].shape[0] == 2
    inputs = BatchPreparer.from_config(cfg, "cpu", training=False).model_inputs(batch)
    batch_keys.check_keys("model input", inputs, "heter preparer")
    assert "voxel_features" not in inputs and sorted(inputs["modality_pillars"]) == ["m1", "m3"]
    for name, cloud, cell, cap in (("m1", ego, 0.4, 32), ("m3", m3_agent, 0.8, 5)):
        pillars = inputs["modality_pillars"][name]
        ranks = pillars["voxel_coords"][:, 0]
        assert ranks.unique().tolist() == [0, 1]
        # the agent's points in the cells of its modality's grid, at most ``cap`` per pillar
        _, per_cell = np.unique(np.floor((cloud[:, :2] - crop[:2]) / cell), axis=0,
                                return_counts=True)
        assert (ranks == 0).sum().item() == len(per_cell)
        assert pillars["voxel_num_points"][ranks == 0].sum().item() == \
            np.minimum(per_cell, cap).sum()


def test_a_missing_or_inconsistent_assignment_is_one_line(heter_data, tmp_path,
                                                          private_point_cache):
    from opencood.data.heter import AssignmentError
    scenario = _scenario(heter_data).name
    good = {"7127": "m4", "8616": "m2", "9883": "m1"}
    cases = [
        ({"other": good}, f"scenario {scenario} is not assigned"),
        ({scenario: {"7127": "m4", "9883": "m1"}}, f"scenario {scenario}, agent 8616: no "
                                                    f"modality assigned"),
        ({scenario: {**good, "1234": "m1"}}, f"scenario {scenario}, agent 1234: assigned 'm1' "
                                             f"but the scenario has no such agent folder"),
        ({scenario: {**good, "8616": "m7"}}, f"scenario {scenario}, agent 8616: assigned 'm7',"
                                             f" which heter.mapping_dict does not map"),
    ]
    for assignment, expected in cases:
        with pytest.raises(AssignmentError) as info:
            _dataset(_heter_config(tmp_path, heter_data, assignment))
        assert expected in str(info.value) and "\n" not in str(info.value)
        assert str(info.value).startswith(str(tmp_path / "assignment.json"))
    # a format whose reader has no assignment
    cfg = _heter_config(tmp_path, heter_data, {scenario: good})
    with pytest.raises(ConfigError, match="heter: the dairv2x reader has no modality "
                                          "assignment"):
        _dataset({**cfg, "fusion": {**cfg["fusion"], "dataset": "dairv2x"}})
    # an ego whose modality the model does not have and no agent of ego_modality: the first
    # agent it has a modality for is the ego; nobody: the scenario takes no part
    cfg = _heter_config(tmp_path, heter_data, {scenario: good}, ego_modality="m1",
                        mapping_dict={"m1": "m9", "m2": "m2", "m4": "m9"})
    assert _dataset(cfg)[0]["agent_ids"] == ["8616"]
    cfg = _heter_config(tmp_path, heter_data, {scenario: good},
                        mapping_dict={"m1": "m9", "m2": "m9", "m4": "m9"})
    assert len(_dataset(cfg)) == 0
    # a mapped modality outside modality_setting leaves its agents out (HEAL's unmatched)
    cfg = _heter_config(tmp_path, heter_data, {scenario: good},
                        mapping_dict={"m1": "m1", "m2": "m9", "m4": "m3"})
    assert _dataset(cfg)[0]["agent_ids"] == ["9883", "7127"]


def test_training_draws_the_modalities_per_sample(heter_data, tmp_path, private_point_cache):
    import json

    from opencood.data.synthetic.writer import ASSIGNMENT_FILES, ASSIGNMENT_FOLDER
    assignment = json.loads((heter_data / ASSIGNMENT_FOLDER / ASSIGNMENT_FILES[0]).read_text())
    cfg = _heter_config(tmp_path, heter_data, assignment, split="train",
                        ego_modality="m1&m3", cav_preference={"m2": 1.0, "m3": 0.0})
    dataset = _dataset(cfg, "train", train=True)
    draws = []
    for epoch in range(8):
        dataset.set_epoch(epoch)
        sample = dataset[0]
        draws.append(tuple(sample["agent_modality"]))
        # the folder's ego stays the ego; the others are all camera agents (cav_preference)
        assert sample["agent_ids"][0] == dataset.split.info(0).cav_ids[0]
        assert draws[-1][0] in ("m1", "m3") and set(draws[-1][1:]) == {"m2"}
        assert (len(sample["agent_points"][0]) > 0) and all(
            len(points) == 0 for points in sample["agent_points"][1:])
    assert {draw[0] for draw in draws} == {"m1", "m3"}       # the ego's draw varies by epoch
    again = _dataset(cfg, "train", train=True)
    again.set_epoch(5)
    assert tuple(again[0]["agent_modality"]) == draws[5]     # a function of (seed, epoch, index)


def test_depth_maps_on_the_camera_path_without_heter(heter_data, tmp_path, private_point_cache):
    """input_source depth reads OPV2V-H's depth images for a camera config too (HEAL's camera
    yamls' [camera, depth]): the depth maps lift-splat's depth supervision reads."""
    from PIL import Image
    width, height = CAMERA_SIZE
    cfg = _with("heter", None)
    cfg["input_source"] = ["camera", "depth"]
    cfg["camera"] = {"data_aug_conf": {"H": height, "W": width, "final_dim": [height, width],
                                       "bot_pct_lim": [0.0, 0.0]}}
    cfg["fusion"]["args"] = {"proj_first": False}
    cfg["test_dir"] = str(heter_data / "test")
    sample = _dataset(load_config(_write(tmp_path / "camera.yaml", cfg)))[0]
    scenario = _scenario(heter_data)
    assert sample["depth_maps"].shape == (3, 4, height, width)
    for row, cav_id in enumerate(sample["agent_ids"]):
        for camera in range(4):
            (path,) = (scenario / cav_id).glob(f"*_depth{camera}.png")
            assert np.array_equal(sample["depth_maps"][row, camera],
                                  np.asarray(Image.open(path)).astype(np.float32))


def test_late_and_no_fusion_carry_the_modalities(heter_data, tmp_path, private_point_cache):
    scenario = _scenario(heter_data).name
    cfg = _heter_config(tmp_path, heter_data, {scenario: {"7127": "m4", "8616": "m2",
                                                          "9883": "m1"}})
    for method, agents, modalities in (("late", ["9883", "7127", "8616"], ["m1", "m3", "m2"]),
                                       ("no", ["9883"], ["m1"])):
        sample = _dataset({**cfg, "fusion": {**cfg["fusion"], "core_method": method,
                                             "args": {"proj_first": True}}})[0]
        assert sample["agent_ids"] == agents and sample["agent_modality"] == modalities
        assert list(sample["modality_cameras"]) == (["m2"] if "m2" in modalities else [])
    # late training: one example per agent, each with the modality its sample drew
    late = {**cfg, "fusion": {**cfg["fusion"], "core_method": "late",
                              "args": {"proj_first": True}}}
    dataset = _dataset(late, train=True)
    drawn = dataset._modalities(0, dataset.split.info(0), dataset._agents(0)[1])
    for position, modality in enumerate(drawn):
        example = dataset[position]
        assert example["agent_modality"] == [modality]
        assert (len(example["agent_points"][0]) > 0) == (modality != "m2")


def test_opv2v_h_is_written_in_the_opv2v_format_only(tmp_path):
    import dataclasses

    from opencood.data.synthetic import generate_dataset, get_preset
    preset = dataclasses.replace(get_preset("tiny"), hetero_lidars=(32, 16))
    with pytest.raises(ValueError, match="--heter.*opv2v format.*not 'dairv2x'"):
        generate_dataset(tmp_path / "dair", preset=preset, data_format="dairv2x")


def test_each_agent_gets_its_own_labels_for_the_pyramid_loss(heter_data, tmp_path,
                                                              private_point_cache):
    """With HEAL's pyramid loss the own-frame samples carry each agent's own GT in its own frame
    (HEAL's label_dict_single): moved by its transform to the ego, every box centre of an agent
    is one of the sample's GT (same object, same place); the preparer turns them into one label
    row per agent."""
    from opencood import batch_keys
    from opencood.config import replaced
    from opencood.data.collate import collate_samples
    from opencood.data.pipeline import BatchPreparer
    scenario = _scenario(heter_data)
    assignment = {scenario.name: {"7127": "m4", "8616": "m2", "9883": "m1"}}
    cfg = _heter_config(tmp_path, heter_data, assignment)
    cfg = replaced(cfg, {"loss": {"core_method": "point_pillar_pyramid_loss"}})
    sample = _dataset(cfg)[0]
    batch_keys.check_keys("sample", sample, "heter dataset")
    own = sample["agent_gt_boxes"]
    assert len(own) == 3 and all(len(boxes) for boxes in own)
    low, high = np.split(np.asarray(cfg["postprocess"]["gt_range"]), 2)
    matched = 0
    for boxes, to_ego in zip(own, sample["transforms_to_ego"]):
        centres = boxes[:, :3] @ to_ego[:3, :3].T + to_ego[:3, 3]
        # an agent also lists objects beyond the ego's GT range: those 2 m inside it
        inside = np.all((centres[:, :2] > low[:2] + 2) & (centres[:, :2] < high[:2] - 2), 1)
        gaps = np.linalg.norm(centres[inside, None] - sample["gt_boxes"][None, :, :3], axis=2)
        assert gaps.min(axis=1).max() < 1e-3
        matched += int(inside.sum())
    assert matched >= 3
    assert not np.array_equal(own[1], own[0])          # another frame, other boxes
    batch = collate_samples([sample, sample])
    batch_keys.check_keys("batch", batch, "heter collate")
    assert batch["agent_gt_boxes"].shape[0] == 6
    assert batch["agent_gt_mask"].sum(1).tolist() == [len(b) for b in own] * 2
    _, targets = BatchPreparer.from_config(cfg, "cpu", training=False)(batch)
    assert targets["agent_labels"].shape == (6, targets["labels"].shape[1])
    assert ((targets["agent_labels"] == 1).sum(1) > 0).all()


def test_training_labels_of_camera_agents_are_what_their_maps_show(heter_data, tmp_path,
                                                                   private_point_cache):
    """HEAL's heter training labels: a camera agent contributes only the vehicles whose box
    centre's pixel of its bev_visibility map is non-zero (HEAL: ``int(x / 0.39)`` from pixel
    127, heading up), a LiDAR agent all of its ``vehicles``."""
    import cv2
    scenario = _scenario(heter_data).name
    cfg = _heter_config(tmp_path, heter_data, {scenario: dict.fromkeys(TEST_AGENTS, "m1")},
                        ego_modality="m1", cav_preference={"m2": 1.0})
    training = _dataset(cfg, train=True)
    sample = training[0]
    assert sample["agent_modality"] == ["m1", "m2", "m2"]
    info = training.split.info(0)
    expected = {int(actor) for actor in training.split.vehicles(info.scenario, info.ego_id,
                                                                 info.timestamp)}
    dropped = 0
    for cav_id in info.cav_ids[1:]:
        (path,) = (heter_data / "test" / scenario / cav_id).glob("*_bev_visibility.png")
        seen = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2GRAY)
        ids, boxes = training.split.frame_boxes(info.scenario, cav_id, info.timestamp,
                                                [-1e5, -1e5, -1e5, 1e5, 1e5, 1e5])
        for actor, box in zip(ids.tolist(), boxes):
            row, col = 127 - int(box[0] / 0.39), 127 + int(box[1] / 0.39)
            if 0 <= row < 256 and 0 <= col < 256 and seen[row, col] > 0:
                expected.add(actor)
            else:
                dropped += actor not in expected
    union_ids, _ = training.split.sample_gt(0, gt_range=cfg["postprocess"]["gt_range"])
    assert sample["gt_ids"].tolist() == sorted(expected & set(union_ids.tolist()))
    assert len(sample["gt_ids"]) < len(union_ids) and dropped > 0
    # the pyramid loss's own labels of a camera agent (HEAL's single labels): the same rule
    from opencood.config import resolve_section
    pyramid = {**cfg, "loss": resolve_section("loss", {"core_method":
                                                       "point_pillar_pyramid_loss"})}
    own = _dataset(pyramid, train=True)[0]["agent_gt_boxes"]
    for cav_id, boxes in zip(info.cav_ids[1:], own[1:]):
        (path,) = (heter_data / "test" / scenario / cav_id).glob("*_bev_visibility.png")
        seen = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2GRAY)
        _, all_own = training.split.frame_boxes(info.scenario, cav_id, info.timestamp,
                                                cfg["postprocess"]["gt_range"])
        rows = [127 - int(box[0] / 0.39) for box in all_own]
        cols = [127 + int(box[1] / 0.39) for box in all_own]
        shown = [0 <= r < 256 and 0 <= c < 256 and seen[r, c] > 0 for r, c in zip(rows, cols)]
        assert len(boxes) == sum(shown) < len(all_own)
    # evaluation keeps every agent's LiDAR labels (HEAL's inference: visualize=True)
    assert _dataset(cfg)[0]["gt_ids"].tolist() == union_ids.tolist()


CAMERA_LABELS = Path(__file__).parent / "fixtures" / "heter_reader" / "camera_labels.json"


def test_camera_labels_keep_the_objects_heals_datasets_keep(heter_data, tmp_path,
                                                            private_point_cache):
    """HEAL's ``label_type: camera`` and its heter camera agents' labels, against HEAL's own
    data sets on these folders (tools/reference/make_camera_label_fixture.py): the object ids
    of each sample's GT, train and test split (2 and 3 agents)."""
    import json

    from opencood.data.datasets import LateFusionDataset
    from opencood.data.heter import in_order_assignment
    heal = json.loads(CAMERA_LABELS.read_text())
    width, height = CAMERA_SIZE
    assert heal["meta"]["generation"]["camera_size"] == [width, height]
    label_range = heal["meta"]["range"]
    for split in ("train", "test"):
        assignment = in_order_assignment(heter_data / split, ["m1", "m2"])
        heter = _heter_config(tmp_path, heter_data, assignment, split, cav_preference={"m2": 1})
        plain = to_plain(heter)
        plain.update(heter=None, input_source=["lidar"], label_type="camera")
        plain["postprocess"]["gt_range"] = label_range
        camera = load_config(_write(tmp_path / "camera.yaml", plain))
        lidar_ids = _dataset({**camera, "label_type": "lidar"}, split)[0]["gt_ids"].tolist()
        # every agent's map (HEAL's plain intermediate data set), in evaluation and training
        (expected,) = heal["intermediate_camera"][split]
        for train in (False, True):
            sample = _dataset(camera, split, train=train)[0]
            assert sample["gt_ids"].tolist() == expected["ids"], (split, train)
        assert set(expected["ids"]) <= set(lidar_ids)
        if split == "train":                # its maps drop objects its LiDARs list
            assert len(expected["ids"]) < len(lidar_ids)
        else:                               # a missing map: one line naming the file
            import shutil

            from opencood.data.cameras import CameraFileError
            copy_root = tmp_path / "no_map"
            shutil.copytree(heter_data / split, copy_root / split)
            (missing,) = (copy_root / split).glob("*/8616/*_bev_visibility.png")
            missing.unlink()
            with pytest.raises(CameraFileError) as info:
                _dataset({**camera, "test_dir": str(copy_root / split)}, split)[0]
            assert str(info.value).startswith(f"{missing}: missing") and \
                "\n" not in str(info.value)
        # heter training: the m1 ego's vehicles, the m2 agents' map-visible ones
        (expected,) = heal["heter_by_sensor"][split]
        sample = _dataset(heter, split, train=True)[0]
        assert sample["agent_modality"] == expected["modalities"]
        assert sample["gt_ids"].tolist() == expected["ids"], split
        # HEAL's intermediateheter ignores label_type: its inference labels are the LiDARs'
        heter_camera = {**heter, "label_type": "camera"}
        assert _dataset(heter_camera, split)[0]["gt_ids"].tolist() == lidar_ids
        # late fusion: each agent's own labels (HEAL's lateheter; here without heter)
        (expected,) = heal["late_camera"][split]
        late = LateFusionDataset.from_config(camera, heter_data / split, train=True)
        own = {late.pairs[k][1]: late[k]["gt_ids"].tolist() for k in range(len(late))}
        agents = expected["agents"]
        assert {agents[k]: ids for k, ids in own.items()} == {
            (expected["ego"] if name == "ego" else name): ids
            for name, ids in expected["own_ids"].items()}


def test_the_ego_is_a_vehicle_the_model_has_a_modality_for(tmp_path):
    """HEAL's reorder with roadside units (V2XSet's negative ids, never our ego) and an ego the
    model has no modality for."""
    import json

    from opencood.data.heter import ModalityPlan
    from opencood.data.opv2v import is_infrastructure
    path = tmp_path / "assignment.json"
    path.write_text(json.dumps({"s": {"-1": "m1", "10": "m4", "20": "m2"},
                                "t": {"-1": "m1", "10": "m4"},
                                "u": {"-1": "m2", "10": "m2", "20": "m1"}}))
    heter = {"assignment_path": str(path), "ego_modality": "m1", "lidar_channels_dict": None,
             "mapping_dict": {"m1": "m1", "m2": "m2", "m4": "m9"}, "cav_preference": None,
             "modality_setting": {"m1": {"sensor_type": "lidar"},
                                  "m2": {"sensor_type": "camera"}}}
    plan = ModalityPlan(heter, train=False, is_infrastructure=is_infrastructure)
    # the RSU is the only m1 agent: not made the ego; 10 (m4 -> m9) leaves; 20 is the ego
    assert plan.agent_order("s", ["10", "20", "-1"]) == ["20", "-1"]
    assert plan.agent_order("t", ["10", "-1"]) == []           # no vehicle the model can run
    assert plan.agent_order("u", ["10", "20", "-1"]) == ["20", "10", "-1"]     # HEAL's reorder
    assert plan.modalities("u", ["20", "10", "-1"], None) == ["m1", "m2", "m2"]
    assert ModalityPlan(heter, train=True).agent_order("s", ["10", "20", "-1"]) == [
        "10", "20", "-1"]                                      # training keeps the folder's ego


def test_in_order_steps_keep_the_first_agents_and_every_agents_gt(heter_data, tmp_path,
                                                                  private_point_cache):
    """HEAL's inference_heter_in_order on the tiny scenario: the in-order assignment is the
    generator's (HEAL's) json, and step k fuses the first k agents (use_cav) while the GT stays
    the union of every agent's labels."""
    import json

    from opencood.data.heter import in_order_assignment
    from opencood.data.synthetic.writer import ASSIGNMENT_FOLDER
    in_order = in_order_assignment(heter_data / "test", ("m1", "m2", "m3", "m4"))
    written = heter_data / ASSIGNMENT_FOLDER / "opv2v_4modality_in_order.json"
    assert in_order == json.loads(written.read_text())
    scenario = _scenario(heter_data).name
    assert in_order[scenario] == dict(zip(TEST_AGENTS, ("m1", "m2", "m3")))
    cfg = _heter_config(tmp_path, heter_data, in_order,
                        mapping_dict={"m1": "m1", "m2": "m2", "m3": "m3"})
    from opencood.data.datasets import build_dataset
    from opencood.strategies import choose_strategy
    dataset = build_dataset(cfg, "test", False, choose_strategy(cfg), use_cav=3)
    everyone = dataset[0]
    assert everyone["agent_ids"] == list(TEST_AGENTS)
    for use_cav in (1, 2):
        dataset.use_cav = use_cav           # (one data set: the index is built once)
        sample = dataset[0]
        assert sample["agent_ids"] == list(TEST_AGENTS[:use_cav])
        assert sample["agent_modality"] == ["m1", "m2", "m3"][:use_cav]
        assert len(sample["agent_points"]) == use_cav
        assert np.array_equal(sample["gt_boxes"], everyone["gt_boxes"])
        assert np.array_equal(sample["gt_ids"], everyone["gt_ids"])
    with pytest.raises(ValueError, match="use_cav 0"):
        build_dataset(cfg, "test", False, choose_strategy(cfg), use_cav=0)
