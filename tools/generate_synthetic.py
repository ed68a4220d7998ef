#!/usr/bin/env python
"""Generate the synthetic cooperative data set in OPV2V format.

    python tools/generate_synthetic.py --out DIR [--preset tiny|small|opv2v] [--seed N]
                                       [--workers N] [--overwrite]

Writes DIR/{train,validate,test}/<scenario>/<cav_id>/<ts>.pcd|.yaml and DIR/generation.yaml,
then prints a summary. Same seed -> identical files, whatever --workers.
"""
import argparse
import sys

from opencood.data.synthetic import PRESETS, format_summary, generate_dataset
from opencood.data.synthetic.writer import OutputDirError


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--preset", default="small",
                        help=f"size preset: {', '.join(PRESETS)} (default: small)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (>= 0)")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the splits of an earlier data set in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        summary = generate_dataset(args.out, preset=args.preset, seed=args.seed,
                                   workers=args.workers, progress=not args.quiet,
                                   overwrite=args.overwrite)
    except (ValueError, OutputDirError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"  written to {args.out} in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
