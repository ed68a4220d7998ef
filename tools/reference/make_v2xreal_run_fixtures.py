"""Make tests/fixtures/v2xreal_runs/: V2X-Real's own multi-class run folders (config.yaml as its
train.py writes it, the key structure of its models) and its models' head outputs, for
``tools/import_checkpoint.py --from v2xreal``. Never run in CI.

For each model: V2X-Real's yaml (``opencood/hypes_yaml/point_pillar_*.yaml``: three classes,
vehicle / pedestrian / truck, two yaws each) with the range and the backbone made small,
parsed by its own ``yaml_utils.load_yaml`` (its ``yaml_parser`` adds the derived entries) and
dumped with ``yaml.dump`` as its ``train_utils.setup_train`` writes ``config.yaml``; its model
built by its own class; generated weights (``tests/parity_weights.py`` recipes, as
``make_model_parity_fixtures.weight_recipes``: only the recipes are stored, the 256-channel
shrink and heads its classes hard-code cost nothing); its ``forward`` in eval mode on one batch
(pillars from its ``SpVoxelPreprocessor``; samples of 1, 2 and 3 agents for the fusion models,
two single-agent samples for ``point_pillar``; identity transforms: the agents' points are in
the ego frame) and its ``psm`` / ``rm`` maps. Also its anchors: ``VoxelPostprocessor.
generate_anchor_box`` stacked and permuted as its ``post_process`` flattens them, so the anchor
order (class-major per cell) is checked, not assumed. Output: ``<model>.config.yaml`` and
``<model>.parity.pt`` per model, and ``v2xreal_pillars.pt`` (the pillars, stored once for the
single-agent model and once for the four fusion models, which share them).

Run from OUTSIDE the repository with the side environment, V2X-Real's sources first on
PYTHONPATH::

    cd /tmp && env -u PYTHONPATH PYTHONPATH=/work/side/V2X-Real \
        /work/side/venv-v2xreal/bin/python REPO/tools/reference/make_v2xreal_run_fixtures.py \
        /work/side/V2X-Real REPO/tests/fixtures/v2xreal_runs

With ``--export-check FIXTURES FOLDER ...`` it instead loads folders our
``tools/export_checkpoint.py --to v2xreal`` wrote from imports of the fixtures (each folder's
name ends with the fixture's model name) with its own ``load_yaml``, model class and
``load_state_dict(strict=True)``, and runs the fixture's inputs (max |diff| of the heads).

(the side environment: torch 2.14.1, numpy, PyYAML, einops, spconv 2.3.8 + cumm 0.7.11 for
its pre-processor; matplotlib, imported and unused by its F-Cooper, is stubbed).
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO = Path(__file__).resolve().parents[2]
# 16 x 16 pillars of 0.4 m, 8 x 8 head cells (its voxel height 30 m stays: its z range goes
# with it).
SMALL_XY = [-3.2, -3.2, 3.2, 3.2]
# Its AttFusion scales by sqrt(num_filters[-1]) (256 published, the shrunk map's width): the last
# scale keeps its 256 channels so that the scale is the published one.
BACKBONE = {"layer_nums": [1, 1, 1], "layer_strides": [2, 2, 2], "num_filters": [8, 16, 256],
            "upsample_strides": [1, 2, 4], "num_upsample_filter": [128, 128, 128]}
POINTS_PER_PILLAR = 8
MODELS = {"early_fusion": "point_pillar_early_fusion.yaml",
          "late_fusion": "point_pillar_late_fusion.yaml",
          "attfuse": "point_pillar_intermediate_fusion.yaml",
          "fcooper": "point_pillar_fcooper.yaml",
          "v2vnet": "point_pillar_v2vnet.yaml",
          "v2xvit": "point_pillar_v2xvit.yaml"}
CONFIG_ONLY = ("early_fusion",)               # the late fusion network: no second parity file
RECORD_LEN = {"point_pillar": [1, 1]}           # early / late: one agent per sample
FUSION_RECORD_LEN = [1, 2, 3]
SEED = 38
PILLARS = "v2xreal_pillars.pt"      # each fixture's "inputs"["pillars"] names its entry here
# V2X-ViT's per-agent priors for samples of 1, 2 and 3 agents: (time delay in frames,
# infrastructure flag, velocity, its spatial correction (dx, dy metres, yaw degrees)); not the
# identity, so its STTF warp, delay encoding and type-dependent attention all take part.
V2XVIT_AGENTS = [
    [(0, 0, 0.30, (0.0, 0.0, 0.0))],
    [(0, 0, 0.10, (0.0, 0.0, 0.0)), (2, 1, 0.00, (1.6, -0.8, 5.0))],
    [(0, 0, 0.25, (0.0, 0.0, 0.0)), (1, 0, 0.40, (-0.8, 0.8, -3.0)),
     (3, 1, 0.00, (0.8, 1.6, 8.0))],
]


def small(hypes: dict) -> dict:
    """Its yaml with a 6.4 x 6.4 m range and a small backbone; everything else as published.
    Its fusion models' heads read 128 * 2 channels and point_pillar's 128 * 3 whatever the yaml
    says, so the upsampled width (3 x 128) and the shrink (256) stay full."""
    old = hypes["preprocess"]["cav_lidar_range"]
    lidar_range = [SMALL_XY[0], SMALL_XY[1], old[2], SMALL_XY[2], SMALL_XY[3], old[5]]
    hypes["preprocess"]["cav_lidar_range"] = lidar_range
    hypes["preprocess"]["args"]["max_points_per_voxel"] = POINTS_PER_PILLAR
    hypes["postprocess"]["anchor_args"]["cav_lidar_range"] = lidar_range
    args = hypes["model"]["args"]
    args["lidar_range"] = lidar_range
    args["base_bev_backbone"] = dict(BACKBONE)
    if "v2vfusion" in args:
        args["v2vfusion"]["conv_gru"].update(H=8, W=8)
    if "transformer" in args:
        v2xvit = load_by_path("make_v2xvit_parity_fixture",
                              REPO / "tools" / "reference" / "make_v2xvit_parity_fixture.py")
        small_transformer = v2xvit.SMALL_TRANSFORMER     # that fixture's small attention
        encoder = args["transformer"]["encoder"]
        encoder.update(depth=small_transformer["depth"],
                       num_blocks=small_transformer["num_blocks"])
        encoder["cav_att_config"].update(heads=small_transformer["heads"],
                                         dim_head=small_transformer["dim_head"])
        encoder["pwindow_att_config"].update(heads=small_transformer["window_heads"],
                                             dim_head=small_transformer["window_dim_heads"],
                                             window_size=small_transformer["window_size"])
        encoder["feed_forward"]["mlp_dim"] = small_transformer["mlp_dim"]
    return hypes


def v2xvit_priors(max_cav: int):
    """prior_encoding (B, max_cav, 3) [velocity, delay, infrastructure] and
    spatial_correction_matrix (B, max_cav, 4, 4), padded as its dataset pads (zeros,
    identities)."""
    import torch
    v2xvit = load_by_path("make_v2xvit_parity_fixture",
                          REPO / "tools" / "reference" / "make_v2xvit_parity_fixture.py")
    priors = np.zeros((len(V2XVIT_AGENTS), max_cav, 3), np.float32)
    corrections = np.tile(np.eye(4), (len(V2XVIT_AGENTS), max_cav, 1, 1))
    for b, agents in enumerate(V2XVIT_AGENTS):
        for i, (delay, infra, velocity, (dx, dy, yaw)) in enumerate(agents):
            priors[b, i] = [velocity, delay, infra]
            corrections[b, i] = v2xvit.correction(dx, dy, yaw)
    return torch.from_numpy(priors), torch.from_numpy(corrections)


def build(hypes: dict, stubs):
    name = hypes["model"]["core_method"]
    module = stubs.import_with_stubs(f"opencood.models.{name}")
    cls = next(v for k, v in vars(module).items() if k.lower() == name.replace("_", ""))
    return cls(hypes["model"]["args"])


def inputs(hypes: dict, record_len: list, parity, stubs) -> dict:
    """The model's input dict as V2X-Real's datasets collate it (its pre-processor's pillars;
    identity pairwise transforms)."""
    import torch
    SpVoxelPreprocessor = stubs.import_with_stubs(
        "opencood.data_utils.pre_processor.sp_voxel_preprocessor").SpVoxelPreprocessor
    pre = SpVoxelPreprocessor(hypes["preprocess"], train=False)
    rng = np.random.default_rng(SEED)
    per_agent = [pre.preprocess(parity.agent_points(rng, hypes["preprocess"]["cav_lidar_range"]))
                 for _ in range(sum(record_len))]
    if hypes["model"]["core_method"] == "point_pillar":
        processed = pre.collate_batch(per_agent)
    else:
        processed = pre.collate_batch(parity.merge_features_to_dict(per_agent))
    max_cav = hypes["train_params"].get("max_cav", 5)
    pairwise = np.zeros((len(record_len), max_cav, max_cav, 4, 4), np.float32)
    pairwise[:, :] = np.identity(4)
    return {"processed_lidar": processed, "record_len": torch.tensor(record_len),
            "pairwise_t_matrix": torch.from_numpy(pairwise)}


class _UnusedModules:
    """Finds its Cython box-overlap module (not built here) and its plotting helpers (open3d,
    matplotlib colour maps) as empty modules, however often the stub importer clears
    ``opencood`` from sys.modules: anchor generation uses neither."""
    NAMES = ("opencood.utils.box_overlaps", "opencood.visualization.vis_utils")

    def find_spec(self, name, path=None, target=None):
        if name not in self.NAMES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        import types
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        module.bbox_overlaps = None


def their_anchors(hypes: dict, stubs):
    """(H, W, K * R, 7) anchors in the order its post_process flattens them."""
    import torch
    VoxelPostprocessor = stubs.import_with_stubs(
        "opencood.data_utils.post_processor.voxel_postprocessor").VoxelPostprocessor
    post = VoxelPostprocessor(hypes["postprocess"], None, train=False)
    anchors, _ = post.generate_anchor_box()
    stacked = torch.from_numpy(np.stack(anchors)).float()        # (K, H, W, R, 7), as its dataset
    return stacked.permute(1, 2, 0, 3, 4).reshape(*stacked.shape[1:3], -1, 7).contiguous()


def main(source_root: str, out_dir: str) -> None:
    import torch
    sys.meta_path.insert(0, _UnusedModules())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stubs = load_by_path("make_peer_run_fixtures", REPO / "tools" / "reference" /
                         "make_peer_run_fixtures.py")
    for name in ("matplotlib", "matplotlib.pyplot"):
        sys.modules[name] = stubs._Stub(name)
    weights = load_by_path("parity_weights", REPO / "tests" / "parity_weights.py")
    parity = load_by_path("make_model_parity_fixtures",
                          REPO / "tools" / "reference" / "make_model_parity_fixtures.py")
    yaml_utils = stubs.import_with_stubs("opencood.hypes_yaml.yaml_utils")
    folder = Path(source_root) / "opencood" / "hypes_yaml"
    shared = {}                 # pillars by group, in PILLARS
    for name, filename in MODELS.items():
        raw = small(yaml.load((folder / filename).read_text(), Loader=yaml.Loader))
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
            yaml.dump(raw, handle)
        hypes = yaml_utils.load_yaml(handle.name)        # its yaml_parser, as train.py runs it
        with open(out / f"{name}.config.yaml", "w") as handle:
            yaml.dump(hypes, handle)                     # as its setup_train writes config.yaml
        if name in CONFIG_ONLY:
            continue
        model = build(hypes, stubs)
        recipes = parity.weight_recipes(model, weights)
        model.load_state_dict(weights.materialize(recipes), strict=True)
        model.eval()
        record_len = RECORD_LEN.get(hypes["model"]["core_method"], FUSION_RECORD_LEN)
        data = inputs(hypes, record_len, parity, stubs)
        extra = {}
        if "transformer" in hypes["model"]["args"]:
            assert [len(a) for a in V2XVIT_AGENTS] == record_len
            extra["prior_encoding"], extra["spatial_correction_matrix"] = \
                v2xvit_priors(hypes["train_params"]["max_cav"])
            data.update(extra)
        with torch.no_grad():
            outputs = model(data)
        group = "point_pillar" if name == "late_fusion" else "fusion"
        pillars = {k: v.contiguous() for k, v in data["processed_lidar"].items()}
        if group in shared:             # the same pillars (same seed and range): stored once
            assert all(torch.equal(shared[group][k], pillars[k]) for k in pillars)
        shared[group] = pillars
        fixture = {"about": f"V2X-Real {hypes['model']['core_method']} ({filename}, small), "
                            "tools/reference/make_v2xreal_run_fixtures.py",
                   "state_dict": recipes,
                   "inputs": {"pillars": group, "record_len": data["record_len"], **extra},
                   "outputs": {k: outputs[k].contiguous() for k in ("psm", "rm")}}
        if name == "attfuse":
            fixture["anchors"] = their_anchors(hypes, stubs)
        torch.save(fixture, out / f"{name}.parity.pt")
        print(name, len(recipes), "tensors", {k: tuple(v.shape) for k, v in outputs.items()},
              f"{(out / f'{name}.parity.pt').stat().st_size / 1024:.0f} KiB")
    torch.save(shared, out / PILLARS)


def export_check(fixtures: str, folders) -> None:
    """Each folder written by our ``tools/export_checkpoint.py --to v2xreal`` from an import of
    the fixture ``<model>`` (the folder's name ends with it): its config.yaml read by its own
    ``load_yaml``, its model built and the newest ``net_epoch<N>.pth`` loaded with
    ``strict=True``, the fixture's inputs run: the heads must be the fixture's."""
    import torch
    sys.meta_path.insert(0, _UnusedModules())
    stubs = load_by_path("make_peer_run_fixtures", REPO / "tools" / "reference" /
                         "make_peer_run_fixtures.py")
    for name in ("matplotlib", "matplotlib.pyplot"):
        sys.modules[name] = stubs._Stub(name)
    yaml_utils = stubs.import_with_stubs("opencood.hypes_yaml.yaml_utils")
    for folder in map(Path, folders):
        name = next(model for model in MODELS if folder.name.endswith(model))
        fixture = torch.load(Path(fixtures) / f"{name}.parity.pt", weights_only=True)
        hypes = yaml_utils.load_yaml(str(folder / "config.yaml"))
        model = build(hypes, stubs)
        newest = max(folder.glob("net_epoch*.pth"),
                     key=lambda path: int(path.stem[len("net_epoch"):]))
        model.load_state_dict(torch.load(newest, map_location="cpu"), strict=True)
        inputs = fixture["inputs"]
        pillars = torch.load(Path(fixtures) / PILLARS, weights_only=True)[inputs["pillars"]]
        data = {"processed_lidar": pillars,
                "record_len": inputs["record_len"],
                "pairwise_t_matrix": torch.eye(4).repeat(
                    len(inputs["record_len"]), hypes["train_params"].get("max_cav", 5),
                    hypes["train_params"].get("max_cav", 5), 1, 1)}
        data.update({key: inputs[key] for key in ("prior_encoding", "spatial_correction_matrix")
                     if key in inputs})
        with torch.no_grad():
            outputs = model.eval()(data)
        diffs = {key: float((outputs[key] - fixture["outputs"][key]).abs().max())
                 for key in ("psm", "rm")}
        print(f"export-check {folder}: {hypes['model']['core_method']} loaded strict, "
              f"max |diff| {diffs}")


if __name__ == "__main__":
    if sys.argv[1] == "--export-check":
        export_check(sys.argv[2], sys.argv[3:])
    else:
        main(*sys.argv[1:3])
