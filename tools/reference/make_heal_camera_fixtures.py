#!/usr/bin/env python
"""Make ``tests/fixtures/peer_runs/heal_camera_<fusion>.*``: HEAL's camera-only cooperative runs
(``heter_model_baseline`` with one ``lift_splat_shoot`` camera modality, HEAL's
``hypes_yaml/opv2v/CameraOnly/camera_{fcooper,attfuse}.yaml``; AttFuse also with m4's
ResNet-101 camera encoder), shrunk, as its ``train.py``
leaves them, for ``tools/import_checkpoint.py --from heal``. Never run in CI.

Per model: the authors' yaml with widths and range made small (a 32 x 32 m grid of 1 m cells,
64 x 128 images, 10 LID depth bins from 1 to 25 m, 8 image channels, a 3-stage backbone of 8 /
16 / 32 filters, 32 channels after the shrinker), parsed by HEAL's own ``yaml_utils.load_yaml``
and dumped as its ``setup_train`` writes ``config.yaml``; HEAL's ``HeterModelBaseline`` built
from it; its state-dict keys and shapes added to ``state_shapes.json``; and
``heal_camera_<fusion>.parity.pt``: the model loaded with generated weights
(``tests/parity_weights.py``), run in eval mode by HEAL's own ``forward`` on one sample of two
camera agents (the two agents x two cameras of ``make_lss_parity_fixture.py``, identity
pairwise transforms, so its ``proj_first: false`` warp is the identity), its cls / reg / dir maps.

Run from OUTSIDE the checkout (side environment of make_lss_parity_fixture.py)::

    git --git-dir=/work/.mirror/yifanlu0227+HEAL/repo archive HEAD opencood | tar -x -C /tmp/heal
    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        CHECKOUT/tools/reference/make_heal_camera_fixtures.py /tmp/heal CHECKOUT/tests/fixtures/peer_runs
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
RANGE = [-16.0, -16.0, -3.0, 16.0, 16.0, 1.0]
GRID = {"xbound": [-16.0, 16.0, 1.0], "ybound": [-16.0, 16.0, 1.0], "zbound": [-10, 10, 20.0],
        "ddiscr": [1, 25, 10], "mode": "LID"}
BACKBONE = {"layer_nums": [1, 1, 1], "layer_strides": [2, 2, 2], "num_filters": [8, 16, 32],
            "upsample_strides": [1, 2, 4], "num_upsample_filter": [16, 16, 16], "inplanes": 8}
SHRINK = {"kernal_size": [3], "stride": [1], "padding": [1], "dim": [32], "input_dim": 48}
# name -> (HEAL's yaml, its camera_encoder: m2's EfficientNet or m4's Resnet101, fusion_method).
# HEAL's camera_fcooper.yaml says fusion_method: att (as camera_attfuse.yaml, its name
# notwithstanding): its F-Cooper fusion, max, is set here so that the fixtures cover it.
MODELS = {"fcooper": ("camera_fcooper.yaml", "EfficientNet", "max"),
          "attfuse": ("camera_attfuse.yaml", "EfficientNet", "att"),
          "attfuse_resnet": ("camera_attfuse.yaml", "Resnet101", "att")}


def small_hypes(hypes: dict, lss, camera_encoder: str, fusion_method: str) -> dict:
    """The CameraOnly yaml shrunk (module doc) with ``fusion_method``; every other key as the
    authors wrote it."""
    hypes["cav_lidar_range"] = RANGE
    hypes["preprocess"]["cav_lidar_range"] = RANGE
    hypes["preprocess"]["args"]["voxel_size"] = [1.0, 1.0, 4]
    hypes["postprocess"]["gt_range"] = RANGE
    hypes["postprocess"]["anchor_args"]["cav_lidar_range"] = RANGE
    setting = hypes["heter"]["modality_setting"]["m2"]
    setting["grid_conf"] = dict(GRID)
    setting["data_aug_conf"].update(final_dim=list(lss.IMAGE_SIZE))
    args = hypes["model"]["args"]
    args["lidar_range"] = RANGE
    m2 = args["m2"]
    m2["encoder_args"].update(grid_conf=dict(GRID), data_aug_conf=dict(setting["data_aug_conf"]),
                              img_features=8, camera_encoder=camera_encoder)
    m2["camera_mask_args"] = {"cav_lidar_range": RANGE, "grid_conf": dict(GRID)}
    m2["backbone_args"] = dict(BACKBONE)
    m2["shrink_header"] = dict(SHRINK, stride=m2["shrink_header"]["stride"])
    args["in_head"] = 32
    args["fusion_method"] = fusion_method
    if "att" in args:
        args["att"]["feat_dim"] = 32
    return hypes


def heal_inputs(hypes: dict, lss, weights, geometry) -> dict:
    """HEAL's heter_model_baseline input: one sample, the fixture's two camera agents (depth
    as a 4th image channel, as HEAL's camera dataset sends it with depth supervision)."""
    import numpy as np
    import torch
    case = {"depth_supervision": hypes["model"]["args"]["m2"]["encoder_args"]
            ["depth_supervision"]}
    image_inputs = lss.heal_image_inputs(case, weights, geometry)
    max_cav = hypes["train_params"]["max_cav"]
    pairwise = np.zeros((1, max_cav, max_cav, 4, 4), np.float32)
    pairwise[:, :] = np.identity(4)
    return {"inputs_m2": image_inputs, "agent_modality_list": ["m2", "m2"],
            "record_len": torch.tensor([2]), "pairwise_t_matrix": torch.from_numpy(pairwise)}


def main(source: str, out_dir: str) -> None:
    import torch
    torch.set_num_threads(1)
    out = Path(out_dir)
    lss = load_by_path("lss_fixture", REPO_ROOT / "tools/reference/make_lss_parity_fixture.py")
    weights = load_by_path("parity_weights", REPO_ROOT / "tests" / "parity_weights.py")
    helpers = load_by_path("model_parity", REPO_ROOT / "tools/reference/"
                                                    "make_model_parity_fixtures.py")
    modules, camera_utils, _ = lss.import_heal(Path(source))
    baseline = __import__("opencood.models.heter_model_baseline",
                          fromlist=["HeterModelBaseline"])
    yaml_utils = __import__("opencood.hypes_yaml.yaml_utils", fromlist=["load_yaml"])
    geometry = lss.make_geometry(camera_utils)
    folder = Path(source) / "opencood" / "hypes_yaml" / "opv2v" / "CameraOnly"
    shapes_path = out / "state_shapes.json"
    shapes = json.loads(shapes_path.read_text()) if shapes_path.exists() else {}
    for name, (filename, camera_encoder, fusion_method) in MODELS.items():
        raw = small_hypes(yaml.load((folder / filename).read_text(), Loader=yaml.Loader), lss,
                          camera_encoder, fusion_method)
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
            yaml.dump(raw, handle)
        hypes = yaml_utils.load_yaml(handle.name)         # its yaml_parser, as train.py runs it
        torch.manual_seed(0)
        model = baseline.HeterModelBaseline(hypes["model"]["args"])
        with open(out / f"heal_camera_{name}.config.yaml", "w") as handle:
            yaml.dump(hypes, handle)                      # as its setup_train writes config.yaml
        shapes[f"heal_camera_{name}"] = [[k, list(v.shape)]
                                         for k, v in model.state_dict().items()]
        recipes = helpers.weight_recipes(model, weights)
        model.load_state_dict(weights.materialize(recipes), strict=True)
        model.eval()
        inputs = heal_inputs(hypes, lss, weights, geometry)
        with torch.no_grad():
            outputs = model(inputs)
        path = out / f"heal_camera_{name}.parity.pt"
        torch.save({"about": "HEAL heter_model_baseline, camera modality m2 "
                             "(tools/reference/make_heal_camera_fixtures.py)",
                    "state_dict": recipes, "image_recipes": lss.image_recipes(),
                    "geometry": geometry,
                    "outputs": {k: outputs[k].contiguous()
                                for k in ("cls_preds", "reg_preds", "dir_preds")}}, path)
        print(name, len(recipes), "tensors;",
              {k: tuple(v.shape) for k, v in outputs.items() if hasattr(v, "shape")},
              f"{path.stat().st_size / 1024:.0f} KiB")
    shapes_path.write_text(json.dumps(shapes, indent=0) + "\n")
    print(f"stubbed: {', '.join(sorted(set(lss.STUBBED)))}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
