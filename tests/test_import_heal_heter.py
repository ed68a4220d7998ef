"""``tools/import_checkpoint.py --from heal`` of HEAL's heterogeneous runs (issue 37 point 5).

The run folders are built from ``tests/fixtures/parity/heal_pyramid.pt`` (HEAL's own
``HeterPyramidCollab``, ``HeterPyramidSingle`` and ``HeterModelLate`` on generated weights,
see test_parity_heal_pyramid.py): its ``model.args`` inside a HEAL hypes laid out as HEAL's
``MoreModality/HEAL`` yamls, its state dict as ``net_epoch<N>.pth``. The imported run, loaded
strictly as tools/eval.py loads it, must give HEAL's outputs on the fixture's inputs.
"""
from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from opencood.interop.importer import translate_run
from opencood.interop.opencood_ckpt import InteropError
from opencood.models.build import build_model
from opencood.strategies import choose_strategy
from parity_weights import materialize
from test_parity_heal_pyramid import (FIXTURE, TOLERANCE, differences, modality_groups,
                                      relative)
from tests.reference_fixtures import load_parity_fixture
from tool_modules import import_and_load as import_peer_and_load, load_tool

RANGE = [-12.8, -12.8, -3.0, 12.8, 12.8, 1.0]
DIR_ARGS = {"dir_offset": 0.7853, "num_bins": 2, "anchor_yaw": [0, 90]}
FUSION_DATASET = {"heter_pyramid_collab": "intermediateheter",
                  "heter_pyramid_single": "lateheter", "heter_model_late": "lateheter"}


pytestmark = pytest.mark.usefixtures("one_thread")     # as the fixture was made (conftest)


@pytest.fixture(scope="module")
def fixture() -> dict:
    return load_parity_fixture(FIXTURE, "make_heal_pyramid_fixture.py")


def heal_hypes(heal_args: dict, core: str) -> dict:
    """HEAL's hypes of a heter run around the fixture's ``model.args`` (its 25.6 m grid)."""
    settings = {name: {"sensor_type": value["sensor_type"], "core_method": value["core_method"]}
                for name, value in heal_args.items() if name.startswith("m")}
    return {
        "name": f"heal_{core}", "root_dir": "dataset/OPV2V/train",
        "validate_dir": "dataset/OPV2V/validate", "test_dir": "dataset/OPV2V/test",
        "yaml_parser": "load_general_params",
        "train_params": {"batch_size": 2, "epoches": 4, "eval_freq": 1, "save_freq": 1,
                         "max_cav": 5},
        "input_source": ["lidar", "camera", "depth"],
        # as HEAL's stage2/m2_single_pyramid.yaml: a stage-two run learns camera labels
        "label_type": "camera" if core == "heter_pyramid_single" else "lidar",
        "heter": {"assignment_path": "heter_modality_assign/opv2v_4modality.json",
                  "ego_modality": "m1&m3", "mapping_dict": {"m1": "m1", "m2": "m2", "m3": "m3",
                                                            "m4": "m3"},
                  "lidar_channels_dict": {"m3": 32, "m4": 16}, "modality_setting": settings},
        "fusion": {"core_method": FUSION_DATASET[core], "dataset": "opv2v",
                   "args": {"proj_first": False, "grid_conf": "None"}},
        "preprocess": {"core_method": "SpVoxelPreprocessor", "cav_lidar_range": RANGE,
                       "args": {"voxel_size": [0.4, 0.4, 4], "max_points_per_voxel": 32,
                                "max_voxel_train": 32000, "max_voxel_test": 70000}},
        "postprocess": {"core_method": "VoxelPostprocessor", "gt_range": RANGE,
                        "anchor_args": {"cav_lidar_range": RANGE, "l": 3.9, "w": 1.6,
                                        "h": 1.56, "r": [0, 90], "feature_stride": 2,
                                        "num": 2},
                        "target_args": {"pos_threshold": 0.6, "neg_threshold": 0.45,
                                        "score_threshold": 0.2},
                        "order": "hwl", "max_num": 150, "nms_thresh": 0.15,
                        "dir_args": DIR_ARGS},
        "model": {"core_method": core, "args": copy.deepcopy(heal_args)},
        "loss": {"core_method": "point_pillar_pyramid_loss", "args": {
            "pos_cls_weight": 2.0, "cls": {"type": "SigmoidFocalLoss", "alpha": 0.25,
                                           "gamma": 2.0, "weight": 1.0},
            "reg": {"type": "WeightedSmoothL1Loss", "sigma": 3.0, "codewise": True,
                    "weight": 2.0},
            "dir": {"type": "WeightedSoftmaxClassificationLoss", "weight": 0.2,
                    "args": DIR_ARGS},
            "pyramid": {"relative_downsample": [1, 2, 4], "weight": [0.4, 0.2, 0.1]}}},
        "optimizer": {"core_method": "Adam", "lr": 0.002, "eps": 1e-10, "weight_decay": 1e-4},
        "lr_scheduler": {"core_method": "multistep", "gamma": 0.1, "step_size": [15, 50]},
    }


def write_heal_run(folder, case: dict, core: str, state=None):
    """HEAL's run folder: config.yaml (as its train.py dumps the hypes) + net_epoch3.pth."""
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(heal_hypes(case["heal_args"], core)))
    torch.save(materialize(case["state_dict"]) if state is None else state,
               folder / "net_epoch3.pth")
    return folder


def import_and_load(tmp_path, case: dict, core: str):
    """Through the tool, then what tools/eval.py does: build from config.yaml, strict load."""
    peer = write_heal_run(tmp_path / "peer", case, core)
    return import_peer_and_load(["--from", "heal", peer], tmp_path / "ours")


# HEAL's README order for heal_tools.py merge_final: the aligned types, then the base
MERGE_ORDER = ("m2_alignto_m1", "m3_alignto_m1", "m1_base")
MERGE_FIXTURE = Path(__file__).parent / "fixtures" / "peer_runs" / "heal_merge_final.json"


def type_of(key: str) -> str:
    """The agent type a HEAL key belongs to (``m2`` of ``aligner_m2.``...), '' when shared."""
    head = key.split(".")[0]
    return head.rsplit("_", 1)[1] if head.rsplit("_", 1)[-1][1:].isdigit() else ""


def write_merge_runs(root, collab_case: dict) -> dict:
    """HEAL's folders before ``merge_final`` (its README's step 3), split from the collab
    fixture's weights: ``m1_base`` (stage one) holds m1 and the shared fusion and heads as
    ``net_epoch_bestval_at5.pth``; each ``m<k>_alignto_m1`` holds that file linked as
    ``net_epoch1.pth`` (HEAL's stage-two start) and, as ``net_epoch_bestval_at3.pth``, its type's
    parts with the shared ones moved (+k: only the base's may survive the merge) and, in m2's,
    a late model's own head (``cls_head_m2``, which HEAL's merge drops). ``final_infer`` holds
    the collab config with the loss of HEAL's final_infer yamls (no pyramid weights). Returns {name: folder}: merging them gives the fixture's state dict."""
    root = Path(root)
    state = materialize(collab_case["state_dict"])
    folders = {name: root / name for name in MERGE_ORDER + ("final_infer",)}
    for folder in folders.values():
        folder.mkdir(parents=True)
    base = {k: v for k, v in state.items() if type_of(k) in ("", "m1")}
    torch.save(base, folders["m1_base"] / "net_epoch_bestval_at5.pth")
    for shift, name in enumerate(("m2", "m3"), start=2):
        aligned = {k: (v + shift if type_of(k) == "" else v) for k, v in state.items()
                   if type_of(k) in ("", name)}
        if name == "m2":
            aligned["cls_head_m2.weight"] = torch.ones(2, 8, 1, 1)
        folder = folders[f"{name}_alignto_m1"]
        torch.save(aligned, folder / "net_epoch_bestval_at3.pth")
        (folder / "net_epoch1.pth").symlink_to(folders["m1_base"] / "net_epoch_bestval_at5.pth")
    final = heal_hypes(collab_case["heal_args"], "heter_pyramid_collab")
    # as HEAL's final_infer/m1m2m3m4.yaml (inference only): the depth loss, no pyramid weights
    final["loss"] = {"core_method": "point_pillar_depth_loss",
                     "args": {key: value for key, value in final["loss"]["args"].items()
                              if key != "pyramid"}}
    (folders["final_infer"] / "config.yaml").write_text(yaml.safe_dump(final))
    return folders


def tensor_digest(tensor: torch.Tensor) -> str:
    """What the merge fixture keeps of a tensor: dtype, shape and a hash of its bytes."""
    data = tensor.detach().contiguous().cpu().numpy().tobytes()
    return f"{tensor.dtype} {list(tensor.shape)} {hashlib.sha256(data).hexdigest()[:16]}"


def single_agent_batch(case: dict) -> dict:
    modalities = [batch["modality"] for batch in case["batches"]]
    return {"record_len": torch.ones(len(modalities), dtype=torch.long),
            "agent_modality": modalities,
            **modality_groups({b["modality"]: b["inputs"] for b in case["batches"]})}


def test_imported_collab_run_gives_heal_s_outputs(fixture, tmp_path):
    """HEAL's HeterPyramidCollab run (three agent types, camera included) imported and loaded
    strictly: fused map, every occupancy scale and the heads equal HEAL's; the config carries
    HEAL's heter section, own-frame fusion and its pyramid loss."""
    case = fixture["collab"]
    cfg, model, checkpoint = import_and_load(tmp_path, case, "heter_pyramid_collab")
    assert cfg["model"]["core_method"] == "heter_pyramid_collab"
    assert cfg["fusion"]["core_method"] == "intermediate"
    assert cfg["fusion"]["args"]["proj_first"] is False
    assert cfg["heter"]["mapping_dict"]["m4"] == "m3"
    assert cfg["heter"]["lidar_channels_dict"] == {"m3": 32}     # m4 is not a model type
    assert set(cfg["heter"]["modality_setting"]) == {"m1", "m2", "m3"}
    assert cfg["heter"]["modality_setting"]["m2"]["data_aug_conf"]["final_dim"] == [64, 128]
    assert cfg["loss"]["core_method"] == "point_pillar_pyramid_loss"
    assert cfg["loss"]["args"]["pyramid"]["weight"] == [0.4, 0.2, 0.1]
    assert checkpoint["epoch"] == 3 and checkpoint["imported_from"]["codebase"] == "heal"
    batch = {"record_len": case["record_len"],
             "transforms_to_ego": case["transforms_to_ego"].float(),
             "points_in_agent_frame": True, "agent_modality": case["agent_modality_list"],
             **modality_groups(case["inputs"])}
    with torch.no_grad():
        diffs = differences(model(batch), case["outputs"]["eval"])
    assert len(diffs) >= 4 and max(diffs.values()) <= TOLERANCE, diffs


@pytest.mark.parametrize("core", ["heter_pyramid_single", "heter_model_late"])
def test_imported_single_and_late_runs_give_heal_s_heads(fixture, tmp_path, core):
    """HEAL's single-agent pyramid (stage two) and its late baseline: each agent's heads equal
    HEAL's, one mixed batch of single-agent samples."""
    case = fixture["single" if core == "heter_pyramid_single" else "late"]
    cfg, model, checkpoint = import_and_load(tmp_path, case, core)
    assert cfg["model"]["core_method"] == core and cfg["fusion"]["core_method"] == "late"
    # HEAL's label_type kept (opencood.data.datasets labels every agent so, as its lateheter)
    assert cfg["label_type"] == ("camera" if core == "heter_pyramid_single" else "lidar")
    assert not any("label" in note for note in checkpoint["imported_from"]["notes"])
    assert cfg["fusion"]["args"]["proj_first"] is True        # late: boxes travel, not maps
    assert choose_strategy(cfg).name == "late"                 # as tools/eval.py takes it
    with torch.no_grad():
        outputs = model(single_agent_batch(case))
    for index, expected in enumerate(case["outputs"]):
        for head in ("cls_preds", "reg_preds", "dir_preds"):
            assert relative(outputs[head][index:index + 1], expected[head]) <= TOLERANCE, \
                (index, head)


def test_a_tampered_key_is_refused_in_one_line(fixture, tmp_path):
    """A renamed tensor fails the import naming the key and the checkpoint file, on one line,
    and leaves no run folder behind."""
    case = fixture["collab"]
    state = materialize(case["state_dict"])
    state["backbone_m3.resnet.layer0.9.conv1.weight"] = state.pop(
        "backbone_m3.resnet.layer0.0.conv1.weight")
    peer = write_heal_run(tmp_path / "peer", case, "heter_pyramid_collab", state=state)
    with pytest.raises(InteropError) as error:
        translate_run(peer, None, "heal")
    message = str(error.value)
    assert "backbone_m3.resnet.layer0.9.conv1.weight" in message
    assert "net_epoch3.pth" in message and "\n" not in message
    out = tmp_path / "ours"
    with pytest.raises(SystemExit):
        load_tool("import_checkpoint").main(["--from", "heal", str(peer), "--out", str(out)])
    assert not out.exists()


def collab_outputs_differences(model, case: dict) -> dict:
    """Our model's outputs vs HEAL's collab outputs on the fixture's mixed batch."""
    batch = {"record_len": case["record_len"],
             "transforms_to_ego": case["transforms_to_ego"].float(),
             "points_in_agent_frame": True, "agent_modality": case["agent_modality_list"],
             **modality_groups(case["inputs"])}
    with torch.no_grad():
        return differences(model(batch), case["outputs"]["eval"])


def test_merge_final_gives_heal_s_merged_state_and_its_outputs(fixture, tmp_path):
    """``--from heal FINAL --merge m2_alignto_m1 m3_alignto_m1 m1_base`` (HEAL's README order):
    the merged state is the one HEAL's own merge_final wrote for these folders (every key,
    dtype, shape and bytes: the base's shared parts win, m2's late head is dropped, each run's
    bestval file is taken over the linked net_epoch1.pth), and the imported run gives HEAL's
    collab outputs."""
    from opencood.interop.heal_merge import merged_heal_state
    case = fixture["collab"]
    folders = write_merge_runs(tmp_path / "heal", case)
    runs = [str(folders[name]) for name in MERGE_ORDER]
    state, origin = merged_heal_state(runs)
    heal_merged = json.loads(MERGE_FIXTURE.read_text())
    assert heal_merged["merge_order"] == list(MERGE_ORDER)
    ours = {key: tensor_digest(value) for key, value in state.items()}
    assert sorted(ours) == sorted(heal_merged["keys"])
    assert [key for key in ours if ours[key] != heal_merged["keys"][key]] == []
    assert origin["pyramid_backbone.single_head_0.weight"].endswith(
        "m1_base/net_epoch_bestval_at5.pth")
    cfg, model, checkpoint = import_peer_and_load(
        ["--from", "heal", folders["final_infer"], "--merge", *runs], tmp_path / "ours")
    assert checkpoint["epoch"] == 1          # HEAL's merged file is net_epoch1.pth
    # final_infer names no pyramid loss: HEAL's stage-one weights, said in a note
    assert cfg["loss"]["args"]["pyramid"]["weight"] == [0.4, 0.2, 0.1]
    assert any("names no loss.args.pyramid" in note
               for note in checkpoint["imported_from"]["notes"])
    assert checkpoint["imported_from"]["checkpoint"].startswith("merge_final of ")
    diffs = collab_outputs_differences(model.eval(), case)
    assert len(diffs) >= 4 and max(diffs.values()) <= TOLERANCE, diffs


def test_a_tampered_or_missing_merged_key_is_refused_in_one_line(fixture, tmp_path):
    """A renamed tensor in an aligned run stops the merge naming the key and that run's
    checkpoint; leaving the base out names the keys no run holds; each on one line, and no
    run folder is written."""
    folders = write_merge_runs(tmp_path / "heal", fixture["collab"])
    runs = [str(folders[name]) for name in MERGE_ORDER]
    final = folders["final_infer"]
    with pytest.raises(InteropError, match=r"are in none of the merged checkpoints.*encoder_m1"):
        translate_run(final, None, "heal", merge=runs[:2])
    aligned = folders["m3_alignto_m1"] / "net_epoch_bestval_at3.pth"
    state = torch.load(aligned, weights_only=True)
    state["aligner_m3.channel_align.model.0.gammma"] = state.pop(
        "aligner_m3.channel_align.model.0.gamma")
    torch.save(state, aligned)
    with pytest.raises(InteropError) as error:
        translate_run(final, None, "heal", merge=runs)
    message = str(error.value)
    assert message.startswith(str(aligned)) and "\n" not in message
    assert "aligner_m3.channel_align.model.0.gammma has no place" in message
    out = tmp_path / "ours"
    with pytest.raises(SystemExit):
        load_tool("import_checkpoint").main(["--from", "heal", str(final), "--merge", *runs,
                                             "--out", str(out)])
    assert not out.exists()


@pytest.mark.parametrize("part", ["collab", "single"])
def test_key_rules_run_back_to_heal_s_state_bit_exact(fixture, part):
    """HEAL's state dict -> ours -> HEAL's by the same rules backwards: every key back, every
    tensor bit-exact (the camera trunk, ConvNeXt aligners, ResNeXt pyramid included); a
    tampered key of ours is refused in one line naming it."""
    from opencood.interop.heal_heter import (camera_encoders_of, heal_state_to_ours,
                                             model_args_from_heal, ours_to_heal_state)
    from test_parity_heal_pyramid import our_model
    case = fixture[part]
    heal_state = materialize(case["state_dict"])
    cameras = camera_encoders_of(case["heal_args"])
    modalities = list(model_args_from_heal(case["heal_args"])["modalities"])
    model = our_model(case, f"heter_pyramid_{part}")
    shapes = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    ours = heal_state_to_ours(heal_state, cameras, shapes, modalities)
    back = ours_to_heal_state(ours, cameras, modalities)
    assert cameras == {"m2": "Resnet101"} and set(back) == set(heal_state)
    unequal = [key for key in heal_state if not torch.equal(back[key], heal_state[key])]
    assert not unequal, unequal[:5]
    ours["branches.m3.aligner.0.gammma"] = ours.pop("branches.m3.aligner.0.gamma")
    with pytest.raises(InteropError) as error:
        ours_to_heal_state(ours, cameras, modalities, "last.pth")
    assert "branches.m3.aligner.0.gammma" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("core", ["heter_pyramid_collab", "heter_pyramid_single",
                                  "heter_model_late"])
def test_export_to_heal_inverts_the_import(fixture, tmp_path, core):
    """``--to heal`` of an imported HEAL run: HEAL's state dict back bit for bit (every key),
    except the late model's never-run first ``layers`` stage, which ours does not keep and the
    export writes as a fresh layer holds it (zero convs, BatchNorm's identity); importing the
    export gives our model section and state dict back unchanged."""
    from opencood.interop.heal_heter import LATE_UNUSED
    case = fixture[{"heter_pyramid_collab": "collab", "heter_pyramid_single": "single",
                    "heter_model_late": "late"}[core]]
    cfg, _, checkpoint = import_and_load(tmp_path, case, core)
    exported = tmp_path / "heal_export"
    load_tool("export_checkpoint").main(["--to", "heal", "--model_dir", str(tmp_path / "ours"),
                                         "--out", str(exported)])
    heal_state = materialize(case["state_dict"])
    state = torch.load(exported / "net_epoch3.pth", weights_only=True)
    assert set(state) == set(heal_state)
    kept = [key for key in heal_state if not LATE_UNUSED.match(key)]
    assert all(torch.equal(state[key], heal_state[key]) for key in kept)
    never_run = {key: state[key] for key in heal_state if LATE_UNUSED.match(key)}
    # 3 types x (2 convs, a strided 1x1 shortcut conv, 3 BatchNorms of 5 tensors)
    assert len(never_run) == (54 if core == "heter_model_late" else 0)
    for key, value in never_run.items():
        batch_norm_scale = key.endswith("running_var") or (key.endswith("weight")
                                                           and value.dim() == 1)
        fresh = 1 if batch_norm_scale else 0
        assert torch.equal(value, torch.full_like(value, fresh)), key
    hypes = yaml.safe_load((exported / "config.yaml").read_text())
    assert hypes["model"]["core_method"] == core
    assert hypes["label_type"] == cfg["label_type"]
    again, ours, _ = translate_run(exported, None, "heal")
    assert again["model"] == cfg["model"] and again["heter"] == cfg["heter"]
    assert all(torch.equal(ours[key], value) for key, value in checkpoint["model"].items())


def test_an_export_s_lidar_types_carry_a_preprocess_heal_s_data_sets_build():
    """HEAL's data sets build each LiDAR type's voxel generator from its own ``preprocess``
    with a number of pillars: the export writes our None (the top-level section) out and our
    None cap (every pillar) as the grid's cell count; its own section and caps stay (the
    import reads the copy back as None: test_export_to_heal_inverts_the_import)."""
    from opencood.interop.heal_heter_export import heal_heter_section
    crop = [-51.2, -25.6, -3.0, 51.2, 25.6, 1.0]
    top = {"core_method": "SpVoxelPreprocessor", "cav_lidar_range": crop,
           "args": {"voxel_size": [0.8, 0.8, 4.0], "max_points_per_voxel": 16,
                    "max_voxel_train": None, "max_voxel_test": 500}}
    own = {**top, "args": {**top["args"], "voxel_size": [0.4, 0.4, 4.0], "max_voxel_train": 9}}
    cfg = {"preprocess": top, "heter": {
        "ego_modality": "m1", "cav_preference": None, "modality_setting": {
            "m1": {"sensor_type": "lidar", "preprocess": None},
            "m2": {"sensor_type": "camera", "preprocess": None},
            "m3": {"sensor_type": "lidar", "preprocess": own}}}}
    heter = heal_heter_section(cfg)
    settings = heter["modality_setting"]
    assert "cav_preference" not in heter and settings["m2"]["preprocess"] is None
    # 128 x 64 pillars of 0.8 m, one layer of 4 m
    assert settings["m1"]["preprocess"] == {**top, "args": {**top["args"],
                                                           "max_voxel_train": 8192}}
    assert settings["m3"]["preprocess"]["args"] == own["args"]
    assert cfg["heter"]["modality_setting"]["m1"]["preprocess"] is None      # not modified


def test_an_efficientnet_camera_type_exports_with_heal_s_classifier(fixture, tmp_path):
    """A collab run whose camera type has the EfficientNet trunk: the export adds HEAL's
    never-run classifier (``_conv_head``, ``_bn1``, ``_fc``: zero weights, BatchNorm's identity)
    beside the trunk, and importing it drops them again, giving our weights back bit for
    bit."""
    from opencood.config import replaced, save_config
    from opencood.utils.checkpoint import save_checkpoint
    peer = write_heal_run(tmp_path / "peer", fixture["collab"], "heter_pyramid_collab")
    cfg = replaced(translate_run(peer, None, "heal")[0],
                   {"model.args.modalities.m2.encoder.args.camera_encoder": "EfficientNet"})
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    run = tmp_path / "efficientnet"
    run.mkdir()
    save_config(cfg, run / "config.yaml")
    save_checkpoint(run / "last.pth", {"model": model.state_dict(), "epoch": 2})
    exported = tmp_path / "heal_export"
    load_tool("export_checkpoint").main(["--to", "heal", "--model_dir", str(run),
                                         "--out", str(exported)])
    state = torch.load(exported / "net_epoch2.pth", weights_only=True)
    trunk = "encoder_m2.camencode.trunk."
    assert torch.equal(state[trunk + "_bn1.running_var"], torch.ones(1280))
    assert state[trunk + "_fc.weight"].shape == (1000, 1280) and not state[trunk + "_fc.weight"].any()
    assert trunk + "_blocks.15._project_conv.weight" in state
    hypes = yaml.safe_load((exported / "config.yaml").read_text())
    assert hypes["model"]["args"]["m2"]["encoder_args"]["camera_encoder"] == "EfficientNet"
    _, ours, _ = translate_run(exported, None, "heal")
    assert set(ours) == set(model.state_dict())
    assert all(torch.equal(ours[key], value) for key, value in model.state_dict().items())
