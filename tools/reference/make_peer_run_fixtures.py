"""Make tests/fixtures/peer_runs/: HEAL's and V2V4Real's own config.yaml and state-dict key
structure for the models ``tools/import_checkpoint.py --from heal|v2v4real`` translates (or
refuses), at small widths. Never run in CI.

For each model: the authors' yaml (HEAL: ``hypes_yaml/opv2v/LiDAROnly/lidar_*.yaml``; V2V4Real:
``hypes_yaml/point_pillar_*.yaml``) with the widths and range made small, parsed by the
codebase's own ``yaml_utils.load_yaml`` (its ``yaml_parser`` adds the derived entries), dumped
as its ``train_utils.setup_train`` writes ``config.yaml`` (``yaml.dump``); its model built by its
own class from those hypes; the ``state_dict()`` keys and shapes saved (values are not needed:
the tests fill them). Output: ``<codebase>_<model>.config.yaml`` and ``state_shapes.json``.

Run from OUTSIDE the repository with the side environment and the authors' sources first on
PYTHONPATH, one codebase at a time::

    git --git-dir=/work/.mirror/yifanlu0227+HEAL/repo archive HEAD opencood | tar -x -C /tmp/heal_src
    cd /tmp && env -u PYTHONPATH PYTHONPATH=/tmp/heal_src /work/refenv/bin/python \
        REPO/tools/reference/make_peer_run_fixtures.py heal /tmp/heal_src REPO/tests/fixtures/peer_runs
    (likewise v2v4real with /tmp/v2v4real_src from ucla-mobility+V2V4Real)

Optional imports the LiDAR models never use (timm, torchvision, icecream) are stubbed.

For HEAL it also writes ``heal_<model>.parity.pt``: the model loaded with generated weights
(``tests/parity_weights.py``, recipes as ``make_model_parity_fixtures.weight_recipes``), run in
eval mode by HEAL's own ``forward`` on one batch of 3 samples with 1, 2 and 3 agents (pillars
from its ``SpVoxelPreprocessor``, identity pairwise transforms: the agents' maps share the ego
frame, so its ``proj_first: false`` warp is the identity), and its cls / reg / dir maps.
"""
import importlib
import importlib.util
import json
import sys
import tempfile
import types
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

RANGE = [-12.8, -6.4, -3.0, 12.8, 6.4, 1.0]
BACKBONE = {"layer_nums": [1, 1, 1], "layer_strides": [2, 2, 2], "num_filters": [8, 16, 32],
            "upsample_strides": [1, 2, 4], "num_upsample_filter": [16, 16, 16]}
SHRINK = {"kernal_size": [3], "stride": [1], "padding": [1], "dim": [32], "input_dim": 48}
# Both build their backbone for 64 input channels whatever the pillar width: the pillar layer stays
# at its published 64.
PILLAR = {"use_norm": True, "with_distance": False, "use_absolute_xyz": True, "num_filters": [64]}

HEAL_MODELS = {"fcooper": "lidar_fcooper.yaml", "attfuse": "lidar_attfuse.yaml",
               "v2vnet": "lidar_v2vnet.yaml"}
V2V4REAL_MODELS = {"early_fusion": "point_pillar_early_fusion.yaml",
                   "late_fusion": "point_pillar_late_fusion.yaml",
                   "intermediate_fusion": "point_pillar_intermediate_fusion.yaml",
                   "fcooper": "point_pillar_fcooper.yaml",
                   "v2vnet": "point_pillar_v2vnet.yaml"}


class _StubType(type):
    """A stand-in class whose attributes are stand-in classes (torchvision.transforms.X)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {"__init__": lambda self, *a, **k: None})


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubType(name, (), {"__init__": lambda self, *a, **k: None})


def import_with_stubs(module: str):
    for _ in range(20):
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name.startswith("opencood"):
                raise
            parts = error.name.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                sys.modules.setdefault(name, _Stub(name))
                sys.modules[name].__path__ = []
            for name in [n for n in sys.modules if n.startswith("opencood")]:
                del sys.modules[name]
    raise RuntimeError(module)


def small_heal(hypes: dict) -> dict:
    hypes["cav_lidar_range"] = RANGE
    setting = hypes["heter"]["modality_setting"]["m1"]
    setting["preprocess"]["cav_lidar_range"] = RANGE
    setting["preprocess"]["args"]["max_points_per_voxel"] = 8
    hypes["preprocess"]["cav_lidar_range"] = RANGE
    hypes["postprocess"]["gt_range"] = RANGE
    hypes["postprocess"]["anchor_args"]["cav_lidar_range"] = RANGE
    args = hypes["model"]["args"]
    args["lidar_range"] = RANGE
    m1 = args["m1"]
    m1["encoder_args"].update(lidar_range=RANGE, pillar_vfe=dict(PILLAR),
                              point_pillar_scatter={"num_features": 64})
    m1["backbone_args"] = dict(BACKBONE)
    stride = m1["shrink_header"]["stride"]
    m1["shrink_header"] = dict(SHRINK, stride=stride)
    args["in_head"] = 32
    if "att" in args:
        args["att"]["feat_dim"] = 32
    if "v2vnet" in args:
        args["v2vnet"]["in_channels"] = 32
        args["v2vnet"]["conv_gru"].update(H=8, W=16)
    return hypes


def small_v2v4real(hypes: dict) -> dict:
    old = hypes["preprocess"]["cav_lidar_range"]          # its z bounds go with its voxel height
    RANGE = [-12.8, -6.4, old[2], 12.8, 6.4, old[5]]
    hypes["preprocess"]["cav_lidar_range"] = RANGE
    hypes["preprocess"]["args"]["max_points_per_voxel"] = 8
    hypes["postprocess"]["anchor_args"]["cav_lidar_range"] = RANGE
    args = hypes["model"]["args"]
    args.update(lidar_range=RANGE, pillar_vfe=dict(PILLAR),
                point_pillar_scatter={"num_features": 64})
    # Its heads read 128 * 3 (point_pillar_intermediate) or 128 * 2 (fcooper, v2vnet) channels
    # whatever the yaml says: the upsampled width (3 x 128) and the shrink (256) stay full.
    args["base_bev_backbone"] = dict(BACKBONE, num_upsample_filter=[128, 128, 128],
                                     compression=0)
    if "shrink_header" in args:
        args["shrink_header"] = dict(SHRINK, stride=args["shrink_header"]["stride"], dim=[256],
                                     input_dim=384)
    args["compression"] = 0
    return hypes


def build(codebase: str, hypes: dict):
    if codebase == "heal":
        import_with_stubs("opencood.models.heter_encoders")   # imported by the model's __init__
        cls = import_with_stubs("opencood.models.heter_model_baseline").HeterModelBaseline
        return cls(hypes["model"]["args"])
    name = hypes["model"]["core_method"]
    module = import_with_stubs(f"opencood.models.{name}")
    cls = next(v for k, v in vars(module).items() if k.lower() == name.replace("_", ""))
    return cls(hypes["model"]["args"])


def heal_inputs(hypes: dict, record_len: list, seed: int, parity) -> dict:
    """HEAL's heter_model_baseline input dict for ``record_len`` samples (all agents m1)."""
    import numpy as np
    import torch
    SpVoxelPreprocessor = import_with_stubs(
        "opencood.data_utils.pre_processor.sp_voxel_preprocessor").SpVoxelPreprocessor

    preprocess = hypes["heter"]["modality_setting"]["m1"]["preprocess"]
    pre = SpVoxelPreprocessor(preprocess, train=False)
    rng = np.random.default_rng(seed)
    features, coords, counts = [], [], []
    for agent in range(sum(record_len)):
        voxels = pre.preprocess(parity.agent_points(rng, preprocess["cav_lidar_range"]))
        features.append(voxels["voxel_features"])
        coords.append(np.pad(voxels["voxel_coords"], ((0, 0), (1, 0)), constant_values=agent))
        counts.append(voxels["voxel_num_points"])
    max_cav = hypes["train_params"]["max_cav"]
    pairwise = np.zeros((len(record_len), max_cav, max_cav, 4, 4), np.float32)
    pairwise[:, :] = np.identity(4)
    return {"inputs_m1": {"voxel_features": torch.from_numpy(np.concatenate(features)),
                          "voxel_coords": torch.from_numpy(np.concatenate(coords)),
                          "voxel_num_points": torch.from_numpy(np.concatenate(counts))},
            "agent_modality_list": ["m1"] * sum(record_len),
            "record_len": torch.tensor(record_len),
            "pairwise_t_matrix": torch.from_numpy(pairwise)}


def heal_parity(model, hypes: dict, out: Path, name: str) -> None:
    import torch
    repo = Path(__file__).resolve().parents[2]
    weights = load_by_path("parity_weights", repo / "tests" / "parity_weights.py")
    parity = load_by_path("make_model_parity_fixtures",
                          repo / "tools" / "reference" / "make_model_parity_fixtures.py")
    recipes = parity.weight_recipes(model, weights)
    model.load_state_dict(weights.materialize(recipes), strict=True)
    model.eval()
    data = heal_inputs(hypes, [1, 2, 3], parity.SEED, parity)
    with torch.no_grad():
        outputs = model(data)
    torch.save({"about": "HEAL heter_model_baseline, tools/reference/make_peer_run_fixtures.py",
                "state_dict": recipes,
                "inputs": {**{k: v.contiguous() for k, v in data["inputs_m1"].items()},
                           "record_len": data["record_len"]},
                "outputs": {k: outputs[k].contiguous()
                            for k in ("cls_preds", "reg_preds", "dir_preds")}},
               out / f"heal_{name}.parity.pt")
    print("parity", name, {k: tuple(v.shape) for k, v in outputs.items()},
          f"{(out / f'heal_{name}.parity.pt').stat().st_size / 1024:.0f} KiB")


def main(codebase: str, source_root: str, out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    yaml_utils = import_with_stubs("opencood.hypes_yaml.yaml_utils")
    root = Path(source_root) / "opencood" / "hypes_yaml"
    models = HEAL_MODELS if codebase == "heal" else V2V4REAL_MODELS
    folder = root / "opv2v" / "LiDAROnly" if codebase == "heal" else root
    small = small_heal if codebase == "heal" else small_v2v4real
    shapes_path = out / "state_shapes.json"
    shapes = json.loads(shapes_path.read_text()) if shapes_path.exists() else {}
    for name, filename in models.items():
        raw = small(yaml.load((folder / filename).read_text(), Loader=yaml.Loader))
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
            yaml.dump(raw, handle)
        hypes = yaml_utils.load_yaml(handle.name)        # its yaml_parser, as train.py runs it
        model = build(codebase, hypes)
        with open(out / f"{codebase}_{name}.config.yaml", "w") as handle:
            yaml.dump(hypes, handle)                     # as its setup_train writes config.yaml
        shapes[f"{codebase}_{name}"] = [[k, list(v.shape)]
                                        for k, v in model.state_dict().items()]
        print(codebase, name, len(shapes[f"{codebase}_{name}"]), "tensors")
        if codebase == "heal":
            heal_parity(model, hypes, out, name)
    shapes_path.write_text(json.dumps(shapes, indent=0) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:4])
