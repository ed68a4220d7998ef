#!/usr/bin/env python
"""Run HEAL's own ``opencood/tools/inference_heter_in_order.py`` (its ``main()``, unchanged) on a
tiny synthetic OPV2V-H test split with a small heterogeneous model of ours exported to HEAL's
layout, and record per step and frame what it fused, scored and found:
``tests/fixtures/heal_in_order/heal_in_order.npz``, which tests/test_heal_in_order.py compares
``tools/eval.py --heter_in_order`` with. Never run in CI.

The data: the ``tiny`` preset with a roadside unit (``opencood.data.synthetic.presets.with_rsu``;
else as ``generate_synthetic.py --heter --cameras --camera-size 64 32 --depth``), test split,
two frames (GENERATION): one scenario, three vehicles about 20 m apart and the unit ``-1``
(HEAL's in-order assignment moves it last: it takes part in the GT only). The model: our
``heter_pyramid_collab`` (m1 PointPillar on the preset's own LiDAR, m2 lift-splat cameras with
EfficientNet-b0, m3 PointPillar on OPV2V-H's 32-beam LiDAR, a 2-scale pyramid) with seeded
initial weights (``torch.manual_seed(SEED)``) whose class head is scaled (weights times
CLS_GAIN, bias CLS_BIAS): the initial head gives every anchor nearly the same score (ties), and
random weights find few boxes; so scaled, about 60 detections per frame survive and some are
true positives (AP small, not zero: every TP / FP decision is compared). The run's own settings
are deliberately not HEAL's in-order ones, so that the evaluation's overrides are what makes the
two agree: comm_range 15 m (HEAL's script: 180), ego ``m1&m3`` and m2 mapped to m1 (HEAL's: ego
m1, every name to itself), ``max_num`` 40 and 100 NMS candidates (HEAL's post-processing caps
nothing and takes 1000). Pillars hold up to MAX_POINTS points, more than any pillar of the data:
HEAL shuffles each cloud, so an overflowing pillar would keep other points than ours.
Exported with ``tools/export_checkpoint.py --to heal`` (opencood.interop.heal_heter_export).

Two steps::

    # 1. OUR side (our venv, in the checkout): the data, our run folder and its HEAL export
    PYTHONPATH=. nice -n 10 python tools/reference/make_heal_in_order_fixture.py \\
        --generate /tmp/heal_in_order
    # 2. HEAL's side (venv-cam: HEAL's data dependencies; /work/side/inorder_extra: a folder
    #    holding only a link to venv-lss's efficientnet_pytorch), from outside the checkout
    cd /tmp && env PYTHONPATH=/work/side/pypcd_src:/work/side/inorder_extra \\
        nice -n 10 /work/side/venv-cam/bin/python \\
        <repo>/tools/reference/make_heal_in_order_fixture.py \\
        /tmp/heal_in_order <repo>/tests/fixtures/heal_in_order

What HEAL's script is given: ``--model_dir <export> --range 51.2,25.6 --use_cav [1,2,3]``
(RANGE_ARG: our run's LiDAR range, which is also its gt_range, so HEAL's range override changes
nothing; three steps: one per name), the export as written. Patched around the script, not
in it: its DataLoader runs in-process (``num_workers`` 0), its picture
(``simple_vis.visualize``) is not drawn, HEAL's hard-coded ``.to("cuda")`` of the lift-splat
encoder is the CPU, EfficientNet is built without its download (the export's weights replace
it), modules venv-cam lacks and this path never calls are stand-ins (sklearn, timm); and calls
are recorded: each frame's ``cav_id_list`` and ``agent_modality_list`` (the agents fused), its
GT (``object_ids``, ``object_bbx_center`` under its mask), the detections
``caluclate_tp_fp`` scores (corners and scores), and each step's ``eval_final_results``
(AP@0.3/0.5/0.7). Deterministic: a rerun writes the same file byte for byte.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import stub_module, two_step_main  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAL_COMMIT = "96812ed5a416"
GENERATION = {"preset": "tiny", "rsu": True, "seed": 0, "frames": 2, "camera_size": [64, 32],
              "hetero_lidars": [32, 16], "depth": True, "splits": ["test"]}
NAMES = ["m1", "m2", "m3"]
SEED = 0
CLS_GAIN = 100.0            # the class head's weights times this (module docstring)
CLS_BIAS = -3.2             # and its bias
LIDAR_RANGE = [-51.2, -25.6, -3.0, 51.2, 25.6, 1.0]
RANGE_ARG = "51.2,25.6"     # HEAL's --range for LIDAR_RANGE
COMM_RANGE = 15.0           # below the agents' distances to the ego (module docstring)
MAX_POINTS = 256            # more than any pillar of the data holds
BACKBONE = {"layer_nums": [1], "layer_strides": [2], "num_filters": [32]}
PILLARS = {"core_method": "pillar",
           "args": {"pillar_vfe": {"num_filters": [16], "padded_slots": "reference"},
                    "point_pillar_scatter": {"num_features": 16}}}


def our_config(data_root: Path) -> dict:
    """Our run's config (unresolved) over the tiny OPV2V-H folders of ``data_root``."""
    width, height = GENERATION["camera_size"]
    return {
        "name": "heal_in_order",
        "root_dir": str(data_root / "test"), "validate_dir": str(data_root / "test"),
        "test_dir": str(data_root / "test"),
        # below the other agents' distances to the ego (about 20 m): only the in-order
        # evaluation's 180 m (HEAL's) keeps them
        "comm_range": COMM_RANGE, "input_source": ["lidar", "camera"], "label_type": "lidar",
        "fusion": {"core_method": "intermediate", "args": {"proj_first": False}},
        "train_params": {"batch_size": 1, "epoches": 1, "max_cav": 5},
        "preprocess": {"core_method": "SpVoxelPreprocessor",
                       "args": {"voxel_size": [0.8, 0.8, 4.0],
                                # no pillar overflows: HEAL shuffles each cloud
                                "max_points_per_voxel": MAX_POINTS},
                       "cav_lidar_range": LIDAR_RANGE},
        "postprocess": {"core_method": "VoxelPostprocessor", "gt_range": LIDAR_RANGE,
                        "anchor_args": {"l": 3.9, "w": 1.6, "h": 1.56, "z": -1.0, "r": [0, 90],
                                        "feature_stride": 2},
                        "target_args": {"pos_threshold": 0.6, "neg_threshold": 0.45,
                                        "score_threshold": 0.2},
                        # the run's own post-processing caps below what a frame holds (HEAL's
                        # pads its GT to max_num, it caps nothing), so only the evaluation's
                        # (HEAL's) keeps every detection
                        "order": "hwl", "max_num": 40, "nms_thresh": 0.15, "pre_nms_max": 100},
        "heter": {
            "assignment_path": str(data_root / "heter_modality_assign/opv2v_4modality.json"),
            # not HEAL's in-order ones (ego m1, every name to itself): the evaluation sets them
            "ego_modality": "m1&m3", "lidar_channels_dict": {"m3": 32},
            "mapping_dict": {"m1": "m1", "m2": "m1", "m3": "m3", "m4": "m3"},
            "modality_setting": {
                "m1": {"sensor_type": "lidar", "core_method": "point_pillar"},
                "m2": {"sensor_type": "camera", "core_method": "lift_splat_shoot",
                       "data_aug_conf": {"H": height, "W": width, "final_dim": [height, width],
                                         "resize_lim": [1.0, 1.0], "bot_pct_lim": [0.0, 0.0],
                                         "rot_lim": [0.0, 0.0], "rand_flip": False}},
                "m3": {"sensor_type": "lidar", "core_method": "point_pillar"}}},
        "model": {"core_method": "heter_pyramid_collab", "args": {
            "bn_momentum": 0.1,
            "modalities": {
                "m1": {"sensor_type": "lidar", "encoder": PILLARS, "backbone": BACKBONE,
                       "aligner": {"core_method": "identity"}},
                "m2": {"sensor_type": "camera",
                       "encoder": {"core_method": "lss", "args": {
                           "xbound": [-25.6, 25.6, 0.8], "ybound": [-12.8, 12.8, 0.8],
                           "image_size": [height, width], "img_downsample": 16,
                           "img_features": 16, "ddiscr": [2.0, 50.0, 12], "depth_mode": "LID",
                           "camera_encoder": "EfficientNet"}},
                       "backbone": BACKBONE,
                       "aligner": {"core_method": "convnext", "num_of_blocks": 1}},
                "m3": {"sensor_type": "lidar", "encoder": PILLARS, "backbone": BACKBONE,
                       "aligner": {"core_method": "convnext", "num_of_blocks": 1}}},
            "fusion_backbone": {"resnext": True, "layer_nums": [1, 1], "layer_strides": [1, 2],
                                "num_filters": [32, 32], "upsample_strides": [1, 2],
                                "num_upsample_filter": [32, 32]},
            "shrink_header": {"dim": 32, "stride": 1, "kernel_size": 3}}},
        "loss": {"core_method": "point_pillar_pyramid_loss",
                 "args": {"cls_weight": 1.0, "reg_weight": 2.0, "dir_weight": 0.2,
                          "pyramid": {"relative_downsample": [1, 2], "weight": [0.4, 0.2]}}},
        "data_augment": [], "optimizer": {"lr": 0.002},
    }


def generate_data(root: Path) -> None:
    """Our tiny OPV2V-H test split (GENERATION) under ``root``."""
    import dataclasses

    from opencood.data.synthetic import generate_dataset, get_preset
    from opencood.data.synthetic.camera import CameraConfig
    from opencood.data.synthetic.presets import with_rsu
    width, height = GENERATION["camera_size"]
    preset = get_preset(GENERATION["preset"])
    if GENERATION["rsu"]:
        preset = with_rsu(preset, f"{preset.name}_rsu")
    preset = dataclasses.replace(
        preset, frames=GENERATION["frames"],
        hetero_lidars=tuple(GENERATION["hetero_lidars"]),
        cameras=CameraConfig(width=width, height=height, depth=GENERATION["depth"]))
    generate_dataset(root, preset=preset, seed=GENERATION["seed"], progress=False,
                     splits=tuple(GENERATION["splits"]))


def write_run(data_root: Path, run_dir: Path) -> None:
    """Our run folder: the resolved config and ``last.pth`` of the seeded model."""
    import torch
    import yaml

    from opencood.config import load_config, save_config
    from opencood.models.build import build_model
    from opencood.utils.checkpoint import save_checkpoint
    run_dir.mkdir(parents=True, exist_ok=True)
    source = run_dir / "source.yaml"
    source.write_text(yaml.safe_dump(our_config(data_root), sort_keys=False))
    cfg = load_config(source)
    torch.manual_seed(SEED)
    model = build_model(cfg["model"]).eval()
    with torch.no_grad():
        model.head.cls_conv.weight.mul_(CLS_GAIN)
        model.head.cls_conv.bias.fill_(CLS_BIAS)
    save_config(cfg, run_dir / "config.yaml")
    save_checkpoint(run_dir / "last.pth", {"model": model.state_dict(), "epoch": 1})


def generate(root: Path) -> None:
    """Our side (module docstring, step 1)."""
    import torch
    torch.set_num_threads(1)
    from opencood.interop.heal_heter_export import export_heal_heter_run
    generate_data(root / "data")
    write_run(root / "data", root / "ours")
    export_heal_heter_run(root / "ours", root / "heal")
    print(f"wrote {root / 'data'}, {root / 'ours'} and {root / 'heal'}")


# ------------------------------------------------------------------------------ HEAL's side


def run(root: Path, out: Path) -> None:
    """HEAL's side (module docstring, step 2)."""
    import numpy as np
    import torch
    torch.set_num_threads(1)
    heal = Path("/work/side/HEAL")
    lss = _load_sibling("lss_fixture", "make_lss_parity_fixture.py")
    stub_module("opencood.visualization.vis_utils")
    stub_module("opencood.visualization.my_vis")
    stub_module("opencood.visualization.simple_vis", visualize=lambda *a, **k: None)
    stub_module("lzf")
    # what venv-cam lacks and this path never calls: inference_utils' metric, the aligner's
    # DropPath (drop_path 0 there); torch's import-time scan of modules wants their specs
    import importlib.machinery
    for name in ("sklearn", "sklearn.metrics", "timm", "timm.models", "timm.models.layers"):
        stub_module(name, mean_squared_error=None, DropPath=None)
        sys.modules[name].__spec__ = importlib.machinery.ModuleSpec(name, None)
    np.Inf = np.inf
    import_heal_for_inference(heal, lss.cpu_torch)
    import torch.utils.data
    script = __import__("opencood.tools.inference_heter_in_order", fromlist=["main"])
    from opencood.tools import inference_utils
    from opencood.utils import eval_utils
    script.DataLoader = lambda dataset, **kw: torch.utils.data.DataLoader(
        dataset, **{**kw, "num_workers": 0})
    steps, frames = [], []
    infer = inference_utils.inference_intermediate_fusion

    def recording_infer(batch_data, model, dataset):
        result = infer(batch_data, model, dataset)
        frames.append((dataset.use_cav, batch_data["ego"], result))
        return result

    script.inference_utils.inference_intermediate_fusion = recording_infer
    final = eval_utils.eval_final_results

    def recording_final(result_stat, save_path, infer_info=None):
        aps = final(result_stat, save_path, infer_info)
        steps.append({"infer_info": infer_info, "ap": [float(v) for v in aps],
                      "num_gt": int(result_stat[0.5]["gt"]),
                      "tp": [int(np.sum(result_stat[iou]["tp"])) for iou in (0.3, 0.5, 0.7)]})
        return aps

    script.eval_utils.eval_final_results = recording_final
    use_cav = "[" + ",".join(str(k) for k in range(1, len(NAMES) + 1)) + "]"
    sys.argv = ["inference_heter_in_order.py", "--model_dir", str(root / "heal"),
                "--range", RANGE_ARG, "--use_cav", use_cav]
    with torch.no_grad():
        script.main()
    meta = {"about": "HEAL's inference_heter_in_order.py on the tiny OPV2V-H test split "
                     "(tools/reference/make_heal_in_order_fixture.py)",
            "heal_commit": HEAL_COMMIT, "torch": str(torch.__version__),
            "generation": GENERATION, "names": NAMES, "seed": SEED, "cls_gain": CLS_GAIN,
            "cls_bias": CLS_BIAS, "range": RANGE_ARG, "steps": steps,
            "heal_hypes": {key: hypes_of(root / "heal")[key] for key in ("comm_range",)}}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "heal_in_order.npz"
    np.savez_compressed(path, meta=np.asarray(json.dumps(meta)), **frame_arrays(frames))
    print(f"wrote {path}: {len(steps)} steps, {len(frames)} frames")
    for step in steps:
        print(step)


def hypes_of(run: Path) -> dict:
    import yaml
    return yaml.safe_load((run / "config.yaml").read_text())


def frame_arrays(frames) -> dict:
    """The recorded frames as flat arrays: per frame its step (``use_cav``), sample index, the
    agents in range (``cav_id_list``, ego first) and those fused (``agent_modality_list``: the
    first of them), its GT (ids; boxes [x, y, z, h, w, l, yaw] as HEAL's ``object_bbx_center``)
    and its detections (BEV corners (K, 4, 2) and the corners' z range (K, 2): what the AP
    reads, float32; scores); ``*_start`` offsets cut the flat lists per frame."""
    import numpy as np
    lists = {name: [] for name in ("use_cav", "sample_idx", "agent_ids", "agent_modality",
                                   "gt_ids", "gt_boxes", "pred_bev", "pred_z", "pred_scores")}
    starts = {"agent_start": [0], "gt_start": [0], "pred_start": [0]}
    for use_cav, ego, result in frames:
        lists["use_cav"].append(use_cav)
        lists["sample_idx"].append(int(ego["sample_idx"]))
        lists["agent_ids"] += [int(c) for c in ego["cav_id_list"]]
        lists["agent_modality"] += list(ego["agent_modality_list"]) + \
            [""] * (len(ego["cav_id_list"]) - len(ego["agent_modality_list"]))
        mask = ego["object_bbx_mask"][0].bool()
        lists["gt_ids"] += [int(i) for i in ego["object_ids"]]
        lists["gt_boxes"] += ego["object_bbx_center"][0][mask].double().tolist()
        corners = result["pred_box_tensor"]
        if corners is not None:
            corners = corners.double().numpy()
            lists["pred_bev"] += corners[:, :4, :2].tolist()
            lists["pred_z"] += np.stack([corners[:, :, 2].min(1), corners[:, :, 2].max(1)],
                                        1).tolist()
            lists["pred_scores"] += result["pred_score"].double().tolist()
        for name, key in (("agent_start", "agent_ids"), ("gt_start", "gt_ids"),
                          ("pred_start", "pred_scores")):
            starts[name].append(len(lists[key]))
    arrays = {name: np.asarray(values) for name, values in {**lists, **starts}.items()}
    for name in ("gt_boxes", "pred_bev", "pred_z", "pred_scores"):
        arrays[name] = arrays[name].astype(np.float32)
    arrays["pred_bev"] = arrays["pred_bev"].reshape(-1, 4, 2)
    arrays["pred_z"] = arrays["pred_z"].reshape(-1, 2)
    arrays["gt_boxes"] = arrays["gt_boxes"].reshape(-1, 7)
    return arrays


def import_heal_for_inference(heal: Path, cpu_torch) -> None:
    """HEAL's package first on ``sys.path`` (refusing ours), EfficientNet built without its
    download (the export's weights replace it), and the lift-splat encoder's hard-coded
    ``.to("cuda")`` the CPU. (Not make_lss_parity_fixture.py's ``import_heal``: its stand-ins
    for missing packages would also answer HEAL's ``try: from spconv.utils import
    VoxelGeneratorV2``, which must fail over to spconv 2's voxel generator here.)"""
    sys.path.insert(0, str(heal.resolve()))
    import opencood
    if heal.resolve() not in Path(opencood.__file__).resolve().parents:
        raise SystemExit(f"error: 'opencood' resolves to {opencood.__file__}, not HEAL's")
    import torch
    from efficientnet_pytorch import EfficientNet
    EfficientNet.from_pretrained = classmethod(lambda cls, name, **kw: cls.from_name(name, **kw))
    encoders = __import__("opencood.models.heter_encoders", fromlist=["LiftSplatShoot"])
    encoders.torch = cpu_torch(torch)


def _load_sibling(name: str, file: str):
    from side_env import load_by_path
    return load_by_path(name, Path(__file__).resolve().parent / file)


if __name__ == "__main__":
    sys.exit(two_step_main(None, "make_heal_in_order_fixture.py", generate, run))
