#!/usr/bin/env python
"""DataLoader throughput (samples/s) for each fusion strategy on an OPV2V-format folder.

    python tools/bench_loader.py --data data/synthetic_small/train [--workers 2] [--batches 20]

Workers only read (cached clouds), project, augment and crop; pillarisation runs on the training
device and is measured by tools/bench_pillars.py. The first pass over a folder parses the ascii
PCDs into the binary cache; the figures are for cached (second and later) epochs, which is what
training sees after its first epoch. One JSON line per fusion strategy.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

from opencood.config import ConfigError, load_config
from opencood.data.collate import collate_samples, seed_worker
from opencood.data.datasets import build_dataset


def measure(cfg, fusion: str, workers: int, batch_size: int, batches: int) -> dict:
    dataset = build_dataset(cfg, "train", train=True, fusion_method=fusion)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                         num_workers=workers, collate_fn=collate_samples,
                                         worker_init_fn=seed_worker, drop_last=True)
    for _ in zip(range(batches), loader):      # fills the point cache, starts the workers
        pass
    samples, start = 0, time.perf_counter()
    for _, batch in zip(range(batches), loader):
        samples += len(batch["record_len"])
    seconds = time.perf_counter() - start
    return {"figure": "loader_samples_per_s", "fusion": fusion, "samples_per_s":
            round(samples / seconds, 2), "samples": samples, "workers": workers,
            "batch_size": batch_size, "dataset_len": len(dataset)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/synthetic_small/train", help="a split folder")
    parser.add_argument("--hypes_yaml", default="hypes_yaml/synthetic/base.yaml")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--fusion", nargs="*", default=["no", "early", "late", "intermediate"])
    args = parser.parse_args(argv)
    if not Path(args.data).is_dir():
        raise SystemExit(f"error: {args.data}: split folder not found (generate one with "
                         f"tools/generate_synthetic.py)")
    try:
        cfg = load_config(args.hypes_yaml, [f"root_dir={args.data}"])
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    for fusion in args.fusion:
        print(json.dumps(measure(cfg, fusion, args.workers, args.batch_size, args.batches)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
