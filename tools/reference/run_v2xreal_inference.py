"""V2X-Real's own inference (its data set, collate, AttFuse model and multi-class
post-processing) on a synthetic V2X-Real test split, against which an import of the same run
(``tools/import_checkpoint.py --from v2xreal``) evaluated by our ``tools/eval.py
--save_detections`` is compared box by box (``compare`` below, run in our environment). Never
run in CI; the numbers are in docs/checkpoints.md.

Step 1, in the side environment (V2X-Real first on PYTHONPATH, from outside our checkout)::

    cd /tmp && env -u PYTHONPATH PYTHONPATH=/work/side/V2X-Real \\
        /work/side/venv-v2xreal/bin/python REPO/tools/reference/run_v2xreal_inference.py \\
        reference SPLIT OUT

builds its ``point_pillar_intermediate_fusion.yaml`` (full range and 256-channel shrink and
heads; a small backbone, 8 / 16 / 256 filters, one layer each) with generated weights
(``tests/parity_weights.py``; ``cls_head.bias`` offset, ``CLS_BIAS_OFFSET``), writes it as its ``train.py`` would (``OUT/run/config.yaml``,
``net_epoch1.pth``), then runs ``build_dataset(train=False)`` in mode vc on SPLIT,
``collate_batch_test``, the model and ``post_process`` per frame, saving the frames' keys,
predicted corners, scores and labels, and its per-class AP as its ``inference.py`` and
``eval_utils`` compute them (``OUT/reference.pt``). Its test-time
``shuffle_points`` (unseeded) is replaced by the identity, so its pillars keep the first points
in file order, as ours (``padded_slots: reference``) do.

Step 2, in our environment::

    python tools/import_checkpoint.py --from v2xreal OUT/run --out OUT/ours
    python tools/eval.py --model_dir OUT/ours --set test_dir=SPLIT --save_detections \\
        --batch_size 1 --num_workers 0 --protocol v2xreal
    python tools/reference/run_v2xreal_inference.py compare OUT

matches each of its boxes to one of ours (centres) and prints the largest corner and score
gaps and whether every label agrees. Measured (SPLIT: ``generate_synthetic.py --preset
tiny_multiclass --format v2xreal --seed 0``'s test split, 3 frames, mode vc): 138 boxes matched
one to one, corners within 2.5e-5 m, scores within 7.0e-7, every class label equal; GT per
class (53 / 23 / 48) and per-class AP equal to its eval_utils' (untrained weights: vehicle
AP@0.3 0.0015, the rest 0).
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path, stub_module  # noqa: E402  (tools/reference/side_env.py)

REPO = Path(__file__).resolve().parents[2]
BACKBONE = {"layer_nums": [1, 1, 1], "layer_strides": [2, 2, 2], "num_filters": [8, 16, 256],
            "upsample_strides": [1, 2, 4], "num_upsample_filter": [128, 128, 128]}
GT_XY = (100.0, 40.0)         # its GT_RANGE's x and y half extents
IOUS = (0.3, 0.5, 0.7)
# Every empty cell gives the same logits (ties no two NMS implementations order alike): the
# cls bias offset keeps those under the 0.2 score threshold and lets tens of boxes per frame of
# cells with points over it (-1.75: the empty cells pass, > 1000 candidates; -1.875: 6-8 boxes).
CLS_BIAS_OFFSET = -1.8125


def reference(split: str, out: str) -> None:
    import torch
    import yaml
    stub_module("opencood.visualization.vis_utils")      # drawing only
    stub_module("open3d")                                 # PCD reading; its clouds are .bin
    from opencood.data_utils.datasets import build_dataset
    from opencood.hypes_yaml.yaml_utils import load_yaml
    from opencood.models.point_pillar_intermediate import PointPillarIntermediate
    from opencood.tools import inference_utils
    from opencood.utils import pcd_utils
    import opencood.data_utils.datasets.intermediate_fusion_dataset as intermediate
    intermediate.shuffle_points = lambda points: points       # its unseeded shuffle, off
    pcd_utils.shuffle_points = intermediate.shuffle_points

    source = next(Path(p) for p in sys.path if (Path(p) / "opencood" / "hypes_yaml").is_dir())
    raw = yaml.load((source / "opencood/hypes_yaml/point_pillar_intermediate_fusion.yaml")
                    .read_text(), Loader=yaml.Loader)
    raw["model"]["args"]["base_bev_backbone"] = dict(BACKBONE)
    raw["root_dir"] = raw["validate_dir"] = str(split)
    raw["dataset_mode"] = "vc"
    out = Path(out)
    run = out / "run"
    run.mkdir(parents=True, exist_ok=True)
    (run / "raw.yaml").write_text(yaml.dump(raw))
    hypes = load_yaml(str(run / "raw.yaml"))
    (run / "raw.yaml").unlink()
    (run / "config.yaml").write_text(yaml.dump(hypes))          # as its setup_train writes
    weights = load_by_path("parity_weights", REPO / "tests" / "parity_weights.py")
    parity = load_by_path("make_model_parity_fixtures",
                          REPO / "tools" / "reference" / "make_model_parity_fixtures.py")
    model = PointPillarIntermediate(hypes["model"]["args"])
    recipes = parity.weight_recipes(model, weights)
    recipes["cls_head.bias"]["offset"] = CLS_BIAS_OFFSET
    state = weights.materialize(recipes)
    model.load_state_dict(state, strict=True)
    torch.save(state, run / "net_epoch1.pth")                   # bare, as its train.py saves
    model.eval()

    dataset = build_dataset(hypes, visualize=False, train=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, num_workers=0, shuffle=False,
                                         collate_fn=dataset.collate_batch_test)
    from opencood.data_utils import SUPER_CLASS_MAP
    from opencood.utils import eval_utils
    result_stat = {name: {iou: {"tp": [], "fp": [], "gt": 0} for iou in IOUS}
                   for name in SUPER_CLASS_MAP}
    frames = []
    for index, batch in enumerate(loader):
        with torch.no_grad():
            corners, scores, gt_corners, gt_labels = \
                inference_utils.inference_intermediate_fusion(batch, model, dataset)
        for class_id, name in enumerate(result_stat, start=1):     # as its inference.py
            for iou in IOUS:
                keep, keep_gt = scores[:, -1] == class_id, gt_labels == class_id
                eval_utils.caluclate_tp_fp(corners[keep], scores[keep, 0],
                                           gt_corners[keep_gt], result_stat[name], iou)
        first = dataset.retrieve_base_data(index, cur_ego_pose_flag=True)
        cav = next(iter(first.values()))
        scenario = dataset.scenario_database[_scenario_index(dataset, index)]
        key = (cav["folder_name"], dataset.return_timestamp_key(scenario, cav["index"]))
        empty = corners is None
        frames.append({"key": key,
                       "corners": torch.zeros(0, 8, 3) if empty else corners.float(),
                       "scores": torch.zeros(0) if empty else scores[:, 0].float(),
                       "labels": torch.zeros(0) if empty else scores[:, 1].long() - 1})
        print(key, 0 if empty else len(corners), "boxes")
    num_gt = {name: stat[IOUS[0]]["gt"] for name, stat in result_stat.items()}
    ap = {name: {iou: float(eval_utils.calculate_ap(stat, iou)[0]) for iou in IOUS}
          for name, stat in result_stat.items()}         # its eval_final_results' numbers
    print("its AP", ap, "GT", num_gt)
    torch.save({"frames": frames, "ap": ap, "num_gt": num_gt}, out / "reference.pt")


def _scenario_index(dataset, index: int) -> int:
    for scenario, start in enumerate(dataset.len_record):
        if index < start:
            return scenario
    raise IndexError(index)


def compare(out: str) -> None:
    """Its boxes against ours (run in our environment, after step 2)."""
    import torch
    import yaml
    from opencood.ops.transforms import boxes_to_corners_3d
    out = Path(out)
    theirs = torch.load(out / "reference.pt", weights_only=True)["frames"]
    (path,) = (out / "ours").glob("detections_*.npz")
    with np.load(path) as data:
        ours = {key: data[key] for key in data.files}
    offsets, order = ours["frame_offsets"], str(ours["box_order"])
    by_key = {tuple(str(k) for k in key[:2]): i for i, key in enumerate(ours["sample_keys"])}
    worst_corner, worst_score, labels_agree, count = 0.0, 0.0, True, 0
    for frame in theirs:
        i = by_key[tuple(frame["key"])]
        boxes = ours["boxes"][offsets[i]:offsets[i + 1]].astype(np.float64)
        corners, scores = boxes_to_corners_3d(boxes, order), ours["scores"][offsets[i]:
                                                                         offsets[i + 1]]
        classes = ours["classes"][offsets[i]:offsets[i + 1]]
        # its post_process ends by dropping boxes with a corner outside GT_RANGE's x, y; our
        # saved detections keep them (the v2xreal AP protocol drops them when scoring)
        inside = np.all((np.abs(corners[..., 0]) <= GT_XY[0]) &
                        (np.abs(corners[..., 1]) <= GT_XY[1]), axis=1)
        corners, scores, classes = corners[inside], scores[inside], classes[inside]
        ref_corners, ref_scores = frame["corners"].double().numpy(), frame["scores"].numpy()
        assert len(scores) == len(ref_scores), (frame["key"], len(scores), len(ref_scores))
        free = list(range(len(scores)))
        for j in np.argsort(-ref_scores, kind="stable"):
            gaps = np.linalg.norm(corners[free].mean(axis=1) - ref_corners[j].mean(axis=0),
                                  axis=1)
            k = free.pop(int(np.argmin(gaps)))
            gap = np.linalg.norm(corners[k][:, None] - ref_corners[j][None], axis=2)
            worst_corner = max(worst_corner, float(gap.min(axis=1).max()))
            worst_score = max(worst_score, abs(float(scores[k]) - float(ref_scores[j])))
            labels_agree &= int(classes[k]) == int(frame["labels"][j])
        count += len(ref_scores)
    (record,) = (out / "ours" / "evals").glob("*v2xreal*.yaml")
    per_class = yaml.safe_load(record.read_text())["results"]["per_class"]
    reference = torch.load(out / "reference.pt", weights_only=True)
    ap_gap = max(abs(per_class[name][f"ap_{round(iou * 100)}"] - value)
                 for name, by_iou in reference["ap"].items() for iou, value in by_iou.items())
    assert all(per_class[name]["num_gt"] == n for name, n in reference["num_gt"].items())
    print(f"per-class AP (--protocol v2xreal) within {ap_gap:.1e} of its eval_utils, GT "
          f"counts equal {reference['num_gt']}")
    print(f"{len(theirs)} frames, {count} boxes matched one to one: corners within "
          f"{worst_corner:.2e} m, scores within {worst_score:.2e}, labels agree: {labels_agree}")


if __name__ == "__main__":
    if sys.argv[1] == "reference":
        reference(*sys.argv[2:4])
    else:
        compare(sys.argv[2])
