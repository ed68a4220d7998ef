#!/usr/bin/env python
"""Run V2X-Real's own data set code on our synthetic V2X-Real folders, in each of its four
collaboration modes, and save what it reads sample by sample: the fixture
tests/test_v2xreal.py compares our reader (``fusion.dataset: v2xreal``) with.

Runs in the side environment, never in CI, with the V2X-Real checkout FIRST on PYTHONPATH (its
package is named ``opencood`` too), from outside our checkout. Exact commands of the committed
fixture (ucla-mobility/V2X-Real at b6d5be142a92)::

    # 1. the synthetic folders, from OUR venv (deterministic: preset + seed, see GENERATION)
    PYTHONPATH=. python tools/generate_synthetic.py --out /work/side/rr/v2xreal \
        --preset tiny_multiclass --format v2xreal --seed 0 --quiet
    # 2. the side environment (torch 2.14.1, numpy, pyyaml, spconv, cumm, cython) and the
    #    reference's cython anchor IoU, built as its README says
    git --git-dir=/work/.mirror/ucla-mobility+V2X-Real/repo archive HEAD \
        | tar -x -C /work/side/V2X-Real
    /work/side/venv-v2xreal/bin/pip install cython spconv cumm
    cd /work/side/V2X-Real && /work/side/venv-v2xreal/bin/python opencood/utils/setup.py \
        build_ext --inplace
    # 3. run it
    cd /work/side && env PYTHONPATH=/work/side/V2X-Real /work/side/venv-v2xreal/bin/python \
        <repo>/tools/reference/v2xreal_dataset.py /work/side/rr/v2xreal \
        <repo>/tests/fixtures/v2xreal

What runs: its ``opencood/hypes_yaml/point_pillar_intermediate_fusion.yaml`` read by its
``load_yaml``, ``root_dir`` / ``validate_dir`` our split, ``dataset_mode`` each of vc, ic, v2v,
i2i, then ``build_dataset(hypes, visualize=False, train=False)`` as its ``tools/inference.py``
does: its ``IntermediateFusionDataset`` over ``BaseDataset``. Stubs stand in for two imports this
path never calls (drawing, open3d's PCD reader: V2X-Real's clouds are ``.bin``, read by numpy).

Saved (``<out>/v2xreal.npz``), for every mode, split and sample in the data set's order:
``sample_mode``, ``sample_split``, ``sample_key`` (scenario/timestamp); the data set's GT
(``box_start`` offsets into ``boxes`` (K, 7, its ``order``), ``box_ids`` (K,), ``box_classes``
(K,): its class ids, 1 vehicle, 2 pedestrian, 3 truck); the evaluation's GT (``eval_start``
offsets into ``eval_ids`` and ``eval_classes``: its post-processor's ``generate_gt_bbx`` on the
test collate of the sample, all 8 corners in GT_RANGE's x and y, each box named by the data set
box with the same corners); per agent its ``__getitem__`` used (in
range and with points in the crop; ``agent_start`` offsets) ``agent_ids``, ``agent_points`` (rows
its ``load_lidar_bin`` read), ``agent_sums`` (their column sums) and ``agent_to_ego`` (A, 4, 4:
the ``transformation_matrix`` of its ``retrieve_base_data``); ``meta``: generation, order,
ranges, class names.
"""
import json
import sys
import types
from pathlib import Path

import numpy as np

SPLITS = ("train", "validate", "test")
MODES = ("vc", "ic", "v2v", "i2i")
GENERATION = {"preset": "tiny_multiclass", "seed": 0}
REFERENCE_YAML = "opencood/hypes_yaml/point_pillar_intermediate_fusion.yaml"
CORNER_MATCH_TOL = 1e-4                        # m: an evaluation box is a data set box


def _stub(name: str) -> None:
    sys.modules[name] = types.ModuleType(name)


def _reference_root() -> Path:
    for entry in sys.path:
        if entry and (Path(entry) / "opencood" / "__init__.py").is_file():
            return Path(entry)
    raise SystemExit("no V2X-Real checkout (a folder with opencood/) on PYTHONPATH")


class _Record:
    """Accumulates the per-sample arrays."""

    def __init__(self):
        self.mode, self.split, self.key = [], [], []
        self.box_start, self.boxes, self.box_ids, self.box_classes = [0], [], [], []
        self.eval_start, self.eval_ids, self.eval_classes = [0], [], []
        self.agent_start, self.agent_ids, self.points, self.sums, self.to_ego = [0], [], [], \
            [], []

    def add(self, mode, split, key, boxes, ids, evaluated, agents):
        """boxes (K, 8): 7 numbers and the class id; evaluated [(id, class id)]; agents
        [(id, points, to_ego)]."""
        self.mode.append(mode)
        self.split.append(split)
        self.key.append(key)
        for box, box_id in zip(boxes, ids):
            self.boxes.append(np.asarray(box[:7], dtype=np.float64))
            self.box_classes.append(int(box[7]))
            self.box_ids.append(int(box_id))
        self.box_start.append(len(self.box_ids))
        for box_id, class_id in evaluated:
            self.eval_ids.append(int(box_id))
            self.eval_classes.append(int(class_id))
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
            path, sample_mode=np.asarray(self.mode), sample_split=np.asarray(self.split),
            sample_key=np.asarray(self.key),
            box_start=np.asarray(self.box_start, dtype=np.int64),
            boxes=np.asarray(self.boxes, dtype=np.float64).reshape(-1, 7),
            box_ids=np.asarray(self.box_ids, dtype=np.int64),
            box_classes=np.asarray(self.box_classes, dtype=np.int64),
            eval_start=np.asarray(self.eval_start, dtype=np.int64),
            eval_ids=np.asarray(self.eval_ids, dtype=np.int64),
            eval_classes=np.asarray(self.eval_classes, dtype=np.int64),
            agent_start=np.asarray(self.agent_start, dtype=np.int64),
            agent_ids=np.asarray(self.agent_ids, dtype=np.int64),
            agent_points=np.asarray(self.points, dtype=np.int64),
            agent_sums=np.asarray(self.sums, dtype=np.float64).reshape(-1, 4),
            agent_to_ego=np.asarray(self.to_ego, dtype=np.float64).reshape(-1, 4, 4),
            meta=np.asarray(json.dumps({**GENERATION, **meta})))


def _scenario_of(dataset, index: int) -> int:
    for scenario, end in enumerate(dataset.len_record):
        if index < end:
            return scenario
    raise IndexError(index)


def _used_agents(dataset):
    """Wrap the data set's ``get_item_single_car`` to record the agents ``__getitem__`` keeps
    (those it processes and finds points for), in its order."""
    used = []
    original = dataset.get_item_single_car

    def recording(selected_cav_base, ego_pose):
        processed, void_lidar = original(selected_cav_base, ego_pose)
        if not void_lidar:
            used.append(selected_cav_base["cav_id"])
        return processed, void_lidar

    dataset.get_item_single_car = recording
    return used


def _evaluated(dataset, item, boxes, ids, boxes_to_corners):
    """The evaluation's GT of one sample: [(id, class id)] of its post-processor's
    ``generate_gt_bbx`` on the test collate of ``item``, each box named by the data set box
    with the same corners (a box the evaluation invented would raise)."""
    import torch
    corners, labels = dataset.post_processor.generate_gt_bbx(dataset.collate_batch_test([item]))
    corners = corners.cpu().numpy().astype(np.float64).reshape(-1, 8, 3)
    ours = boxes_to_corners(torch.from_numpy(np.asarray(boxes[:, :7], dtype=np.float64)),
                            dataset.params["postprocess"]["order"]).numpy().reshape(-1, 8, 3)
    named = []
    for box, label in zip(corners, labels.cpu().numpy().tolist()):
        gap = np.abs(ours - box).reshape(len(ours), -1).max(axis=1)
        if not len(gap) or gap.min() > CORNER_MATCH_TOL:
            raise RuntimeError("an evaluation GT box matches no data set GT box")
        named.append((int(ids[int(np.argmin(gap))]), int(label)))
    return named


def sample(dataset, used: list, index: int, boxes_to_corners):
    """(key, boxes (K, 8), ids, evaluated, agents) of one sample."""
    used.clear()
    item = dataset[index]
    ego = item["ego"]
    boxes = ego["object_bbx_center"][ego["object_bbx_mask"] == 1]
    ids = list(ego["object_ids"])
    evaluated = _evaluated(dataset, item, boxes, ids, boxes_to_corners)
    base = dataset.retrieve_base_data(index, cur_ego_pose_flag=True)
    by_id = {int(cav_id): cav for cav_id, cav in base.items()}
    agents = [(agent, by_id[agent]["lidar_np"], by_id[agent]["params"]["transformation_matrix"])
              for agent in used]
    first = next(iter(base.values()))
    scenario = dataset.scenario_database[_scenario_of(dataset, index)]
    key = f"{first['folder_name']}/{dataset.return_timestamp_key(scenario, first['index'])}"
    return key, boxes, ids, evaluated, agents


def run(root: Path, out: Path) -> None:
    reference = _reference_root()
    _stub("opencood.visualization.vis_utils")      # drawing only
    _stub("open3d")                                 # PCD reading; V2X-Real's clouds are .bin
    from opencood.data_utils import SUPER_CLASS_MAP
    from opencood.data_utils.datasets import COM_RANGE, GT_RANGE, build_dataset
    from opencood.hypes_yaml.yaml_utils import load_yaml
    from opencood.utils.box_utils import boxes_to_corners_3d
    record, hypes = _Record(), None
    for mode in MODES:
        for split in SPLITS:
            hypes = load_yaml(str(reference / REFERENCE_YAML))
            hypes["root_dir"] = hypes["validate_dir"] = str(root / split)
            hypes["dataset_mode"] = mode
            dataset = build_dataset(hypes, visualize=False, train=False)
            used = _used_agents(dataset)
            for index in range(len(dataset)):
                record.add(mode, split, *sample(dataset, used, index, boxes_to_corners_3d))
    record.save(out / "v2xreal.npz", reader=f"V2X-Real IntermediateFusionDataset "
                                            f"({REFERENCE_YAML})",
                order=hypes["postprocess"]["order"], gt_range=list(GT_RANGE),
                crop_range=hypes["preprocess"]["cav_lidar_range"], comm_range=COM_RANGE,
                max_cav=dataset.max_cav, classes=list(SUPER_CLASS_MAP))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: v2xreal_dataset.py DATA_DIR OUT_DIR", file=sys.stderr)
        return 2
    run(Path(args[0]), Path(args[1]))
    print(f"wrote {Path(args[1]) / 'v2xreal.npz'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
