#!/usr/bin/env python
"""Build ``tests/fixtures/parity/heal_pyramid.pt`` by running HEAL's heterogeneous models
(github.com/yifanlu0227/HEAL: ``opencood/models/heter_pyramid_collab.py``,
``heter_pyramid_single.py``, ``fuse_modules/pyramid_fuse.py``, ``sub_modules/`` (its
``ResNetBEVBackbone``, ``AlignNet`` / ConvNeXt, ``DownsampleConv``), ``heter_encoders.py``'s
PointPillar and LiftSplatShoot, and ``loss/point_pillar_pyramid_loss.py``). CI never runs this
script; ``tests/test_parity_heal_pyramid.py`` reads what it wrote.

Three agent types, HEAL's ``model.args`` shrunk (a 25.6 m square of 0.4 m pillars):

* ``m1`` LiDAR-64: PointPillar (8 features), one residual stage, identity aligner;
* ``m2`` camera: LiftSplatShoot with the ResNet-101 trunk (2 cameras, 64 x 128 images, a 12.8 m
  square of its own, 12 LID bins), a ConvNeXt aligner (2 blocks); its map is padded to the
  LiDAR range (HEAL's CenterCrop);
* ``m3`` LiDAR-32: a second PointPillar with its own weights, two residual blocks, a 3 x 3
  ConvNeXt aligner (1 block).

Cases: ``collab``: ``HeterPyramidCollab`` (ResNeXt pyramid, 3 scales, a shrink header), samples of
4, 1 and 3 agents mixing the three types, own-frame agents (``pairwise_t_matrix`` float64, agents
0.5-2.5 m and up to 5 degrees off the ego), outputs in eval mode (camera score masks on) and in
train mode (BatchNorm batch statistics, no masks), HEAL's pyramid loss (``forward`` with suffix
``_single``) on the eval occupancy maps with generated per-agent labels; ``single``:
``HeterPyramidSingle`` (ResNet pyramid, no shrink), run once per modality as HEAL's single-modality
batches are (eval mode), its occupancy loss (``calc_occ_loss``) over all agents; ``late``:
``HeterModelLate`` (``heter_model_late.py``, HEAL's late-fusion model: a detector per type with
its own further scales, shrink and heads), one modality per batch, eval mode.

Every weight is generated (``tests/parity_weights.py``), as are images, pillars and labels, so the
file holds recipes, small inputs and outputs. HEAL's hard-coded ``.to("cuda")`` becomes the CPU;
imports its forward never reaches are stubbed (as ``make_lss_parity_fixture.py`` does). fp32,
CPU, one thread.

Run (side environment: torch, torchvision; from outside the checkout)::

    git --git-dir=/work/.mirror/yifanlu0227+HEAL/repo archive HEAD opencood | tar -x -C /tmp/heal
    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        /path/to/checkout/tools/reference/make_heal_pyramid_fixture.py --heal /tmp/heal \\
        --commit <HEAL commit> --out /path/to/checkout/tests/fixtures/parity

Deterministic: rerunning it rewrites identical tensors.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
LIDAR_RANGE = [-12.8, -12.8, -3.0, 12.8, 12.8, 1.0]
VOXEL_SIZE = [0.4, 0.4, 4.0]
MAX_POINTS = 8
CAMERA_GRID = {"xbound": [-6.4, 6.4, 0.4], "ybound": [-6.4, 6.4, 0.4], "zbound": [-10.0, 10.0, 20.0],
               "ddiscr": [1, 25, 12], "mode": "LID"}
COLLAB_MODALITIES = [["m1", "m2", "m3", "m2"], ["m3"], ["m2", "m1", "m3"]]
SINGLE_MODALITIES = [["m1"], ["m2"], ["m3"]]      # HEAL: one modality per batch
ANCHORS = 2
ABOUT = ("Made by tools/reference/make_heal_pyramid_fixture.py from HEAL (github.com/"
         "yifanlu0227/HEAL {commit}): HeterPyramidCollab and HeterPyramidSingle with PointPillar "
         "(two agent types) and ResNet-101 lift-splat agents, ConvNeXt / identity aligners, "
         "ResNeXt and ResNet pyramids, HEAL's pyramid loss; generated weights, pillars, images "
         "and labels; own-frame agents; fp32, CPU.")


def heal_model_args(resnext: bool, shrink: bool) -> dict:
    """HEAL's ``model.args`` of a heter pyramid model, as its yamls give them, shrunk."""
    pillar = {"voxel_size": VOXEL_SIZE, "lidar_range": LIDAR_RANGE,
              "pillar_vfe": {"use_norm": True, "with_distance": False, "use_absolute_xyz": True,
                             "num_filters": [8]},
              "point_pillar_scatter": {"num_features": 8}}
    camera = {"anchor_number": ANCHORS, "grid_conf": CAMERA_GRID,
              "data_aug_conf": {"final_dim": [64, 128], "H": 600, "W": 800},
              "img_downsample": 8, "img_features": 8, "use_depth_gt": False,
              "depth_supervision": False, "camera_encoder": "Resnet101"}
    args = {
        "lidar_range": LIDAR_RANGE, "supervise_single": True,
        "m1": {"core_method": "point_pillar", "sensor_type": "lidar",
               "encoder_args": copy.deepcopy(pillar),
               "backbone_args": {"layer_nums": [1], "layer_strides": [2], "num_filters": [16],
                                 "inplanes": 8},
               "aligner_args": {"core_method": "identity"}},
        "m2": {"core_method": "lift_splat_shoot", "sensor_type": "camera",
               "encoder_args": camera,
               "camera_mask_args": {"cav_lidar_range": LIDAR_RANGE, "grid_conf": CAMERA_GRID},
               "backbone_args": {"layer_nums": [1], "layer_strides": [2], "num_filters": [16],
                                 "inplanes": 8},
               "aligner_args": {"core_method": "convnext", "spatial_align": False,
                                "args": {"num_of_blocks": 2, "dim": 16}}},
        "m3": {"core_method": "point_pillar", "sensor_type": "lidar",
               "encoder_args": copy.deepcopy(pillar),
               "backbone_args": {"layer_nums": [2], "layer_strides": [2], "num_filters": [16],
                                 "inplanes": 8},
               "aligner_args": {"core_method": "convnext", "spatial_align": False,
                                "args": {"num_of_blocks": 1, "dim": 16, "kernel_size": 3}}},
        "fusion_backbone": {"resnext": resnext, "layer_nums": [1, 2, 1],
                            "layer_strides": [1, 2, 2], "num_filters": [16, 32, 64],
                            "upsample_strides": [1, 2, 4], "num_upsample_filter": [8, 8, 8],
                            "inplanes": 16, "anchor_number": ANCHORS},
        "in_head": 24, "anchor_number": ANCHORS,
        "dir_args": {"dir_offset": 0.7853, "num_bins": 2, "anchor_yaw": [0, 90]},
    }
    if shrink:
        args["shrink_header"] = {"kernal_size": [3], "stride": [1], "padding": [1], "dim": [8],
                                 "input_dim": 24}
        args["in_head"] = 8
    return args


LOSS_ARGS = {"pos_cls_weight": 2.0,
             "cls": {"type": "SigmoidFocalLoss", "alpha": 0.25, "gamma": 2.0, "weight": 1.0},
             "reg": {"type": "WeightedSmoothL1Loss", "sigma": 3.0, "codewise": True, "weight": 2.0},
             "dir": {"type": "WeightedSoftmaxClassificationLoss", "weight": 0.2,
                     "args": {"dir_offset": 0.7853, "num_bins": 2, "anchor_yaw": [0, 90]}},
             "depth": {"weight": 1.0},
             "pyramid": {"relative_downsample": [1, 2, 4], "weight": [0.4, 0.2, 0.1]}}


def agent_pillars(rng, agent: int) -> dict:
    """One agent's pillars as HEAL's collate gives them: voxel_features (P, 8, 4), voxel_coords
    (P, 4) [agent, z, y, x], voxel_num_points (P,); 40 distinct cells, 1-8 points each (the
    rest zero padding), points inside their cell."""
    nx = int(round((LIDAR_RANGE[3] - LIDAR_RANGE[0]) / VOXEL_SIZE[0]))
    ny = int(round((LIDAR_RANGE[4] - LIDAR_RANGE[1]) / VOXEL_SIZE[1]))
    cells = rng.choice(nx * ny, size=40, replace=False)
    counts = rng.integers(1, MAX_POINTS + 1, size=40)
    counts[:5] = MAX_POINTS
    features = np.zeros((40, MAX_POINTS, 4), dtype=np.float32)
    for index, (cell, count) in enumerate(zip(cells, counts)):
        y, x = divmod(int(cell), nx)
        low = [LIDAR_RANGE[0] + x * VOXEL_SIZE[0], LIDAR_RANGE[1] + y * VOXEL_SIZE[1],
               LIDAR_RANGE[2]]
        points = rng.uniform(low, [low[0] + VOXEL_SIZE[0], low[1] + VOXEL_SIZE[1],
                                   LIDAR_RANGE[5]], size=(count, 3))
        features[index, :count, :3] = points
        features[index, :count, 3] = rng.uniform(0, 1, size=count)
    coords = np.stack([np.full(40, agent), np.zeros(40, dtype=np.int64), cells // nx,
                       cells % nx], axis=1)
    return {"voxel_features": features, "voxel_coords": coords.astype(np.int64),
            "voxel_num_points": counts.astype(np.int32)}


def modality_inputs(rng, modalities: list, camera_inputs) -> dict:
    """HEAL's ``inputs_<m>`` for a batch whose agents have ``modalities`` (flat, batch order):
    pillars of each LiDAR agent (agent index counted within its modality) and camera rows."""
    import torch
    inputs = {}
    for name in sorted(set(modalities)):
        agents = [i for i, m in enumerate(modalities) if m == name]
        if name == "m2":
            rows = camera_inputs(len(agents))
            inputs[name] = rows
            continue
        per_agent = [agent_pillars(rng, k) for k in range(len(agents))]
        inputs[name] = {key: torch.from_numpy(np.concatenate([p[key] for p in per_agent]))
                        for key in per_agent[0]}
    return inputs


def camera_rows(weights, geometry, seed: str):
    """Camera inputs of n camera agents: generated images, the geometry of the lift-splat
    fixture's 2 agents repeated."""
    def rows(count: int) -> dict:
        import torch
        pick = [k % 2 for k in range(count)]
        recipe = {"key": f"{seed}.images.{count}", "shape": [count, 2, 3, 64, 128]}
        out = {"imgs": recipe}
        for key in ("rots", "trans", "intrins", "post_rots", "post_trans"):
            out[key] = geometry[key][pick].clone()
        out["extrinsics"] = geometry["extrinsics"][pick].clone()
        return out
    return rows


def own_frame(rng, record_len: list) -> tuple:
    """(pairwise (B, L, L, 4, 4) float64, [b, i, j] agent i -> agent j; to_ego (N, 4, 4)
    float64, agent -> its sample's ego)."""
    helpers = sys.modules["model_parity"]
    pairwise = helpers.own_frame_pairwise(rng, record_len, max(record_len))
    to_ego = [pairwise[b, i, 0] for b, count in enumerate(record_len) for i in range(count)]
    return pairwise, np.stack(to_ego)


def labels_for(rng, agents: int, height: int, width: int):
    """Generated anchor labels (N, H W A) in {-1 ignore, 0 negative, 1 positive} (ours) and
    HEAL's pos_equal_one / neg_equal_one (N, H, W, A) of the same."""
    import torch
    draw = rng.uniform(size=(agents, height, width, ANCHORS))
    labels = np.where(draw < 0.03, 1, np.where(draw < 0.15, -1, 0)).astype(np.int64)
    labels[:, :2, :2, 1] = 1                       # a positive in every agent
    pos = torch.from_numpy((labels == 1).astype(np.float32))
    neg = torch.from_numpy((labels == 0).astype(np.float32))
    return torch.from_numpy(labels.reshape(agents, -1).astype(np.int8)), pos, neg


def materialized(inputs: dict, weights) -> dict:
    """A modality's inputs with the generated images made (stored as their recipe)."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, dict):
            value = weights.generated_tensor(value["key"], value["shape"])
        out[key] = value.clone()
    return out


def build(module_cls, args, helpers, weights):
    import torch
    torch.manual_seed(0)
    model = module_cls(copy.deepcopy(args))
    recipes = helpers.weight_recipes(model, weights)
    model.load_state_dict(weights.materialize(recipes), strict=True)
    return model, recipes


def heads(out: dict) -> dict:
    return {key: out[key].detach().clone() for key in ("cls_preds", "reg_preds", "dir_preds")}


def fused_hook(model, captured: dict):
    """The fused map the head reads (the shrink's output, or the pyramid's)."""
    def hook(module, inputs):
        captured["fused_features"] = inputs[0].detach().clone()
    return model.cls_head.register_forward_pre_hook(hook)


def collab_case(modules, helpers, weights, geometry, pyramid_loss) -> dict:
    import torch
    rng = np.random.default_rng(37)
    args = heal_model_args(resnext=True, shrink=True)
    model, recipes = build(modules["collab"].HeterPyramidCollab, args, helpers, weights)
    record_len = [len(sample) for sample in COLLAB_MODALITIES]
    flat = [m for sample in COLLAB_MODALITIES for m in sample]
    inputs = modality_inputs(rng, flat, camera_rows(weights, geometry, "collab"))
    pairwise, to_ego = own_frame(rng, record_len)

    def data_dict():
        data = {f"inputs_{name}": materialized(value, weights) for name, value in inputs.items()}
        data.update(agent_modality_list=list(flat), record_len=torch.tensor(record_len),
                    pairwise_t_matrix=torch.from_numpy(pairwise.copy()))
        return data

    outputs = {}
    for mode in ("eval", "train"):
        model.train(mode == "train")
        captured = {}
        hook = fused_hook(model, captured)
        with torch.no_grad():
            out = model(data_dict())
        hook.remove()
        # train mode: the fused map and occupancy (the 1x1 heads on it are checked in eval)
        outputs[mode] = {**(heads(out) if mode == "eval" else {}), **captured,
                         "occupancy": [o.detach().clone() for o in out["occ_single_list"]]}
    height, width = outputs["eval"]["occupancy"][0].shape[2:]
    labels, pos, neg = labels_for(rng, len(flat), height, width)
    loss = pyramid_loss({"pyramid": "collab", "occ_single_list": outputs["eval"]["occupancy"]},
                        {"pos_equal_one": pos, "neg_equal_one": neg}, suffix="_single")
    print(f"collab: {len(recipes)} tensors, fused {tuple(outputs['eval']['fused_features'].shape)},"
          f" pyramid loss {float(loss):.6f}")
    return {"heal_args": args, "state_dict": recipes, "agent_modality_list": flat,
            "record_len": torch.tensor(record_len), "inputs": inputs,
            "transforms_to_ego": torch.from_numpy(to_ego), "outputs": outputs,
            "labels": labels, "pyramid_loss": loss.detach().clone()}


def single_case(modules, helpers, weights, geometry, pyramid_loss) -> dict:
    import torch
    rng = np.random.default_rng(38)
    args = heal_model_args(resnext=False, shrink=False)
    model, recipes = build(modules["single"].HeterPyramidSingle, args, helpers, weights)
    model.eval()
    batches, outputs = [], []
    for modalities in SINGLE_MODALITIES:
        inputs = modality_inputs(rng, modalities, camera_rows(weights, geometry, "single"))
        name = modalities[0]
        with torch.no_grad():
            out = model({f"inputs_{name}": materialized(inputs[name], weights)})
        batches.append({"modality": name, "inputs": inputs[name]})
        # the heads and occupancy (the fused map they read is checked in the collab case)
        outputs.append({**heads(out),
                        "occupancy": [o.detach().clone() for o in out["occ_single_list"]]})
    occupancy = [torch.cat([o["occupancy"][level] for o in outputs])
                 for level in range(len(outputs[0]["occupancy"]))]
    agents = occupancy[0].shape[0]
    labels, pos, neg = labels_for(rng, agents, *occupancy[0].shape[2:])
    loss = pyramid_loss.calc_occ_loss(occupancy, pos, neg, agents)
    print(f"single: {len(recipes)} tensors, {agents} agents, occupancy loss {float(loss):.6f}")
    return {"heal_args": args, "state_dict": recipes, "batches": batches, "outputs": outputs,
            "labels": labels, "occupancy_loss": loss.detach().clone()}


def heal_late_args() -> dict:
    """HEAL's ``model.args`` of ``heter_model_late`` (its Single/m*_pretrain yamls), shrunk:
    the pyramid models' agent types, each with ``layers_args`` (3 scales, the first the
    backbone's output), a shrink header and heads of its own."""
    args = heal_model_args(resnext=False, shrink=False)
    for name in ("m1", "m2", "m3"):
        args[name].pop("aligner_args")
        args[name].update(
            layers_args={"layer_nums": [1, 1, 2], "layer_strides": [2, 2, 2],
                         "num_filters": [16, 24, 32], "upsample_strides": [1, 2, 4],
                         "num_upsample_filter": [8, 8, 8], "inplanes": 16},
            shrink_header={"kernal_size": [3], "stride": [1], "padding": [1], "dim": [8],
                           "input_dim": 24},
            head_args={"in_head": 8})
    for key in ("fusion_backbone", "in_head", "supervise_single"):
        args.pop(key)
    return args


def late_case(modules, helpers, weights, geometry) -> dict:
    """HEAL's ``HeterModelLate``, one modality per batch (eval mode)."""
    import torch
    rng = np.random.default_rng(39)
    args = heal_late_args()
    model, recipes = build(modules["late"].HeterModelLate, args, helpers, weights)
    model.eval()
    batches, outputs = [], []
    for modalities in SINGLE_MODALITIES:
        inputs = modality_inputs(rng, modalities, camera_rows(weights, geometry, "late"))
        name = modalities[0]
        with torch.no_grad():
            out = model({f"inputs_{name}": materialized(inputs[name], weights)})
        batches.append({"modality": name, "inputs": inputs[name]})
        outputs.append(heads(out))
    print(f"late: {len(recipes)} tensors, {len(outputs)} agents")
    return {"heal_args": args, "state_dict": recipes, "batches": batches, "outputs": outputs}


def import_heal_models(source: Path, lss):
    """HEAL's heter models and pyramid loss (its other imports stubbed as the lift-splat
    script's; its PointPillarLoss kept: the pyramid loss subclasses it)."""
    modules, _, _ = lss.import_heal(source)
    import torch
    loss_module = __import__("opencood.loss.point_pillar_loss", fromlist=["x"])
    if loss_module.PointPillarLoss is torch.nn.Module:   # the lift-splat script's stand-in
        del sys.modules["opencood.loss.point_pillar_loss"]
        sys.modules.pop("opencood.loss.point_pillar_depth_loss", None)
    # the post-processor that loss module imports pulls in plotting (matplotlib's colour maps)
    import types
    sys.modules["opencood.visualization.vis_utils"] = types.ModuleType("vis_utils")
    pyramid = __import__("opencood.loss.point_pillar_pyramid_loss", fromlist=["x"])
    collab = __import__("opencood.models.heter_pyramid_collab", fromlist=["x"])
    single = __import__("opencood.models.heter_pyramid_single", fromlist=["x"])
    late = __import__("opencood.models.heter_model_late", fromlist=["x"])
    late.torch = lss.cpu_torch(torch)
    return {"collab": collab, "single": single, "late": late,
            "encoders": modules["heter_encoders"]}, pyramid


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heal", type=Path, required=True, help="HEAL's sources (has opencood/)")
    parser.add_argument("--commit", required=True, help="HEAL commit the sources are from")
    parser.add_argument("--out", type=Path, required=True, help="tests/fixtures/parity")
    options = parser.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    here = REPO_ROOT / "tools" / "reference"
    lss = load_by_path("lss_fixture", here / "make_lss_parity_fixture.py")
    weights = load_by_path("parity_weights", REPO_ROOT / "tests" / "parity_weights.py")
    helpers = load_by_path("model_parity", here / "make_model_parity_fixtures.py")
    modules, pyramid = import_heal_models(options.heal, lss)
    camera_utils = __import__("opencood.utils.camera_utils", fromlist=["img_transform"])
    geometry = lss.make_geometry(camera_utils)
    pyramid_loss = pyramid.PointPillarPyramidLoss(copy.deepcopy(LOSS_ARGS))
    fixture = {"format": 1, "about": ABOUT.format(commit=options.commit),
               "reference": f"HEAL {options.commit}", "torch": str(torch.__version__),
               "loss_args": LOSS_ARGS,
               "collab": collab_case(modules, helpers, weights, geometry, pyramid_loss),
               "single": single_case(modules, helpers, weights, geometry, pyramid_loss),
               "late": late_case(modules, helpers, weights, geometry)}
    options.out.mkdir(parents=True, exist_ok=True)
    path = options.out / "heal_pyramid.pt"
    torch.save(fixture, path)
    print(f"stubbed: {', '.join(sorted(set(lss.STUBBED)))}")
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
