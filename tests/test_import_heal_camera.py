"""``tools/import_checkpoint.py --from heal`` of HEAL's camera runs (issue 36, point 6).

The run folders are HEAL's ``heter_model_baseline`` with one ``lift_splat_shoot`` camera
modality (its CameraOnly yamls, shrunk), as its ``train.py`` writes them: ``config.yaml``,
state-dict keys and the heads of HEAL's own forward on generated weights
(``tests/fixtures/peer_runs/heal_camera_*``, made by
``tools/reference/make_heal_camera_fixtures.py`` from HEAL's sources; CI never runs it).
"""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from opencood.interop.importer import translate_run
from opencood.interop.opencood_ckpt import InteropError
from parity_weights import materialize
from test_import_heal_v2v4real import FIXTURES, peer_state, write_peer_run
from tool_modules import import_and_load, load_tool

CAMERA_RUNS = ("heal_camera_fcooper", "heal_camera_attfuse", "heal_camera_attfuse_resnet")
HEADS = ("cls_preds", "reg_preds", "dir_preds")


def fixture_of(name: str) -> dict:
    return torch.load(FIXTURES / f"{name}.parity.pt", weights_only=True)


def heal_state(name: str) -> "OrderedDict[str, torch.Tensor]":
    """HEAL's state dict with the fixture's generated weights (every key of its model)."""
    return OrderedDict(materialize(fixture_of(name)["state_dict"]))


def camera_batch(fixture: dict) -> dict:
    """The fixture's one sample of two camera agents in our batch keys (HEAL's intrins ->
    intrinsics; its extrinsics are camera -> agent, as ours)."""
    inputs = materialize(fixture["image_recipes"])
    geometry = fixture["geometry"]
    return {"images": inputs["images"], "intrinsics": geometry["intrins"],
            "extrinsics": geometry["extrinsics"], "post_rots": geometry["post_rots"],
            "post_trans": geometry["post_trans"], "record_len": torch.tensor([2]),
            "transforms_to_ego": torch.eye(4).repeat(2, 1, 1), "points_in_agent_frame": True}


def import_camera_run(name: str, tmp_path, state=None):
    peer = write_peer_run(tmp_path / "peer", name, state=heal_state(name) if state is None
                          else state)
    return import_and_load(["--from", "heal", peer], tmp_path / "ours")


@pytest.mark.parametrize("name", CAMERA_RUNS)
def test_imported_camera_run_gives_heal_s_heads(name, tmp_path):
    """HEAL's weights through the tool, loaded strictly, give HEAL's cls / reg / dir maps on its
    own inputs within 1e-5 relative (EfficientNet-b0 or ResNet-101 trunk, LID depth bins, two
    agents)."""
    cfg, model, checkpoint = import_camera_run(name, tmp_path)
    encoder = cfg["model"]["args"]["encoder"]
    assert encoder["core_method"] == "lss"
    assert encoder["args"]["camera_encoder"] == ("Resnet101" if name.endswith("resnet")
                                                 else "EfficientNet")
    assert encoder["args"]["depth_supervision"] is False
    fixture = fixture_of(name)
    with torch.no_grad():
        outputs = model(camera_batch(fixture))
    for head in HEADS:
        expected = fixture["outputs"][head]
        assert outputs[head].shape == expected.shape
        error = float((outputs[head] - expected).abs().max() / expected.abs().max())
        assert error <= 1e-5, (head, error)


def test_camera_keys_land_where_heal_has_them(tmp_path):
    """Distinct values per tensor: the trunk's stem, a stage-1 block (no expansion conv: its
    layers one index lower), the depth head and the backbone land on our keys."""
    name = "heal_camera_fcooper"
    source = peer_state(name)
    _, _, checkpoint = import_camera_run(name, tmp_path, state=source)
    ours = checkpoint["model"]
    trunk = "encoder_m2.camencode.trunk."
    pairs = [(f"{trunk}_conv_stem.weight", "encoder.camera_encoder.trunk.features.0.0.weight"),
             (f"{trunk}_blocks.0._depthwise_conv.weight",
              "encoder.camera_encoder.trunk.features.1.0.block.0.0.weight"),
             (f"{trunk}_blocks.1._expand_conv.weight",
              "encoder.camera_encoder.trunk.features.2.0.block.0.0.weight"),
             ("encoder_m2.camencode.depth_head.bias", "encoder.camera_encoder.depth_head.bias"),
             ("encoder_m2.camencode.up2.conv.4.running_var",
              "encoder.camera_encoder.up2.conv.4.running_var"),
             ("backbone_m2.blocks.0.1.weight", "backbone.blocks.0.0.weight"),
             ("dir_head.weight", "head.dir_conv.weight")]
    for theirs, mine in pairs:
        assert torch.equal(ours[mine], source[theirs]), (theirs, mine)


def test_a_tensor_without_a_place_is_refused(tmp_path):
    """Strict: the classifier keys HEAL's forward never runs are dropped by name, nothing
    else; a stray tensor under the encoder fails the import."""
    state = heal_state("heal_camera_attfuse")
    state["encoder_m2.camencode.extra.weight"] = torch.zeros(1)
    peer = write_peer_run(tmp_path / "peer", "heal_camera_attfuse", state=state)
    with pytest.raises(InteropError, match="encoder_m2.camencode.extra.weight"):
        translate_run(peer, None, "heal")


def test_a_camera_grid_other_than_the_bev_grid_is_refused(tmp_path):
    """HEAL centre-crops a camera map whose grid_conf is wider than cav_lidar_range; ours
    writes the BEV grid itself, so such a run is refused naming the key."""
    import yaml

    from opencood.data.numpy_yaml import NumpyYamlDumper, NumpyYamlLoader
    peer = write_peer_run(tmp_path / "peer", "heal_camera_fcooper")
    config = peer / "config.yaml"
    data = yaml.load(config.read_text(), Loader=NumpyYamlLoader)
    data["model"]["args"]["m2"]["encoder_args"]["grid_conf"]["xbound"] = [-32.0, 32.0, 1.0]
    config.write_text(yaml.dump(data, Dumper=NumpyYamlDumper))
    with pytest.raises(InteropError, match="grid_conf.xbound"):
        translate_run(peer, None, "heal")


def test_camera_import_notes_say_depth_supervision_is_off(tmp_path):
    _, _, provenance = translate_run(write_peer_run(tmp_path / "p", "heal_camera_attfuse"),
                                     None, "heal")
    assert provenance["model"] == "heter_model_baseline/att"
    assert any("depth_supervision: false" in note for note in provenance["notes"])


@pytest.mark.parametrize("name", CAMERA_RUNS)
def test_camera_key_rules_run_both_ways(name, tmp_path):
    """Our imported state dict back through the same rules gives HEAL's state dict (every key
    but the classifier HEAL never runs), tensor for tensor: the mapping is one-to-one, what an
    export back to HEAL needs."""
    from opencood.interop.heal import heal_rules, heal_unused_keys
    from opencood.interop.opencood_ckpt import ours_to_peer_state
    from opencood.interop.opencood_config import read_opencood_yaml
    source = peer_state(name)
    _, _, checkpoint = import_camera_run(name, tmp_path, state=source)
    config = str(FIXTURES / f"{name}.config.yaml")
    data = read_opencood_yaml(config)
    unused = heal_unused_keys(data)
    expected = {key: value for key, value in source.items()
                if not (unused and key.startswith(unused))}
    back = ours_to_peer_state(checkpoint["model"], heal_rules(data, config),
                              {key: tuple(value.shape) for key, value in expected.items()},
                              "ours", f"HEAL's {name}")
    assert list(back) == list(expected)
    assert all(torch.equal(back[key], expected[key]) for key in expected)


def test_heal_s_single_agent_camera_pretraining_is_refused_in_one_line(tmp_path):
    """HEAL's camera pretraining runs are heter_model_late, imported by the heterogeneous path
    (tests/test_import_heal_heter.py); a baseline camera run relabelled so (its data set is
    intermediate fusion's) is refused in one line naming the key."""
    import yaml

    from opencood.data.numpy_yaml import NumpyYamlDumper, NumpyYamlLoader
    peer = write_peer_run(tmp_path / "peer", "heal_camera_attfuse")
    config = peer / "config.yaml"
    data = yaml.load(config.read_text(), Loader=NumpyYamlLoader)
    data["model"]["core_method"] = "heter_model_late"
    config.write_text(yaml.dump(data, Dumper=NumpyYamlDumper))
    with pytest.raises(InteropError, match="fusion.core_method is 'intermediateheter'; HEAL runs "
                                           "heter_model_late with 'lateheter'") as error:
        translate_run(peer, None, "heal")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", CAMERA_RUNS)
def test_export_to_heal_inverts_the_import(name, tmp_path):
    """``--to heal`` of an imported HEAL camera run: HEAL's key set and shapes exactly (its
    own model's, the fixture), every tensor the import took back bit for bit (the never-run
    classifier as freshly initialised), and importing the export gives our state dict and
    model section back unchanged."""
    from opencood.config import load_config
    from opencood.interop.heal_export import EFFICIENTNET_CLASSIFIER
    source = peer_state(name)
    _, _, checkpoint = import_camera_run(name, tmp_path, state=source)
    ours = tmp_path / "ours"
    load_tool("export_checkpoint").main(["--to", "heal", "--model_dir", str(ours),
                                         "--out", str(tmp_path / "heal")])
    exported = torch.load(tmp_path / "heal" / "net_epoch4.pth", weights_only=True)
    heal_shapes = {key: tuple(value.shape) for key, value in heal_state(name).items()}
    assert list(exported) == list(heal_shapes)
    assert {key: tuple(value.shape) for key, value in exported.items()} == heal_shapes
    classifier = {f"encoder_m2.camencode.trunk.{key}" for key in EFFICIENTNET_CLASSIFIER} \
        if not name.endswith("resnet") else set()
    assert classifier <= set(exported)
    for key, value in exported.items():
        if key in classifier:
            assert not value.any() or key.endswith(("_bn1.weight", "_bn1.running_var")), key
        else:
            assert torch.equal(value, source[key]), key
    again = tmp_path / "again"
    load_tool("import_checkpoint").main(["--from", "heal", str(tmp_path / "heal"),
                                         "--out", str(again)])
    back = torch.load(again / "last.pth", weights_only=True)["model"]
    assert list(back) == list(checkpoint["model"])
    assert all(torch.equal(back[key], checkpoint["model"][key]) for key in back)
    assert load_config(again / "config.yaml")["model"] == load_config(ours / "config.yaml")["model"]


def test_export_to_heal_refuses_what_heal_has_not(tmp_path):
    """Our synthetic camera models fuse without HEAL's shrinker, on cell-centre anchors:
    refused in one line naming the key; nothing is written."""
    from opencood.config import load_config, replaced, save_config
    from opencood.interop.heal_export import translate_our_camera_run
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_config("hypes_yaml/synthetic/camera_fcooper.yaml")
    save_config(cfg, run / "config.yaml")
    with pytest.raises(InteropError, match="model.args.fusion.stage"):
        translate_our_camera_run(run)
    cfg = replaced(cfg, {"model.args.fusion.stage": "backbone"})
    save_config(cfg, run / "config.yaml")
    with pytest.raises(InteropError, match="model.args.shrink_header is missing"):
        translate_our_camera_run(run)
    lidar = tmp_path / "lidar"
    lidar.mkdir()
    save_config(load_config("hypes_yaml/synthetic/point_pillar_fcooper.yaml"),
                lidar / "config.yaml")
    with pytest.raises(InteropError, match="model.args.encoder.core_method"):
        translate_our_camera_run(lidar)
    assert not (tmp_path / "heal").exists()


def test_export_to_heal_refuses_our_light_trunk_and_a_narrowed_efficientnet():
    """HEAL's CamEncode is EfficientNet-b0 or ResNet-101 with 512-wide heads: our Light trunk and
    a ``trunk_width`` other than 512 are refused in one line naming the key; the same config
    with HEAL's trunk passes the check."""
    from opencood.config import load_config, replaced
    from opencood.config_schema import to_plain
    from opencood.interop.heal_export import check_exportable
    cfg = replaced(load_config("hypes_yaml/synthetic/camera_fcooper.yaml"), {
        "model.args.fusion.stage": "backbone", "model.args.use_dir": True,
        "model.args.shrink_header": {"kernel_size": 3, "stride": 1, "dim": 64},
        "postprocess.anchor_args.placement": "reference"})
    check_exportable(to_plain(cfg), "run")
    light = replaced(cfg, {"model.args.encoder.args.camera_encoder": "Light"})
    with pytest.raises(InteropError, match="camera_encoder 'Light' has no HEAL counterpart"):
        check_exportable(to_plain(light), "run")
    narrow = to_plain(replaced(cfg, {"model.args.encoder.args.trunk_width": 128}))
    with pytest.raises(InteropError, match="trunk_width is 128"):
        check_exportable(narrow, "run")
