"""``tools/import_checkpoint.py --from v2xreal`` (issue 38 point 5): V2X-Real's multi-class runs.

``tests/fixtures/v2xreal_runs/`` was made by running V2X-Real's own code
(``tools/reference/make_v2xreal_run_fixtures.py``, never run in CI): its yamls (3 classes x 2
yaws) at a small range and backbone, parsed and dumped as its ``train.py`` writes
``config.yaml``, its models built by its own classes with generated weights (only the recipes
are stored, ``tests/parity_weights.py``), their ``psm`` / ``rm`` maps on its own pillars, and its
anchors. Here the run folder is rebuilt (config.yaml + ``net_epoch<N>.pth`` of those weights),
imported through the tool, and our model, built from the imported config, must give its maps
on the same pillars (``v2xreal_pillars.pt`` / ``quantv2x_pillars.pt``, stored once for the
models that share them): the class / anchor order of its heads is ours.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from opencood.config import load_config, replaced, save_config
from opencood.interop.importer import translate_run
from opencood.interop.opencood_ckpt import InteropError
from opencood.models.build import build_model
from opencood.postprocess.voxel_postprocessor import anchors_from_config
from parity_weights import materialize
from tool_modules import load_tool

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v2xreal_runs"
PARITY = ("late_fusion", "attfuse", "fcooper", "v2vnet", "v2xvit", "quantv2x_attfuse",
          "quantv2x_fcooper")
TOLERANCE = 1e-5          # relative to the map's largest magnitude
CLASSES = [{"name": "vehicle", "l": 3.9, "w": 1.6, "h": 1.56, "z": -1.78,
            "pos_threshold": 0.6, "neg_threshold": 0.45},
           {"name": "pedestrian", "l": 0.8, "w": 0.6, "h": 1.73, "z": -0.6,
            "pos_threshold": 0.5, "neg_threshold": 0.35},
           {"name": "truck", "l": 8.0, "w": 3.0, "h": 3.0, "z": -1.78,
            "pos_threshold": 0.6, "neg_threshold": 0.45}]


def write_peer_run(folder: Path, name: str, state=None, epoch: int = 3) -> Path:
    """V2X-Real's run folder: its config.yaml and net_epoch<epoch>.pth (its weights)."""
    folder.mkdir(parents=True)
    shutil.copy(FIXTURES / f"{name}.config.yaml", folder / "config.yaml")
    if state is None:
        fixture = torch.load(FIXTURES / f"{name}.parity.pt", weights_only=True)
        state = materialize(fixture["state_dict"])
    torch.save(state, folder / f"net_epoch{epoch}.pth")
    return folder


def import_run(peer: Path, out: Path) -> None:
    tool = load_tool("import_checkpoint")
    tool.run(tool.parse_args(["--from", "v2xreal", str(peer), "--out", str(out)]))


def our_batch(inputs: dict) -> dict:
    """Its collated inputs (the pillars from the shared file its ``pillars`` names) as our
    batch names them; V2X-ViT's per-slot prior_encoding [velocity, delay, infrastructure] as
    per-agent types and delays, its correction matrices as they are."""
    codebase = "quantv2x" if inputs["pillars"] == "quantv2x" else "v2xreal"
    pillars = torch.load(FIXTURES / f"{codebase}_pillars.pt",
                         weights_only=True)[inputs["pillars"]]
    batch = {key: pillars[key].long() if key != "voxel_features" else pillars[key]
             for key in ("voxel_features", "voxel_num_points", "voxel_coords")}
    batch["record_len"] = inputs["record_len"]
    if "prior_encoding" in inputs:
        slots = torch.arange(inputs["prior_encoding"].shape[1])
        prior = inputs["prior_encoding"][slots[None] < inputs["record_len"][:, None]]
        batch.update(agent_types=prior[:, 2].long(), agent_latency=prior[:, 1].long(),
                     spatial_correction_matrix=inputs["spatial_correction_matrix"])
    return batch


def test_imported_heads_equal_v2xreal_forward(tmp_path):
    """Each model: its run folder translated (the tool's path without the writing, which
    test_imported_config_and_anchors covers), our model built from that config and loaded
    strictly, its pillars run: the class and box maps equal V2X-Real's within 1e-5 relative
    (samples of 1, 2 and 3 agents for the fusion models; V2X-ViT's with delays, infrastructure
    agents and corrections that are not the identity). QuantV2X's heter_model_baseline_mc
    (HEAL's layout, multi-class) likewise, its direction head left out (its inference never
    reads it)."""
    worst = {}
    for name in PARITY:
        codebase = "quantv2x" if name.startswith("quantv2x") else "v2xreal"
        cfg, state, _ = translate_run(write_peer_run(tmp_path / name, name), None, codebase)
        assert [dict(c) for c in cfg["postprocess"]["classes"]] == CLASSES
        model = build_model(cfg["model"])
        model.load_state_dict(state, strict=True)
        fixture = torch.load(FIXTURES / f"{name}.parity.pt", weights_only=True)
        with torch.no_grad():
            outputs = model.eval()(our_batch(fixture["inputs"]))
        for ours, theirs in (("cls_preds", "psm"), ("reg_preds", "rm")):
            expected = fixture["outputs"].get(theirs, fixture["outputs"].get(ours))
            assert outputs[ours].shape == expected.shape, (name, ours)
            worst[name, ours] = float((outputs[ours] - expected).abs().max() /
                                      expected.abs().max())
    assert max(worst.values()) <= TOLERANCE, worst


def test_imported_config_and_anchors(tmp_path):
    """The classes, yaws (its radians in degrees), thresholds and GT range translated; our
    anchors from the imported config are V2X-Real's generate_anchor_box, in its order."""
    out = tmp_path / "ours"
    import_run(write_peer_run(tmp_path / "peer", "attfuse"), out)
    cfg = load_config(out / "config.yaml")
    post, args = cfg["postprocess"], cfg["model"]["args"]
    assert post["anchor_args"]["r"] == pytest.approx([0.0, 89.954374], abs=1e-6)   # 1.57 rad
    assert (args["num_class"], args["anchor_number"]) == (3, 6)
    assert args["fusion"]["core_method"] == "attfuse" and args["fusion"]["stage"] == "backbone"
    assert post["gt_range"] == [-3.2, -3.2, -15.0, 3.2, 3.2, 15.0]
    assert (post["target_args"]["score_threshold"], post["nms_thresh"]) == (0.2, 0.15)
    assert (post["filters"], post["pre_nms_max"], post["max_num"]) == ("v2xreal", 1000, 300)
    assert (cfg["fusion"]["dataset"], cfg["fusion"]["dataset_mode"], cfg["comm_range"]) == \
        ("v2xreal", "vc", 50.0)
    assert cfg["train_params"]["max_cav"] == 4        # its datasets' default (its yaml has none)
    anchors = anchors_from_config(post["anchor_args"], cfg["bev_grid"], post["order"],
                                  classes=post["classes"])
    expected = torch.load(FIXTURES / "attfuse.parity.pt", weights_only=True)["anchors"]
    torch.testing.assert_close(anchors, expected, rtol=0, atol=1e-6)
    # Its early fusion runs its late fusion network (point_pillar) on the merged points.
    network = materialize(torch.load(FIXTURES / "late_fusion.parity.pt",
                                     weights_only=True)["state_dict"])
    early, _, _ = translate_run(write_peer_run(tmp_path / "early", "early_fusion", network),
                                None, "v2xreal")
    late, _, _ = translate_run(write_peer_run(tmp_path / "late", "late_fusion"), None, "v2xreal")
    assert (early["fusion"]["core_method"], late["fusion"]["core_method"]) == ("early", "late")
    assert early["model"] == late["model"] and early["model"]["args"]["shrink_header"] is None


def test_quantv2x_import_drops_only_its_unread_direction_head(tmp_path):
    """--from quantv2x: its dir_head is left out (its multi-class post-processing never reads
    it), nothing else: an extra tensor is still refused in one line; a HEAL run is not a
    QuantV2X one."""
    state = materialize(torch.load(FIXTURES / "quantv2x_fcooper.parity.pt",
                                   weights_only=True)["state_dict"])
    cfg, ours, provenance = translate_run(write_peer_run(tmp_path / "p", "quantv2x_fcooper",
                                                         state), None, "quantv2x")
    assert cfg["model"]["args"]["use_dir"] is False and "head.dir_conv.weight" not in ours
    assert len(ours) == len(state) - 2 and any("dir_head" in n for n in provenance["notes"])
    assert cfg["fusion"]["args"]["proj_first"] is False
    assert (cfg["fusion"]["dataset"], cfg["fusion"]["dataset_mode"], cfg["comm_range"]) == \
        ("v2xreal", "v2v", 70.0)
    assert cfg["model"]["args"]["fusion"]["core_method"] == "fcooper"
    state["shrinker_m1.extra.weight"] = torch.zeros(1)
    with pytest.raises(InteropError, match=r"net_epoch3.pth: .*no place in our model \(for "
                                           r"QuantV2X's heter_model_baseline_mc\): "
                                           r"shrinker_m1.extra.weight$"):
        translate_run(write_peer_run(tmp_path / "q", "quantv2x_fcooper", state), None,
                      "quantv2x")
    heal = tmp_path / "heal"
    heal.mkdir()
    shutil.copy(FIXTURES.parent / "peer_runs" / "heal_fcooper.config.yaml", heal / "config.yaml")
    with pytest.raises(InteropError, match="model.core_method 'heter_model_baseline': only "
                                           "QuantV2X's heter_model_baseline_mc"):
        translate_run(heal, None, "quantv2x")


def test_anchors_over_another_range_refused():
    """Its anchors span postprocess.anchor_args.cav_lidar_range, ours the crop: a run whose
    two ranges differ is refused (its yamls alias one list)."""
    from opencood.interop.opencood_config import read_opencood_yaml
    from opencood.interop.v2xreal import translate_classes
    data = read_opencood_yaml(FIXTURES / "attfuse.config.yaml")
    assert translate_classes(data, "config.yaml")[2] == 2
    data["postprocess"]["anchor_args"]["cav_lidar_range"] = [-6.4, -3.2, -15, 6.4, 3.2, 15]
    with pytest.raises(InteropError, match=r"config.yaml: postprocess.anchor_args."
                                           r"cav_lidar_range \[-6.4, .* is not "
                                           r"preprocess.cav_lidar_range"):
        translate_classes(data, "config.yaml")


def tampered(name: str, change: str) -> dict:
    state = materialize(torch.load(FIXTURES / f"{name}.parity.pt",
                                   weights_only=True)["state_dict"])
    if change == "renamed":
        state["cls_head.weights"] = state.pop("cls_head.weight")
    elif change == "extra":
        state["fusion_net.extra.weight"] = torch.zeros(1)
    else:
        state.pop("shrink_conv.layers.0.double_conv.0.bias")
    return state


@pytest.mark.parametrize("change, message", [
    ("renamed", r"net_epoch3.pth: not a strict match: 1 of its tensors have no place in our "
                r"model \(for V2X-Real's point_pillar_intermediate\): cls_head.weights; 1 "
                r"tensors .* left unfilled: head.cls_conv.weight"),
    ("extra", r"net_epoch3.pth: .*no place in our model .*: fusion_net.extra.weight$"),
    ("missing", r"net_epoch3.pth: .*left unfilled: shrink.layers.0.bias$"),
    ("num_class: 2", r"config.yaml: model.args.num_class is 2; its "
                     r"postprocess.anchor_args.anchor_generator_config makes it 3"),
    ("align_center: true", r"config.yaml: postprocess.anchor_args.anchor_generator_config\[0\]"
                           r".align_center: only true"),
    ("dataset_mode: vc", r"config.yaml: dataset_mode: missing \(V2X-Real's collaboration "
                         r"mode"),
    ("core_method: second_intermediate", "config.yaml: model.core_method "
                                         "'second_intermediate': V2X-Real's model has no "
                                         "counterpart here"),
])
def test_refused_in_one_line_and_nothing_written(tmp_path, change, message):
    state = tampered("attfuse", change) if ":" not in change else None
    peer = write_peer_run(tmp_path / "peer", "attfuse", state)
    if ":" in change:
        old = {"num_class": "num_class: 3", "align_center": "align_center: true",
               "core_method": "core_method: point_pillar_intermediate",
               "dataset_mode": "dataset_mode: vc"}[change.split(":")[0]]
        text = (peer / "config.yaml").read_text()
        assert old in text
        new = {"align_center: true": "align_center: false",
               "dataset_mode: vc": "dataset_mod: vc"}.get(change, change)
        (peer / "config.yaml").write_text(text.replace(old, new))
    with pytest.raises(InteropError, match=message) as error:
        import_run(peer, tmp_path / "ours")
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["peer"]       # nothing, not even staging


def test_export_back_to_v2xreal(tmp_path):
    """--to v2xreal inverts the import: V2X-Real's tensors come back bit for bit under its keys,
    and the exported folder imports to the same config (V2X-ViT's 1.6 m warp cell on a
    stride-2 map comes back as its downsample_rate 4). V2X-Real's own load_yaml, model and
    load_state_dict(strict=True) loaded these exports and gave the fixtures' heads exactly
    (make_v2xreal_run_fixtures.py --export-check). A run without a class list is refused."""
    export = load_tool("export_checkpoint")
    for name in ("attfuse", "v2xvit"):
        peer = write_peer_run(tmp_path / name, name)
        import_run(peer, tmp_path / f"ours_{name}")
        out = tmp_path / f"export_{name}"
        export.run(export.parse_args(["--to", "v2xreal", "--model_dir",
                                      str(tmp_path / f"ours_{name}"), "--out", str(out)]))
        original = torch.load(peer / "net_epoch3.pth", weights_only=True)
        exported = torch.load(out / "net_epoch3.pth", weights_only=True)
        assert sorted(exported) == sorted(original)
        assert all(torch.equal(exported[key], original[key]) for key in original)
        again, _, _ = translate_run(out, None, "v2xreal")
        first = load_config(tmp_path / f"ours_{name}" / "config.yaml")
        for section in ("model", "postprocess", "preprocess", "fusion"):
            assert again[section] == first[section], (name, section)
    single = tmp_path / "single"
    single.mkdir()
    save_config(replaced(first, {"postprocess.classes": None}), single / "config.yaml")
    shutil.copy(tmp_path / "ours_v2xvit" / "last.pth", single / "last.pth")
    with pytest.raises(InteropError, match=r"single/config.yaml: postprocess.classes is not "
                                           r"set; V2X-Real's heads score a class list"):
        export.run(export.parse_args(["--to", "v2xreal", "--model_dir", str(single), "--out",
                                      str(tmp_path / "never")]))
    assert not (tmp_path / "never").exists()


def test_v2xreal_filters_are_one_class_agnostic_nms_without_a_cap():
    """postprocess.filters v2xreal (its post_process): a box suppresses boxes of every class
    (ours: only its own) and every survivor is kept (ours: at most max_num)."""
    from opencood.postprocess.box_coder import ResidualBoxCoder
    from opencood.postprocess.voxel_postprocessor import VoxelPostprocessor
    boxes = torch.tensor([[0.0, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0],
                          [0.2, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0],      # IoU ~0.9 with box 0
                          [20.0, 0.0, -1.0, 1.5, 1.6, 3.9, 0.0],
                          [40.0, 0.0, -1.0, 3.0, 3.0, 9.0, 0.0]])    # 9 m: kept (its 100 m)
    scores, classes = torch.tensor([0.9, 0.8, 0.7, 0.6]), torch.tensor([0, 1, 0, 2])
    thresholds = [(0.6, 0.45), (0.5, 0.35), (0.6, 0.45)]

    def kept(filters):
        post = VoxelPostprocessor(torch.zeros(1, 1, 3, 7), ResidualBoxCoder(), 0.6, 0.45, 0.2,
                                  0.15, 2, 1000, filters, class_thresholds=thresholds)
        return post.nms(boxes, scores, classes).scores.tolist()
    assert kept("v2xreal") == pytest.approx([0.9, 0.7, 0.6])
    assert kept("ours") == pytest.approx([0.9, 0.8])                 # per class, max_num 2
    assert kept("reference") == pytest.approx([0.9, 0.8, 0.7])       # 6 m filter, per class
