#!/usr/bin/env python
"""End-to-end parity fixture (issue 24 point 5): OpenCOOD's OWN inference of an exported AttFuse
on a synthetic OPV2V test folder. CI never runs this script; ``tests/test_e2e_parity.py`` runs
our ``tools/eval.py`` path on the same frames with the same checkpoint and compares.

What runs is OpenCOOD's (opencoodx 0.1.19) ``tools/inference.py`` for intermediate fusion, step
by step: ``load_yaml`` of the exported ``config.yaml`` (its yaml_parser included), with the
synthetic folder as ``validate_dir`` (OpenCOOD's test-time dataset reads ``validate_dir``);
``build_dataset(hypes, visualize=False, train=False)`` (``IntermediateFusionDataset``);
``collate_batch_test`` with batch size 1; ``create_model`` + ``load_state_dict(strict=True)``
of the newest ``net_epoch<N>.pth``; ``inference_utils.inference_intermediate_fusion``
(``post_process``: sigmoid, score threshold, decoding, corners, large/abnormal-z removal, NMS,
GT range); ``eval_utils.caluclate_tp_fp`` at IoU 0.3 / 0.5 / 0.7 and ``calculate_ap``.

One change to OpenCOOD, made here and stated in the fixture: ``shuffle_points`` (a random
permutation of every CAV's points, unseeded, also at test time) is replaced by the identity.
With it OpenCOOD's own result changes from run to run whenever a pillar holds more than
``max_points_per_voxel`` points (it keeps the first ones in point order); the identity pins the
file order, which our ``padded_slots: reference`` pillarisation keeps. The fixture records how
many pillars overflow, so the comparison is seen to exercise that rule.

Saved (``torch.save``, read with ``weights_only=True``)::

    {"format": 1, "about": str, "reference": "opencoodx 0.1.19", "torch": str,
     "data": {"command": str, "files": {relative path: sha256}},
     "checkpoint": str (the exported folder, relative to the fixture),
     "frames": [{"scenario", "timestamp", "cav_ids": [str], "overflowing_pillars": int,
                 "pred_corners": (N, 8, 3) float32, "pred_scores": (N,) float32,
                 "gt_corners": (G, 8, 3) float32}],
     "ap": {"ap_30", "ap_50", "ap_70"}}

Run (the side environment; from a folder outside the checkout, PYTHONPATH unset)::

    python tools/generate_synthetic.py --out /tmp/e2e_data --preset small --seed 0 \\
        --frames 2 --scenarios 1 1 1 --splits test
    cd /tmp && env -u PYTHONPATH /work/refenv/bin/python \\
        /path/to/checkout/tools/reference/run_opencood_inference.py \\
        --export /path/to/checkout/tests/fixtures/e2e_parity/attfuse_export \\
        --data /tmp/e2e_data/test --out /path/to/checkout/tests/fixtures/e2e_parity/attfuse.pt
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import importlib.util
import os
from pathlib import Path

import numpy as np

DATA_COMMAND = ("python tools/generate_synthetic.py --out DIR --preset small --seed 0 "
                "--frames 2 --scenarios 1 1 1 --splits test")
IOUS = (0.3, 0.5, 0.7)


def fixture_tools():
    """tools/reference/make_model_parity_fixtures.py by path (import_reference,
    newest_epoch_file)."""
    path = Path(__file__).with_name("make_model_parity_fixtures.py")
    spec = importlib.util.spec_from_file_location("make_model_parity_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def data_hashes(split_dir: Path) -> dict:
    """{path relative to split_dir: sha256} of every file, so the test can tell that it
    regenerated the same frames."""
    return {str(p.relative_to(split_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(split_dir.rglob("*")) if p.is_file()}


def overflowing_pillars(dataset, base_data: dict, ego_pose) -> int:
    """Pillars holding more than max_points_per_voxel of one CAV's points (projected to the ego,
    ego-body points removed, cropped to the range: what OpenCOOD's voxel generator sees)."""
    from opencood.utils import box_utils
    from opencood.utils.pcd_utils import mask_ego_points, mask_points_by_range
    from opencood.utils.transformation_utils import x1_to_x2
    pre = dataset.params["preprocess"]
    lidar_range = np.asarray(pre["cav_lidar_range"])
    voxel = np.asarray(pre["args"]["voxel_size"])
    count = 0
    for cav in base_data.values():
        points = mask_ego_points(cav["lidar_np"])
        points[:, :3] = box_utils.project_points_by_matrix_torch(
            points[:, :3], x1_to_x2(cav["params"]["lidar_pose"], ego_pose))
        points = mask_points_by_range(points, pre["cav_lidar_range"])
        cells = np.floor((points[:, :3] - lidar_range[:3]) / voxel).astype(np.int64)
        _, counts = np.unique(cells, axis=0, return_counts=True)
        count += int((counts > pre["args"]["max_points_per_voxel"]).sum())
    return count


def frame_key(dataset, index: int) -> tuple:
    """(scenario folder name, timestamp) of OpenCOOD's sample ``index`` (its own lookup)."""
    scenario = next(i for i, end in enumerate(dataset.len_record) if index < end)
    database = dataset.scenario_database[scenario]
    local = index if scenario == 0 else index - dataset.len_record[scenario - 1]
    timestamp = dataset.return_timestamp_key(database, local)
    first_cav = next(iter(database.values()))
    return Path(first_cav[timestamp]["yaml"]).parents[1].name, timestamp


def run(export_dir: Path, data_dir: Path) -> dict:
    import torch
    from torch.utils.data import DataLoader

    import opencood.data_utils.datasets as datasets
    import opencood.data_utils.datasets.intermediate_fusion_dataset as intermediate
    from opencood.hypes_yaml.yaml_utils import load_yaml
    from opencood.tools import inference_utils, train_utils
    from opencood.utils import eval_utils

    tools = fixture_tools()
    tools.import_reference()
    intermediate.shuffle_points = lambda points: points     # see the module docstring

    hypes = load_yaml(str(export_dir / "config.yaml"))
    for key in ("root_dir", "validate_dir", "test_dir"):
        hypes[key] = str(data_dir)
    dataset = datasets.build_dataset(hypes, visualize=False, train=False)
    loader = DataLoader(dataset, batch_size=1, num_workers=0, shuffle=False,
                        collate_fn=dataset.collate_batch_test)
    model = train_utils.create_model(hypes)
    checkpoint = tools.newest_epoch_file(export_dir)
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True),
                          strict=True)
    model.eval()

    stats = {iou: {"tp": [], "fp": [], "gt": 0} for iou in IOUS}
    frames = []
    for index, batch in enumerate(loader):
        with torch.no_grad():
            boxes, scores, gt = inference_utils.inference_intermediate_fusion(batch, model,
                                                                              dataset)
        for iou in IOUS:
            eval_utils.caluclate_tp_fp(boxes, scores, gt, stats, iou)
        base = dataset.retrieve_base_data(index)
        ego = next(c for c in base.values() if c["ego"])
        scenario, timestamp = frame_key(dataset, index)
        empty = torch.zeros((0, 8, 3))
        frames.append({
            "scenario": scenario, "timestamp": timestamp, "cav_ids": list(base),
            "overflowing_pillars": overflowing_pillars(dataset, base,
                                                       ego["params"]["lidar_pose"]),
            "pred_corners": (empty if boxes is None else boxes).float().clone(),
            "pred_scores": (torch.zeros(0) if scores is None else scores).float().clone(),
            "gt_corners": gt.float().clone()})
        print(f"frame {index} {scenario}/{timestamp}: {len(frames[-1]['pred_scores'])} "
              f"detections, {gt.shape[0]} GT, {frames[-1]['overflowing_pillars']} pillars "
              f"over {hypes['preprocess']['args']['max_points_per_voxel']} points")
    ap = {f"ap_{round(iou * 100)}": float(eval_utils.calculate_ap(copy.deepcopy(stats), iou)[0])
          for iou in IOUS}
    print("AP", ap)
    return {"frames": frames, "ap": ap, "checkpoint_file": checkpoint.name}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--export", type=Path, required=True,
                        help="folder written by tools/export_checkpoint.py --to opencood")
    parser.add_argument("--data", type=Path, required=True, help="the synthetic test split")
    parser.add_argument("--out", type=Path, required=True, help="fixture file to write")
    args = parser.parse_args(argv)
    import torch
    from importlib import metadata
    result = run(args.export.resolve(), args.data.resolve())
    fixture = {
        "format": 1,
        "about": "Made by tools/reference/run_opencood_inference.py: OpenCOOD's own "
                 "intermediate-fusion inference (dataset, collate, model, post_process, "
                 "caluclate_tp_fp / calculate_ap) with shuffle_points replaced by the identity.",
        "reference": f"opencoodx {metadata.version('opencoodx')}", "torch": str(torch.__version__),
        "data": {"command": DATA_COMMAND, "files": data_hashes(args.data.resolve())},
        "checkpoint": os.path.relpath(args.export.resolve(), args.out.resolve().parent),
        **result}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
