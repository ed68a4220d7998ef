#!/usr/bin/env python
"""``--from heal --merge`` on run folders HEAL's own classes write from HEAL's own yamls, full
size, against HEAL's own ``merge_final``. Never run in CI (the checkpoints are tens of MB).

Step 1 (HEAL's side) follows HEAL's README ("HEAL's Train Command"): ``stage1/m1_base`` holds
``MoreModality/HEAL/stage1/m1_pyramid.yaml`` as ``config.yaml`` and the state dict of HEAL's
``HeterPyramidCollab`` built from it (seeded initial weights, as ``net_epoch_bestval_at23.pth``);
``stage2/m2_alignto_m1`` and ``stage2/m4_alignto_m1`` hold ``stage2/m{2,4}_single_pyramid.yaml``
(EfficientNet-b0 and ResNet-101 cameras) and their ``HeterPyramidSingle`` (as
``net_epoch_bestval_at11.pth``) beside ``net_epoch1.pth`` linked to the base's checkpoint;
``final_infer`` holds ``final_infer/m1m2m3m4.yaml`` without m3 (a SECOND agent, not built here;
its model and modality settings and its name in ``ego_modality`` removed),
and HEAL's ``heal_tools.merge_and_save_final`` writes its ``net_epoch1.pth`` from
m2, m4, m1 (base last). Step 2 (ours) imports ``final_infer`` twice: its merged
``net_epoch1.pth`` as any run, and the folders through ``--merge``; the two state dicts must be
equal, key for key and bit for bit::

    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        CHECKOUT/tools/reference/check_heal_merge_yamls.py --heal /work/side/HEAL --out /tmp/heal_logs
    cd CHECKOUT && PYTHONPATH=. python tools/reference/check_heal_merge_yamls.py --check /tmp/heal_logs
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
YAMLS = "opencood/hypes_yaml/opv2v/MoreModality/HEAL"
# folder -> (HEAL's yaml, its model class key, bestval epoch)
RUNS = {"stage1/m1_base": ("stage1/m1_pyramid.yaml", "collab", 23),
        "stage2/m2_alignto_m1": ("stage2/m2_single_pyramid.yaml", "single", 11),
        "stage2/m4_alignto_m1": ("stage2/m4_single_pyramid.yaml", "single", 11)}
MERGE_ORDER = ("stage2/m2_alignto_m1", "stage2/m4_alignto_m1", "stage1/m1_base")
LEFT_OUT = "m3"           # final_infer's SECOND agent


def final_config(text: str) -> str:
    """HEAL's final_infer yaml without the left-out type (model and modality_setting)."""
    import yaml
    hypes = yaml.safe_load(text)
    hypes["model"]["args"].pop(LEFT_OUT)
    hypes["heter"]["modality_setting"].pop(LEFT_OUT)
    hypes["heter"]["ego_modality"] = "&".join(
        name for name in hypes["heter"]["ego_modality"].split("&") if name != LEFT_OUT)
    return yaml.safe_dump(hypes, sort_keys=False)


def write_heal_runs(heal: Path, out: Path) -> None:
    """HEAL's side: build, save, link, merge (module doc)."""
    import torch
    torch.set_num_threads(2)
    lss = load_by_path("lss_fixture", REPO_ROOT / "tools/reference/make_lss_parity_fixture.py")
    load_by_path("model_parity", REPO_ROOT / "tools/reference/make_model_parity_fixtures.py")
    pyramid_fixture = load_by_path("heal_pyramid_fixture",
                                   REPO_ROOT / "tools/reference/make_heal_pyramid_fixture.py")
    modules, _ = pyramid_fixture.import_heal_models(heal, lss)
    classes = {"collab": modules["collab"].HeterPyramidCollab,
               "single": modules["single"].HeterPyramidSingle}
    yaml_utils = __import__("opencood.hypes_yaml.yaml_utils", fromlist=["load_yaml"])
    heal_tools = load_by_path("heal_tools", heal / "opencood" / "tools" / "heal_tools.py")
    for seed, (folder, (config, kind, epoch)) in enumerate(RUNS.items()):
        run = out / folder
        run.mkdir(parents=True)
        (run / "config.yaml").write_text((heal / YAMLS / config).read_text())
        hypes = yaml_utils.load_yaml(str(run / "config.yaml"))
        torch.manual_seed(seed)
        model = classes[kind](hypes["model"]["args"])
        torch.save(model.state_dict(), run / f"net_epoch_bestval_at{epoch}.pth")
        print(f"{run}: {len(model.state_dict())} tensors")
    base = out / "stage1/m1_base/net_epoch_bestval_at23.pth"
    for folder in MERGE_ORDER[:-1]:
        os.symlink(base, out / folder / "net_epoch1.pth")
    final = out / "final_infer"
    final.mkdir()
    (final / "config.yaml").write_text(final_config((heal / YAMLS / "final_infer/m1m2m3m4.yaml")
                                                    .read_text()))
    heal_tools.merge_and_save_final([str(out / folder) for folder in MERGE_ORDER], str(final))


def check(out: Path) -> int:
    """Our side: the merged file imported, and the folders merged by the import, compared."""
    import torch
    from opencood.interop.importer import translate_run
    final = out / "final_infer"
    cfg, from_file, provenance = translate_run(final, None, "heal")
    _, merged, _ = translate_run(final, None, "heal",
                                 merge=[str(out / folder) for folder in MERGE_ORDER])
    unequal = [key for key in from_file if not torch.equal(from_file[key], merged[key])]
    print(f"{cfg['model']['core_method']} with {', '.join(cfg['model']['args']['modalities'])}: "
          f"{len(from_file)} tensors from HEAL's merged {Path(provenance['checkpoint']).name}, "
          f"{len(merged)} merged by --merge, {len(unequal)} unequal")
    for note in provenance["notes"]:
        print(f"note: {note}")
    return 0 if set(from_file) == set(merged) and not unequal else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heal", type=Path, help="HEAL's sources (step 1)")
    parser.add_argument("--out", type=Path, help="the logs folder to write (step 1)")
    parser.add_argument("--check", type=Path, help="the logs folder step 1 wrote (step 2)")
    args = parser.parse_args()
    if args.check:
        raise SystemExit(check(args.check))
    write_heal_runs(args.heal, args.out)
