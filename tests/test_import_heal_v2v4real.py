"""``tools/import_checkpoint.py --from heal`` and ``--from v2v4real`` (issue 24).

The peer run folders are built as HEAL's and V2V4Real's ``train.py`` write them: the
``config.yaml`` each codebase's own ``yaml_utils.load_yaml`` + ``yaml.dump`` produced from its
published yaml (small widths), and ``net_epoch*.pth`` state dicts with the key names and shapes
its own model classes have (``tests/fixtures/peer_runs/``, made by
``tools/reference/make_peer_run_fixtures.py`` from the authors' sources; CI never runs it).
Tensor values are filled here (each tensor a distinct constant pattern), so where every value
lands is checked key by key.
"""
from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from opencood.config_schema import to_plain
from opencood.interop.importer import translate_run
from opencood.interop.opencood_ckpt import InteropError
from opencood.models.build import build_model
from tool_modules import load_tool

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "peer_runs"
# (V2V4Real's early fusion model is its late fusion one: test_translated_v2v4real_config.)
IMPORTED = ("heal_fcooper", "heal_attfuse", "heal_v2vnet", "v2v4real_late_fusion",
            "v2v4real_intermediate_fusion", "v2v4real_fcooper")


def peer_shapes(name: str) -> "OrderedDict[str, tuple]":
    shapes = json.loads((FIXTURES / "state_shapes.json").read_text())[name]
    return OrderedDict((key, tuple(shape)) for key, shape in shapes)


def peer_state(name: str, offset: float = 0.0) -> "OrderedDict[str, torch.Tensor]":
    """Tensor i holds ``offset + i + arange(n) / n``: every tensor distinguishable."""
    state = OrderedDict()
    for index, (key, shape) in enumerate(peer_shapes(name).items()):
        count = int(torch.tensor(shape).prod()) if shape else 1
        state[key] = (offset + index + torch.arange(count, dtype=torch.float32) / count) \
            .reshape(shape)
    return state


def write_peer_run(folder: Path, name: str, files=("net_epoch4.pth",),
                   state=None) -> Path:
    """config.yaml and each of ``files`` (the last one holds ``state``, others zeros)."""
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / f"{name}.config.yaml", folder / "config.yaml")
    state = peer_state(name) if state is None else state
    for file in files:
        saved = state if file == files[-1] else OrderedDict(
            (key, torch.zeros_like(value)) for key, value in state.items())
        torch.save(saved, folder / file)
    return folder


def codebase(name: str) -> str:
    return name.split("_")[0]


@pytest.mark.parametrize("name", IMPORTED)
def test_import_then_strict_load(name, tmp_path):
    """Import through the tool, then what tools/eval.py does: build_model + strict load, and a
    forward on two samples (1 and 2 agents) giving head maps of the expected shapes."""
    peer = write_peer_run(tmp_path / "peer", name)
    out = tmp_path / "ours"
    load_tool("import_checkpoint").main(["--from", codebase(name), str(peer), "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "last.pth"]
    from opencood.config import load_config
    cfg = load_config(out / "config.yaml")
    checkpoint = torch.load(out / "last.pth", weights_only=True)
    model = build_model(cfg["model"])
    model.load_state_dict(checkpoint["model"], strict=True)
    assert checkpoint["epoch"] == 4 and checkpoint["imported_from"]["codebase"] == codebase(name)

    # Where values land: the heads, the backbone's first conv (one index earlier: ZeroPad2d),
    # the pillar layer, the shrink, HEAL's direction head.
    source = peer_state(name)
    prefix = {"heal": ("encoder_m1.", "backbone_m1.", "shrinker_m1."),
              "v2v4real": ("", "backbone.", "shrink_conv.")}[codebase(name)]
    pairs = [("cls_head.weight", "head.cls_conv.weight"),
             ("reg_head.bias", "head.reg_conv.bias"),
             (f"{prefix[0]}pillar_vfe.pfn_layers.0.norm.running_var",
              "encoder.vfe.layers.0.norm.running_var"),
             (f"{prefix[1]}blocks.0.1.weight", "backbone.blocks.0.0.weight")]
    if f"{prefix[2]}layers.0.double_conv.0.weight" in source:
        pairs.append((f"{prefix[2]}layers.0.double_conv.0.weight", "shrink.layers.0.weight"))
    if codebase(name) == "heal":
        pairs.append(("dir_head.weight", "head.dir_conv.weight"))
    for theirs, ours in pairs:
        assert torch.equal(checkpoint["model"][ours], source[theirs]), (theirs, ours)

    model.eval()
    lidar_range = cfg["preprocess"]["cav_lidar_range"]
    voxel = cfg["preprocess"]["args"]["voxel_size"]
    nx = round((lidar_range[3] - lidar_range[0]) / voxel[0])
    ny = round((lidar_range[4] - lidar_range[1]) / voxel[1])
    late_or_early = cfg["model"]["core_method"] == "point_pillar"
    record_len = torch.tensor([1, 1] if late_or_early else [1, 2])
    agents = int(record_len.sum())
    coords = torch.tensor([[a, 0, ny // 2 + a, nx // 3 + 2 * a] for a in range(agents)])
    points = torch.zeros(agents, cfg["preprocess"]["args"]["max_points_per_voxel"], 4)
    points[:, 0] = torch.tensor([1.0, 0.5, -1.0, 0.3])
    with torch.no_grad():
        outputs = model({"voxel_features": points, "voxel_num_points": torch.ones(agents).long(),
                         "voxel_coords": coords, "record_len": record_len})
    stride = cfg["postprocess"]["anchor_args"]["feature_stride"]
    assert outputs["cls_preds"].shape == (2, 2, ny // stride, nx // stride)
    assert ("dir_preds" in outputs) == (codebase(name) == "heal")


def translate(name: str, tmp_path: Path) -> dict:
    return translate_run(write_peer_run(tmp_path / name, name), None, codebase(name))


def test_translated_heal_config(tmp_path):
    cfg, _, provenance = translate("heal_v2vnet", tmp_path)
    args = cfg["model"]["args"]
    assert cfg["fusion"] == {"core_method": "intermediate", "dataset": "opv2v",
                             "args": {"proj_first": False}, "gt_source": "cooperative",
                             "dataset_mode": "vc"}
    assert args["use_dir"] is True and args["fusion"]["stage"] == "backbone"
    assert args["shrink_header"] == {"dim": 32, "stride": 2, "kernel_size": 3}
    assert args["fusion"]["args"]["num_iteration"] == 2
    assert args["fusion"]["args"]["cell_size"] == pytest.approx(1.6)      # 0.4 m x stride 4
    assert cfg["loss"]["args"]["dir_offset"] == pytest.approx(0.7853)
    assert cfg["preprocess"]["args"]["max_points_per_voxel"] == 8      # the modality's, not 1
    assert cfg["postprocess"]["anchor_args"]["feature_stride"] == 4
    assert cfg["postprocess"]["nms_thresh"] == 0.15
    assert cfg["postprocess"]["target_args"]["score_threshold"] == 0.2
    assert cfg["postprocess"]["gt_range"] == [-12.8, -6.4, -3.0, 12.8, 6.4, 1.0]
    assert provenance["model"] == "heter_model_baseline/v2vnet"
    assert any("proj_first" in note for note in provenance["notes"])


def test_translated_v2v4real_config(tmp_path):
    cfg, state, _ = translate("v2v4real_late_fusion", tmp_path)
    assert cfg["fusion"] == {"core_method": "late", "dataset": "v2v4real",
                             "args": {"proj_first": True}, "gt_source": "cooperative",
                             "dataset_mode": "vc"}
    assert cfg["model"]["args"]["shrink_header"] == {"dim": 256, "stride": 2, "kernel_size": 3}
    assert cfg["model"]["args"]["use_dir"] is False
    # V2V4Real's test GT range [-100, -40, -5, 100, 40, 3] cut to the LiDAR range.
    assert cfg["postprocess"]["gt_range"] == [-12.8, -6.4, -5.0, 12.8, 6.4, 3.0]
    assert cfg["postprocess"]["anchor_args"]["feature_stride"] == 4
    early_cfg, early_state, _ = translate("v2v4real_early_fusion", tmp_path)
    assert early_cfg["fusion"]["core_method"] == "early"
    assert early_cfg["model"] == cfg["model"] and early_state.keys() == state.keys()


@pytest.mark.parametrize("files, expected", [
    (("net_epoch2.pth", "net_epoch10.pth", "net_epoch_bestval_at6.pth"), 6),
    (("net_epoch2.pth", "net_epoch12.pth"), 12)])
def test_heal_checkpoint_choice(tmp_path, files, expected):
    """HEAL's load_saved_model: the bestval file, else the highest epoch."""
    cfg, state, provenance = translate_run(write_peer_run(tmp_path / "p", "heal_attfuse", files),
                                           None, "heal")
    assert provenance["epoch"] == expected and state["head.cls_conv.bias"].abs().sum() > 0


def test_heal_two_bestval_files_refused(tmp_path):
    peer = write_peer_run(tmp_path / "p", "heal_attfuse",
                          ("net_epoch_bestval_at4.pth", "net_epoch_bestval_at8.pth"))
    with pytest.raises(InteropError, match="2 net_epoch_bestval_at<N>.pth files"):
        translate_run(peer, None, "heal")


def test_v2v4real_checkpoint_choice_ignores_latest(tmp_path):
    """V2V4Real's loader reads the highest net_epoch<N>.pth and never latest.pth."""
    peer = write_peer_run(tmp_path / "p", "v2v4real_fcooper",
                          ("latest.pth", "net_epoch3.pth", "net_epoch7.pth"))
    _, state, provenance = translate_run(peer, None, "v2v4real")
    assert provenance["epoch"] == 7 and Path(provenance["checkpoint"]).name == "net_epoch7.pth"
    assert state["head.cls_conv.bias"].abs().sum() > 0


def bad_state(name: str, kind: str):
    state = peer_state(name)
    if kind == "extra":
        state["fusion_net.extra.weight"] = torch.zeros(1)
    else:
        state.pop("dir_head.bias" if codebase(name) == "heal" else "cls_head.bias")
    return state


@pytest.mark.parametrize("name, change, message", [
    ("heal_attfuse", "extra", r"1 of its tensors have no place in our model \(for HEAL's "
                              r"heter_model_baseline/att\): fusion_net.extra.weight"),
    ("heal_attfuse", "missing", "1 tensors of our model .* left unfilled: head.dir_conv.bias"),
    ("v2v4real_late_fusion", "extra", "no place in our model .*: fusion_net.extra.weight"),
    ("v2v4real_late_fusion", "missing", "left unfilled: head.cls_conv.bias"),
    ("heal_attfuse", "fusion_method: v2xvit",
     "model.args.fusion_method 'v2xvit': HEAL's v2xvit has no established key mapping"),
    ("heal_attfuse", "core_method: heter_model_sharedhead",
     "model.core_method 'heter_model_sharedhead' has no counterpart here"),
    # a heter pyramid model is imported (opencood.interop.heal_heter_run); its config is checked
    ("heal_attfuse", "core_method: heter_pyramid_collab",
     r"model.args: \(HEAL's heter_pyramid_collab\) 'aligner_args' is missing"),
    ("v2v4real_v2vnet", None, "temporal-encoding conv \\(fusion_net.cnn"),
])
def test_refusals_in_one_line_and_nothing_written(tmp_path, name, change, message):
    state = bad_state(name, change) if change in ("extra", "missing") else None
    peer = write_peer_run(tmp_path / "peer", name, state=state)
    if change and ":" in change:
        old = {"fusion_method": "fusion_method: att", "core_method": "core_method: "
               "heter_model_baseline"}[change.split(":")[0]]
        text = (peer / "config.yaml").read_text()
        assert old in text
        (peer / "config.yaml").write_text(text.replace(old, change))
    out = tmp_path / "ours"
    with pytest.raises(InteropError, match=message) as error:
        load_tool("import_checkpoint").run(load_tool("import_checkpoint").parse_args(
            ["--from", codebase(name), str(peer), "--out", str(out)]))
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer"]       # nothing, not even staging


def test_heal_multi_modality_refused():
    from opencood.interop.heal import translate_heal_config
    from opencood.interop.opencood_config import read_opencood_yaml
    data = read_opencood_yaml(FIXTURES / "heal_fcooper.config.yaml")
    data["model"]["args"]["m2"] = dict(data["model"]["args"]["m1"])
    with pytest.raises(InteropError, match=r"modalities \['m1', 'm2'\]: only one"):
        translate_heal_config(data, "config.yaml")
    del data["model"]["args"]["m2"]
    data["model"]["args"]["m1"]["sensor_type"] = "camera"
    with pytest.raises(InteropError, match="m1.sensor_type is 'camera'; only 'lidar'"):
        translate_heal_config(data, "config.yaml")


# ----------------------------------------------------------------------------------------------
# parity with HEAL's own forward (heal_<model>.parity.pt, made by HEAL's code)
# ----------------------------------------------------------------------------------------------

HEAL_HEADS = (("cls_preds", "cls_preds"), ("reg_preds", "reg_preds"), ("dir_preds", "dir_preds"))


def heal_model_with_fixture_weights(name: str, tmp_path: Path, stage=None):
    from opencood.interop.heal import heal_rules
    from opencood.interop.opencood_ckpt import peer_state_to_ours, state_shapes
    from opencood.interop.opencood_config import read_opencood_yaml
    from parity_weights import materialize
    fixture = torch.load(FIXTURES / f"heal_{name}.parity.pt", weights_only=True)
    cfg = to_plain(translate(f"heal_{name}", tmp_path)[0])      # changed below: a plain copy
    if stage is not None:
        cfg["model"]["args"]["fusion"]["stage"] = stage
    model = build_model(cfg["model"])
    source = str(FIXTURES / f"heal_{name}.config.yaml")
    rules = heal_rules(read_opencood_yaml(source), source)
    state = peer_state_to_ours(OrderedDict(materialize(fixture["state_dict"])), rules,
                               state_shapes(model.state_dict()), source, "ours")
    model.load_state_dict(state, strict=True)
    return model.eval(), fixture


def heal_differences(model, fixture) -> dict:
    inputs = fixture["inputs"]
    with torch.no_grad():
        outputs = model({key: inputs[key] for key in ("voxel_features", "voxel_num_points",
                                                      "voxel_coords", "record_len")})
    diffs = {}
    for ours, theirs in HEAL_HEADS:
        expected = fixture["outputs"][theirs]
        assert outputs[ours].shape == expected.shape
        diffs[ours] = float((outputs[ours] - expected).abs().max() / expected.abs().max())
    return diffs


@pytest.mark.parametrize("name", ("fcooper", "attfuse", "v2vnet"))
def test_heal_parity(name, tmp_path):
    """HEAL's weights through the importer give HEAL's heads (1, 2 and 3 agents per sample,
    agents in one frame), within 1e-5 relative."""
    model, fixture = heal_model_with_fixture_weights(name, tmp_path)
    assert fixture["inputs"]["record_len"].tolist() == [1, 2, 3]
    diffs = heal_differences(model, fixture)
    assert max(diffs.values()) <= 1e-5, diffs


def test_heal_attfuse_fuses_after_the_shrinker(tmp_path):
    """HEAL's AttFuse fuses the shrunk single-scale map: fusing at every backbone scale (our
    AttFuse default) has the same tensors but other heads."""
    model, fixture = heal_model_with_fixture_weights("attfuse", tmp_path, stage="multiscale")
    assert max(heal_differences(model, fixture).values()) > 1e-3



def test_a_heal_dairv2x_run_keeps_heal_s_single_side_gt(tmp_path):
    """HEAL's DAIR data sets train and evaluate on the two sides' own labels merged: an imported
    HEAL DAIR run gets fusion.gt_source single_side (ours defaults to label_world)."""
    import yaml

    from opencood.data.numpy_yaml import NumpyYamlDumper, NumpyYamlLoader
    peer = write_peer_run(tmp_path / "p", "heal_attfuse")
    (config,) = [path for path in peer.iterdir() if path.suffix == ".yaml"]
    data = yaml.load(config.read_text(), Loader=NumpyYamlLoader)       # HEAL saves numpy tags
    data["fusion"]["dataset"] = "dairv2x"
    config.write_text(yaml.dump(data, Dumper=NumpyYamlDumper))
    cfg, _, _ = translate_run(peer, None, "heal")
    assert cfg["fusion"]["dataset"] == "dairv2x" and cfg["fusion"]["gt_source"] == "single_side"
