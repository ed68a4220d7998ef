#!/usr/bin/env python
"""Run the reference V2V4Real / DAIR-V2X-C readers on our synthetic folders and save what they
read, sample by sample, as the fixture tests/test_reference_readers.py compares our readers with.

Runs in the side environment (/work/refenv), never in CI, with the reference checkout FIRST on
PYTHONPATH (both references are packages named ``opencood``, so one reader per process)::

    # 1. the synthetic folders, from OUR venv (deterministic: preset + seed, see GENERATION)
    PYTHONPATH=. python tools/generate_synthetic.py --out /tmp/rr/v2v4real --preset tiny \
        --format v2v4real --seed 0 --quiet
    PYTHONPATH=. python tools/generate_synthetic.py --out /tmp/rr/dairv2x --preset tiny \
        --format dairv2x --seed 0 --quiet
    # 2. the reference checkouts
    git --git-dir=<mirror of ucla-mobility/V2V4Real> archive HEAD | tar -x -C /tmp/V2V4Real
    git --git-dir=<mirror of yifanlu0227/HEAL> archive HEAD | tar -x -C /tmp/HEAL
    git --git-dir=<mirror of klintan/pypcd> archive HEAD | tar -x -C /tmp/pypcd_src
    # 3. one reader per process
    cd /tmp && env PYTHONPATH=/tmp/V2V4Real /work/refenv/bin/python \
        <repo>/tools/reference/compare_readers.py v2v4real /tmp/rr/v2v4real <repo>/tests/fixtures/reference_readers
    cd /tmp && env PYTHONPATH=/tmp/HEAL:/tmp/pypcd_src /work/refenv/bin/python \
        <repo>/tools/reference/compare_readers.py dairv2x /tmp/rr/dairv2x <repo>/tests/fixtures/reference_readers

What each reader does (their code, called as their datasets call it):

* v2v4real: V2V4Real's ``BaseDataset`` (train=False: CAV folders sorted, the first is the ego;
  no latency, no pose noise) ``retrieve_base_data``; GT of each CAV from its post-processor's
  ``generate_object_center([cav], transformation_matrix)`` (``project_world_objects``: the CAV's
  own-frame boxes to the ego, GT_RANGE [-100, -40, -5, 100, 40, 3], >= 2 corners in range), then
  the intermediate dataset's union ("first occurrence of an id wins", ego first).
* dairv2x: HEAL's ``DAIRV2XBaseDataset.retrieve_base_data`` and its ``generate_object_center``
  (label_type lidar: ``cooperative/label_world``, ``project_world_objects_dairv2x`` on the
  ego's 6-number pose, HEAL's DAIR range [-102.4, -51.2, -3.5, 102.4, 51.2, 1.5] widened by 1 m
  in z, all 8 corners in range); agent -> ego = ``x1_to_x2`` of the two 6-number poses, as
  HEAL's intermediate dataset computes it.

Saved per format (``<out>/<format>.npz``), for every split and sample in the reader's order:
``sample_split``, ``sample_key`` (scenario/timestamp or the vehicle frame id), per sample the GT
``box_start`` offsets into ``boxes`` (K, 7 in ``order``) and ``box_ids`` (K,), per agent
(``agent_start`` offsets) ``agent_ids``, ``agent_points`` (raw rows read), ``agent_sums``
(column sums of x, y, z, intensity as the reader returns them) and ``agent_to_ego`` (A, 4, 4).
"""
import json
import sys
import types
from pathlib import Path

import numpy as np

SPLITS = {"v2v4real": ("train", "validate", "test"), "dairv2x": ("train.json", "val.json",
                                                                "test.json")}
# How the folders were generated (the test regenerates them in-process from these).
GENERATION = {"preset": "tiny", "seed": 0}
ORDER = "hwl"                       # both references' configs use hwl
V2V4REAL_GT_RANGE = [-100, -40, -5, 100, 40, 3]
HEAL_DAIR_RANGE = [-102.4, -51.2, -3.5, 102.4, 51.2, 1.5]


def _stub(name: str, **attributes) -> None:
    """An empty module for an import the readers make but never use on this path."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


class _Record:
    """Accumulates the per-sample arrays of one format."""

    def __init__(self):
        self.split, self.key, self.box_start, self.boxes, self.box_ids = [], [], [0], [], []
        self.agent_start, self.agent_ids, self.points, self.sums, self.to_ego = [0], [], [], \
            [], []

    def add(self, split, key, ids, boxes, agents):
        """agents: [(agent id, points (N, 4), agent_to_ego (4, 4))], ego first."""
        self.split.append(split)
        self.key.append(key)
        self.box_ids.extend(int(i) for i in ids)
        self.boxes.extend(np.asarray(b, dtype=np.float64).reshape(7) for b in boxes)
        self.box_start.append(len(self.box_ids))
        for agent_id, points, to_ego in agents:
            self.agent_ids.append(int(agent_id))
            self.points.append(len(points))
            self.sums.append(np.asarray(points, dtype=np.float64).sum(axis=0))
            self.to_ego.append(np.asarray(to_ego, dtype=np.float64))
        self.agent_start.append(len(self.agent_ids))

    def save(self, path: Path, **meta):
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            path, sample_split=np.asarray(self.split), sample_key=np.asarray(self.key),
            box_start=np.asarray(self.box_start, dtype=np.int64),
            boxes=np.asarray(self.boxes, dtype=np.float64).reshape(-1, 7),
            box_ids=np.asarray(self.box_ids, dtype=np.int64),
            agent_start=np.asarray(self.agent_start, dtype=np.int64),
            agent_ids=np.asarray(self.agent_ids, dtype=np.int64),
            agent_points=np.asarray(self.points, dtype=np.int64),
            agent_sums=np.asarray(self.sums, dtype=np.float64).reshape(-1, 4),
            agent_to_ego=np.asarray(self.to_ego, dtype=np.float64).reshape(-1, 4, 4),
            meta=np.asarray(json.dumps({**GENERATION, "order": ORDER, **meta})))


# ------------------------------------------------------------------------------ V2V4Real

def v2v4real_dataset(split_dir: Path):
    """V2V4Real's BaseDataset on one split folder, test mode (sorted CAVs, nothing random)."""
    from opencood.data_utils.datasets.basedataset import BaseDataset
    params = {"data_augment": [], "root_dir": str(split_dir), "validate_dir": str(split_dir),
              "train_params": {"max_cav": 2}}
    return BaseDataset(params, visualize=False, train=False)


def v2v4real_sample(dataset, post_processor, index: int):
    """(key, ids, boxes, agents) of one sample as V2V4Real's intermediate dataset builds it."""
    base = dataset.retrieve_base_data(index, cur_ego_pose_flag=True)
    id_stack, box_stack, agents = [], [], []
    for cav_id, cav in base.items():
        to_ego = cav["params"]["transformation_matrix"]
        boxes, mask, ids = post_processor.generate_object_center([cav], to_ego)
        id_stack += list(ids)
        box_stack.append(boxes[mask == 1])
        agents.append((cav_id, cav["lidar_np"], to_ego))
    boxes = np.vstack(box_stack)
    # the intermediate dataset's de-duplication: the first occurrence of an id is kept
    unique = [id_stack.index(x) for x in sorted(set(id_stack))]
    ego = next(iter(base.values()))
    scenario = dataset.scenario_database[_scenario_of(dataset, index)]
    key = f"{ego['folder_name']}/{dataset.return_timestamp_key(scenario, ego['index'])}"
    return key, [id_stack[i] for i in unique], boxes[unique], agents


def _scenario_of(dataset, index: int) -> int:
    for scenario, end in enumerate(dataset.len_record):
        if index < end:
            return scenario
    raise IndexError(index)


def v2v4real_post_processor():
    """V2V4Real's post-processor base, test mode (GT filtered with its GT_RANGE)."""
    # the cython IoU of the voxel post-processor (built by setup.py): the GT path never calls it
    _stub("opencood.utils.box_overlaps", bbox_overlaps=None)
    from opencood.data_utils.post_processor.base_postprocessor import BasePostprocessor
    return BasePostprocessor({"order": ORDER, "max_num": 200,
                              "anchor_args": {"cav_lidar_range": V2V4REAL_GT_RANGE}}, train=False)


def v2v4real_reader(root: Path):
    """[(split, sample count, sample(index) -> (key, ids, boxes, agents))] of the reference."""
    post_processor = v2v4real_post_processor()
    out = []
    for split in SPLITS["v2v4real"]:
        dataset = v2v4real_dataset(root / split)
        out.append((split, len(dataset),
                    lambda index, dataset=dataset: v2v4real_sample(dataset, post_processor,
                                                                    index)))
    return out


# ------------------------------------------------------------------------- HEAL DAIR-V2X-C

def heal_params(data_dir: Path, split_file: Path) -> dict:
    """The keys DAIRV2XBaseDataset's constructor reads (HEAL's dairv2x LiDAROnly config)."""
    return {"data_dir": str(data_dir), "root_dir": str(split_file),
            "validate_dir": str(split_file), "train_params": {"max_cav": 2},
            "comm_range": 100, "input_source": ["lidar"], "label_type": "lidar",
            "fusion": {"args": {}},
            "preprocess": {"core_method": "BasePreprocessor", "args": {},
                           "cav_lidar_range": HEAL_DAIR_RANGE},
            "postprocess": {"core_method": "VoxelPostprocessor", "order": ORDER, "max_num": 200,
                            "gt_range": HEAL_DAIR_RANGE,
                            "anchor_args": {"cav_lidar_range": HEAL_DAIR_RANGE, "l": 3.9,
                                            "w": 1.6, "h": 1.56, "r": [0, 90], "num": 2,
                                            "feature_stride": 2, "W": 512, "H": 256, "D": 1,
                                            "vh": 0.4, "vw": 0.4, "vd": 5},
                            "target_args": {"pos_threshold": 0.6, "neg_threshold": 0.45,
                                            "score_threshold": 0.2},
                            "nms_thresh": 0.15}}


def heal_imports():
    """HEAL's DAIR base dataset class and x1_to_x2, with the stubs and the pypcd fix."""
    _stub("opencood.utils.box_overlaps", bbox_overlaps=None)    # as in v2v4real_post_processor
    _stub("lzf")                    # pypcd's compressed-PCD codec: our clouds are binary
    _stub("h5py")                   # imported by the DAIR base dataset, unused for lidar
    # camera_utils builds image transforms at import; the lidar path never runs them
    _placeholder = lambda *args, **kwargs: None                      # noqa: E731
    _stub("torchvision", transforms=types.SimpleNamespace(
        Normalize=type("Normalize", (), {"__init__": _placeholder}), Compose=_placeholder,
        ToPILImage=_placeholder, ToTensor=_placeholder))
    from pypcd import pypcd
    # pypcd (klintan's, what HEAL installs) reads binary PCD with np.fromstring, which numpy 2
    # removed: the same bytes through np.frombuffer (copied: pypcd's arrays are writable)
    pypcd.parse_binary_pc_data = lambda f, dtype, metadata: np.frombuffer(
        f.read(metadata["points"] * dtype.itemsize), dtype=dtype).copy()
    from opencood.data_utils.datasets.basedataset.dairv2x_basedataset import DAIRV2XBaseDataset
    from opencood.utils.transformation_utils import x1_to_x2
    return DAIRV2XBaseDataset, x1_to_x2


def dairv2x_sample(dataset, x1_to_x2, index: int):
    """(key, ids, boxes, agents) of one pair as HEAL's intermediate dataset reads it."""
    base = dataset.retrieve_base_data(index)
    ego_pose = base[0]["params"]["lidar_pose"]
    boxes, mask, ids = dataset.generate_object_center([base[0]], ego_pose)
    # agent ids as our reader names them: the vehicle "0", the roadside unit "-1" (HEAL: 1)
    agents = [(0 if agent == 0 else -1, base[agent]["lidar_np"],
               x1_to_x2(base[agent]["params"]["lidar_pose"], ego_pose)) for agent in (0, 1)]
    return dataset.split_info[index], ids, boxes[mask == 1], agents


def dairv2x_reader(root: Path):
    """As v2v4real_reader, for HEAL's DAIR-V2X-C base dataset."""
    dataset_class, x1_to_x2 = heal_imports()
    data_dir = root / "cooperative-vehicle-infrastructure"
    out = []
    for split in SPLITS["dairv2x"]:
        dataset = dataset_class(heal_params(data_dir, data_dir / split), visualize=False,
                                train=False)
        out.append((split, len(dataset),
                    lambda index, dataset=dataset: dairv2x_sample(dataset, x1_to_x2, index)))
    return out


READERS = {"v2v4real": (v2v4real_reader, {"gt_range": V2V4REAL_GT_RANGE,
                                          "reader": "V2V4Real basedataset"}),
           "dairv2x": (dairv2x_reader, {"gt_range": HEAL_DAIR_RANGE,
                                        "reader": "HEAL DAIRV2XBaseDataset"})}


def run(name: str, root: Path, out: Path) -> None:
    make_reader, meta = READERS[name]
    record = _Record()
    for split, count, sample in make_reader(root):
        for index in range(count):
            record.add(split, *sample(index))
    record.save(out / f"{name}.npz", **meta)


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3 or args[0] not in SPLITS:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        print("usage: compare_readers.py v2v4real|dairv2x DATA_DIR OUT_DIR", file=sys.stderr)
        return 2
    run(args[0], Path(args[1]), Path(args[2]))
    print(f"wrote {Path(args[2]) / (args[0] + '.npz')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
