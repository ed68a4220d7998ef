#!/usr/bin/env python
"""Build the OPV2V conformance fixture ``tests/fixtures/opv2v_mini`` (docs/DESIGN.md §2.1).

The fixture is small OPV2V-format data written by OUR synthetic world plus ``expected.json``: what
the REFERENCE implementation computes from it -- OpenCOOD as packaged on PyPI (``opencoodx``),
its ``EarlyFusionDataset`` in test mode. ``tests/test_opv2v_reader.py`` checks our reader
against it. CI never runs this script; it only reads the files the script wrote (committed).

Both projects call their package ``opencood``, so the two steps run in two environments:

1. ``data``: this project's environment, from the repository root::

       PYTHONPATH=. python tools/reference/make_opv2v_fixture.py data \\
           --out tests/fixtures/opv2v_mini --overwrite

   Three splits, one scenario each, three CAVs, four frames: hand-placed traffic scanned by
   ``opencood.data.synthetic``'s ray-cast LiDAR and written by its writer, plus the awkward
   cases a reader must get right and our generator never makes by itself (see ``SCENES``).

2. ``expected``: OpenCOOD in a side virtual environment OUTSIDE the checkout, run from a folder
   that is not the checkout (so that our ``opencood`` cannot shadow OpenCOOD's)::

       python3 -m venv /work/refenv && REF=/work/refenv/lib/python3.11/site-packages/opencood
       /work/refenv/bin/pip install opencoodx==0.1.19 torch==2.13.0 pyyaml "matplotlib<3.9" spconv
       apt-get install libusb-1.0-0          # open3d's pybind module links it
       # OpenCOOD's own Cython IoU, imported by its post-processor (the wheel ships the .pyx only):
       mkdir /tmp/bo && cd /tmp/bo && cp $REF/utils/box_overlaps.pyx . \
         && CFLAGS="-I$(/work/refenv/bin/python -c 'import numpy; print(numpy.get_include())')" \
            /work/refenv/bin/cythonize -i -3 box_overlaps.pyx && cp box_overlaps*.so $REF/utils/
       cd /tmp && env -u PYTHONPATH /work/refenv/bin/python \
           /path/to/checkout/tools/reference/make_opv2v_fixture.py expected \
           --fixture /path/to/checkout/tests/fixtures/opv2v_mini

   matplotlib < 3.9 because OpenCOOD's visualisation module, imported by its datasets, calls
   ``cm.get_cmap``; spconv because its pre-processor package imports it (the hypes used here,
   OpenCOOD's own ``point_pillar_early_fusion.yaml``, voxelise with it; voxels are not compared).
   The step refuses to run when ``opencood`` resolves to this checkout. Both steps are
   deterministic: rerunning them on an unchanged tree rewrites identical files.

Nothing is stubbed: the numbers come from OpenCOOD's dataset code reading the fixture files
with its own loaders (open3d for the PCD files, its own yaml loader).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SPLITS = ("train", "validate", "test")
SCENARIO = "2021_09_09_13_20_58"
TIMESTAMPS = ("000068", "000070", "000072", "000074")
FRAME_DT = 0.1                            # seconds between saved OPV2V frames
REFERENCE_PACKAGE = ("opencoodx", "0.1.19")
GT_RANGE = [-140, -40, -3, 140, 40, 1]    # what the reference uses in test mode
CROP_RANGE = [-140.8, -40, -3, 140.8, 40, 1]

ABOUT = (
    "Computed by the reference OPV2V implementation (OpenCOOD as packaged on PyPI: opencoodx "
    "{version}, EarlyFusionDataset, train=False, its point_pillar_early_fusion.yaml) from the "
    "files beside this one, by tools/reference/make_opv2v_fixture.py. ego: the CAV the reference "
    "marks ego; cavs_in_range: the CAVs it fuses (2-D lidar distance to the ego <= 70 m), in its "
    "order; transforms: cav id -> 4x4 cav-lidar-to-ego-lidar; boxes: actor id -> [x, y, z, h, w, "
    "l, yaw(rad)] in the ego lidar frame, kept when all 8 corners of the level box lie in "
    "[-140, -40, -3, 140, 40, 1]; points_in_range: points of all cavs in range after removing "
    "each cav's own-body points and cropping to (-140.8, -40, -3, 140.8, 40, 1), bounds "
    "exclusive. Compare yaw modulo 2*pi.")


# ---------------------------------------------------------------------------------------------
# Step 1: the data, written by our synthetic world (this project's environment)
#
# Every scene is laid out in the frame of the train ego's lidar at its first frame (x ahead,
# y left, metres; headings in degrees from +x); ``EGO_ORIGIN`` puts that frame in the world, so
# the world coordinates in the files are not round numbers. Awkward cases on purpose:
#   * cav ids 1001, 1010, 987: string order (the ego is 1001) differs from numeric order;
#   * roll and pitch on every lidar pose, changing from frame to frame;
#   * CAV 987 is in range in train, out of range in validate, and leaves the 70 m range in the
#     middle of test (68.6, 69.6, 70.6, 71.6 m);
#   * box-centre offsets in x and y (``center``), vehicles a little above the ground, roll and
#     pitch on every vehicle;
#   * boxes partly outside the GT range: across y = +40 (204), across y = -40 (208), and a box
#     too tall for z <= 1 (203); a vehicle in range that no LiDAR reaches (209); a vehicle that
#     only CAV 1010 sees, hidden from the ego by a building (205); other CAVs never listed;
#   * the LiDARs see their own car's roof: points in the own-body box, which readers drop;
#   * ``predicted_ego_pos`` / ``true_ego_pos`` written as a yaml anchor and alias, as OPV2V's
#     files have them; ``plan_trajectory`` and ``ego_speed`` present.

EGO_ORIGIN = (10.0, 5.0, 30.0)            # world x, y, heading of the scene frame

# cav id -> lidar height (m), base roll, base pitch (deg); per-frame drift is added to both.
CAV_LIDARS = {"1001": (1.9, 0.3, -0.4), "1010": (1.95, -0.5, 0.6), "987": (2.0, 0.3, 1.0)}
TILT_DRIFT_DEG = (0.05, -0.04)            # roll, pitch change per frame
LIDAR_MOUNT_X = -0.5                      # the lidar sits 0.5 m behind the car's centre

# Per split: cav id -> (x, y, heading, speed km/h) of the LIDAR at the first frame (scene frame).
SCENES = {
    "train": {"1001": (0.0, 0.0, 0.0, 21.6), "1010": (12.0, 30.0, -90.0, 18.0),
              "987": (55.0, -20.0, 180.0, 10.0)},
    "validate": {"1001": (4.0, 0.0, 0.0, 21.6), "1010": (14.0, 32.0, -90.0, 18.0),
                 "987": (92.0, -30.0, 180.0, 10.0)},
    # 987 drives ahead of the ego on the same heading, 36 km/h faster: 1 m further per frame.
    "test": {"1001": (-20.0, 0.0, 0.0, 21.6), "1010": (12.0, 34.0, -90.0, 18.0),
             "987": (48.6, 0.0, 0.0, 57.6)},
}

# actor id -> (kind, x, y, heading, speed km/h, centre offset x, y (m), lift above ground (m),
#              roll, pitch (deg)), scene frame, first frame.
VEHICLES = {
    201: ("car", 14.0, -3.5, 12.0, 25.0, 0.05, -0.02, 0.02, 0.4, -0.3),
    202: ("car", -18.0, -4.5, -75.0, 0.0, 0.0, 0.0, 0.01, -0.2, 0.5),
    203: ("tall_truck", 30.0, 4.0, 180.0, 20.0, 0.1, 0.0, 0.03, 0.1, 0.2),
    204: ("car", 8.0, 40.3, 90.0, 0.0, -0.04, 0.03, 0.0, 0.3, -0.1),
    205: ("car", 22.0, 36.5, 0.0, 15.0, 0.0, 0.05, 0.02, -0.4, 0.3),
    206: ("van", 95.0, -12.0, 180.0, 30.0, 0.08, 0.0, 0.0, 0.2, 0.4),
    207: ("car", 70.0, -30.0, 90.0, 12.0, 0.0, -0.06, 0.01, 0.5, -0.5),
    208: ("car", 62.0, -39.2, 0.0, 0.0, 0.03, 0.03, 0.02, -0.3, 0.2),
    209: ("car", 120.0, 32.0, 180.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
}
HALF_SIZES = {"car": (2.3, 0.95, 0.75), "van": (2.7, 1.05, 0.95),
              "tall_truck": (4.2, 1.25, 1.6), "cav": (2.3, 0.95, 0.75)}

# Buildings: (x, y, half length, half width, height), scene frame. The first hides 205 from
# the ego.
BUILDINGS = ((15.0, 20.0, 6.0, 5.0, 10.0), (40.0, 14.0, 8.0, 4.0, 12.0),
             (-30.0, 15.0, 10.0, 6.0, 8.0))


def _scene_to_world(x, y, heading=0.0):
    """Scene-frame (x, y, heading) -> world (x, y, heading)."""
    ox, oy, oyaw = EGO_ORIGIN
    c, s = math.cos(math.radians(oyaw)), math.sin(math.radians(oyaw))
    return ox + c * x - s * y, oy + s * x + c * y, oyaw + heading


def _moved(x, y, heading, speed_kmh, frame):
    """Scene-frame position after ``frame`` frames at constant speed and heading."""
    step = speed_kmh / 3.6 * FRAME_DT * frame
    return (x + step * math.cos(math.radians(heading)),
            y + step * math.sin(math.radians(heading)))


def _wrap_deg(angle):
    return (angle + 180.0) % 360.0 - 180.0


def _r(values, digits=6):
    return [round(float(v), digits) for v in values]


def _vehicle_entry(actor_id, frame):
    """(synthetic Vehicle for the ray caster, OPV2V ``vehicles`` entry) of one actor."""
    from opencood.data.synthetic import Vehicle
    kind, x, y, heading, speed, cx, cy, lift, roll, pitch = VEHICLES[actor_id]
    wx, wy, wyaw = _scene_to_world(*_moved(x, y, heading, speed, frame), heading)
    half = HALF_SIZES[kind]
    body = Vehicle(actor_id, wx, wy, wyaw, half, speed, 0.6, kind)
    # location + center = the box centre (the offset is not rotated), lifted by ``lift``.
    entry = {"location": _r([wx - cx, wy - cy, lift]), "center": _r([cx, cy, half[2]]),
             "extent": _r(half), "angle": _r([roll, _wrap_deg(wyaw), pitch]),
             "speed": float(speed)}
    return body, entry


def _cav_state(split, cav_id, frame):
    """(lidar pose, car pose, car Vehicle) of a CAV at ``frame``; poses rounded as written."""
    from opencood.data.synthetic import Vehicle
    x, y, heading, speed = SCENES[split][cav_id]
    lx, ly, yaw = _scene_to_world(*_moved(x, y, heading, speed, frame), heading)
    height, roll, pitch = CAV_LIDARS[cav_id]
    roll += TILT_DRIFT_DEG[0] * frame
    pitch += TILT_DRIFT_DEG[1] * frame
    lidar_pose = _r([lx, ly, height, roll, _wrap_deg(yaw), pitch])
    cos, sin = math.cos(math.radians(yaw)), math.sin(math.radians(yaw))
    car_x, car_y = lx - LIDAR_MOUNT_X * cos, ly - LIDAR_MOUNT_X * sin
    car_pose = _r([car_x, car_y, 0.0, 0.0, _wrap_deg(yaw), 0.0])
    body = Vehicle(int(cav_id), car_x, car_y, yaw, HALF_SIZES["cav"], speed, 0.5, "car")
    return lidar_pose, car_pose, body


def _cav_params(split, cav_id, frame, lidar_pose, car_pose, vehicles):
    _, _, heading, speed = SCENES[split][cav_id]
    plan = []
    for horizon_s in (0.5, 1.0):
        ahead = speed / 3.6 * horizon_s
        plan.append(_r([car_pose[0] + ahead * math.cos(math.radians(car_pose[4])),
                        car_pose[1] + ahead * math.sin(math.radians(car_pose[4])), speed], 4))
    # One list for both keys: the yaml dumper writes it as an anchor and an alias, as in OPV2V.
    return {"lidar_pose": lidar_pose, "predicted_ego_pos": car_pose, "true_ego_pos": car_pose,
            "ego_speed": float(speed), "plan_trajectory": plan, "vehicles": vehicles}


def write_data(out: Path, overwrite: bool, seed: int = 0) -> None:
    import numpy as np
    from opencood.data.synthetic import Building, LidarConfig, Scene, cast_lidar
    from opencood.data.synthetic import visible_vehicles
    from opencood.data.synthetic.writer import write_frame

    if any((out / split).exists() for split in SPLITS):
        if not overwrite:
            raise SystemExit(f"error: {out} already holds fixture splits; pass --overwrite")
        for split in SPLITS:
            shutil.rmtree(out / split, ignore_errors=True)
    # 12 beams x 120 azimuths keeps the fixture near 1.3 MB of ascii PCD; -20 deg is low
    # enough to see the own car's roof in front of and behind the lidar.
    lidar = LidarConfig(beams=12, fov_deg=(-16.0, 4.0), azimuth_steps=120, max_range=80.0,
                        sectors=24)
    buildings = [Building(-2 - i, *_scene_to_world(x, y)[:2], hl, hw, h,
                          yaw_deg=EGO_ORIGIN[2])
                 for i, (x, y, hl, hw, h) in enumerate(BUILDINGS)]
    rng = np.random.default_rng(seed)
    cav_ids = [int(c) for c in CAV_LIDARS]
    for split in SPLITS:
        for frame, timestamp in enumerate(TIMESTAMPS):
            states = {c: _cav_state(split, c, frame) for c in SCENES[split]}
            traffic = {a: _vehicle_entry(a, frame) for a in VEHICLES}
            scene = Scene(buildings, [body for body, _ in traffic.values()]
                          + [state[2] for state in states.values()])
            for cav_id, (lidar_pose, car_pose, _) in states.items():
                # Nothing excluded: the rays hit the CAV's own roof too.
                points, hit_ids = cast_lidar(scene, lidar_pose, lidar, rng, exclude_ids=())
                seen = visible_vehicles(hit_ids, scene.vehicles, cav_ids)
                vehicles = {a: traffic[a][1] for a in seen}
                params = _cav_params(split, cav_id, frame, lidar_pose, car_pose, vehicles)
                cav_dir = out / split / SCENARIO / cav_id
                cav_dir.mkdir(parents=True, exist_ok=True)
                write_frame(cav_dir, timestamp, points, params)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"wrote {out} ({size / 1e6:.2f} MB)")


# ---------------------------------------------------------------------------------------------
# Step 2: expected.json from OpenCOOD (the side environment)

def _import_reference():
    """OpenCOOD's ``opencood`` package; refuses ours (same name) with a one-line error."""
    from importlib import metadata
    try:
        import opencood
    except ImportError as exc:
        raise SystemExit(f"error: OpenCOOD is not importable here ({exc}); run this step with "
                         "the side environment's python (pip install opencoodx==0.1.19)")
    location = Path(opencood.__file__).resolve()
    if REPO_ROOT in location.parents or not (location.parent / "data_utils").is_dir():
        raise SystemExit(f"error: 'opencood' resolves to {location.parent}, not OpenCOOD's; run "
                         "from outside the checkout with PYTHONPATH unset")
    try:
        version = metadata.version(REFERENCE_PACKAGE[0])
    except metadata.PackageNotFoundError:
        raise SystemExit(f"error: package {REFERENCE_PACKAGE[0]} is not installed here")
    if version != REFERENCE_PACKAGE[1]:
        print(f"warning: {REFERENCE_PACKAGE[0]} {version} installed; the fixture was made with "
              f"{REFERENCE_PACKAGE[1]}", file=sys.stderr)
    try:
        import opencood.utils.box_overlaps  # noqa: F401  (OpenCOOD's Cython extension)
    except ImportError:
        raise SystemExit("error: OpenCOOD's opencood/utils/box_overlaps.pyx is not compiled; "
                         "see this script's docstring")
    return location.parent, version


def _reference_params(package_dir: Path, split_dir: Path) -> dict:
    """OpenCOOD's own early-fusion hypes, read with safe_load, derived values by its parser."""
    import yaml
    from opencood.hypes_yaml.yaml_utils import load_point_pillar_params
    params = yaml.safe_load((package_dir / "hypes_yaml" /
                             "point_pillar_early_fusion.yaml").read_text())
    params.pop("yaml_parser")             # named there for OpenCOOD's eval; called directly here
    params = load_point_pillar_params(params)
    params["root_dir"] = params["validate_dir"] = str(split_dir)
    return params


def _split_expected(params) -> list:
    """Run OpenCOOD's EarlyFusionDataset (test mode) over a split and record what it computed."""
    import numpy as np
    from opencood.data_utils.datasets.early_fusion_dataset import EarlyFusionDataset
    from opencood.utils.transformation_utils import x1_to_x2

    dataset = EarlyFusionDataset(params, visualize=True, train=False)
    seen = {}
    retrieve, single = dataset.retrieve_base_data, dataset.get_item_single_car

    def retrieve_recording(idx):
        seen["base"] = retrieve(idx)
        seen["fused"], seen["transforms"] = [], {}
        return seen["base"]

    def single_recording(cav_base, ego_pose):
        # The dataset only calls this for the CAVs within its communication range.
        cav_id = next(k for k, v in seen["base"].items() if v is cav_base)
        seen["fused"].append(cav_id)
        seen["transforms"][cav_id] = x1_to_x2(cav_base["params"]["lidar_pose"], ego_pose)
        return single(cav_base, ego_pose)

    dataset.retrieve_base_data = retrieve_recording
    dataset.get_item_single_car = single_recording
    entries = []
    for index in range(len(dataset)):
        ego = dataset[index]["ego"]
        boxes = ego["object_bbx_center"][ego["object_bbx_mask"] == 1]
        assert len(boxes) == len(ego["object_ids"])
        ego_ids = [cav_id for cav_id, cav in seen["base"].items() if cav["ego"]]
        entries.append({
            "index": index,
            "ego": ego_ids[0],
            "cavs_in_range": list(seen["fused"]),
            "transforms": {cav_id: np.round(matrix, 6).tolist()
                           for cav_id, matrix in seen["transforms"].items()},
            "boxes": {str(actor_id): np.round(box, 5).tolist()
                      for actor_id, box in zip(ego["object_ids"], boxes)},
            "points_in_range": int(len(ego["origin_lidar"])),
        })
    return entries


def write_expected(fixture: Path) -> None:
    package_dir, version = _import_reference()
    import numpy as np
    np.random.seed(0)                     # OpenCOOD shuffles points; counts do not depend on it
    expected = {"_about": ABOUT.format(version=version)}
    for split in SPLITS:
        split_dir = fixture / split
        if not split_dir.is_dir():
            raise SystemExit(f"error: {split_dir} is missing; run the 'data' step first")
        expected[split] = _split_expected(_reference_params(package_dir, split_dir))
    (fixture / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")
    print(f"wrote {fixture / 'expected.json'} (OpenCOOD from {REFERENCE_PACKAGE[0]} {version})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    steps = parser.add_subparsers(dest="step", required=True)
    data = steps.add_parser("data", help="write the fixture's OPV2V folders (our environment)")
    data.add_argument("--out", type=Path, default=REPO_ROOT / "tests" / "fixtures" / "opv2v_mini")
    data.add_argument("--overwrite", action="store_true")
    data.add_argument("--seed", type=int, default=0)
    expected = steps.add_parser("expected", help="write expected.json (OpenCOOD's environment)")
    expected.add_argument("--fixture", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.step == "data":
        write_data(args.out.resolve(), args.overwrite, args.seed)
    else:
        write_expected(args.fixture.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
