#!/usr/bin/env python
"""Export one of our runs as another codebase's run folder (issue 24)::

    python tools/export_checkpoint.py --to opencood|heal|v2xreal --model_dir RUN --out DIR
                                      [--checkpoint FILE]

Writes ``DIR/config.yaml`` (the peer's hypes, read by its ``load_yaml``) and
``DIR/net_epoch<N>.pth`` (a bare state dict with the peer's keys), which the peer's
``create_model`` builds and ``load_state_dict(strict=True)`` accepts. ``--to opencood``: LiDAR
models whose architecture exists there, run with the reference options
(``hypes_yaml/opv2v/reference/``, or any run made by ``tools/import_checkpoint.py``;
``opencood/interop/exporter.py``). ``--to heal``: camera runs (the lss encoder), as HEAL's
``heter_model_baseline`` with one ``lift_splat_shoot`` modality, the inverse of ``--from heal``
(``opencood/interop/heal_export.py``); and HEAL's heterogeneous runs (``heter_pyramid_collab``,
``heter_pyramid_single``, ``heter_model_late``: ``opencood/interop/heal_heter_export.py``).
``--to v2xreal``: multi-class runs of V2X-Real's five networks, the inverse of ``--from
v2xreal`` (``opencood/interop/v2xreal_export.py``). Others are refused in one line. Nothing is
written unless the whole export succeeds.
"""
from __future__ import annotations

import argparse

from opencood.errors import run_cli
from opencood.interop.exporter import export_opencood_run
from opencood.interop.heal_export import export_heal_run
from opencood.interop.heal_heter_export import export_heal_heter_run, is_heter_run
from opencood.interop.v2xreal_export import export_v2xreal_run

CODEBASES = ("opencood", "heal", "v2xreal")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Export our run as another codebase's.")
    parser.add_argument("--to", dest="codebase", required=True, choices=CODEBASES,
                        help="the codebase to write for")
    parser.add_argument("--model_dir", required=True, help="our run folder")
    parser.add_argument("--out", required=True, help="the folder to create (must not exist)")
    parser.add_argument("--checkpoint", help="checkpoint file (default RUN/best.pth, else "
                                             "last.pth, as tools/eval.py picks)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace):
    if args.codebase == "heal":
        export = export_heal_heter_run if is_heter_run(args.model_dir) else export_heal_run
        out, notes = export(args.model_dir, args.out, args.checkpoint)
    elif args.codebase == "v2xreal":
        out, notes = export_v2xreal_run(args.model_dir, args.out, args.checkpoint), []
    else:
        out, notes = export_opencood_run(args.model_dir, args.out, args.checkpoint), []
    print(f"exported {args.model_dir} -> {out} ({args.codebase}: config.yaml, "
          f"{', '.join(sorted(p.name for p in out.glob('*.pth')))})")
    for note in notes:
        print(f"note: {note}")
    return out


def main(argv=None):
    return run_cli(lambda argv: run(parse_args(argv)), argv)


if __name__ == "__main__":
    main()
