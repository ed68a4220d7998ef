#!/usr/bin/env python
"""Run the reference V2V4Real / DAIR-V2X-C data sets on our synthetic folders, built as their
users build them (their fusion dataset classes from their own yamls), and save what they read
and what their training and evaluation see, sample by sample: the fixture
tests/test_reference_readers.py compares our readers and datasets with.

Runs in the side environment, never in CI, with the reference checkout FIRST on PYTHONPATH
(both references are packages named ``opencood``, so one reference per process), from outside
our checkout. Exact commands of the committed fixtures (V2V4Real at da1db75383c7, HEAL at
96812ed5a416, klintan/pypcd at 144478abe12b)::

    # 1. the synthetic folders, from OUR venv (deterministic: preset + seed, see GENERATION)
    PYTHONPATH=. python tools/generate_synthetic.py --out /work/side/rr/v2v4real --preset tiny \
        --format v2v4real --seed 0 --quiet
    PYTHONPATH=. python tools/generate_synthetic.py --out /work/side/rr/dairv2x --preset tiny \
        --format dairv2x --seed 0 --quiet
    # 2. the side environment and the reference checkouts (outside any checkout)
    python3 -m venv /work/side/venv-ref
    /work/side/venv-ref/bin/pip install torch==2.14.1 numpy pyyaml shapely icecream \
        opencv-python-headless h5py pillow scipy open3d pyquaternion matplotlib einops spconv cumm
    apt-get install -y libusb-1.0-0 libgl1 libgomp1          # open3d's shared libraries
    git --git-dir=/work/.mirror/ucla-mobility+V2V4Real/repo archive HEAD | tar -x -C /work/side/V2V4Real
    git --git-dir=/work/.mirror/yifanlu0227+HEAL/repo archive HEAD | tar -x -C /work/side/HEAL
    git --git-dir=/work/.mirror/klintan+pypcd/repo/.git archive HEAD | tar -x -C /work/side/pypcd_src
    /work/side/venv-ref/bin/pip install cython setuptools
    cd /work/side/V2V4Real && /work/side/venv-ref/bin/python opencood/utils/setup.py build_ext --inplace
    cd /work/side/HEAL && /work/side/venv-ref/bin/python opencood/utils/setup.py build_ext --inplace
    # 3. one reference per process
    cd /work/side && env PYTHONPATH=/work/side/V2V4Real /work/side/venv-ref/bin/python \
        <repo>/tools/reference/compare_readers.py v2v4real /work/side/rr/v2v4real <repo>/tests/fixtures/reference_readers
    cd /work/side && env PYTHONPATH=/work/side/HEAL:/work/side/pypcd_src /work/side/venv-ref/bin/python \
        <repo>/tools/reference/compare_readers.py dairv2x /work/side/rr/dairv2x <repo>/tests/fixtures/reference_readers

What runs (their code, their cython anchor IoU built as their READMEs say; only the data paths
of their yamls are changed, and stubs stand in for imports these paths never call: drawing,
pypcd's lzf codec, torchvision's image transforms):

* v2v4real: ``opencood/hypes_yaml/point_pillar_intermediate_fusion.yaml`` read by V2V4Real's
  ``load_yaml``, ``root_dir``/``validate_dir`` our split, ``build_dataset(hypes, visualize=True,
  train=False)`` as its ``tools/inference.py`` does: its ``IntermediateFusionDataset``. Per
  sample: ``dataset[i]``'s GT (``object_bbx_center`` under its mask, ``object_ids``: GT_RANGE
  with >= 2 corners, then the crop filter against the yaml's ``cav_lidar_range``, the union,
  70 m communication range), and the evaluation's GT, ``post_processor.generate_gt_bbx`` of
  ``collate_batch_test([item])`` (all 8 corners in GT_RANGE, x and y), its ids found by
  matching the corners to the dataset's boxes.
* dairv2x: ``opencood/hypes_yaml/dairv2x/LiDAROnly/lidar_pyramid.yaml`` (every HEAL DAIR LiDAR
  yaml builds the same data set) read by HEAL's ``load_yaml``, ``data_dir`` our root,
  ``root_dir``/``validate_dir``/``test_dir`` our split file, then what HEAL's
  ``tools/inference.py`` does to a ``heter`` yaml at its default ``--range 102.4,102.4``: the
  crop, lidar and GT ranges become [-102.4, -102.4, z0, 102.4, 102.4, z1] (z of the yaml),
  ``load_general_params`` again, ``build_dataset(hypes, visualize=True, train=False)``: its
  ``IntermediateheterFusionDataset`` over ``DAIRV2XBaseDataset``. Per sample: ``dataset[i]``'s
  GT (the two single-side label sets merged by BEV IoU, ids 0..) and the evaluation's GT
  (``generate_gt_bbx_by_iou`` of ``collate_batch_test([item])``).

Both also record, from the same dataset object's ``retrieve_base_data``, every agent's raw
point count and column sums and its agent -> ego matrix (HEAL: ``x1_to_x2`` of the 6-number
poses, as its dataset computes it).

Saved per format (``<out>/<format>.npz``), for every split and sample in the dataset's order:
``sample_split``, ``sample_key`` (scenario/timestamp or the vehicle frame id); the dataset's GT:
``box_start`` offsets into ``boxes`` (K, 7 in ``order``) and ``box_ids`` (K,); the
evaluation's GT: ``eval_start`` offsets into ``eval_centres`` (E, 3, the corners' mean) and
``eval_ids`` (E,); per agent (``agent_start`` offsets) ``agent_ids``, ``agent_points`` (raw rows
read), ``agent_sums`` (column sums of x, y, z, intensity as the reader returns them) and
``agent_to_ego`` (A, 4, 4); ``meta``: the generation, the order and each range used.
"""
import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import reference_root, stub_module  # noqa: E402  (tools/reference/side_env.py)

SPLITS = {"v2v4real": ("train", "validate", "test"), "dairv2x": ("train.json", "val.json",
                                                                "test.json")}
# How the folders were generated (the test regenerates them in-process from these).
GENERATION = {"preset": "tiny", "seed": 0}
V2V4REAL_YAML = "opencood/hypes_yaml/point_pillar_intermediate_fusion.yaml"
HEAL_YAML = "opencood/hypes_yaml/dairv2x/LiDAROnly/lidar_pyramid.yaml"
HEAL_INFERENCE_RANGE = (102.4, 102.4)          # HEAL's tools/inference.py --range default
CORNER_MATCH_TOL = 1e-4                        # m: an evaluation box is a dataset box


class _Record:
    """Accumulates the per-sample arrays of one format."""

    def __init__(self):
        self.split, self.key = [], []
        self.box_start, self.boxes, self.box_ids = [0], [], []
        self.eval_start, self.eval_centres, self.eval_ids = [0], [], []
        self.agent_start, self.agent_ids, self.points, self.sums, self.to_ego = [0], [], [], \
            [], []

    def add(self, split, key, ids, boxes, eval_ids, eval_centres, agents):
        """agents: [(agent id, points (N, 4), agent_to_ego (4, 4))], ego first."""
        self.split.append(split)
        self.key.append(key)
        self.box_ids.extend(int(i) for i in ids)
        self.boxes.extend(np.asarray(b, dtype=np.float64).reshape(7) for b in boxes)
        self.box_start.append(len(self.box_ids))
        self.eval_ids.extend(int(i) for i in eval_ids)
        self.eval_centres.extend(np.asarray(c, dtype=np.float64).reshape(3)
                                 for c in eval_centres)
        self.eval_start.append(len(self.eval_ids))
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
            eval_start=np.asarray(self.eval_start, dtype=np.int64),
            eval_centres=np.asarray(self.eval_centres, dtype=np.float64).reshape(-1, 3),
            eval_ids=np.asarray(self.eval_ids, dtype=np.int64),
            agent_start=np.asarray(self.agent_start, dtype=np.int64),
            agent_ids=np.asarray(self.agent_ids, dtype=np.int64),
            agent_points=np.asarray(self.points, dtype=np.int64),
            agent_sums=np.asarray(self.sums, dtype=np.float64).reshape(-1, 4),
            agent_to_ego=np.asarray(self.to_ego, dtype=np.float64).reshape(-1, 4, 4),
            meta=np.asarray(json.dumps({**GENERATION, **meta})))


def _eval_gt(dataset, item, boxes, ids, order: str, boxes_to_corners):
    """The evaluation's GT of one sample: (ids (E,), centres (E, 3)). Its post-processor's
    ``generate_gt_bbx`` on the test collate of ``item``; each box named by the dataset box with
    the same corners (a box the evaluation invented would raise)."""
    import torch
    corners = dataset.post_processor.generate_gt_bbx(dataset.collate_batch_test([item]))
    corners = np.asarray(corners.cpu().numpy() if torch.is_tensor(corners) else corners,
                         dtype=np.float64).reshape(-1, 8, 3)
    dataset_corners = np.asarray(boxes_to_corners(np.array(boxes, dtype=np.float64).reshape(
        -1, 7), order), dtype=np.float64).reshape(-1, 8, 3)
    named = []
    for box in corners:
        gap = np.abs(dataset_corners - box).reshape(len(dataset_corners), -1).max(axis=1)
        if not len(gap) or gap.min() > CORNER_MATCH_TOL:
            raise RuntimeError("an evaluation GT box matches no dataset GT box")
        named.append(int(ids[int(np.argmin(gap))]))
    return named, corners.mean(axis=1)


# ------------------------------------------------------------------------------ V2V4Real

def v2v4real_hypes(reference: Path, split_dir: Path) -> dict:
    """V2V4Real's intermediate-fusion yaml, read by its load_yaml, pointed at our split."""
    from opencood.hypes_yaml.yaml_utils import load_yaml
    hypes = load_yaml(str(reference / V2V4REAL_YAML))
    hypes["root_dir"] = hypes["validate_dir"] = str(split_dir)
    return hypes


def v2v4real_imports():
    """V2V4Real's build_dataset, GT_RANGE and boxes_to_corners_3d, with the stubs."""
    # drawing only; it calls matplotlib's cm.get_cmap at import, which matplotlib 3.9 removed
    stub_module("opencood.visualization.vis_utils")
    from opencood.data_utils.datasets import GT_RANGE, build_dataset
    from opencood.utils.box_utils import boxes_to_corners_3d
    return build_dataset, GT_RANGE, boxes_to_corners_3d


def v2v4real_sample(dataset, boxes_to_corners, index: int):
    """(key, ids, boxes, eval ids, eval centres, agents) of one sample."""
    import torch
    item = dataset[index]
    ego = item["ego"]
    boxes = ego["object_bbx_center"][ego["object_bbx_mask"] == 1]
    ids = list(ego["object_ids"])
    order = dataset.params["postprocess"]["order"]
    eval_ids, eval_centres = _eval_gt(
        dataset, item, boxes, ids, order,
        lambda b, o: boxes_to_corners(torch.from_numpy(b.copy()), o).numpy())
    base = dataset.retrieve_base_data(index, cur_ego_pose_flag=True)
    agents = [(cav_id, cav["lidar_np"], cav["params"]["transformation_matrix"])
              for cav_id, cav in base.items()]
    first = next(iter(base.values()))
    scenario = dataset.scenario_database[_scenario_of(dataset, index)]
    key = f"{first['folder_name']}/{dataset.return_timestamp_key(scenario, first['index'])}"
    return key, ids, boxes, eval_ids, eval_centres, agents


def _scenario_of(dataset, index: int) -> int:
    for scenario, end in enumerate(dataset.len_record):
        if index < end:
            return scenario
    raise IndexError(index)


def v2v4real_reader(root: Path):
    """([(split, sample count, sample(index))], meta) of the reference."""
    reference = reference_root()
    build_dataset, gt_range, boxes_to_corners = v2v4real_imports()
    out, hypes = [], None
    for split in SPLITS["v2v4real"]:
        hypes = v2v4real_hypes(reference, root / split)
        dataset = build_dataset(hypes, visualize=True, train=False)
        out.append((split, len(dataset),
                    lambda index, dataset=dataset: v2v4real_sample(dataset, boxes_to_corners,
                                                                    index)))
    meta = {"reader": f"V2V4Real IntermediateFusionDataset ({V2V4REAL_YAML})",
            "order": hypes["postprocess"]["order"], "gt_range": list(gt_range),
            "crop_range": hypes["preprocess"]["cav_lidar_range"], "comm_range": 70.0,
            "eval": "generate_gt_bbx: 8 corners (x, y) in gt_range"}
    return out, meta


# ------------------------------------------------------------------------- HEAL DAIR-V2X-C

def heal_imports():
    """HEAL's build_dataset, load_yaml, update_dict, x1_to_x2 and boxes_to_corners_3d, with
    the stubs and the pypcd fix."""
    stub_module("opencood.visualization.vis_utils")                   # as in v2v4real_imports
    stub_module("lzf")                    # pypcd's compressed-PCD codec: our clouds are binary
    # camera_utils builds image transforms at import; the lidar path never runs them
    _placeholder = lambda *args, **kwargs: None                      # noqa: E731
    stub_module("torchvision", transforms=types.SimpleNamespace(
        Normalize=type("Normalize", (), {"__init__": _placeholder}), Compose=_placeholder,
        ToPILImage=_placeholder, ToTensor=_placeholder))
    # numpy 2 removed the alias np.Inf, which HEAL's downsample_lidar_minimum (the test
    # collate of a visualize=True data set) still spells: the same constant under its old name
    np.Inf = np.inf
    from pypcd import pypcd
    # pypcd (klintan's, what HEAL installs) reads binary PCD with np.fromstring, which numpy 2
    # removed: the same bytes through np.frombuffer (copied: pypcd's arrays are writable)
    pypcd.parse_binary_pc_data = lambda f, dtype, metadata: np.frombuffer(
        f.read(metadata["points"] * dtype.itemsize), dtype=dtype).copy()
    from opencood.data_utils.datasets import build_dataset
    from opencood.hypes_yaml import yaml_utils
    from opencood.utils.box_utils import boxes_to_corners_3d
    from opencood.utils.common_utils import update_dict
    from opencood.utils.transformation_utils import x1_to_x2
    return build_dataset, yaml_utils, update_dict, x1_to_x2, boxes_to_corners_3d


def heal_hypes(reference: Path, yaml_utils, update_dict, data_dir: Path,
               split_file: Path) -> dict:
    """HEAL's DAIR LiDAR yaml pointed at our files, then what its tools/inference.py does to a
    heter yaml at the default --range (the ranges' x and y become +-102.4, the parser reruns)."""
    hypes = yaml_utils.load_yaml(str(reference / HEAL_YAML))
    hypes["data_dir"] = str(data_dir)
    hypes["root_dir"] = hypes["validate_dir"] = hypes["test_dir"] = str(split_file)
    half_x, half_y = HEAL_INFERENCE_RANGE
    z_range = hypes["postprocess"]["anchor_args"]["cav_lidar_range"]
    new_range = [-half_x, -half_y, z_range[2], half_x, half_y, z_range[5]]
    hypes = update_dict(hypes, {"cav_lidar_range": new_range, "lidar_range": new_range,
                                "gt_range": new_range})
    hypes = getattr(yaml_utils, hypes["yaml_parser"])(hypes)
    hypes["validate_dir"] = hypes["test_dir"]
    return hypes


def dairv2x_sample(dataset, x1_to_x2, boxes_to_corners, index: int):
    """(key, ids, boxes, eval ids, eval centres, agents) of one pair."""
    item = dataset[index]
    ego = item["ego"]
    boxes = ego["object_bbx_center"][ego["object_bbx_mask"] == 1]
    ids = [int(i) for i in ego["object_ids"]]
    eval_ids, eval_centres = _eval_gt(dataset, item, boxes, ids,
                                      dataset.params["postprocess"]["order"], boxes_to_corners)
    base = dataset.retrieve_base_data(index)
    ego_pose = base[0]["params"]["lidar_pose"]
    # agent ids as our reader names them: the vehicle "0", the roadside unit "-1" (HEAL: 1)
    agents = [(0 if agent == 0 else -1, base[agent]["lidar_np"],
               x1_to_x2(base[agent]["params"]["lidar_pose"], ego_pose)) for agent in (0, 1)]
    return dataset.split_info[index], ids, boxes, eval_ids, eval_centres, agents


def dairv2x_reader(root: Path):
    """As v2v4real_reader, for HEAL's DAIR-V2X-C data set."""
    reference = reference_root()
    build_dataset, yaml_utils, update_dict, x1_to_x2, boxes_to_corners = heal_imports()
    data_dir = root / "cooperative-vehicle-infrastructure"
    out, hypes = [], None
    for split in SPLITS["dairv2x"]:
        hypes = heal_hypes(reference, yaml_utils, update_dict, data_dir, data_dir / split)
        dataset = build_dataset(hypes, visualize=True, train=False)
        out.append((split, len(dataset),
                    lambda index, dataset=dataset: dairv2x_sample(dataset, x1_to_x2,
                                                                   boxes_to_corners, index)))
    meta = {"reader": f"HEAL IntermediateheterFusionDataset over DAIRV2XBaseDataset "
                      f"({HEAL_YAML}, inference ranges)",
            "order": hypes["postprocess"]["order"],
            "gt_range": hypes["postprocess"]["gt_range"], "comm_range": hypes["comm_range"],
            "eval": "generate_gt_bbx_by_iou: 8 corners (x, y) in gt_range"}
    return out, meta


READERS = {"v2v4real": v2v4real_reader, "dairv2x": dairv2x_reader}


def run(name: str, root: Path, out: Path) -> None:
    readers, meta = READERS[name](root)
    record = _Record()
    for split, count, sample in readers:
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
