#!/usr/bin/env python
"""Build ``tests/fixtures/parity/point_pillar_transformer.pt`` by running the AUTHORS' V2X-ViT:
the sources of https://github.com/DerrickXuNu/v2x-vit (package ``v2xvit``; its
``models/point_pillar_transformer.py`` with STTF, RTE, HMSA and MSwin). CI never runs this
script; ``tests/test_parity_v2xvit.py`` reads what it wrote.

The recipe is that of ``make_model_parity_fixtures.py`` (whose helpers it loads by path):

1. the authors' ``hypes_yaml/point_pillar_v2xvit.yaml``, shrunk (``shrink``: the same 25.6 x
   12.8 m range, 8 points per pillar and one-conv backbone as the OpenCOOD fixtures; a 16 x 8
   map after the shrink header, so windows 2 / 4 / 8 (their MSwin needs sizes that divide the
   map); 2 HMSA heads of 8, window heads 2 / 2 / 1 of 8 / 8 / 16, feed-forward 32, depth 2).
   The widths the authors hard-code stay: 256 channels (``SplitAttn(256)``, the 256-input
   heads). Read with the authors' ``load_yaml`` and written, parsed, to
   ``point_pillar_transformer.config.yaml``;
2. their ``PointPillarTransformer`` with generated weights (``tests/parity_weights.py``),
   loaded ``strict=True``: every tensor is stored as a recipe, so the fixture stays small;
3. pillars from OpenCOOD's ``SpVoxelPreprocessor`` (opencoodx 0.1.19: the same code as
   v2xvit's), collated as their intermediate dataset does, ``record_len`` [2, 1, 4]; the
   per-sample inputs their dataset adds: ``prior_encoding`` (B, max_cav, 3) = [velocity,
   time delay in frames, infrastructure flag] and ``spatial_correction_matrix``
   (B, max_cav, 4, 4), padded with identities. The non-ego agents get delays 1 to 3,
   infrastructure in two samples, and corrections that are not the identity: whole- and
   half-cell translations (the feature cell is 1.6 m) and rotations of 3 to 8 degrees;
4. forward in eval mode, fp32, no grad; saved as::

       {"format": 1, "about", "reference": "v2x-vit <commit>", "torch", "core_method":
        "point_pillar_transformer", "config_yaml", "state_dict": {key: recipe or tensor},
        "inputs": {"voxel_features", "voxel_coords", "voxel_num_points", "record_len",
                   "prior_encoding", "spatial_correction_matrix"},
        "outputs": {"psm", "rm"}}

Run (the side environment; v2xvit sources first on PYTHONPATH, from outside the checkout)::

    git --git-dir=/work/.mirror/DerrickXuNu+v2x-vit/repo archive HEAD | tar -x -C /tmp/v2xvit_src
    cd /tmp && env -u PYTHONPATH PYTHONPATH=/tmp/v2xvit_src /work/refenv/bin/python \\
        /path/to/checkout/tools/reference/make_v2xvit_parity_fixture.py \\
        --out /path/to/checkout/tests/fixtures/parity --commit <v2x-vit commit>

With ``--export-check FOLDER ...`` it instead takes folders written by our
``tools/export_checkpoint.py --to opencood`` from a V2X-ViT run, reads each ``config.yaml`` with
the authors' ``load_yaml``, builds their ``PointPillarTransformer``, loads the newest
``net_epoch<N>.pth`` with ``strict=True`` and runs the fixture's inputs through it (max |diff|
of the heads against the fixture; equal bits expected for a fixture imported and exported).

Deterministic: rerunning it rewrites identical tensors.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
CORE_METHOD = "point_pillar_transformer"
RECORD_LEN = [2, 1, 4]
# per sample, per agent (ego first): delay frames, infrastructure flag, velocity / 30,
# correction (dx m, dy m, yaw degrees)
AGENTS = [
    [(0, 0, 0.30, (0.0, 0.0, 0.0)), (2, 1, 0.00, (3.2, -1.6, 5.0))],
    [(0, 0, 0.10, (0.0, 0.0, 0.0))],
    [(0, 0, 0.25, (0.0, 0.0, 0.0)), (1, 0, 0.40, (-2.4, 0.8, -3.0)),
     (3, 1, 0.00, (1.6, 2.4, 8.0)), (1, 0, 0.20, (0.0, 0.0, 0.0))],
]
SMALL_TRANSFORMER = {"depth": 2, "num_blocks": 1, "heads": 2, "dim_head": 8,
                     "window_size": [2, 4, 8], "window_heads": [2, 2, 1],
                     "window_dim_heads": [8, 8, 16], "mlp_dim": 32}
ABOUT = ("Made by tools/reference/make_v2xvit_parity_fixture.py from the authors' V2X-ViT "
         "(github.com/DerrickXuNu/v2x-vit {commit}, its point_pillar_v2xvit.yaml shrunk; config in "
         "{config}): generated weights loaded strict, pillars from OpenCOOD's "
         "SpVoxelPreprocessor, prior_encoding and spatial_correction_matrix as its "
         "intermediate dataset collates them (non-identity corrections, delays, infrastructure), "
         "forward in eval mode, fp32. outputs psm/rm are its cls_head/reg_head maps.")


def shrink(raw: dict, small_range, points_per_pillar: int, backbone: dict) -> dict:
    """The small edit of the authors' yaml (module docstring)."""
    raw["preprocess"]["cav_lidar_range"][:] = small_range   # shared by the yaml's anchors
    raw["preprocess"]["args"].update(max_points_per_voxel=points_per_pillar,
                                     max_voxel_train=4000, max_voxel_test=4000)
    args = raw["model"]["args"]
    args["base_bev_backbone"].update(backbone)
    encoder = args["transformer"]["encoder"]
    small = SMALL_TRANSFORMER
    encoder.update(depth=small["depth"], num_blocks=small["num_blocks"])
    encoder["cav_att_config"].update(heads=small["heads"], dim_head=small["dim_head"])
    encoder["pwindow_att_config"].update(heads=small["window_heads"],
                                         dim_head=small["window_dim_heads"],
                                         window_size=small["window_size"])
    encoder["feed_forward"]["mlp_dim"] = small["mlp_dim"]
    raw["name"] = raw["name"] + "_parity_small"
    return raw


def read_hypes(source_root: Path, helpers) -> tuple:
    import yaml
    from v2xvit.hypes_yaml.yaml_utils import load_yaml

    source = source_root / "v2xvit" / "hypes_yaml" / "point_pillar_v2xvit.yaml"
    load_yaml(str(source))                       # registers its float resolver on yaml.Loader
    with open(source) as stream:
        raw = yaml.load(stream, Loader=yaml.Loader)
    raw = shrink(raw, helpers.SMALL_RANGE, helpers.SMALL_POINTS_PER_PILLAR,
                 helpers.SMALL_BACKBONE)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "hypes.yaml"
        path.write_text(yaml.dump(raw))
        hypes = load_yaml(str(path))
    return hypes, yaml.dump(hypes)


def correction(dx: float, dy: float, yaw_degrees: float) -> np.ndarray:
    """4x4: a rotation about z by ``yaw_degrees`` then a translation (dx, dy) metres."""
    yaw = math.radians(yaw_degrees)
    matrix = np.eye(4)
    matrix[:2, :2] = [[math.cos(yaw), -math.sin(yaw)], [math.sin(yaw), math.cos(yaw)]]
    matrix[:2, 3] = [dx, dy]
    return matrix


def sample_priors(max_cav: int) -> tuple:
    """prior_encoding (B, max_cav, 3) float32 and spatial_correction_matrix (B, max_cav, 4, 4)
    float64, padded as the authors' dataset pads (zeros, identities)."""
    import torch
    priors = np.zeros((len(AGENTS), max_cav, 3), np.float32)
    corrections = np.tile(np.eye(4), (len(AGENTS), max_cav, 1, 1))
    for b, agents in enumerate(AGENTS):
        for i, (delay, infra, velocity, (dx, dy, yaw)) in enumerate(agents):
            priors[b, i] = [velocity, delay, infra]
            corrections[b, i] = correction(dx, dy, yaw)
    return torch.from_numpy(priors), torch.from_numpy(corrections)


def export_check(folders, fixture_path: Path) -> int:
    """Their model from each exported folder, loaded strictly, on the fixture's inputs."""
    import torch
    from v2xvit.hypes_yaml.yaml_utils import load_yaml
    from v2xvit.models.point_pillar_transformer import PointPillarTransformer

    fixture = torch.load(fixture_path, weights_only=True)
    inputs = fixture["inputs"]
    data = {"processed_lidar": {key: inputs[key] for key in
                                ("voxel_features", "voxel_coords", "voxel_num_points")},
            **{key: inputs[key] for key in ("record_len", "prior_encoding",
                                            "spatial_correction_matrix")}}
    failures = 0
    for folder in map(Path, folders):
        try:
            hypes = load_yaml(str(folder / "config.yaml"))
            model = PointPillarTransformer(hypes["model"]["args"])
            path = max(folder.glob("net_epoch*.pth"), key=lambda p: int(p.stem[9:]))
            model.load_state_dict(torch.load(path, weights_only=True), strict=True)
            with torch.no_grad():
                outputs = model.eval()(data)
            diffs = {k: float((outputs[k] - fixture["outputs"][k]).abs().max())
                     for k in ("psm", "rm")}
            print(f"{folder}: PointPillarTransformer + load_state_dict(strict=True) OK "
                  f"({path.name}); heads vs fixture max |diff| {diffs}")
        except Exception as error:          # one line per folder
            failures += 1
            print(f"{folder}: FAILED {type(error).__name__}: {error}")
    return 1 if failures else 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "parity")
    parser.add_argument("--commit", help="the v2x-vit commit the sources are at")
    parser.add_argument("--export-check", nargs="+", metavar="FOLDER")
    args = parser.parse_args(argv)
    if args.export_check:
        raise SystemExit(export_check(args.export_check, args.out / f"{CORE_METHOD}.pt"))
    if not args.commit:
        parser.error("--commit is required to build the fixture")

    import torch
    import v2xvit
    from v2xvit.models.point_pillar_transformer import PointPillarTransformer

    assert [len(a) for a in AGENTS] == RECORD_LEN
    source_root = Path(v2xvit.__file__).resolve().parents[1]
    helpers = load_by_path("make_model_parity_fixtures",
                           REPO_ROOT / "tools" / "reference" / "make_model_parity_fixtures.py")
    helpers.import_reference()                  # OpenCOOD's pillariser and collate
    weights = helpers.load_parity_weights()
    hypes, config_text = read_hypes(source_root, helpers)
    torch.manual_seed(helpers.SEED)
    model = PointPillarTransformer(hypes["model"]["args"])
    recipes = helpers.weight_recipes(model, weights)
    model.load_state_dict(weights.materialize(recipes), strict=True)
    model.eval()

    data = helpers.make_inputs(hypes, RECORD_LEN, helpers.SEED)
    priors, corrections = sample_priors(hypes["train_params"]["max_cav"])
    data.pop("pairwise_t_matrix")
    data["prior_encoding"] = priors
    data["spatial_correction_matrix"] = corrections
    with torch.no_grad():
        outputs = model(data)
    lidar = data["processed_lidar"]
    config_name = f"{CORE_METHOD}.config.yaml"
    fixture = {
        "format": 1,
        "about": ABOUT.format(commit=args.commit, config=config_name),
        "reference": f"v2x-vit {args.commit}",
        "torch": str(torch.__version__),
        "core_method": CORE_METHOD,
        "config_yaml": config_name,
        "state_dict": recipes,
        "inputs": {"voxel_features": lidar["voxel_features"].contiguous(),
                   "voxel_coords": lidar["voxel_coords"].contiguous(),
                   "voxel_num_points": lidar["voxel_num_points"].contiguous(),
                   "record_len": data["record_len"],
                   "prior_encoding": priors, "spatial_correction_matrix": corrections},
        "outputs": {"psm": outputs["psm"].contiguous(), "rm": outputs["rm"].contiguous()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / config_name).write_text(config_text)
    path = args.out / f"{CORE_METHOD}.pt"
    torch.save(fixture, path)
    torch.load(path, weights_only=True)
    print(f"{CORE_METHOD}: {len(recipes)} tensors, {lidar['voxel_features'].shape[0]} pillars, "
          f"psm {tuple(outputs['psm'].shape)} std {float(outputs['psm'].std()):.3g}, "
          f"{path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
