"""Every shipped experiment config loads, validates and builds its model and dataset class."""
from pathlib import Path

import pytest

import opencood.data.datasets  # noqa: F401  (registers the fusion datasets)
from opencood.config import load_config
from opencood.models.build import build_model
from opencood.ops.voxelize import grid_size
from opencood.registry import DATASETS

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("hypes_yaml/*/*.yaml"))
FUSION_TO_MODEL = {"no": "point_pillar", "early": "point_pillar", "late": "point_pillar",
                   "intermediate": "point_pillar_intermediate"}
HETER_FUSION_TO_MODEL = {"late": "heter_pyramid_single", "intermediate": "heter_pyramid_collab"}


def test_both_families_ship_every_model():
    names = {(path.parent.name, path.stem) for path in CONFIGS}
    for family in ("synthetic", "opv2v"):
        for model in ("no_fusion", "early_fusion", "late_fusion", "attfuse", "fcooper",
                      "where2comm"):
            assert (family, f"point_pillar_{model}") in names
    assert ("synthetic", "smoke") in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_config_builds(path):
    cfg = load_config(path)
    fusion = cfg["fusion"]["core_method"]
    assert fusion in DATASETS
    # heterogeneous agents (a heter section): HEAL's pyramid models (§4.5)
    expected = HETER_FUSION_TO_MODEL[fusion] if cfg.get("heter") else FUSION_TO_MODEL[fusion]
    assert cfg["model"]["core_method"] == expected
    model = build_model(cfg["model"])
    assert sum(p.numel() for p in model.parameters()) > 0
    # The pillar grid must reduce by the backbone's total stride (8) without remainder.
    nx, ny, _ = grid_size(cfg["preprocess"]["cav_lidar_range"],
                          cfg["preprocess"]["args"]["voxel_size"])
    assert nx % 8 == 0 and ny % 8 == 0


def test_opv2v_family_has_the_opv2v_geometry():
    cfg = load_config(Path(CONFIGS[0]).parents[1] / "opv2v" / "point_pillar_attfuse.yaml")
    assert grid_size(cfg["preprocess"]["cav_lidar_range"],
                     cfg["preprocess"]["args"]["voxel_size"]) == (704, 200, 1)


CAMERA_CONFIGS = [path for path in CONFIGS if path.stem.startswith("camera_")
                  and path.stem != "camera_base"]


def test_both_families_ship_the_camera_models():
    names = {(path.parent.name, path.stem) for path in CAMERA_CONFIGS}
    for family in ("synthetic", "opv2v"):
        for model in ("no_fusion", "late_fusion", "attfuse", "fcooper", "v2xvit", "cobevt"):
            assert (family, f"camera_{model}") in names


@pytest.mark.parametrize("path", CAMERA_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_camera_config_feeds_the_encoder_the_images_the_reader_makes(path):
    """The reader resizes and crops every image to camera.data_aug_conf.final_dim; the lss
    encoder's frustum is built for image_size: the two must be one size, and no .pcd is read.
    Depth supervision is all three keys or none: depth images read, the encoder's depth
    outputs, the loss's depth term."""
    cfg = load_config(path)
    encoder = cfg["model"]["args"]["encoder"]
    assert encoder["core_method"] == "lss"
    assert "camera" in cfg["input_source"] and "lidar" not in cfg["input_source"]
    supervised = encoder["args"]["depth_supervision"]
    assert supervised == ("depth" in cfg["input_source"]) == (cfg["loss"]["args"]["depth"]
                                                              is not None)
    assert list(cfg["camera"]["data_aug_conf"]["final_dim"]) == list(encoder["args"]["image_size"])
