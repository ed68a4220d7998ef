#!/usr/bin/env python
"""Build the model parity fixtures ``tests/fixtures/parity/<model>.pt`` by running the AUTHORS'
code: OpenCOOD as packaged on PyPI (``opencoodx==0.1.19``). CI never runs this script; it reads
the files the script wrote (committed). ``tests/test_parity_opencood.py`` imports each fixture's
weights into our model (``opencood.interop.opencood_ckpt``) and compares head outputs.

Models (OpenCOOD's ``model.core_method``): ``point_pillar`` (no / early / late fusion: one
network), ``point_pillar_intermediate`` (AttFuse), ``point_pillar_fcooper`` (F-Cooper),
``point_pillar_v2vnet`` (V2VNet). For each, the script

1. takes OpenCOOD's own yaml for it (``point_pillar_early_fusion.yaml``,
   ``point_pillar_intermediate_fusion.yaml``, ``point_pillar_fcooper.yaml``,
   ``point_pillar_v2vnet.yaml``) and shrinks it (``SMALL``: a 25.6 x 12.8 m range, 8 points per
   pillar, a one-conv-per-scale backbone of 8-16 filters; the widths OpenCOOD hard-codes stay:
   64 pillar features, 384 (AttFuse, PointPillar) or 256 (F-Cooper, V2VNet) head inputs),
   then reads it with OpenCOOD's ``load_yaml`` (its ``yaml_parser`` derives the grid and the
   anchor sizes) and writes ``<model>.config.yaml`` as OpenCOOD's ``train.py`` does
   (``yaml.dump`` of the parsed hypes: numpy tags included);
2. builds the model with OpenCOOD's ``create_model`` and loads generated weights
   (``tests/parity_weights.py``: every floating tensor a hash of its key, exact in float32, so
   256-channel V2VNet and F-Cooper need not be stored; BatchNorm affine and running statistics
   drawn too, running_var in [0.5, 1.5), so they matter), ``strict=True``;
3. makes each agent's LiDAR points (clusters, where pillars fill all 8 point slots, plus sparse
   returns, where most slots are padding), pillarises them with OpenCOOD's
   ``SpVoxelPreprocessor`` (spconv) in test mode and collates them as its datasets do
   (``merge_features_to_dict`` and ``collate_batch``: ``voxel_coords`` [agent, z, y, x], the
   agents of a sample consecutive, ego first), with ``record_len`` [2, 1, 4] for the fusion
   models (3 single-agent samples for PointPillar) and ``pairwise_t_matrix`` (B, max_cav,
   max_cav, 4, 4) identities (``proj_first``, as OpenCOOD's intermediate dataset builds it);
4. runs the model's forward in eval mode, fp32, no grad, and saves::

       {"format": 1, "about": str, "reference": "opencoodx 0.1.19", "torch": str,
        "core_method": str, "config_yaml": "<model>.config.yaml",
        "state_dict": {key: tensor (integer buffers) | {"shape", "scale", "offset"}},
        "inputs": {"voxel_features", "voxel_coords", "voxel_num_points", "record_len",
                   "pairwise_t_matrix"},
        "outputs": {"psm": (B, A, H, W), "rm": (B, 7A, H, W)}}

   with ``torch.save`` (plain tensors, dicts, strings: ``torch.load(weights_only=True)`` reads
   it).

Models of other sources (``GITHUB_MODELS``, with the commit each fixture was made at) need
``--source CHECKOUT``, put first on ``sys.path`` (``timm``, ``icecream``, ``pypcd`` and the
Cython ``box_overlaps``, imported but never called here, are stubbed): DerrickXuNu/OpenCOOD for
``point_pillar_where2comm`` (its yaml: multi-scale, Gaussian smoothing) and
``point_pillar_cobevt`` (its yaml, shrunk to 2 blocks and a 64-wide FFN), yifanlu0227/CoAlign
for ``point_pillar_disconet`` (its ``opv2v/lidar_only_with_noise/pointpillar_disconet.yaml``;
its forward also reads the teacher's pillars and the poses, given as the same pillars and zeros;
no ``decoded`` step: its post-processor has a direction classifier), and its
``point_pillar_baseline_multiscale`` (CoAlign's fusion network: its
``coalign/pointpillar_coalign.yaml``, ``point_pillar_coalign.py`` subclasses the model
unchanged; the middle backbone stage given 2 blocks, ``att.feat_dim`` the small widths), fed
OWN-FRAME pillars with non-identity ``pairwise_t_matrix`` (float64, [b, i, j] agent i -> agent j,
agents 0.5-2.5 m and 1-5 degrees from the ego: ``own_frame_pairwise``), which its forward
normalises and warps with at every scale (fixtures only)::

    mkdir -p /tmp/OpenCOOD && git --git-dir=/work/.mirror/DerrickXuNu+OpenCOOD/repo archive \
        HEAD opencood | tar -x -C /tmp/OpenCOOD       # the same for CoAlign
    cd /tmp && env -u PYTHONPATH /work/refenv/bin/python \
        /path/to/checkout/tools/reference/make_model_parity_fixtures.py fixtures \
        --source /tmp/OpenCOOD --models point_pillar_where2comm point_pillar_cobevt
    # then ``decoded`` with the same flags; ``--source /tmp/CoAlign --models
    # point_pillar_disconet point_pillar_baseline_multiscale`` (fixtures only); ``export-check ... --source /tmp/OpenCOOD``

Where2comm's fixture also holds ``conf_logits`` (its cls head on each agent's own map) and
``comm_mask`` (N, 1, H, W); its cls head's generated weights are widened and its bias shifted
(``RECIPE_EDITS``) so that the confidence straddles the threshold, and its Gaussian kernel is
kept as OpenCOOD initialises it (``KEEP_INITIAL``).

Step ``fullsize`` writes, instead, a run folder exactly as OpenCOOD's training leaves it
(``config.yaml`` + ``net_epoch<N>.pth``, a bare state_dict) for OpenCOOD's full-width AttFuse
(its own ``point_pillar_intermediate_fusion.yaml``, default initialisation): the importer's
timing input (issue 24: under 5 s on 2 cores). Never committed (26 MB).

Run (the side environment of ``tools/reference/make_opv2v_fixture.py``, whose docstring has the
set-up commands; OpenCOOD's package is also called ``opencood``, so run from a folder outside
the checkout with PYTHONPATH unset; the script refuses to run when ``opencood`` is ours)::

    cd /tmp && env -u PYTHONPATH /work/refenv/bin/python \\
        /path/to/checkout/tools/reference/make_model_parity_fixtures.py fixtures \\
        --out /path/to/checkout/tests/fixtures/parity
    cd /tmp && env -u PYTHONPATH /work/refenv/bin/python \\
        /path/to/checkout/tools/reference/make_model_parity_fixtures.py fullsize --out /tmp/peer

Step ``decoded`` writes ``<model>.decoded.pt`` beside each fixture: OpenCOOD's anchors and
box decoding applied to the fixture's head outputs (``make_decoded``), for the decoding parity
test.

Step ``export-check`` takes folders written by our ``tools/export_checkpoint.py --to opencood``
and, for each, reads its ``config.yaml`` with OpenCOOD's ``load_yaml`` (its yaml_parser
included), builds the model with OpenCOOD's ``create_model`` and loads the newest
``net_epoch<N>.pth`` with ``load_state_dict(strict=True)``; with ``--fixtures`` it also runs the
fixture's inputs through it and compares the heads with the fixture's outputs (exact weights
round trip: equal bits expected). One line per folder; exit status 1 if any fails::

    cd /tmp && env -u PYTHONPATH /work/refenv/bin/python \
        /path/to/checkout/tools/reference/make_model_parity_fixtures.py export-check \
        /tmp/exported/point_pillar ... [--fixtures /path/to/checkout/tests/fixtures/parity]

Deterministic: rerunning it rewrites identical tensors.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PACKAGE = ("opencoodx", "0.1.19")

# OpenCOOD core_method -> (its yaml, record_len of the fixture batch)
MODELS = {
    "point_pillar": ("point_pillar_early_fusion.yaml", [1, 1, 1]),
    "point_pillar_intermediate": ("point_pillar_intermediate_fusion.yaml", [2, 1, 4]),
    "point_pillar_fcooper": ("point_pillar_fcooper.yaml", [2, 1, 4]),
    "point_pillar_v2vnet": ("point_pillar_v2vnet.yaml", [2, 1, 4]),
    "point_pillar_where2comm": ("point_pillar_where2comm.yaml", [2, 1, 4]),
    "point_pillar_disconet": ("opv2v/lidar_only_with_noise/pointpillar_disconet.yaml",
                              [2, 1, 4]),
    "point_pillar_cobevt": ("point_pillar_cobevt.yaml", [2, 1, 4]),
    # CoAlign's fusion network (its point_pillar_coalign.py subclasses this model unchanged;
    # its coalign yamls name this core_method)
    "point_pillar_baseline_multiscale": (
        "opv2v/lidar_only_with_noise/coalign/pointpillar_coalign.yaml", [2, 1, 4]),
}
# Models of other sources than opencoodx 0.1.19: made with ``--source CHECKOUT`` (a checkout of
# the repository at the commit named), put first on sys.path. -> the fixture's reference label.
GITHUB_MODELS = {"point_pillar_where2comm": "OpenCOOD github 31ba160",   # DerrickXuNu/OpenCOOD
                 "point_pillar_cobevt": "OpenCOOD github 31ba160",
                 "point_pillar_disconet": "CoAlign github 64d1987",      # yifanlu0227/CoAlign
                 "point_pillar_baseline_multiscale": "CoAlign github 64d1987"}
# Models fed own-frame pillars (proj_first: false) and non-identity pairwise transforms:
# CoAlign warps every agent's map at every scale into the ego frame itself.
OWN_FRAME_MODELS = ("point_pillar_baseline_multiscale",)
# CoAlign: a second block in the middle stage, so a residual block without a downsample
# shortcut is exercised too.
BACKBONE_EDITS = {"point_pillar_baseline_multiscale": {"layer_nums": [1, 2, 1]}}
# Where2comm: the confidence head's weights are widened and its bias shifted so that its
# smoothed confidence straddles the 0.01 threshold where the agents' maps differ (some cells
# sent, some not, not the same for every agent) with these generated weights.
RECIPE_EDITS = {"point_pillar_where2comm": {"cls_head.bias": {"offset": -4.75},
                                            "cls_head.weight": {"scale": 0.5}},
                # DiscoNet: edge scores spread over both signs, so the weights over agents
                # differ and the ReLU on the scores matters.
                "point_pillar_disconet": {
                    "fusion_net.pixel_weight_layer.conv1_4.weight": {"scale": 32.0},
                    "fusion_net.pixel_weight_layer.conv1_4.bias": {"scale": 0.5,
                                                                    "offset": -4.375}}}
# Tensors kept as the reference initialises them (stored as they are; a key containing one of
# the strings): Where2comm's Gaussian smoothing kernel, which its training never changes (no
# gradient reaches it); CoBEVT's relative-position index buffers (integers, constant).
KEEP_INITIAL = {"point_pillar_where2comm": ("fusion_net.naive_communication.gaussian_filter.",),
                "point_pillar_cobevt": (".relative_position_index",)}
SMALL_RANGE = [-12.8, -6.4, -3.0, 12.8, 6.4, 1.0]
SMALL_POINTS_PER_PILLAR = 8
SMALL_BACKBONE = {"layer_nums": [1, 1, 1], "layer_strides": [2, 2, 2], "num_filters": [8, 8, 16],
                  "upsample_strides": [1, 2, 4], "num_upsample_filter": [128, 128, 128]}
SEED = 24

ABOUT = ("Made by tools/reference/make_model_parity_fixtures.py from OpenCOOD ("
         "{version}, its {yaml} shrunk; config in {config}): weights generated by "
         "tests/parity_weights.py and loaded strict, pillars from its SpVoxelPreprocessor, "
         "collated as its datasets do, forward in eval mode, fp32. outputs psm/rm are its "
         "cls_head/reg_head maps (Where2comm also: conf_logits, its cls_head on each "
         "agent's own map, and comm_mask, its communication masks).")


# ---------------------------------------------------------------------------------------------
# The reference environment

def stub_unused_imports() -> None:
    """Imports of the GitHub sources that the fixtures never use: ``train_utils`` imports
    ``timm`` for its cosine learning-rate scheduler, the datasets' post-processor the Cython
    extension ``box_overlaps`` (for training targets; not built in a source checkout); CoAlign's
    transformation utilities import ``icecream`` (debug printing), its pcd reader ``pypcd``. Empty
    stand-ins (calling one fails) keep the models' and the collation's code as it is."""
    import types

    def unavailable(*args, **kwargs):
        raise RuntimeError("stubbed by make_model_parity_fixtures.py")

    for name in ("timm", "icecream"):          # CoAlign's transformation utils: icecream's ic
        try:
            __import__(name)
        except ImportError:
            sys.modules[name] = types.ModuleType(name)
            sys.modules[name].ic = unavailable
    try:                                      # CoAlign's pcd_utils: ``from pypcd import pypcd``
        import pypcd  # noqa: F401
    except ImportError:
        sys.modules["pypcd"] = types.ModuleType("pypcd")
        sys.modules["pypcd"].pypcd = types.ModuleType("pypcd.pypcd")
    overlaps = types.ModuleType("opencood.utils.box_overlaps")
    overlaps.bbox_overlaps = unavailable
    sys.modules["opencood.utils.box_overlaps"] = overlaps


def import_reference(source: Path | None = None):
    """OpenCOOD's ``opencood`` package; refuses ours (same name) with a one-line error.
    ``source``: a checkout of OpenCOOD's GitHub sources, imported instead of the package.
    -> (its root folder, the reference label written into the fixtures)."""
    from importlib import metadata
    if source is not None:
        sys.path.insert(0, str(source.resolve()))
        stub_unused_imports()
    try:
        import opencood
    except ImportError as exc:
        raise SystemExit(f"error: OpenCOOD is not importable here ({exc}); run with the side "
                         "environment's python (pip install opencoodx==0.1.19)")
    location = Path(opencood.__file__).resolve()
    if REPO_ROOT in location.parents or not (location.parent / "data_utils").is_dir():
        raise SystemExit(f"error: 'opencood' resolves to {location.parent}, not OpenCOOD's; run "
                         "from outside the checkout with PYTHONPATH unset")
    if source is not None:
        if source.resolve() not in location.parents:
            raise SystemExit(f"error: 'opencood' resolves to {location.parent}, not {source}")
        return location.parent, "github"
    version = metadata.version(REFERENCE_PACKAGE[0])
    if version != REFERENCE_PACKAGE[1]:
        print(f"warning: {REFERENCE_PACKAGE[0]} {version} installed; the fixtures were made "
              f"with {REFERENCE_PACKAGE[1]}", file=sys.stderr)
    return location.parent, f"{REFERENCE_PACKAGE[0]} {version}"


def load_parity_weights():
    """``tests/parity_weights.py`` by path (it imports numpy and torch only)."""
    path = REPO_ROOT / "tests" / "parity_weights.py"
    spec = importlib.util.spec_from_file_location("parity_weights", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_hypes(reference_root: Path, yaml_name: str, shrink: bool) -> tuple:
    """(hypes as OpenCOOD's train.py holds them, the text its setup_train writes).

    The raw yaml is edited (``shrink``), written to a temporary file and read back with
    OpenCOOD's ``load_yaml``, so its ``yaml_parser`` derives grid and anchors from the edit."""
    import yaml
    from opencood.hypes_yaml.yaml_utils import load_yaml

    source = reference_root / "hypes_yaml" / yaml_name
    load_yaml(str(source))           # registers OpenCOOD's float resolver on yaml.Loader
    with open(source) as stream:
        raw = yaml.load(stream, Loader=yaml.Loader)   # the reference's own loader, its yaml
    if shrink:
        raw = shrink_hypes(raw)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hypes.yaml"
        path.write_text(yaml.dump(raw))
        hypes = load_yaml(str(path))
    return hypes, yaml.dump(hypes)      # train_utils.setup_train: yaml.dump(hypes, outfile)


def shrink_hypes(raw: dict) -> dict:
    """The small-width, small-range edit of one of OpenCOOD's yamls (module docstring)."""
    # The yaml's anchors make these lists shared objects: edit them in place, everywhere.
    raw["preprocess"]["cav_lidar_range"][:] = SMALL_RANGE
    raw["preprocess"]["args"]["max_points_per_voxel"] = SMALL_POINTS_PER_PILLAR
    raw["preprocess"]["args"]["max_voxel_test"] = 4000
    raw["preprocess"]["args"]["max_voxel_train"] = 4000
    args = raw["model"]["args"]
    args["lidar_range"][:] = SMALL_RANGE
    args["base_bev_backbone"].update(SMALL_BACKBONE)
    args["base_bev_backbone"].update(BACKBONE_EDITS.get(raw["model"]["core_method"], {}))
    if "att" in args:                       # CoAlign: the attention's sqrt(dim) per scale
        args["att"]["feat_dim"] = list(args["base_bev_backbone"]["num_filters"])
    if "where2comm_fusion" in args:         # its own copies of the backbone lists
        args["where2comm_fusion"].update(layer_nums=SMALL_BACKBONE["layer_nums"],
                                         num_filters=SMALL_BACKBONE["num_filters"])
    if "fax_fusion" in args:                # CoBEVT: two blocks (still chained), a narrower FFN
        args["fax_fusion"].update(depth=2, mlp_dim=64)
    if "v2vfusion" in args:
        nx = round((SMALL_RANGE[3] - SMALL_RANGE[0]) / raw["preprocess"]["args"]["voxel_size"][0])
        ny = round((SMALL_RANGE[4] - SMALL_RANGE[1]) / raw["preprocess"]["args"]["voxel_size"][1])
        rate = args["v2vfusion"]["downsample_rate"]
        args["v2vfusion"]["conv_gru"].update({"H": ny // rate, "W": nx // rate})
    raw["name"] = raw["name"] + "_parity_small"
    return raw


# ---------------------------------------------------------------------------------------------
# Weights

def weight_recipes(model, weights) -> dict:
    """state_dict key -> integer tensor or generated-tensor recipe, by module kind."""
    import torch
    from torch import nn

    recipes = {}
    for module_name, module in model.named_modules():
        entries = list(module.named_parameters(recurse=False)) + \
            list(module.named_buffers(recurse=False))
        for name, tensor in entries:
            key = f"{module_name}.{name}" if module_name else name
            if not tensor.is_floating_point():
                recipes[key] = torch.full_like(tensor, 5)      # num_batches_tracked
                continue
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                scale, offset = {"weight": (0.25, 1.0), "bias": (0.25, 0.0),
                                 "running_mean": (0.25, 0.0),
                                 "running_var": (0.5, 1.0)}[name]
            elif name == "bias":
                scale, offset = 0.125, 0.0
            else:
                fan_in = tensor[0].numel() if not isinstance(module, nn.ConvTranspose2d) \
                    else tensor.shape[0]
                scale, offset = weights.power_of_two_scale(fan_in), 0.0
            recipes[key] = {"shape": list(tensor.shape), "scale": scale, "offset": offset}
    missing = set(model.state_dict()) - set(recipes)
    if missing:
        raise SystemExit(f"error: no recipe for {sorted(missing)[:3]}")
    return recipes


# ---------------------------------------------------------------------------------------------
# Inputs

def agent_points(rng, lidar_range) -> np.ndarray:
    """(N, 4) points of one agent: 3 dense clusters (pillars with every slot filled, some
    overflowing) and 50 scattered returns (pillars of 1-2 points: mostly padding), all inside
    the range."""
    xmin, ymin, zmin, xmax, ymax, zmax = lidar_range
    parts = []
    for _ in range(3):
        centre = rng.uniform([xmin + 2, ymin + 2], [xmax - 2, ymax - 2])
        cluster = np.empty((48, 4), np.float32)
        cluster[:, :2] = centre + rng.uniform(-0.4, 0.4, (48, 2))
        cluster[:, 2] = rng.uniform(-2.0, 0.0, 48)
        cluster[:, 3] = rng.uniform(0, 1, 48)
        parts.append(cluster)
    scattered = np.empty((50, 4), np.float32)
    scattered[:, 0] = rng.uniform(xmin + 0.05, xmax - 0.05, 50)
    scattered[:, 1] = rng.uniform(ymin + 0.05, ymax - 0.05, 50)
    scattered[:, 2] = rng.uniform(zmin + 0.05, zmax - 0.05, 50)
    scattered[:, 3] = rng.uniform(0, 1, 50)
    parts.append(scattered)
    return np.concatenate(parts)


def make_inputs(hypes: dict, record_len: list, seed: int) -> dict:
    """The model's input dict as OpenCOOD's datasets collate it."""
    import torch
    from opencood.data_utils.pre_processor.sp_voxel_preprocessor import SpVoxelPreprocessor

    rng = np.random.default_rng(seed)
    pre_processor = SpVoxelPreprocessor(hypes["preprocess"], train=False)
    per_agent = []
    for _ in range(sum(record_len)):
        voxels = pre_processor.preprocess(agent_points(rng, hypes["preprocess"]["cav_lidar_range"]))
        counts = voxels["voxel_num_points"]
        slots = np.arange(voxels["voxel_features"].shape[1])
        padding = voxels["voxel_features"][slots[None, :] >= counts[:, None]]
        assert not padding.any(), "spconv left values in padded point slots"
        per_agent.append(voxels)
    if hypes["model"]["core_method"] == "point_pillar":
        processed = pre_processor.collate_batch(per_agent)          # early / late: a list
    else:
        processed = pre_processor.collate_batch(merge_features_to_dict(per_agent))
    max_cav = hypes["train_params"].get("max_cav", 5)
    if hypes["model"]["core_method"] in OWN_FRAME_MODELS:
        pairwise = own_frame_pairwise(rng, record_len, max_cav)
    else:
        pairwise = np.zeros((len(record_len), max_cav, max_cav, 4, 4))
        pairwise[:, :] = np.identity(4)                             # proj_first
    data = {"processed_lidar": processed,
            "record_len": torch.from_numpy(np.array(record_len, dtype=int)),
            "pairwise_t_matrix": torch.from_numpy(pairwise)}
    if hypes["model"]["core_method"] == "point_pillar_disconet":
        # CoAlign's forward reads these too: the early-fusion teacher's pillars (used by its
        # loss only) and the poses (its noise; identity transforms here).
        data["teacher_processed_lidar"] = processed
        data["lidar_pose"] = torch.zeros(sum(record_len), 6, dtype=torch.float64)
        data["pairwise_t_matrix"] = data["pairwise_t_matrix"].float()
    if hypes["model"]["core_method"] == "point_pillar_cobevt":
        # Read by its forward, not used by the model: identities (proj_first).
        data["spatial_correction_matrix"] = torch.eye(4, dtype=torch.float64).repeat(
            len(record_len), max_cav, 1, 1)
    return data


def planar_pose(x: float, y: float, yaw_degrees: float) -> np.ndarray:
    """(4, 4) agent -> world of a pose on the ground plane."""
    yaw = np.deg2rad(yaw_degrees)
    pose = np.identity(4)
    pose[:2, :2] = [[np.cos(yaw), -np.sin(yaw)], [np.sin(yaw), np.cos(yaw)]]
    pose[:2, 3] = x, y
    return pose


def own_frame_pairwise(rng, record_len: list, max_cav: int) -> np.ndarray:
    """(B, max_cav, max_cav, 4, 4) float64 as CoAlign's ``get_pairwise_transformation`` builds it
    for ``proj_first: false``: entry [b, i, j] maps agent i's frame into agent j's
    (inv(T_j) @ T_i, T = agent -> world), identities elsewhere. Each agent of a sample sits a few
    cells (0.4 m pillars) and a few degrees from the ego, not on whole cells; the ego itself
    somewhere in the world (only relative poses matter)."""
    pairwise = np.tile(np.identity(4), (len(record_len), max_cav, max_cav, 1, 1))
    for b, count in enumerate(record_len):
        ego = planar_pose(*rng.uniform([-50, -50, -180], [50, 50, 180]))
        poses = [ego]
        for _ in range(count - 1):
            offset = rng.uniform(0.5, 2.5, 3) * rng.choice([-1, 1], 3)   # m, m, degrees
            offset[2] *= 2.0
            poses.append(ego @ planar_pose(*offset))
        for i in range(count):
            for j in range(count):
                if i != j:
                    pairwise[b, i, j] = np.linalg.solve(poses[j], poses[i])
    return pairwise


def merge_features_to_dict(per_agent: list) -> dict:
    """OpenCOOD's ``IntermediateFusionDataset.merge_features_to_dict``: the agents' pillar dicts
    -> one dict of per-agent lists, in agent order (CoAlign's datasets do the same, in a
    function its dataset factory closes over, so it is restated here)."""
    from collections import OrderedDict
    merged = OrderedDict()
    for features in per_agent:
        for name, value in features.items():
            merged.setdefault(name, [])
            merged[name] += value if isinstance(value, list) else [value]
    return merged


# ---------------------------------------------------------------------------------------------
# Steps

def capture_where2comm(model) -> dict:
    """Hooks recording Where2comm's per-agent confidence logits (``psm_single``: the cls head's
    first call) and its communication masks (N, 1, H, W) (ego cells 1)."""
    captured = {}

    def first_cls(module, inputs, output):
        captured.setdefault("conf_logits", output.detach().clone())

    def masks(module, inputs, output):
        captured["comm_mask"] = output[0].detach().clone()

    model.cls_head.register_forward_hook(first_cls)
    model.fusion_net.naive_communication.register_forward_hook(masks)
    return captured


def make_fixture(reference_root: Path, reference: str, core_method: str, out: Path) -> None:
    import torch
    from opencood.tools import train_utils

    yaml_name, record_len = MODELS[core_method]
    hypes, config_text = read_hypes(reference_root, yaml_name, shrink=True)
    assert hypes["model"]["core_method"] == core_method
    weights = load_parity_weights()
    torch.manual_seed(SEED)
    model = train_utils.create_model(hypes)
    recipes = weight_recipes(model, weights)
    for key, edit in RECIPE_EDITS.get(core_method, {}).items():
        recipes[key].update(edit)
    for key, tensor in model.state_dict().items():
        if any(part in key for part in KEEP_INITIAL.get(core_method, ())):
            recipes[key] = tensor.detach().clone()
    model.load_state_dict(weights.materialize(recipes), strict=True)
    model.eval()
    data = make_inputs(hypes, record_len, SEED)
    pairwise = data["pairwise_t_matrix"].clone()        # as given, whatever the forward does
    captured = capture_where2comm(model) if core_method == "point_pillar_where2comm" else {}
    with torch.no_grad():
        outputs = model(data)
    lidar = data["processed_lidar"]
    config_name = f"{core_method}.config.yaml"
    fixture = {
        "format": 1,
        "about": ABOUT.format(version=reference, yaml=yaml_name, config=config_name),
        "reference": reference,
        "torch": str(torch.__version__),
        "core_method": core_method,
        "config_yaml": config_name,
        "state_dict": recipes,
        "inputs": {"voxel_features": lidar["voxel_features"].contiguous(),
                   "voxel_coords": lidar["voxel_coords"].contiguous(),
                   "voxel_num_points": lidar["voxel_num_points"].contiguous(),
                   "record_len": data["record_len"],
                   "pairwise_t_matrix": pairwise},
        "outputs": {**head_outputs(outputs), **captured},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / config_name).write_text(config_text)
    torch.save(fixture, out / f"{core_method}.pt")
    torch.load(out / f"{core_method}.pt", weights_only=True)        # loads as the tests will
    outputs = head_outputs(outputs)
    full = lidar["voxel_num_points"] == SMALL_POINTS_PER_PILLAR
    sparse = lidar["voxel_num_points"] <= 2
    print(f"{core_method}: {len(recipes)} tensors, {lidar['voxel_features'].shape[0]} pillars "
          f"({int(full.sum())} full, {int(sparse.sum())} of 1-2 points), "
          f"psm {tuple(outputs['psm'].shape)}, "
          + (f"sent {float(captured['comm_mask'].mean()):.2f} of cells, " if captured else "")
          +
          f"{(out / f'{core_method}.pt').stat().st_size / 1024:.0f} KiB")


def head_outputs(outputs: dict) -> dict:
    """OpenCOOD's psm / rm (CoAlign names them cls_preds / reg_preds, and adds dir_preds, saved
    as dm)."""
    names = {"psm": "psm", "rm": "rm", "cls_preds": "psm", "reg_preds": "rm", "dir_preds": "dm"}
    return {names[key]: value.contiguous() for key, value in outputs.items() if key in names}


def make_fullsize_run(reference_root: Path, out: Path, epoch: int) -> None:
    """A run folder as OpenCOOD's train.py leaves it, for its full-width AttFuse."""
    import torch
    from opencood.tools import train_utils

    hypes, config_text = read_hypes(reference_root, "point_pillar_intermediate_fusion.yaml",
                                    shrink=False)
    torch.manual_seed(SEED)
    model = train_utils.create_model(hypes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(config_text)
    torch.save(model.state_dict(), out / f"net_epoch{epoch}.pth")   # as its train.py saves
    print(f"{out}: config.yaml, net_epoch{epoch}.pth ({len(model.state_dict())} tensors)")


DECODED_PER_SAMPLE = 64      # best-scored anchors kept per sample in <model>.decoded.pt


def make_decoded(out: Path, core_method: str) -> None:
    """``<model>.decoded.pt``: OpenCOOD's anchors and decoding (its VoxelPostprocessor's
    ``generate_anchor_box`` and ``delta_to_boxes3d``, sigmoid scores) applied to the fixture's
    head outputs: per sample the ``DECODED_PER_SAMPLE`` best-scored anchors (flat index in
    (H, W, A) order), their boxes [x, y, z, h, w, l, yaw] and scores. Pins anchor placement
    (stride 4 for V2VNet) and the decoding without a direction classifier."""
    import torch
    from opencood.data_utils.post_processor import build_postprocessor
    from opencood.hypes_yaml.yaml_utils import load_yaml

    hypes = load_yaml(str(out / f"{core_method}.config.yaml"))     # OpenCOOD's own reader
    postprocessor = build_postprocessor(hypes["postprocess"], train=False)
    anchors = torch.from_numpy(postprocessor.generate_anchor_box())
    fixture = torch.load(out / f"{core_method}.pt", weights_only=True)
    psm, rm = fixture["outputs"]["psm"], fixture["outputs"]["rm"]
    samples = []
    for b in range(psm.shape[0]):
        boxes = postprocessor.delta_to_boxes3d(rm[b:b + 1], anchors)[0]
        scores = torch.sigmoid(psm[b:b + 1].permute(0, 2, 3, 1)).reshape(-1)
        top = torch.topk(scores, DECODED_PER_SAMPLE).indices
        samples.append({"index": top, "boxes": boxes[top].contiguous(),
                        "scores": scores[top].contiguous()})
    torch.save({"format": 1, "core_method": core_method, "per_sample": samples},
               out / f"{core_method}.decoded.pt")
    print(f"{core_method}: decoded {len(samples)} samples, anchors {tuple(anchors.shape)}")


def newest_epoch_file(folder: Path) -> Path:
    import re
    epochs = sorted((int(m.group(1)), p) for p in folder.glob("net_epoch*.pth")
                    if (m := re.fullmatch(r"net_epoch(\d+)\.pth", p.name)))
    if not epochs:
        raise ValueError(f"{folder}: no net_epoch<N>.pth")
    return epochs[-1][1]


def export_check_one(folder: Path, fixtures: Path | None) -> str:
    """Build OpenCOOD's model from an exported folder and load its checkpoint strictly; a
    one-line report (raises on failure)."""
    import torch
    from opencood.hypes_yaml.yaml_utils import load_yaml
    from opencood.tools import train_utils

    hypes = load_yaml(str(folder / "config.yaml"))
    model = train_utils.create_model(hypes)
    path = newest_epoch_file(folder)
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    core_method = hypes["model"]["core_method"]
    report = f"{core_method}: create_model + load_state_dict(strict=True) OK ({len(state)} " \
             f"tensors, {path.name})"
    fixture_path = fixtures / f"{core_method}.pt" if fixtures else None
    if fixture_path is not None and fixture_path.is_file():
        fixture = torch.load(fixture_path, weights_only=True)
        inputs = fixture["inputs"]
        data = {"processed_lidar": {key: inputs[key] for key in
                                    ("voxel_features", "voxel_coords", "voxel_num_points")},
                "record_len": inputs["record_len"],
                "pairwise_t_matrix": inputs["pairwise_t_matrix"]}
        if core_method == "point_pillar_cobevt":        # read by its forward, unused
            data["spatial_correction_matrix"] = torch.eye(4, dtype=torch.float64).repeat(
                *inputs["pairwise_t_matrix"].shape[:2], 1, 1)
        with torch.no_grad():
            outputs = model.eval()(data)
        diffs = {name: float((outputs[name] - fixture["outputs"][name]).abs().max())
                 for name in ("psm", "rm")}
        report += f"; heads vs fixture max |diff| {diffs}"
    return report


def export_check(folders, fixtures: Path | None) -> int:
    failures = 0
    for folder in folders:
        try:
            print(f"{folder}: {export_check_one(Path(folder), fixtures)}")
        except Exception as error:          # one line per folder, every folder checked
            failures += 1
            print(f"{folder}: FAILED {type(error).__name__}: "
                  f"{str(error).splitlines()[0] if str(error) else ''}")
    return 1 if failures else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    fixtures = sub.add_parser("fixtures", help="tests/fixtures/parity/<model>.pt")
    fixtures.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "parity")
    fixtures.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    fullsize = sub.add_parser("fullsize", help="an OpenCOOD run folder of full-width AttFuse")
    fullsize.add_argument("--out", type=Path, required=True)
    fullsize.add_argument("--epoch", type=int, default=15)
    decoded = sub.add_parser("decoded", help="tests/fixtures/parity/<model>.decoded.pt")
    decoded.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "parity")
    decoded.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    check = sub.add_parser("export-check", help="OpenCOOD loads our exports strictly")
    check.add_argument("folders", nargs="+", type=Path)
    check.add_argument("--fixtures", type=Path, help="also run the fixtures' inputs")
    for step in (fixtures, decoded, check):
        step.add_argument("--source", type=Path,
                          help="a checkout of the sources of the models named in "
                               f"GITHUB_MODELS: {GITHUB_MODELS}")
    args = parser.parse_args(argv)
    source = getattr(args, "source", None)
    github_models = [m for m in getattr(args, "models", ()) if m in GITHUB_MODELS]
    if source is None and args.step != "export-check":
        if args.models == list(MODELS):
            args.models = [m for m in MODELS if m not in GITHUB_MODELS]
        elif github_models:
            parser.error(f"{', '.join(github_models)} need --source (OpenCOOD's GitHub sources)")
    reference_root, version = import_reference(source)
    if args.step == "export-check":
        raise SystemExit(export_check(args.folders, args.fixtures))
    if args.step == "decoded":
        for core_method in args.models:
            make_decoded(args.out, core_method)
        return
    if args.step == "fixtures":
        for core_method in args.models:
            reference = GITHUB_MODELS[core_method] if source else version
            make_fixture(reference_root, reference, core_method, args.out)
    else:
        make_fullsize_run(reference_root, args.out, args.epoch)


if __name__ == "__main__":
    main()
