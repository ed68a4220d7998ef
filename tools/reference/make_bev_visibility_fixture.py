#!/usr/bin/env python
"""Run HEAL's own camera-visibility GT filter on the ``bev_visibility`` maps our synthetic world
writes, and save which vehicles it keeps per agent frame:
``tests/fixtures/camera_reader/bev_visibility.json``, which tests/test_camera_visibility.py
compares our rule (opencood.data.camera_visibility.boxes_visible) with.

Two steps (HEAL's package is named ``opencood`` too: step 2 runs outside our checkout with
HEAL's checkout first on PYTHONPATH, in tools/reference/make_camera_reader_fixture.py's side
environment)::

    # 1. the folder, from OUR venv (deterministic: GENERATION below)
    PYTHONPATH=. python tools/reference/make_bev_visibility_fixture.py --generate /work/side/vis
    # 2. HEAL's filter
    cd /work/side && env PYTHONPATH=/work/side/HEAL /work/side/venv-cam/bin/python \\
        <repo>/tools/reference/make_bev_visibility_fixture.py /work/side/vis \\
        <repo>/tests/fixtures/camera_reader/bev_visibility.json

What runs in step 2, per agent frame of the test split: the map read as HEAL's base dataset
reads an ``add_data_extension`` file (``cv2.imread``), then HEAL's
``BasePostprocessor.generate_visible_object_center`` (the GT of a camera agent in its
heterogeneous datasets: ``COLOR_BGR2GRAY``, ``box_utils.project_world_visible_objects`` /
``box_is_visible``) with a range wide enough (``FILTER_RANGE``) that only the map decides, once on
the frame's own ``vehicles`` (what HEAL's dataset passes) and once on every agent's of that
timestamp (the sample's GT); HEAL's drawing module, imported on the way, is stubbed. Saved: per
frame its key, the map's sha256, the shape and dtype HEAL's grey map has, and the actor ids
kept (sorted), with ``meta`` (generation, HEAL commit).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

GENERATION = {"preset": "tiny", "seed": 0, "frames": 2, "camera_size": [80, 60]}
FILTER_RANGE = [-1000.0, -1000.0, -100.0, 1000.0, 1000.0, 100.0]
HEAL_COMMIT = "96812ed5a416"


def generate(out: Path) -> None:
    """Our synthetic test split with cameras (and their visibility maps), as GENERATION says."""
    import dataclasses
    from opencood.data.synthetic import generate_dataset, get_preset
    from opencood.data.synthetic.camera import CameraConfig
    width, height = GENERATION["camera_size"]
    preset = dataclasses.replace(get_preset(GENERATION["preset"]), frames=GENERATION["frames"],
                                 cameras=CameraConfig(width=width, height=height, depth=True))
    generate_dataset(out, preset=preset, seed=GENERATION["seed"], progress=False,
                     splits=("test",))


def heal_visible_ids(folder: Path) -> dict:
    """HEAL's filter on every agent frame of ``folder``/test (module docstring)."""
    import types
    import cv2
    import numpy as np
    import yaml
    # drawing, imported on the way and never run (its matplotlib call fails on new versions)
    sys.modules["opencood.visualization.vis_utils"] = types.ModuleType("vis_utils")
    from opencood.data_utils.post_processor.base_postprocessor import BasePostprocessor
    post = BasePostprocessor({"anchor_args": {"cav_lidar_range": FILTER_RANGE},
                              "order": "hwl", "max_num": 200}, train=False)
    frames = []
    for scenario in sorted(p for p in (folder / "test").iterdir() if p.is_dir()):
        agents = sorted(p for p in scenario.iterdir() if p.is_dir())
        for stamp in sorted({p.stem for p in agents[0].glob("*.yaml")}):
            params = {a.name: yaml.safe_load((a / f"{stamp}.yaml").read_text()) for a in agents}
            union = {}
            for frame in params.values():
                union.update(frame["vehicles"])
            for agent in agents:
                path = agent / f"{stamp}_bev_visibility.png"
                image = cv2.imread(str(path))
                grey = np.asarray(cv2.cvtColor(image, cv2.COLOR_BGR2GRAY))
                pose = params[agent.name]["lidar_pose"]
                kept = {}
                for name, vehicles in (("own", params[agent.name]["vehicles"]), ("union", union)):
                    content = {"params": {"vehicles": vehicles, "lidar_pose_clean": pose},
                               "bev_visibility.png": image}
                    _, _, ids = post.generate_visible_object_center([content], pose)
                    kept[name] = sorted(int(i) for i in ids)
                frames.append({"key": [scenario.name, agent.name, stamp],
                               "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                               "grey_shape": list(grey.shape), "grey_dtype": str(grey.dtype),
                               "own": kept["own"], "union": kept["union"]})
    return {"meta": {"generation": GENERATION, "filter_range": FILTER_RANGE,
                     "heal_commit": HEAL_COMMIT}, "frames": frames}


def main(argv):
    if argv[:1] == ["--generate"]:
        generate(Path(argv[1]))
        return
    folder, out = Path(argv[0]), Path(argv[1])
    out.write_text(json.dumps(heal_visible_ids(folder), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
