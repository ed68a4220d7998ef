#!/usr/bin/env python
"""Check an OPV2V-format folder before training: every problem, one line each.

    python tools/check_data.py data/synthetic_small          # train/, validate/, test/
    python tools/check_data.py /data/OPV2V/validate          # one split
    python tools/check_data.py /data/v2v4real --dataset v2v4real
    python tools/check_data.py /data/cooperative-vehicle-infrastructure --dataset dairv2x

Reads every yaml and PCD (seconds for the synthetic presets, minutes for real OPV2V). Prints one
line per problem, then a summary; exits 1 when there is a problem, 0 when there is none.
"""
import argparse
import sys

from opencood.data.check import DATASET_NAMES, check_folder
from opencood.errors import run_cli


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="a data set folder (train/validate/test) or one split")
    parser.add_argument("--dataset", default="opv2v", choices=DATASET_NAMES,
                        help="the format of the folder (a config's fusion.dataset; default opv2v)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    report = check_folder(args.folder, progress=not args.quiet, dataset=args.dataset)
    for problem in report.problems:
        print(f"problem: {problem}")
    print(f"{args.folder}: {report.summary()}")
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
