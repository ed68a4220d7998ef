"""What an agent's cameras see (opencood.data.camera_visibility): HEAL's bev_visibility maps
painted and read as HEAL reads them (hand-checked pixels, and HEAL's own filter on the maps the
synthetic world writes: tests/fixtures/camera_reader/bev_visibility.json), unoccluded pixels
from depth images, tools/bev_visibility.py, and the camera ego's AP visibility split."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest

from opencood.data.camera_visibility import (FILE_SUFFIX, boxes_visible, map_path,
                                             read_visibility_map, unoccluded_pixels,
                                             visibility_map, write_visibility_map)
from opencood.data.cameras import UE4_FROM_OPENCV
from opencood.data.datasets import VISIBILITY_RULES, IntermediateFusionDataset
from opencood.data.opv2v import load_frame_yaml, vehicles_to_boxes
from opencood.errors import ConfigError
from opencood.eval.report import format_metrics
from tests.tool_modules import load_tool

FIXTURE = Path(__file__).parent / "fixtures" / "camera_reader" / "bev_visibility.json"
UNBOUNDED = (-1e9, -1e9, -1e9, 1e9, 1e9, 1e9)
# [x, y, z, h, w, l, yaw]
AHEAD = [10.0, 0.0, 0.0, 1.5, 2.0, 4.0, 0.0]          # 4 x 2 m, 10 m ahead
RIGHT = [0.0, 10.0, 0.0, 1.5, 2.0, 4.0, np.pi / 2]    # the same, turned along y, 10 m right
SPECK = [-0.2, -0.2, 0.0, 0.1, 0.1, 0.1, 0.0]         # covers no cell centre


def painted(visibility):
    return {(int(r), int(c)) for r, c in zip(*np.nonzero(visibility))}


def test_maps_paint_footprints_by_cell_centre_and_heal_reads_them(tmp_path):
    visibility = visibility_map(np.array([AHEAD, RIGHT, SPECK]))
    assert visibility.shape == (256, 256) and visibility.dtype == np.uint8
    assert set(np.unique(visibility).tolist()) == {0, 255}
    # AHEAD: x in [8, 12] holds the centres of cells k = 21..30 ((k + 0.5) 0.39 m), rows
    # 127 - k = 97..106; y in [-1, 1] those of k = -2..2 (k = 0: the two-wide cell at 0), columns
    # 125..129. RIGHT: the same turned: rows 125..129, columns 148..157. SPECK: only the pixel of
    # its centre by HEAL's int() (truncation: row 127 - int(-0.51) = 127, not 128).
    expected = {(r, c) for r in range(97, 107) for c in range(125, 130)}
    expected |= {(r, c) for r in range(125, 130) for c in range(148, 158)}
    assert painted(visibility) == expected | {(127, 127)}
    hidden = [-10.0, 5.0, 0.0, 1.5, 2.0, 4.0, 0.0]
    off_map = [60.0, 0.0, 0.0, 1.5, 2.0, 4.0, 0.0]
    assert boxes_visible(visibility, np.array([AHEAD, RIGHT, SPECK, hidden, off_map])
                         ).tolist() == [True, True, True, False, False]
    # the file, named as HEAL's add_data_extension looks it up, read as HEAL reads it
    path = map_path(tmp_path, "000068")
    assert path.name == "000068" + FILE_SUFFIX == "000068_bev_visibility.png"
    write_visibility_map(path, visibility)
    heal_grey = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2GRAY)
    assert heal_grey.dtype == np.uint8 and np.array_equal(heal_grey, visibility)
    assert np.array_equal(read_visibility_map(path), visibility)


def test_unoccluded_pixels_hand_counted_with_and_without_a_depth_image():
    """A camera at the LiDAR looking along +x (f = 400, 800 x 600): AHEAD's front face (x = 8,
    2.1 m wide, 1.5 m high, at the camera's height) spans u 347.5..452.5 and v 262.5..337.5:
    105 x 75 pixel centres; the same box 10 m further is wholly behind it."""
    front = np.asarray(UE4_FROM_OPENCV, np.float64)[None]
    intrinsic = np.array([[[400.0, 0, 400], [0, 400, 300], [0, 0, 1]]])
    near = [10.0, 0.0, 0.0, 1.5, 2.1, 4.0, 0.0]
    far = [20.0, 0.0, 0.0, 1.5, 2.1, 4.0, 0.0]
    boxes = np.array([near, far])
    assert unoccluded_pixels(boxes, front, intrinsic, (800, 600)).tolist() == [7875, 0]
    depth = np.full((1, 600, 800), 8.0, np.float32)        # what the box shows: 8 m
    assert unoccluded_pixels(boxes, front, intrinsic, (800, 600), depth).tolist() == [7875, 0]
    depth[0, :, :400] = 5.0                                # something nearer on the left half
    assert unoccluded_pixels(boxes, front, intrinsic, (800, 600), depth).tolist() == \
        [53 * 75, 0]                                       # u = 400..452 left
    assert unoccluded_pixels(boxes[:0], front, intrinsic, (800, 600)).tolist() == []


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The fixture's synthetic test split with cameras, as tools/reference/
    make_bev_visibility_fixture.py --generate writes it."""
    out = tmp_path_factory.mktemp("vis")
    load_tool("reference/make_bev_visibility_fixture").generate(out)
    return out


def frame_boxes(split: Path, key, union: bool):
    scenario, cav, stamp = key
    frames = {a.name: load_frame_yaml(a / f"{stamp}.yaml") for a in (split / scenario).iterdir()}
    vehicles = {}
    for name, frame in frames.items():
        if union or name == cav:
            vehicles.update(frame["vehicles"])
    return vehicles_to_boxes(vehicles, frames[cav]["lidar_pose"], UNBOUNDED)


def test_the_worlds_maps_and_heals_filter_keep_the_same_vehicles(written):
    reference = json.loads(FIXTURE.read_text())
    split = written / "test"
    kept_any = hidden_any = False
    for frame in reference["frames"]:
        path = map_path(split / frame["key"][0] / frame["key"][1], frame["key"][2])
        # the world has not changed since the fixture was made (else: regenerate it)
        assert hashlib.sha256(path.read_bytes()).hexdigest() == frame["sha256"], path
        assert frame["grey_shape"] == [256, 256] and frame["grey_dtype"] == "uint8"
        for name in ("own", "union"):
            ids, boxes = frame_boxes(split, frame["key"], union=name == "union")
            ours = ids[boxes_visible(read_visibility_map(path), boxes)].tolist()
            assert ours == frame[name], (frame["key"], name)
            kept_any |= bool(ours)
            hidden_any |= len(ours) < len(ids)
    assert kept_any and hidden_any and len(reference["frames"]) == 6


def test_the_tool_recomputes_the_maps_from_depth_images(written, tmp_path, capsys):
    """Maps deleted, recomputed from the depth images (80 x 60, whole metres): the same visible
    / hidden decision as the world's exact maps on all 192 boxes (6 frames x the sample GT)."""
    copy = tmp_path / "copy"
    shutil.copytree(written, copy)
    originals = {p.relative_to(copy): read_visibility_map(p)
                 for p in copy.rglob("*" + FILE_SUFFIX)}
    for path in originals:
        (copy / path).unlink()
    tool = load_tool("bev_visibility")
    totals = tool.main([str(copy)])
    (counts,) = totals.values()
    assert counts == {"frames": 6, "written": 6, "kept": 0, "no_depth": 0}
    assert "6 agent frames, 6 maps written, 0 kept" in capsys.readouterr().out
    same = total = visible = 0
    for path, original in originals.items():
        scenario, cav, name = path.parts[-3:]
        _, boxes = frame_boxes(copy / "test", (scenario, cav, name[:6]), union=True)
        recomputed = read_visibility_map(copy / path)
        same += int((boxes_visible(original, boxes) == boxes_visible(recomputed, boxes)).sum())
        total += len(boxes)
        visible += int(boxes_visible(original, boxes).sum())
    assert (same, total) == (192, 192) and 0 < visible < total
    # again: every map is there, nothing written; without depth images: said, exit status 1
    assert tool.main([str(copy / "test")])[str(copy / "test")]["kept"] == 6
    for depth in copy.rglob("*_depth0.png"):
        depth.unlink()
    with pytest.raises(SystemExit):
        tool.main([str(copy), "--overwrite"])
    assert "6 without depth images (first: " in capsys.readouterr().out


CAMERA_CONF = {"H": 60, "W": 80, "final_dim": [32, 48], "resize_lim": [0.6, 0.7],
               "bot_pct_lim": [0.0, 0.05], "rot_lim": [0.0, 0.0], "rand_flip": False}


def test_a_camera_ego_splits_the_gt_by_its_bev_visibility_map(written, tmp_path):
    dataset = IntermediateFusionDataset(written / "test", input_source=("camera",),
                                        data_aug_conf=CAMERA_CONF, cache_dir=tmp_path / "c")
    assert dataset.visibility_rule == "camera"
    counts = []
    for index in range(len(dataset)):
        sample = dataset[index]
        info = dataset.split.info(index)
        ego_map = read_visibility_map(map_path(written / "test" / info.scenario / info.ego_id,
                                               info.timestamp))
        expected = boxes_visible(ego_map, sample["gt_boxes"]).astype(np.int64)
        assert np.array_equal(sample["gt_ego_points"], expected)
        counts += sample["gt_ego_points"].tolist()
    assert 0 in counts and 1 in counts
    # a copy without the maps: unknown (-1), so the AP has no visibility rows
    bare = tmp_path / "bare"
    shutil.copytree(written / "test", bare)
    for path in bare.rglob("*" + FILE_SUFFIX):
        path.unlink()
    bare_set = IntermediateFusionDataset(bare, input_source=("camera",),
                                         data_aug_conf=CAMERA_CONF, cache_dir=tmp_path / "c")
    assert (bare_set[0]["gt_ego_points"] == -1).all()
    lidar_set = IntermediateFusionDataset(written / "test", cache_dir=tmp_path / "c")
    assert lidar_set.visibility_rule == "lidar"
    # chosen (tools/eval.py --visibility): a LiDAR run split by its ego's cameras
    by_cameras = IntermediateFusionDataset(written / "test", visibility="camera",
                                           cache_dir=tmp_path / "c")
    info = by_cameras.split.info(0)
    ego_map = read_visibility_map(map_path(written / "test" / info.scenario / info.ego_id,
                                           info.timestamp))
    sample = by_cameras[0]
    assert "agent_points" in sample and np.array_equal(
        sample["gt_ego_points"], boxes_visible(ego_map, sample["gt_boxes"]).astype(np.int64))
    with pytest.raises(ConfigError, match="visibility 'lidar': the inputs have no LiDAR"):
        IntermediateFusionDataset(written / "test", input_source=("camera",), visibility="lidar",
                                  data_aug_conf=CAMERA_CONF, cache_dir=tmp_path / "c")
    assert IntermediateFusionDataset(written / "test", train=True, cache_dir=tmp_path / "c"
                                     ).visibility_rule is None
    row = {"ap_30": 0.5, "ap_50": 0.4, "ap_70": 0.1, "num_gt": 3}
    table = format_metrics("camera", {**row, "distance": {}, "bytes_per_agent": 0,
                                      "frames_per_s": 1.0, "num_frames": 1,
                                      "visibility": {"ego-visible": row},
                                      "visibility_rule": VISIBILITY_RULES["camera"]})
    assert "ego-visible by camera: the ego's cameras see the box" in table


def test_the_tool_leaves_an_agent_s_own_body_out_of_its_view(written, tmp_path):
    """Real OPV2V lists each CAV among the other CAVs' vehicles: the agent's own box, around
    its cameras, is not a vehicle they see. One CAV written into another's yaml changes its
    own recomputed map by nothing."""
    import math
    import yaml
    copy = tmp_path / "copy"
    shutil.copytree(written, copy)
    scenario = sorted((copy / "test").iterdir())[0]
    agent, other = sorted(p for p in scenario.iterdir() if p.name.isdigit())[:2]
    stamp = sorted(p.stem for p in agent.glob("*.yaml"))[0]
    tool = load_tool("bev_visibility")
    tool.main([str(copy), "--overwrite"])
    before = read_visibility_map(map_path(agent, stamp))
    x, y, _, _, yaw, _ = load_frame_yaml(agent / f"{stamp}.yaml")["lidar_pose"]
    centre = (x + 0.5 * math.cos(math.radians(yaw)), y + 0.5 * math.sin(math.radians(yaw)))
    other_yaml = other / f"{stamp}.yaml"
    params = yaml.safe_load(other_yaml.read_text())
    params["vehicles"][int(agent.name)] = {      # the car under the LiDAR, 0.5 m ahead of it
        "location": [centre[0], centre[1], 0.0], "center": [0.0, 0.0, 0.75],
        "extent": [2.3, 0.95, 0.75], "angle": [0.0, yaw, 0.0], "speed": 0.0}
    other_yaml.write_text(yaml.safe_dump(params))
    tool.main([str(copy), "--overwrite"])
    assert np.array_equal(read_visibility_map(map_path(agent, stamp)), before)
    assert boxes_visible(read_visibility_map(map_path(other, stamp)),
                         frame_boxes(copy / "test", (scenario.name, other.name, stamp),
                                     union=True)[1]).any()
