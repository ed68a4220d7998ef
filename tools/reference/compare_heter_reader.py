#!/usr/bin/env python
"""Run HEAL's own heterogeneous data set on our synthetic OPV2V-H folders and save, sample by
sample, what it reads for each agent of each modality: ``tests/fixtures/heter_reader/
heter.npz``, the fixture tests/test_heter_reader.py compares our reader and datasets with. Also
HEAL's own modality assignments of the folders (its ``heter_utils.assign_modality_4`` and
``assign_modality_4_in_order``), which our generator's json files must equal byte for byte.

Runs in a side environment, never in CI, with HEAL's checkout FIRST on PYTHONPATH (HEAL's
package is named ``opencood`` too), from outside our checkout. Exact commands of the committed
fixture (HEAL at 96812ed5a416; the side environment of make_camera_reader_fixture.py)::

    # 1. the folders and the hand-made assignment, from OUR venv (deterministic: GENERATION)
    PYTHONPATH=. python tools/reference/compare_heter_reader.py --generate /work/side/hh
    # 2. HEAL's data set on them
    cd /work/side && env PYTHONPATH=/work/side/HEAL:/work/side/pypcd_src \\
        /work/side/venv-cam/bin/python <repo>/tools/reference/compare_heter_reader.py \\
        /work/side/hh <repo>/tests/fixtures/heter_reader

What runs: HEAL's ``build_dataset(hypes, visualize=True, train=False)`` (its
``IntermediateheterFusionDataset`` over ``OPV2VBaseDataset``; ``visualize`` makes every agent's
labels its LiDAR labels, HEAL's test-time choice, since camera labels need OPV2V's
``bev_visibility.png``) from its ``opv2v/MoreModality/3_modality_end2end_training/
m1m2m3_pyramid.yaml`` (m1 PointPillar on the 64-beam LiDAR, m2 lift-splat cameras, m3 SECOND on
the 32-beam LiDAR), ``input_source`` [lidar, camera, depth], no ``add_data_extension``, m2's
``data_aug_conf`` sized for our 64 x 48 images, the data paths ours. Two settings (VARIANTS):

* ``heal_m1m2m3``: the yaml's heter section, with the generator's ``opv2v_4modality.json``
  (HEAL's own algorithm: every agent mapped, m4 -> m3);
* ``ego_m1_unmatched``: ego_modality m1, m4 mapped to a modality the model lacks (its agents
  leave, HEAL's ``unmatched_modality``), m3 on the 16-beam LiDAR, with HAND_ASSIGNMENT (the
  first folder is not m1 in two scenarios: HEAL's ``reorder_cav_list`` makes the m1 agent the
  ego).

Per sample: the agents (``cav_id_list``, ego first) and their ``agent_modality_list``; per LiDAR
agent the cloud its modality's file gives after HEAL's ``mask_ego_points`` (row count, column
sums); per agent its ``x1_to_x2`` to the ego; per camera agent its ``image_inputs`` (RGB channel
sums per camera, the depth channel whole, intrinsics, extrinsics, post_rots, post_trans); the
GT (``object_bbx_center`` under its mask, ``object_ids``). Training draws (HEAL's global
``random`` / ``numpy.random``, and its agent shuffle) are not compared.

Stubs for imports on paths that never run: drawing (``opencood.visualization.vis_utils``),
pypcd's ``lzf``; numpy 2's removed ``np.Inf`` aliased.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import reference_root, stub_module  # noqa: E402  (tools/reference/side_env.py)

GENERATION = {"preset": "tiny", "seed": 0, "frames": 1, "camera_size": [64, 48],
              "hetero_lidars": [32, 16], "depth": True}
HEAL_YAML = "opencood/hypes_yaml/opv2v/MoreModality/3_modality_end2end_training/" \
            "m1m2m3_pyramid.yaml"
HEAL_COMMIT = "96812ed5a416"
SPLITS = ("train", "validate", "test")
# HEAL's camera keys of image_inputs, ours
CAMERA_KEYS = {"intrins": "intrinsics", "extrinsics": "extrinsics", "post_rots": "post_rots",
               "post_trans": "post_trans"}
DATA_AUG_CONF = {"resize_lim": [0.65, 0.7], "final_dim": [32, 48], "rot_lim": [-3.6, 3.6],
                 "H": 48, "W": 64, "rand_flip": False, "bot_pct_lim": [0.0, 0.05],
                 "cams": ["camera0", "camera1", "camera2", "camera3"], "Ncams": 4}
# The hand-made assignment: per split, the modality of each agent folder in string order.
HAND_ASSIGNMENT = {"train": ("m2", "m1"), "validate": ("m1", "m4"), "test": ("m3", "m4", "m1")}
HAND_FILE = "hand_assignment.json"
VARIANTS = {
    "heal_m1m2m3": {"assignment": "heter_modality_assign/opv2v_4modality.json"},
    "ego_m1_unmatched": {"assignment": HAND_FILE, "ego_modality": "m1",
                         "mapping_dict": {"m1": "m1", "m2": "m2", "m3": "m3", "m4": "m9"},
                         "lidar_channels_dict": {"m3": 16}},
}


def generate_folders(root: Path) -> None:
    """Our OPV2V-H folders of GENERATION and HAND_FILE (run with OUR opencood)."""
    generate_opv2v_h(root, GENERATION)
    write_hand_assignment(root)


def generate_opv2v_h(root: Path, generation: dict) -> None:
    """Our synthetic OPV2V-H folders as ``generation`` says (GENERATION's keys; "splits":
    those only, default all)."""
    import dataclasses

    from opencood.data.synthetic import generate_dataset, get_preset
    from opencood.data.synthetic.camera import CameraConfig
    width, height = generation["camera_size"]
    preset = dataclasses.replace(
        get_preset(generation["preset"]), frames=generation["frames"],
        hetero_lidars=tuple(generation["hetero_lidars"]),
        cameras=CameraConfig(width=width, height=height, depth=generation["depth"]))
    splits = {"splits": tuple(generation["splits"])} if "splits" in generation else {}
    generate_dataset(root, preset=preset, seed=generation["seed"], progress=False, **splits)


def write_hand_assignment(root: Path) -> Path:
    assignment = {}
    for split, modalities in HAND_ASSIGNMENT.items():
        for scenario in sorted((root / split).iterdir()):
            cav_ids = sorted(p.name for p in scenario.iterdir())
            assignment[scenario.name] = dict(zip(cav_ids, modalities))
    path = root / HAND_FILE
    path.write_text(json.dumps(assignment, indent=4))
    return path


def heter_section(base: dict, variant: dict, root: Path) -> dict:
    """The heter section of ``variant`` over the yaml's ``base`` one."""
    heter = json.loads(json.dumps(base))
    heter["assignment_path"] = str(root / variant["assignment"])
    for key in ("ego_modality", "mapping_dict", "lidar_channels_dict"):
        if key in variant:
            heter[key] = variant[key]
    heter["modality_setting"]["m2"]["data_aug_conf"] = DATA_AUG_CONF
    return heter


# ------------------------------------------------------------------------------ HEAL's side


def heal_hypes(load_yaml, reference: Path, root: Path, split: str, variant: dict) -> dict:
    hypes = load_yaml(str(reference / HEAL_YAML))
    hypes.pop("add_data_extension", None)
    hypes["heter"] = heter_section(hypes["heter"], variant, root)
    hypes["input_source"] = ["lidar", "camera", "depth"]
    hypes["root_dir"] = hypes["validate_dir"] = hypes["test_dir"] = str(root / split)
    return hypes


def heal_assignments(root: Path) -> dict:
    """HEAL's two assignment files of ``root``, as text."""
    from opencood.utils.heter_utils import assign_modality_4, assign_modality_4_in_order
    texts = {}
    with tempfile.TemporaryDirectory() as folder:
        for function in (assign_modality_4, assign_modality_4_in_order):
            path = Path(folder) / f"{function.__name__}.json"
            function(root_dir=str(root), output_path=str(path))
            texts[function.__name__] = path.read_text()
    return texts


class _Record:
    def __init__(self):
        self.lists = {name: [] for name in (
            "sample_variant", "sample_split", "sample_index", "agent_ids", "agent_modality",
            "agent_points", "agent_sums", "agent_to_ego", "boxes", "box_ids", "camera_agent",
            "rgb_sums", "depth", *CAMERA_KEYS.values())}
        self.agent_start, self.box_start, self.camera_start = [0], [0], [0]

    def save(self, path: Path, meta: dict) -> None:
        arrays = {name: np.asarray(values) for name, values in self.lists.items()}
        arrays["boxes"] = arrays["boxes"].reshape(-1, 7)
        for name in ("agent_start", "box_start", "camera_start"):
            arrays[name] = np.asarray(getattr(self, name), dtype=np.int64)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path, meta=np.asarray(json.dumps(meta)), **arrays)


def record_sample(record: _Record, dataset, index: int, tools, variant: str, split: str):
    mask_ego_points, x1_to_x2 = tools
    ego = dataset[index]["ego"]
    base = dataset.retrieve_base_data(index)
    cav_ids = list(ego["cav_id_list"])
    ego_pose = base[cav_ids[0]]["params"]["lidar_pose"]
    lists = record.lists
    lists["sample_variant"].append(variant)
    lists["sample_split"].append(split)
    lists["sample_index"].append(index)
    camera_rows = {}
    for cav_id, modality in zip(cav_ids, ego["agent_modality_list"]):
        lists["agent_ids"].append(int(cav_id))
        lists["agent_modality"].append(modality)
        lists["agent_to_ego"].append(x1_to_x2(base[cav_id]["params"]["lidar_pose"], ego_pose))
        if dataset.sensor_type_dict[modality] == "lidar":
            points = mask_ego_points(base[cav_id]["lidar_np"])
            lists["agent_points"].append(len(points))
            lists["agent_sums"].append(np.asarray(points, np.float64).sum(axis=0))
        else:
            lists["agent_points"].append(-1)
            lists["agent_sums"].append(np.zeros(4))
            row = camera_rows.setdefault(modality, 0)
            camera_rows[modality] += 1
            inputs = ego[f"input_{modality}"]
            images = np.asarray(inputs["imgs"][row], dtype=np.float64)     # (C, 4, H, W)
            lists["camera_agent"].append(int(cav_id))
            lists["rgb_sums"].append(images[:, :3].sum(axis=(2, 3)))
            lists["depth"].append(images[:, 3].astype(np.float32))
            for heal_key, our_key in CAMERA_KEYS.items():
                lists[our_key].append(np.asarray(inputs[heal_key][row]))
    record.agent_start.append(len(lists["agent_ids"]))
    record.camera_start.append(len(lists["camera_agent"]))
    boxes = ego["object_bbx_center"][ego["object_bbx_mask"] == 1]
    lists["boxes"].extend(np.asarray(boxes, np.float64))
    lists["box_ids"].extend(int(i) for i in ego["object_ids"])
    record.box_start.append(len(lists["box_ids"]))


def run(root: Path, out: Path) -> None:
    stub_module("opencood.visualization.vis_utils")
    stub_module("lzf")
    np.Inf = np.inf
    from opencood.data_utils.datasets import build_dataset
    from opencood.hypes_yaml.yaml_utils import load_yaml
    from opencood.utils.pcd_utils import mask_ego_points
    from opencood.utils.transformation_utils import x1_to_x2
    reference = reference_root()
    record, heters = _Record(), {}
    for name, variant in VARIANTS.items():
        for split in SPLITS:
            hypes = heal_hypes(load_yaml, reference, root, split, variant)
            heters[name] = hypes["heter"]
            dataset = build_dataset(hypes, visualize=True, train=False)
            for index in range(len(dataset)):
                record_sample(record, dataset, index, (mask_ego_points, x1_to_x2), name, split)
    meta = {"generation": GENERATION, "heal_commit": HEAL_COMMIT, "heal_yaml": HEAL_YAML,
            "variants": VARIANTS, "heter": {name: _relative(heter, root)
                                            for name, heter in heters.items()},
            "gt_range": hypes["postprocess"]["gt_range"], "order": hypes["postprocess"]["order"],
            "comm_range": hypes["comm_range"], "max_cav": hypes["train_params"]["max_cav"],
            "assignments": heal_assignments(root)}
    record.save(out / "heter.npz", meta)
    print(f"wrote {out / 'heter.npz'}: {len(record.lists['sample_index'])} samples")


def _relative(heter: dict, root: Path) -> dict:
    """The heter section with its assignment path relative to the data root."""
    return {**heter, "assignment_path": str(Path(heter["assignment_path"]).relative_to(root))}


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--generate":
        generate_folders(Path(args[1]))
        return 0
    if len(args) != 2:
        print("usage: compare_heter_reader.py [--generate] DATA_DIR [OUT_DIR]", file=sys.stderr)
        return 2
    run(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
