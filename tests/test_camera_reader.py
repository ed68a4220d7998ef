"""Camera inputs: our readers and datasets against HEAL's own camera data set code, sample by
sample, and the geometry the batch's matrices must keep.

The fixtures (tests/fixtures/camera_reader/*.npz) hold what HEAL's intermediate fusion data set
(``input_source: [camera]``, ``fusion.args.data_aug_conf``) hands its lift-splat models on our
tiny synthetic camera folders (V2XSet's layout with a roadside unit; DAIR-V2X-C): per agent the
normalised images, intrinsics, camera -> agent extrinsics, post_rots and post_trans, in
evaluation (fixed resize and centre crop) and in training (draws from the generator our dataset
uses: seed, camera stream, epoch, index); made by tools/reference/make_camera_reader_fixture.py
in a side environment. We regenerate the folders and read them through our config and
``build_dataset``: images equal to 1e-6, matrices to 1e-8.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from opencood.config import load_config
from opencood.data import cameras, datasets
from opencood.data.cameras import (CameraFileError, ImageAugmentation, camera_inputs,
                                   image_augmentation_matrices)
from opencood.data.formats import get_format
from opencood.errors import ConfigError
from opencood.ops.transforms import boxes_to_corners_3d
from opencood.strategies import choose_strategy
from tests.reference_fixtures import load_npz_fixture
from tests.tool_modules import load_tool


def build_dataset(cfg, split, train, **options):
    """The dataset of the config's own strategy (the engine's choice)."""
    return datasets.build_dataset(cfg, split, train=train, strategy=choose_strategy(cfg),
                                  **options)


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "camera_reader"
IMAGE_TOL, MATRIX_TOL = 1e-6, 1e-8
MATRIX_KEYS = ("intrinsics", "extrinsics", "post_rots", "post_trans")
CONFIG = "hypes_yaml/synthetic/point_pillar_attfuse.yaml"


def _fixture(name: str) -> tuple[dict, dict]:
    return load_npz_fixture(FIXTURES / f"{name}.npz")


pytestmark = pytest.mark.usefixtures("private_point_cache")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The folders the fixtures were made from (the script's own generation, deterministic)."""
    tool = load_tool("reference/make_camera_reader_fixture")
    return tool.generate_folders(tmp_path_factory.mktemp("camera_reader"))


def _split_dir(name: str, root: Path) -> Path:
    """The validation split of the fixture's folders (the format's own layout)."""
    return get_format(name).split_paths(root)[1]


def camera_config(split_dir, conf: dict, *extra: str, seed: int = 0) -> dict:
    """A camera-only intermediate config on ``split_dir``: own-frame agents, no BEV
    augmentation, no pose noise (HEAL's camera path has neither)."""
    return load_config(CONFIG, [f"root_dir={split_dir}", f"validate_dir={split_dir}",
                                "input_source=[camera]", f"camera={{data_aug_conf: {json.dumps(conf)}}}",
                                "fusion.args.proj_first=false", "data_augment=[]",
                                f"seed={seed}", *extra])


@pytest.mark.parametrize("name", ["v2xset", "dairv2x"])
def test_camera_inputs_equal_heal_sample_by_sample(folders, name):
    reference, meta = _fixture(name)
    dataset_key = "dairv2x" if name == "dairv2x" else "v2xset"
    cfg = camera_config(_split_dir(name, folders[name]), meta["data_aug_conf"],
                        f"fusion.dataset={dataset_key}", seed=meta["seed"])
    datasets = {mode: build_dataset(cfg, "validate", train=mode == "train")
                for mode in ("eval", "train")}
    assert len(reference["sample_index"]) == 2 * len(datasets["eval"])
    flips = 0
    for sample, (mode, index) in enumerate(zip(reference["sample_mode"],
                                               reference["sample_index"])):
        ours = datasets[str(mode)][int(index)]
        start, end = reference["agent_start"][sample], reference["agent_start"][sample + 1]
        heal_ids = [str(i) for i in reference["agent_ids"][start:end]]
        if name == "dairv2x":              # HEAL names the roadside unit 1, we name it -1
            heal_ids = ["-1" if i == "1" else i for i in heal_ids]
        assert ours["agent_ids"] == heal_ids
        gap = np.abs(ours["images"] - reference["images"][start:end]).max()
        assert gap <= IMAGE_TOL, (mode, index, "images", gap)
        for key in MATRIX_KEYS:
            gap = np.abs(ours[key].astype(np.float64) - reference[key][start:end]).max()
            assert gap <= MATRIX_TOL, (mode, index, key, gap)
        flips += int((ours["post_rots"][..., 0, 0] < 0).sum())
    # the training pass drew flips (so the flip's homography was compared too)
    assert flips > 0


def _pixels(sample, points_by_agent):
    """Project (A, M, 3) points of each agent's output frame through the sample's matrices ->
    (A, C, M, 2) pixels of the augmented images and (A, C, M) depths."""
    extrinsics = sample["extrinsics"].astype(np.float64)
    camera = np.einsum("acij,amj->acmi", np.linalg.inv(extrinsics)[..., :3, :3],
                       points_by_agent) + np.linalg.inv(extrinsics)[..., None, :3, 3]
    image = np.einsum("acij,acmj->acmi", sample["intrinsics"].astype(np.float64), camera)
    depth = image[..., 2]
    pixel = np.concatenate([image[..., :2] / depth[..., None], np.ones_like(depth)[..., None]],
                           axis=-1)
    moved = np.einsum("acij,acmj->acmi", sample["post_rots"].astype(np.float64), pixel) \
        + sample["post_trans"][:, :, None].astype(np.float64)
    return moved[..., :2], depth


def test_extrinsics_follow_the_bev_augmentation(folders):
    """A GT box seen through the batch's matrices lands on the same pixel with and without the
    sample's BEV augmentation (flip, rotation, scaling move the points, the boxes and the
    cameras' mounting alike); the image draws do not depend on it."""
    _, meta = _fixture("v2xset")
    split_dir = _split_dir("v2xset", folders["v2xset"])
    augment = ("data_augment=[{NAME: random_world_flip, ALONG_AXIS_LIST: [x, y]}, "
               "{NAME: random_world_rotation, WORLD_ROT_ANGLE: [-0.7, 0.7]}, "
               "{NAME: random_world_scaling, WORLD_SCALE_RANGE: [0.9, 1.1]}]")
    for proj_first in ("true", "false"):
        plain = build_dataset(camera_config(split_dir, meta["data_aug_conf"], seed=5),
                              "validate", train=True)
        moved = build_dataset(camera_config(split_dir, meta["data_aug_conf"], augment,
                                            f"fusion.args.proj_first={proj_first}", seed=5),
                              "validate", train=True)
        for index in range(len(plain)):
            a, b = plain[index], moved[index]
            np.testing.assert_array_equal(a["images"], b["images"])
            common = np.intersect1d(a["gt_ids"], b["gt_ids"])
            assert len(common) > 3
            centres = {}
            for sample, name in ((a, "plain"), (b, "moved")):
                rows = [int(np.flatnonzero(sample["gt_ids"] == i)[0]) for i in common]
                boxes = sample["gt_boxes"][rows].astype(np.float64)
                # the GT is in the ego's (augmented) frame; each agent's points, in its own
                # frame (plain: own frame) or the ego's (proj_first): through transforms_to_ego
                to_ego = sample["transforms_to_ego"].astype(np.float64)
                if sample["points_in_agent_frame"]:
                    to_agent = np.linalg.inv(to_ego)
                else:
                    to_agent = np.broadcast_to(np.eye(4), to_ego.shape)
                centres[name] = np.einsum("aij,mj->ami", to_agent[:, :3, :3], boxes[:, :3]) \
                    + to_agent[:, None, :3, 3]
            pixels_a, depth_a = _pixels(a, centres["plain"])
            pixels_b, depth_b = _pixels(b, centres["moved"])
            seen = depth_a > 1.0
            assert seen.sum() > 3
            np.testing.assert_allclose(pixels_b[seen], pixels_a[seen], atol=2e-3)


def test_gt_corners_project_into_the_image_where_heal_would_put_them(folders):
    """Evaluation sample: the batch's matrices equal HEAL's own projection of the raw pixel
    (``coord_3d_to_2d``: K @ inv(extrinsic)) followed by the resize and crop."""
    _, meta = _fixture("v2xset")
    conf = meta["data_aug_conf"]
    dataset = build_dataset(camera_config(_split_dir("v2xset", folders["v2xset"]), conf),
                            "validate", train=False)
    sample = dataset[0]
    corners = np.asarray(boxes_to_corners_3d(sample["gt_boxes"].astype(np.float64))).reshape(-1, 3)
    to_agent = np.linalg.inv(sample["transforms_to_ego"].astype(np.float64))
    points = np.einsum("aij,mj->ami", to_agent[:, :3, :3], corners) + to_agent[:, None, :3, 3]
    pixels, _ = _pixels(sample, points)
    resize = max(conf["final_dim"][0] / conf["H"], conf["final_dim"][1] / conf["W"])
    new_w, new_h = int(conf["W"] * resize), int(conf["H"] * resize)
    top = int((1 - np.mean(conf["bot_pct_lim"])) * new_h) - conf["final_dim"][0]
    left = int(max(0, new_w - conf["final_dim"][1]) / 2)
    for agent in range(points.shape[0]):
        for camera in range(4):
            extrinsic = sample["extrinsics"][agent, camera].astype(np.float64)
            raw = (sample["intrinsics"][agent, camera] @ np.linalg.inv(extrinsic)[:3]
                   @ np.c_[points[agent], np.ones(len(points[agent]))].T).T
            raw = raw[:, :2] / raw[:, 2:]
            np.testing.assert_allclose(pixels[agent, camera], raw * resize - [left, top],
                                       rtol=1e-5, atol=1e-3)


def test_training_draws_follow_seed_epoch_and_index(folders):
    _, meta = _fixture("v2xset")
    cfg = camera_config(_split_dir("v2xset", folders["v2xset"]), meta["data_aug_conf"])
    first, again = (build_dataset(cfg, "validate", train=True) for _ in range(2))
    np.testing.assert_array_equal(first[1]["images"], again[1]["images"])
    np.testing.assert_array_equal(first[1]["post_trans"], again[1]["post_trans"])
    again.set_epoch(1)
    assert not np.array_equal(first[1]["post_trans"], again[1]["post_trans"])
    # evaluation draws nothing: every camera the same fixed resize and crop
    evaluation = build_dataset(cfg, "validate", train=False)[1]
    assert np.unique(evaluation["post_trans"].reshape(-1, 3), axis=0).shape[0] == 1


def test_camera_only_needs_no_pcd_and_lidar_configs_still_do(folders, tmp_path):
    _, meta = _fixture("v2xset")
    copy = tmp_path / "validate"
    shutil.copytree(_split_dir("v2xset", folders["v2xset"]), copy)
    for pcd in copy.rglob("*.pcd"):
        pcd.unlink()
    cfg = camera_config(copy, meta["data_aug_conf"])
    sample = build_dataset(cfg, "validate", train=False)[0]
    assert "agent_points" not in sample                    # camera-only: no LiDAR keys
    # no LiDAR: visibility by the ego's cameras (its bev_visibility map: 1 seen, 0 not)
    assert set(sample["gt_ego_points"].tolist()) <= {0, 1}
    assert sample["images"].shape[:2] == (len(sample["agent_ids"]), 4)
    lidar = load_config(CONFIG, [f"validate_dir={copy}"])
    with pytest.raises(ValueError, match=r"missing \d+\.pcd"):
        build_dataset(lidar, "validate", train=False)


def test_lidar_and_camera_inputs_together(folders):
    _, meta = _fixture("v2xset")
    split_dir = _split_dir("v2xset", folders["v2xset"])
    both = camera_config(split_dir, meta["data_aug_conf"], "input_source=[lidar, camera]")
    lidar_only = load_config(CONFIG, [f"validate_dir={split_dir}", "data_augment=[]",
                                      "fusion.args.proj_first=false"])
    with_cameras = build_dataset(both, "validate", train=False)[0]
    without = build_dataset(lidar_only, "validate", train=False)[0]
    assert "images" not in without
    for ours, theirs in zip(with_cameras["agent_points"], without["agent_points"]):
        np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(with_cameras["gt_ego_points"], without["gt_ego_points"])


def test_config_errors_name_the_key(folders):
    split_dir = _split_dir("v2xset", folders["v2xset"])
    with pytest.raises(ValueError, match="camera.*is missing"):
        load_config(CONFIG, [f"validate_dir={split_dir}", "input_source=[camera]"])
    with pytest.raises(ValueError, match="camera.*input_source"):
        load_config(CONFIG, [f"validate_dir={split_dir}", "camera={data_aug_conf: {}}"])
    with pytest.raises(ValueError, match="resize_lim"):
        load_config(CONFIG, ["input_source=[camera]",
                             "camera={data_aug_conf: {resize_lim: [0.9, 0.5]}}"])
    with pytest.raises(ValueError, match="input_source"):
        load_config(CONFIG, ["input_source=[radar]"])
    early = camera_config(split_dir, {}, "fusion.core_method=early", "fusion.args.proj_first=true")
    with pytest.raises(ConfigError, match="early fusion"):
        build_dataset(early, "validate", train=False)


def test_image_files_wrong_size_or_missing_fail_naming_the_file(folders, tmp_path):
    _, meta = _fixture("v2xset")
    copy = tmp_path / "validate"
    shutil.copytree(_split_dir("v2xset", folders["v2xset"]), copy)
    wrong_size = camera_config(copy, {**meta["data_aug_conf"], "W": 800, "H": 600})
    with pytest.raises(CameraFileError, match=r"camera0\.png: image is 64 x 48"):
        build_dataset(wrong_size, "validate", train=False)[0]
    missing = sorted(copy.rglob("*_camera2.png"))[0]
    missing.unlink()
    dataset = build_dataset(camera_config(copy, meta["data_aug_conf"]), "validate", train=False)
    with pytest.raises(CameraFileError, match=f"{missing.name}: camera image missing"):
        for index in range(len(dataset)):
            dataset[index]


def test_post_homography_by_hand():
    """resize 0.5, crop at (10, 4), flip, 90 degrees: pixel (20, 12) -> resized (10, 6) ->
    cropped (0, 2) -> flipped in a 40-wide crop (40, 2) -> turned about the crop centre
    (20, 15) by +90 deg (counter-clockwise on screen, v down): (x, y) - c = (20, -13) ->
    (-13, -20) + c = (7, -5)."""
    aug = ImageAugmentation(0.5, (50, 40), (10, 4, 50, 34), True, 90.0)
    post_rot, post_tran = image_augmentation_matrices(aug)
    moved = post_rot.numpy() @ np.array([20.0, 12.0, 1.0]) + post_tran.numpy()
    np.testing.assert_allclose(moved[:2], [7.0, -5.0], atol=1e-5)


def test_v2v4real_has_no_cameras():
    from opencood.data.v2v4real import V2V4RealSplit
    with pytest.raises(CameraFileError, match="V2V4Real has no camera files"):
        V2V4RealSplit.load_cameras(type("Split", (), {"split_dir": Path("v")})(), "s", "0", "1")


def test_camera_inputs_compose_lidar_to_output():
    """The extrinsic is ``lidar_to_output @ camera_to_lidar``, in that order."""
    frame = cameras.CameraFrame(
        [cameras.Image.new("RGB", (8, 6))], np.eye(3, dtype=np.float32)[None],
        np.array([[[0, 0, 1, 1], [1, 0, 0, 2], [0, -1, 0, 3], [0, 0, 0, 1]]], np.float32),
        [Path("x.png")])
    conf = {"H": 6, "W": 8, "final_dim": [4, 8], "resize_lim": [1, 1], "bot_pct_lim": [0, 0],
            "rot_lim": [0, 0], "rand_flip": False, "Ncams": 1}
    turn = np.array([[0.0, -1, 0, 5], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    out = camera_inputs(frame, conf, None, turn)
    np.testing.assert_array_equal(out["extrinsics"][0],
                                  (turn @ frame.camera_to_lidar[0]).astype(np.float32))
    # the camera's optical axis (OpenCV z) points along the turned LiDAR's x: +y of the output
    np.testing.assert_array_equal(out["extrinsics"][0][:3, 2], [0.0, 1.0, 0.0])


def test_camera_picture_tool_draws_the_gt_through_the_sample_matrices(folders, tmp_path):
    import cv2
    _, meta = _fixture("v2xset")
    conf = json.dumps(meta["data_aug_conf"])
    out = tmp_path / "cameras.png"
    tool = load_tool("camera_picture")
    assert tool.main(["--config", CONFIG, "--out", str(out), "--train", "--set",
                      f"validate_dir={_split_dir('v2xset', folders['v2xset'])}", "--set",
                      "input_source=[camera]", "--set", f"camera={{data_aug_conf: {conf}}}"]) == 0
    picture = cv2.imread(str(out))[..., ::-1]
    rows, columns = 3, 4                       # 3 agents (the RSU last), 4 cameras each
    assert picture.shape == (rows * 32 * tool.SCALE, columns * 48 * tool.SCALE, 3)
    assert (picture == tool.GT_COLOUR).all(axis=-1).sum() > 50      # GT edges drawn
    assert tool.main(["--config", CONFIG, "--out", str(out)]) == 2   # a LiDAR config: refused


def test_camera_samples_batches_and_model_inputs_use_the_declared_keys(folders):
    from opencood import batch_keys
    from opencood.data.collate import collate_samples
    from opencood.data.pipeline import BatchPreparer
    _, meta = _fixture("v2xset")
    cfg = camera_config(_split_dir("v2xset", folders["v2xset"]), meta["data_aug_conf"])
    dataset = build_dataset(cfg, "validate", train=False)
    samples = [dataset[0], dataset[1]]
    for sample in samples:
        batch_keys.check_keys("sample", sample, "camera dataset")
    batch = collate_samples(samples)
    batch_keys.check_keys("batch", batch, "collate of camera samples")
    agents = sum(len(sample["agent_ids"]) for sample in samples)
    assert batch["images"].shape[:2] == (agents, 4) and batch["record_len"].sum() == agents
    inputs = BatchPreparer.from_config(cfg, "cpu", training=False).model_inputs(batch)
    batch_keys.check_keys("model input", inputs, "preparer of camera samples")
    for key in ("images", "intrinsics", "extrinsics", "post_rots", "post_trans"):
        assert torch.equal(inputs[key], batch[key]), key


@pytest.mark.parametrize("method", ["no", "late"])
def test_no_and_late_fusion_carry_one_camera_row_per_agent_of_the_model_input(folders, method):
    """no: the ego's cameras only; late: every agent's, each in its own frame (training: one
    (sample, CAV) example with that CAV's cameras)."""
    _, meta = _fixture("v2xset")
    split_dir = _split_dir("v2xset", folders["v2xset"])
    cfg = camera_config(split_dir, meta["data_aug_conf"], f"fusion.core_method={method}",
                        "fusion.args.proj_first=true")
    intermediate = build_dataset(camera_config(split_dir, meta["data_aug_conf"]), "validate",
                                 train=False)[0]
    for train in (False, True):
        dataset = build_dataset(cfg, "validate", train=train)
        sample = dataset[len(dataset) - 1 if train else 0]
        assert sample["images"].shape[0] == len(sample["agent_ids"])
        if not train:
            rows = 1 if method == "no" else len(intermediate["agent_ids"])
            assert sample["images"].shape[0] == rows
            # evaluation, no BEV augmentation: each agent's cameras as the own-frame read
            np.testing.assert_array_equal(sample["extrinsics"], intermediate["extrinsics"][:rows])
            np.testing.assert_array_equal(sample["images"], intermediate["images"][:rows])


def test_a_batch_without_points_draws_no_points(folders):
    from opencood.data.collate import collate_samples
    from opencood.eval.vis import sample_agent_points
    _, meta = _fixture("v2xset")
    cfg = camera_config(_split_dir("v2xset", folders["v2xset"]), meta["data_aug_conf"])
    batch = collate_samples([build_dataset(cfg, "validate", train=False)[0]])
    assert "points" not in batch and sample_agent_points(batch, 0) == {}
