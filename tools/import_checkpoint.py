#!/usr/bin/env python
"""Import another codebase's trained run as one of ours (issue 24)::

    python tools/import_checkpoint.py --from {opencood,heal,coalign,v2v4real,v2xreal,quantv2x} PEER_RUN_DIR --out RUN_DIR
        [--checkpoint FILE | --merge RUN [RUN ...]]     # --merge: HEAL heterogeneous runs
    python tools/eval.py --model_dir RUN_DIR [--set test_dir=PATH] [--protocol opencood]

``PEER_RUN_DIR`` is a folder as OpenCOOD's ``train.py`` writes it: ``config.yaml`` and
``net_epoch<N>.pth`` (bare state dicts; ``latest.pth`` preferred when present, as OpenCOOD's own
loader does). Supported models: ``point_pillar`` (no / early / late fusion),
``point_pillar_intermediate`` (AttFuse), ``point_pillar_fcooper``, ``point_pillar_v2vnet``.

``--from v2v4real``: the same layout (its ``point_pillar`` may shrink before the heads; the
highest ``net_epoch<N>.pth`` is taken; its V2VNet is refused). ``--from heal``: HEAL's
``heter_model_baseline`` with one LiDAR PointPillar modality and ``fusion_method`` max / att /
v2vnet (``net_epoch_bestval_at<N>.pth`` preferred, as HEAL's loader does); see
``opencood/interop/heal.py`` and ``v2v4real.py`` for what is refused and why; HEAL's
heterogeneous runs (``heter_pyramid_collab``, ``heter_pyramid_single``, ``heter_model_late``)
import with their ``heter`` section (``opencood/interop/heal_heter_run.py``); ``--merge
RUN ...`` assembles the final collaboration checkpoint from HEAL's stage-one and aligned runs as
its ``heal_tools.py merge_final`` does (``opencood/interop/heal_merge.py``), PEER_RUN_DIR giving
the final ``config.yaml``. ``--from
coalign``: CoAlign's fusion network (``point_pillar_baseline_multiscale``, ``fusion_method:
att``; checkpoints picked as HEAL's), imported own-frame with the ResNet backbone
(``opencood/interop/coalign.py``). ``--from v2xreal``: V2X-Real's multi-class runs
(``point_pillar``, its AttFuse, F-Cooper, V2VNet, V2X-ViT) with their class list
(``opencood/interop/v2xreal.py``); ``--from quantv2x``: QuantV2X's multi-class
``heter_model_baseline_mc`` runs on V2X-Real (``opencood/interop/quantv2x.py``).

The import is strict (every tensor placed, every one of ours filled, shapes equal) and writes
nothing unless it succeeds; the imported config switches on the reference options of our modules
(docs/checkpoints.md), so the heads equal OpenCOOD's. See ``opencood/interop/``
for the config translation and the key mapping; ``tools/export_checkpoint.py`` goes back.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from opencood.config import load_config
from opencood.errors import run_cli
from opencood.eval.records import uses_validation_as_test
from opencood.interop.importer import CODEBASES, import_run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Import a trained run of another codebase.")
    parser.add_argument("--from", dest="codebase", required=True, choices=tuple(CODEBASES),
                        help="the codebase that wrote PEER_RUN_DIR")
    parser.add_argument("peer_run_dir", metavar="PEER_RUN_DIR",
                        help="its run folder (config.yaml + checkpoints)")
    parser.add_argument("--out", required=True, help="our run folder to create (must not exist)")
    parser.add_argument("--checkpoint", help="checkpoint file (default: as the codebase's own "
                                             "loader picks it)")
    parser.add_argument("--merge", nargs="+", metavar="RUN",
                        help="HEAL: the run folders its heal_tools.py merge_final assembles "
                             "(aligned types first, the base last); their merged weights "
                             "replace PEER_RUN_DIR's checkpoint, PEER_RUN_DIR gives the config")
    return parser.parse_args(argv)


def run(args: argparse.Namespace):
    start = time.perf_counter()
    out, notes = import_run(args.peer_run_dir, args.out, args.checkpoint, args.codebase,
                            args.merge)
    for note in notes:
        print(f"note: {note}")
    print(f"imported {args.peer_run_dir} ({args.codebase}) -> {out} in "
          f"{time.perf_counter() - start:.2f} s; evaluate with: python tools/eval.py "
          f"--model_dir {out}{test_split_hint(out)}")
    return out


def test_split_hint(run_dir: Path) -> str:
    """'' or, when the imported config's test split is its validation folder, what to add."""
    cfg = load_config(Path(run_dir) / "config.yaml")
    if not uses_validation_as_test(cfg, "test"):
        return ""
    return (f" --set test_dir=PATH (without it, --split test evaluates the validation folder "
            f"{cfg['validate_dir']})")


def main(argv=None):
    return run_cli(lambda argv: run(parse_args(argv)), argv)


if __name__ == "__main__":
    main()
