#!/usr/bin/env python
"""Run HEAL's own data sets with ``label_type: camera`` (and its heter camera agents' labels) on
our tiny OPV2V-H folders and save which objects each sample's GT keeps:
``tests/fixtures/heter_reader/camera_labels.json``, which tests/test_heter.py compares our
datasets' labels with (opencood.data.datasets ``BaseFusionDataset._camera_labelled``).

Two steps (HEAL's package is named ``opencood`` too: step 2 runs outside our checkout with
HEAL's checkout first on PYTHONPATH, in the side environment of
tools/reference/make_camera_reader_fixture.py)::

    # 1. the folders, from OUR venv (tests/test_heter.py's heter_data: GENERATION below)
    PYTHONPATH=. python tools/reference/make_camera_label_fixture.py --generate /work/side/hlab
    # 2. HEAL's data sets on them
    cd /work/side && env PYTHONPATH=/work/side/HEAL:/work/side/pypcd_src \\
        /work/side/venv-cam/bin/python <repo>/tools/reference/make_camera_label_fixture.py \\
        /work/side/hlab <repo>/tests/fixtures/heter_reader/camera_labels.json

What runs (HEAL at 96812ed5a416, ``train=False``, every sample of the train and test splits),
each from HEAL's ``opv2v/MoreModality/3_modality_end2end_training/m1m2m3_pyramid.yaml`` with
``add_data_extension: [bev_visibility.png]``, m2's ``data_aug_conf`` sized for our images, and
every label range (``gt_range``, ``anchor_args.cav_lidar_range``) set to RANGE:

* ``intermediate_camera``: HEAL's plain ``IntermediateFusionDataset`` (``fusion.core_method:
  intermediate``, no ``heter``, ``input_source: [lidar]``) with ``label_type: camera``: every
  agent's ``generate_object_center_camera`` (its map, in its own frame, then RANGE in the ego
  frame), the GT their union by object id (``object_ids``).
* ``heter_by_sensor``: HEAL's ``IntermediateheterFusionDataset`` outside ``visualize`` (its
  training labels) with the ego folder m1 (LiDAR) and every other agent m2 (camera): the LiDAR
  agent's ``vehicles``, each camera agent's map-visible ones.
* ``late_camera``: HEAL's ``LateheterFusionDataset`` (``fusion.core_method: lateheter``,
  ``label_type: camera``, every agent m2, ``visualize=True`` as its inference builds it): each
  agent's own labels (``generate_object_center_single``, bound to the camera generator when the
  data set is built, so its test-time switch to LiDAR labels does not reach it), in its own
  frame, RANGE there.

Saved: per variant, split and sample index the ego and agents (HEAL's order) and the object ids
kept (sorted; ``late_camera``: per agent), with ``meta``. Stubs for imports on paths that never
run: drawing (``opencood.visualization.vis_utils``), pypcd's ``lzf``; numpy 2's ``np.Inf``.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import (load_by_path, reference_root, stub_module,  # noqa: E402
                      two_step_main)                     # (tools/reference/side_env.py)

GENERATION = {"preset": "tiny", "seed": 0, "frames": 1, "camera_size": [32, 24],
              "hetero_lidars": [32, 16], "depth": True, "splits": ["train", "test"]}
HEAL_YAML = "opencood/hypes_yaml/opv2v/MoreModality/3_modality_end2end_training/" \
            "m1m2m3_pyramid.yaml"
HEAL_COMMIT = "96812ed5a416"
RANGE = [-51.2, -51.2, -3.0, 51.2, 51.2, 1.0]
VARIANTS = ("intermediate_camera", "heter_by_sensor", "late_camera")


def generate(root: Path) -> None:
    """tests/test_heter.py's heter_data folders (run with OUR opencood)."""
    load_by_path("compare_heter_reader", Path(__file__).with_name("compare_heter_reader.py")
                 ).generate_opv2v_h(root, GENERATION)


def data_aug_conf() -> dict:
    """m2's image augmentation for our images: evaluation keeps them whole (HEAL's resize by
    max(fH / H, fW / W) = 1, no crop)."""
    width, height = GENERATION["camera_size"]
    return {"resize_lim": [0.65, 0.7], "final_dim": [height, width], "rot_lim": [-3.6, 3.6],
            "H": height, "W": width, "rand_flip": False, "bot_pct_lim": [0.0, 0.0],
            "cams": ["camera0", "camera1", "camera2", "camera3"], "Ncams": 4}


def sensor_assignment(root: Path, split: str, first: str, others: str) -> dict:
    """{scenario: {cav id: modality}}: the first agent folder (string order) ``first``, the
    others ``others``."""
    assignment = {}
    for scenario in sorted(p for p in (root / split).iterdir() if p.is_dir()):
        cav_ids = sorted(p.name for p in scenario.iterdir() if p.is_dir())
        assignment[scenario.name] = {cav_id: first if k == 0 else others
                                     for k, cav_id in enumerate(cav_ids)}
    return assignment


def heal_hypes(load_yaml, root: Path, split: str, variant: str, folder: Path) -> dict:
    hypes = load_yaml(str(reference_root() / HEAL_YAML))
    hypes["root_dir"] = hypes["validate_dir"] = hypes["test_dir"] = str(root / split)
    hypes["add_data_extension"] = ["bev_visibility.png"]
    hypes["postprocess"]["gt_range"] = list(RANGE)
    hypes["postprocess"]["anchor_args"]["cav_lidar_range"] = list(RANGE)
    hypes["heter"]["modality_setting"]["m2"]["data_aug_conf"] = data_aug_conf()
    identity = {name: name for name in ("m1", "m2", "m3", "m4")}
    if variant == "intermediate_camera":
        del hypes["heter"]
        hypes["fusion"]["core_method"] = "intermediate"
        hypes["input_source"] = ["lidar"]
        hypes["label_type"] = "camera"
        return hypes
    path = folder / f"{variant}_{split}.json"
    if variant == "heter_by_sensor":
        path.write_text(json.dumps(sensor_assignment(root, split, "m1", "m2")))
        hypes["heter"].update(ego_modality="m1", mapping_dict=identity)
    else:                                   # late_camera
        path.write_text(json.dumps(sensor_assignment(root, split, "m2", "m2")))
        hypes["heter"].update(ego_modality="m2", mapping_dict=identity)
        hypes["fusion"]["core_method"] = "lateheter"
        hypes["label_type"] = "camera"
    hypes["heter"]["assignment_path"] = str(path)
    return hypes


def record(dataset, variant: str) -> list:
    samples = []
    for index in range(len(dataset)):
        item = dataset[index]
        base = dataset.retrieve_base_data(index)
        entry = {"index": index, "agents": list(base)}
        if variant == "late_camera":
            entry["ego"] = next(cav_id for cav_id, content in base.items() if content["ego"])
            entry["own_ids"] = {("ego" if name == "ego" else name):
                                sorted(int(i) for i in content["object_ids"])
                                for name, content in item.items()}
        else:
            ego = item["ego"]
            entry["ego"] = str(ego["cav_id_list"][0]) if "cav_id_list" in ego else \
                next(cav_id for cav_id, content in base.items() if content["ego"])
            entry["ids"] = sorted(int(i) for i in ego["object_ids"])
            if "agent_modality_list" in ego:
                entry["modalities"] = list(ego["agent_modality_list"])
        samples.append(entry)
    return samples


def run(root: Path, out: Path) -> None:
    import numpy as np
    stub_module("opencood.visualization.vis_utils")
    stub_module("lzf")
    np.Inf = np.inf
    from opencood.data_utils.datasets import build_dataset
    from opencood.hypes_yaml.yaml_utils import load_yaml
    result = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in VARIANTS:
            for split in GENERATION["splits"]:
                hypes = heal_hypes(load_yaml, root, split, variant, Path(folder))
                visualize = variant != "heter_by_sensor"
                dataset = build_dataset(hypes, visualize=visualize, train=False)
                result.setdefault(variant, {})[split] = record(dataset, variant)
    meta = {"generation": GENERATION, "heal_commit": HEAL_COMMIT, "heal_yaml": HEAL_YAML,
            "range": RANGE, "comm_range": hypes["comm_range"],
            "max_cav": hypes["train_params"]["max_cav"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, **result}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


def main(argv=None) -> int:
    return two_step_main(argv, "make_camera_label_fixture.py", generate, run)


if __name__ == "__main__":
    sys.exit(main())
