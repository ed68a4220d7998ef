#!/usr/bin/env python
"""Generate the synthetic cooperative data set in OPV2V, V2V4Real, V2X-Real or DAIR-V2X-C format.

    python tools/generate_synthetic.py --out DIR [--preset tiny|small|opv2v|v2x_small|v2x|
                                                 tiny_multiclass|small_multiclass]
                                       [--format opv2v|v2v4real|v2xreal|dairv2x]
                                       [--seed N] [--workers N] [--overwrite]
                                       [--frames N] [--scenarios TRAIN VALIDATE TEST]
                                       [--splits train validate test]
                                       [--cameras [--camera-size W H] [--depth]] [--heter]
                                       [--multiclass]

Writes DIR/{train,validate,test}/<scenario>/<cav_id>/<ts>.pcd|.yaml (opv2v; v2v4real: two CAVs,
folders 0 and 1, numpy-tagged yaml; v2xreal: two vehicles 1, 2 and two roadside units -1, -2,
<ts>.bin clouds, labels with V2X-Real's class names; dairv2x:
DIR/cooperative-vehicle-infrastructure/ with train.json, val.json, test.json) and
DIR/generation.yaml, then prints a summary. Same seed -> identical files, whatever --workers.
``--frames`` and
``--scenarios`` resize a preset (e.g. a lighter ``opv2v`` for a short GPU session); the sizes
used are recorded in generation.yaml. ``--splits test`` writes only the test split, byte-identical
to the test split of the whole data set (tests/test_e2e_parity.py regenerates its frames so).
``--cameras`` also photographs the scene: OPV2V's 4 cameras per agent (V2XSet's RSUs included),
``<ts>_camera0..3.png`` (800 x 600 unless ``--camera-size``) and the yaml's ``camera0..3``;
``--depth`` adds OPV2V-H's ``<ts>_depth0..3.png``; with ``--format dairv2x``, DAIR's one camera
per side (``image/*.jpg`` and its calib files). Off by default: it costs more CPU than the
LiDAR (docs/DESIGN.md §3). ``--heter`` writes HEAL's OPV2V-H extras: every agent's 32- and
16-beam LiDARs (``<ts>_32.pcd``, ``<ts>_16.pcd``) beside the preset's, and HEAL's modality
assignments ``DIR/heter_modality_assign/opv2v_4modality.json`` (and ``_in_order``) for a
``heter`` config's ``assignment_path``; with ``--cameras --depth`` that is all of OPV2V-H.
``--multiclass`` adds pedestrians and cyclists to any preset's world (the ``*_multiclass``
presets have them): ``dairv2x`` and ``v2xreal`` label them with their own class; the
vehicle-only formats (opv2v, v2v4real) leave them unlabelled in the clouds.
"""
import argparse
import dataclasses
import sys

from opencood.data.synthetic import PRESETS, format_summary, generate_dataset, get_preset
from opencood.data.synthetic.presets import with_road_users
from opencood.data.synthetic.camera import CameraConfig
from opencood.data.synthetic.writer import FORMATS, SPLITS, OutputDirError


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--preset", default="small",
                        help=f"size preset: {', '.join(PRESETS)} (default: small)")
    parser.add_argument("--format", default="opv2v", choices=FORMATS, dest="data_format",
                        help="file format (default: opv2v); v2v4real has two CAVs per "
                             "scenario, v2xreal two CAVs and two roadside units, dairv2x one "
                             "vehicle and one roadside unit")
    parser.add_argument("--seed", type=int, default=0, help="random seed (>= 0)")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the splits of an earlier data set in --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--frames", type=int, help="frames per scenario (default: the preset's)")
    parser.add_argument("--scenarios", type=int, nargs=3, metavar=("TRAIN", "VALIDATE", "TEST"),
                        help="scenarios per split (default: the preset's)")
    parser.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS),
                        help="write only these splits (default: all three)")
    parser.add_argument("--cameras", action="store_true",
                        help="also write camera images (opv2v: 4 per agent; dairv2x: 1 per side)")
    parser.add_argument("--camera-size", type=int, nargs=2, metavar=("W", "H"),
                        help="camera image size (default: OPV2V's 800 600)")
    parser.add_argument("--depth", action="store_true",
                        help="with --cameras: also write depth images (OPV2V-H's)")
    parser.add_argument("--heter", action="store_true",
                        help="OPV2V-H's 32- and 16-beam LiDARs per agent and HEAL's modality "
                             "assignment json (opv2v format)")
    parser.add_argument("--multiclass", action="store_true",
                        help="add pedestrians and cyclists to the preset's world (labelled by "
                             "the formats with classes: dairv2x)")
    return parser.parse_args(argv)


# OPV2V-H's LiDARs beside OPV2V's (HEAL's lidar_channels_dict values)
HETERO_LIDARS = (32, 16)


def sized_preset(name: str, frames=None, scenarios=None, cameras=None, heter: bool = False,
                 multiclass: bool = False):
    """The preset ``name`` with its frames per scenario and scenarios per split replaced and,
    with ``cameras`` (a CameraConfig), cameras added; ``heter``: OPV2V-H's extra LiDARs;
    ``multiclass``: pedestrians and cyclists (a preset that has them keeps its own)."""
    preset = get_preset(name)
    if multiclass and preset.road_users is None:
        preset = with_road_users(preset)
    if heter:
        preset = dataclasses.replace(preset, hetero_lidars=HETERO_LIDARS)
    if cameras is not None:
        preset = dataclasses.replace(preset, cameras=cameras)
    if frames is not None:
        if frames < 1:
            raise ValueError(f"--frames must be >= 1, got {frames}")
        preset = dataclasses.replace(preset, frames=int(frames))
    if scenarios is not None:
        if min(scenarios) < 1:
            raise ValueError(f"--scenarios needs >= 1 scenario per split, got {scenarios}")
        preset = dataclasses.replace(preset, scenarios=dict(zip(("train", "validate", "test"),
                                                                map(int, scenarios))))
    return preset


def camera_config(args):
    """The CameraConfig the flags ask for, or None without ``--cameras``."""
    if not args.cameras:
        if args.camera_size or args.depth:
            raise ValueError("--camera-size and --depth need --cameras")
        return None
    config = CameraConfig(depth=args.depth)
    if args.camera_size:
        width, height = args.camera_size
        if min(width, height) < 2:
            raise ValueError(f"--camera-size must be at least 2 x 2 pixels, got {width} {height}")
        config = dataclasses.replace(config, width=int(width), height=int(height))
    return config


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        preset = sized_preset(args.preset, args.frames, args.scenarios, camera_config(args),
                              heter=args.heter, multiclass=args.multiclass)
        summary = generate_dataset(args.out, preset=preset, seed=args.seed,
                                   workers=args.workers, progress=not args.quiet,
                                   overwrite=args.overwrite, data_format=args.data_format,
                                   splits=tuple(args.splits))
    except (ValueError, OutputDirError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    print(f"  written to {args.out} in {summary['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
