#!/usr/bin/env python
"""Samples/s of the reference readers on our tiny synthetic folders: the other side of
tools/bench.py's ``loader_by_format`` figure (side environment, never CI).

    # the folders, from OUR venv (the bench figure writes the same ones: tiny, seed 0)
    PYTHONPATH=. python tools/generate_synthetic.py --out /tmp/rr/FORMAT --preset tiny \
        --format FORMAT --seed 0 --quiet                  # FORMAT: opv2v, v2v4real, dairv2x
    # one reader per process (each reference is a package named opencood)
    cd /tmp && env -u PYTHONPATH /work/refenv/bin/python <repo>/tools/reference/bench_reference_readers.py opv2v /tmp/rr/opv2v
    cd /tmp && env PYTHONPATH=/tmp/V2V4Real /work/refenv/bin/python <repo>/tools/reference/bench_reference_readers.py v2v4real /tmp/rr/v2v4real
    cd /tmp && env PYTHONPATH=/tmp/HEAL:/tmp/pypcd_src /work/refenv/bin/python <repo>/tools/reference/bench_reference_readers.py dairv2x /tmp/rr/dairv2x

What is timed per sample is what our figure's "reader" path does: every agent's cloud read from
its file, its transform to the ego and the ego-frame GT, with the reference's own code
(compare_readers.py's per-sample functions; opv2v: OpenCOOD's BaseDataset.retrieve_base_data,
installed in the side environment as opencoodx, and its generate_object_center per CAV). The
references' indexes (scenario database, split json) are built before timing, as ours is.
Prints one JSON line: the median over ``--repeats`` passes over every sample of the 3 splits.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_readers  # noqa: E402  (its per-sample reference functions)

OPV2V_SPLITS = ("train", "validate", "test")


def opv2v_reader(root: Path):
    """[(split, count, sample(index))] of OpenCOOD's (opencoodx's) OPV2V reader, test mode."""
    from opencood.data_utils.datasets.basedataset import BaseDataset
    from opencood.data_utils.post_processor.base_postprocessor import BasePostprocessor
    post_processor = BasePostprocessor({"order": compare_readers.ORDER, "max_num": 200,
                                        "anchor_args": {"cav_lidar_range": [-140.8, -40, -3,
                                                                            140.8, 40, 1]}},
                                       train=False)

    def sample(dataset, index):
        base = dataset.retrieve_base_data(index)
        ego_pose = next(iter(base.values()))["params"]["lidar_pose"]
        id_stack, boxes = [], []
        for cav in base.values():
            cav_boxes, mask, ids = post_processor.generate_object_center([cav], ego_pose)
            id_stack += list(ids)
            boxes.append(cav_boxes[mask == 1])
        unique = [id_stack.index(x) for x in set(id_stack)]     # OpenCOOD's de-duplication
        return np.vstack(boxes)[unique]

    out = []
    for split in OPV2V_SPLITS:
        # max_cav 5: every CAV of a sample, as our figure reads them
        params = {"data_augment": [], "root_dir": str(root / split),
                  "validate_dir": str(root / split), "train_params": {"max_cav": 5}}
        dataset = BaseDataset(params, visualize=False, train=False)
        out.append((split, len(dataset), lambda index, dataset=dataset: sample(dataset, index)))
    return out


READERS = {"opv2v": (opv2v_reader, "OpenCOOD (opencoodx 0.1.19) BaseDataset"),
           "v2v4real": (compare_readers.v2v4real_reader, "V2V4Real BaseDataset"),
           "dairv2x": (compare_readers.dairv2x_reader, "HEAL DAIRV2XBaseDataset")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("format", choices=sorted(READERS))
    parser.add_argument("data", type=Path, help="the synthetic data set written in the format")
    parser.add_argument("--repeats", type=int, default=10, help="timed passes (median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes first")
    args = parser.parse_args(argv)
    make_reader, name = READERS[args.format]
    readers = make_reader(args.data)
    count = sum(n for _, n, _ in readers)

    def one_pass():
        for _, n, sample in readers:
            for index in range(n):
                sample(index)

    for _ in range(args.warmup):
        one_pass()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({"figure": "reference_loader", "format": args.format, "reader": name,
                      "samples_per_s": round(count / median, 1),
                      "ms_per_sample": round(median * 1e3 / count, 3), "samples": count,
                      "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
