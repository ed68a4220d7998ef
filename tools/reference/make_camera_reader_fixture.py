#!/usr/bin/env python
"""Run HEAL's own camera data set code on our synthetic camera folders and save, sample by
sample, what its lift-splat models receive: ``tests/fixtures/camera_reader/<format>.npz``, the
fixture tests/test_camera_reader.py compares our readers and datasets with (images to 1e-6,
intrinsics / extrinsics / post_rots / post_trans to 1e-8).

Runs in a side environment, never in CI, with HEAL's checkout FIRST on PYTHONPATH (HEAL's package
is named ``opencood`` too), from outside our checkout. Exact commands of the committed fixture
(HEAL at 96812ed5a416)::

    # 1. the folders, from OUR venv (deterministic: generate_folders, GENERATION below):
    #    v2xset/ (tiny + one roadside unit, OPV2V's layout), dairv2x/
    PYTHONPATH=. python tools/reference/make_camera_reader_fixture.py --generate /work/side/cam
    # 2. the side environment: tools/reference/compare_readers.py's venv-ref (torch, numpy,
    #    pillow, h5py, spconv, shapely, icecream, opencv, pypcd, HEAL built) plus torchvision
    #    (camera_utils' normalisation), here layered over it:
    python3 -m venv /work/side/venv-cam
    echo /work/side/venv-ref/lib/python3.11/site-packages > \\
        /work/side/venv-cam/lib/python3.11/site-packages/ref.pth
    /work/side/venv-cam/bin/pip install --no-deps torchvision==0.29.1
    # 3. run
    cd /work/side && env PYTHONPATH=/work/side/HEAL:/work/side/pypcd_src \\
        /work/side/venv-cam/bin/python <repo>/tools/reference/make_camera_reader_fixture.py \\
        /work/side/cam <repo>/tests/fixtures/camera_reader

What runs: HEAL's ``build_dataset`` with its ``intermediate`` fusion over ``V2XSETBaseDataset``
(OPV2V's reader, roadside units moved last; the tiny world with one RSU, whose cameras look
down from the pole) and ``DAIRV2XBaseDataset``, ``input_source: ['camera']`` (no LiDAR file read), ``label_type:
lidar``, ``fusion.args.data_aug_conf`` = ``DATA_AUG_CONF`` below (HEAL's camera yamls' keys,
sized for the 64 x 48 images), the pre/post-processor sections of HEAL's
``hypes_yaml/opv2v/CameraOnly/camera_attfuse.yaml``; per sample ``dataset[i]['ego']
['image_inputs']`` (the agents' ``imgs``, ``intrins``, ``extrinsics``, ``post_rots``,
``post_trans``, stacked) and its ``cav_id_list``. Two passes per split:

* ``eval``: ``train=False``: the fixed resize / centre crop;
* ``train``: the same data set object with ``train`` switched on after indexing (so its agents
  stay in folder order, not shuffled), so ``sample_augmentation`` draws. Its draws come from
  ``numpy.random`` (global): for sample ``i`` the ``np`` that ``camera_utils`` sees has its
  ``random`` replaced by ``numpy.random.default_rng([SEED, CAMERA_STREAM, 0, i])``, the
  generator our dataset draws the sample's image augmentation from (seed, stream, epoch,
  index), so the two draw the same numbers in the same order (agent by agent, camera by
  camera). Everything else is HEAL's code unchanged.

Stubs for imports on paths that never run: drawing (``opencood.visualization.vis_utils``),
pypcd's ``lzf``. Saved per format: ``sample_split``, ``sample_mode`` (eval / train),
``sample_index``, ``agent_start`` offsets, ``agent_ids``, and per agent ``images`` (A, C, 3, fH,
fW) float32, ``intrinsics`` (A, C, 3, 3), ``extrinsics`` (A, C, 4, 4), ``post_rots`` (A, C, 3,
3), ``post_trans`` (A, C, 3); ``meta`` (json: generation, data_aug_conf, seed, stream, HEAL
commit). Deterministic: a rerun writes the same arrays.
"""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import reference_root, stub_module  # noqa: E402  (tools/reference/side_env.py)

GENERATION = {"preset": "tiny", "seed": 0, "frames": 2, "camera_size": [64, 48],
              "rsu": "v2xset"}
# HEAL's data_aug_conf keys (its camera yamls), for 64 x 48 images: final 32 x 48, the
# training resize 0.8-0.95, HEAL's rot_lim and bottom cut, flips on (HEAL's yamls have them off;
# on, the flip's post-homography is compared too).
DATA_AUG_CONF = {"resize_lim": [0.8, 0.95], "final_dim": [32, 48], "rot_lim": [-3.6, 3.6],
                 "H": 48, "W": 64, "rand_flip": True, "bot_pct_lim": [0.0, 0.05],
                 "cams": ["camera0", "camera1", "camera2", "camera3"], "Ncams": 4}
SEED, CAMERA_STREAM = 3, 3
HEAL_YAML = "opencood/hypes_yaml/opv2v/CameraOnly/camera_attfuse.yaml"
HEAL_COMMIT = "96812ed5a416"
SPLITS = {"v2xset": ("validate",), "dairv2x": ("val.json",)}
KEYS = {"images": "imgs", "intrinsics": "intrins", "extrinsics": "extrinsics",
        "post_rots": "post_rots", "post_trans": "post_trans"}


def generate_folders(root: Path) -> dict:
    """Our synthetic folders of GENERATION (run with OUR opencood): {format: folder}."""
    import dataclasses
    from opencood.data.synthetic import generate_dataset, get_preset
    from opencood.data.synthetic.camera import CameraConfig
    from opencood.data.synthetic.presets import with_rsu
    width, height = GENERATION["camera_size"]
    tiny = dataclasses.replace(get_preset(GENERATION["preset"]), frames=GENERATION["frames"],
                               cameras=CameraConfig(width=width, height=height))
    folders = {"v2xset": Path(root) / "v2xset", "dairv2x": Path(root) / "dairv2x"}
    generate_dataset(folders["v2xset"], preset=with_rsu(tiny, "tiny_rsu"),
                     seed=GENERATION["seed"], progress=False, splits=("validate",))
    generate_dataset(folders["dairv2x"], preset=tiny, seed=GENERATION["seed"], progress=False,
                     data_format="dairv2x")
    return folders


class _SeededNumpy(types.ModuleType):
    """numpy with ``random`` replaced by one Generator (what camera_utils' draws see)."""

    def __init__(self, generator):
        super().__init__("numpy")
        self.random = generator

    def __getattr__(self, name):
        return getattr(np, name)


def heal_hypes(reference: Path, fmt: str, data_root: Path, split: str) -> dict:
    from opencood.hypes_yaml.yaml_utils import load_yaml
    hypes = load_yaml(str(reference / HEAL_YAML))       # its parser fills the anchors' W, H
    for key in ("heter", "add_data_extension"):
        hypes.pop(key, None)
    hypes.update(input_source=["camera"], label_type="lidar",
                 model={"core_method": "lift_splat_shoot", "args": {}})
    hypes["fusion"] = {"core_method": "intermediate", "dataset": fmt,
                       "args": {"proj_first": False, "data_aug_conf": DATA_AUG_CONF,
                                "grid_conf": None}}
    if fmt == "v2xset":
        hypes["root_dir"] = hypes["validate_dir"] = str(data_root / split)
    else:
        folder = data_root / "cooperative-vehicle-infrastructure"
        hypes["data_dir"] = str(folder)
        hypes["root_dir"] = hypes["validate_dir"] = str(folder / split)
    return hypes


def run(data: Path, out: Path) -> None:
    stub_module("opencood.visualization.vis_utils")
    stub_module("lzf")
    from opencood.data_utils.datasets import build_dataset
    from opencood.utils import camera_utils
    for fmt, splits in SPLITS.items():
        record = {"sample_split": [], "sample_mode": [], "sample_index": [], "agent_ids": [],
                  "agent_start": [0], **{key: [] for key in KEYS}}
        for split in splits:
            dataset = build_dataset(heal_hypes(reference_root(), fmt, data / fmt, split),
                                    visualize=False, train=False)
            for mode in ("eval", "train"):
                dataset.train = mode == "train"
                for index in range(len(dataset)):
                    camera_utils.np = _SeededNumpy(np.random.default_rng(
                        [SEED, CAMERA_STREAM, 0, index]))
                    ego = dataset[index]["ego"]
                    camera_utils.np = np
                    inputs = ego["image_inputs"]
                    record["sample_split"].append(split)
                    record["sample_mode"].append(mode)
                    record["sample_index"].append(index)
                    record["agent_ids"].extend(int(i) for i in ego["cav_id_list"])
                    record["agent_start"].append(len(record["agent_ids"]))
                    for key, heal_key in KEYS.items():
                        record[key].extend(np.asarray(inputs[heal_key]))
        arrays = {key: np.asarray(value) for key, value in record.items()}
        arrays["images"] = arrays["images"].astype(np.float32)
        meta = {"generation": GENERATION, "data_aug_conf": DATA_AUG_CONF, "seed": SEED,
                "camera_stream": CAMERA_STREAM, "heal_commit": HEAL_COMMIT,
                "reader": f"HEAL intermediate fusion over {fmt.upper()}BaseDataset, "
                          f"input_source [camera]"}
        out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(out / f"{fmt}.npz", meta=np.asarray(json.dumps(meta)), **arrays)
        print(f"wrote {out / (fmt + '.npz')}: {len(arrays['sample_index'])} samples, "
              f"{len(arrays['agent_ids'])} agents")


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--generate":
        print(generate_folders(Path(args[1])))
        return 0
    if len(args) != 2:
        print("usage: make_camera_reader_fixture.py [--generate] DATA_DIR [OUT_DIR]",
              file=sys.stderr)
        return 2
    run(Path(args[0]), Path(args[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
