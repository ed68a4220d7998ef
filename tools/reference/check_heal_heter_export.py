#!/usr/bin/env python
"""Run ``tools/export_checkpoint.py --to heal`` folders of our heterogeneous models through
HEAL's own code: its ``yaml_utils.load_yaml`` parses the exported ``config.yaml``, its
``HeterPyramidCollab`` / ``HeterPyramidSingle`` / ``HeterModelLate`` is built from the exported
``model.args``, takes ``net_epoch<N>.pth`` with ``load_state_dict(strict=True)`` and runs its
``forward`` (eval mode) on the pyramid parity fixture's inputs. Never run in CI. Cases:

* ``heter_pyramid_collab``, ``heter_pyramid_single``, ``heter_model_late``: the fixture's HEAL
  runs (tests/test_import_heal_heter.py ``write_heal_run``) imported and exported back; HEAL's
  heads on the export must equal the fixture's outputs (HEAL's heads with the original weights);
* ``efficientnet_collab``: our collab model with an EfficientNet-b0 camera type (seeded
  initial weights; HEAL's never-run classifier added by the export); HEAL's heads on the
  export must equal ours on the same inputs.

Two steps::

    # 1. from OUR venv, in the checkout: the exports (and our EfficientNet model's heads)
    PYTHONPATH=. python tools/reference/check_heal_heter_export.py --export /tmp/heter_exports
    # 2. HEAL's side (make_heal_pyramid_fixture.py's environment), from outside the checkout
    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        CHECKOUT/tools/reference/check_heal_heter_export.py /work/side/HEAL /tmp/heter_exports

Prints, per case and head, the largest difference relative to the largest magnitude; exit
status 1 above 1e-5 (the parity tests' tolerance).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
HEADS = ("cls_preds", "reg_preds", "dir_preds")
FIXTURE_CASES = {"heter_pyramid_collab": "collab", "heter_pyramid_single": "single",
                 "heter_model_late": "late"}
TOLERANCE = 1e-5


def export(out: Path) -> None:
    """Our side: each fixture run imported and exported; the EfficientNet collab model built,
    run on the collab inputs (its heads saved beside its export) and exported."""
    import torch
    torch.set_num_threads(1)
    from opencood.config import replaced, save_config
    from opencood.interop.heal_heter_export import export_heal_heter_run
    from opencood.interop.importer import import_run, translate_run
    from opencood.models.build import build_model
    from opencood.utils.checkpoint import save_checkpoint
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from test_import_heal_heter import write_heal_run
    from test_parity_heal_pyramid import FIXTURE, modality_groups
    fixture = torch.load(FIXTURE, weights_only=True)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        for core, part in FIXTURE_CASES.items():
            peer = write_heal_run(folder / core / "peer", fixture[part], core)
            ours, _ = import_run(peer, folder / core / "ours", None, "heal")
            export_heal_heter_run(ours, out / core)
            print(f"exported {out / core}")
        case = fixture["collab"]
        peer = write_heal_run(folder / "efficientnet" / "peer", case, "heter_pyramid_collab")
        cfg = replaced(translate_run(peer, None, "heal")[0],
                       {"model.args.modalities.m2.encoder.args.camera_encoder": "EfficientNet"})
        torch.manual_seed(0)
        model = build_model(cfg["model"]).eval()
        batch = {"record_len": case["record_len"],
                 "transforms_to_ego": case["transforms_to_ego"].float(),
                 "points_in_agent_frame": True, "agent_modality": case["agent_modality_list"],
                 **modality_groups(case["inputs"])}
        with torch.no_grad():
            heads = {key: value for key, value in model(batch).items() if key in HEADS}
        run = folder / "efficientnet" / "ours"
        run.mkdir()
        save_config(cfg, run / "config.yaml")
        save_checkpoint(run / "last.pth", {"model": model.state_dict(), "epoch": 1})
        export_heal_heter_run(run, out / "efficientnet_collab")
        torch.save(heads, out / "efficientnet_collab" / "ours_heads.pt")
        print(f"exported {out / 'efficientnet_collab'}")


def heal_collab_input(pyramid_fixture, weights, geometry):
    """HEAL's data_dict of the fixture's collab batch (its inputs and pairwise transforms drawn
    again exactly as make_heal_pyramid_fixture.py's collab_case draws them)."""
    import numpy as np
    import torch
    rng = np.random.default_rng(37)
    samples = pyramid_fixture.COLLAB_MODALITIES
    record_len = [len(sample) for sample in samples]
    flat = [m for sample in samples for m in sample]
    inputs = pyramid_fixture.modality_inputs(
        rng, flat, pyramid_fixture.camera_rows(weights, geometry, "collab"))
    pairwise, _ = pyramid_fixture.own_frame(rng, record_len)
    data = {f"inputs_{name}": pyramid_fixture.materialized(value, weights)
            for name, value in inputs.items()}
    data.update(agent_modality_list=list(flat), record_len=torch.tensor(record_len),
                pairwise_t_matrix=torch.from_numpy(pairwise.copy()))
    return data


def relative(ours, expected) -> float:
    return float((ours - expected).abs().max() / expected.abs().max())


def check(source: Path, exports: Path) -> int:
    """HEAL's side: parse, build, strict load, forward, compare (module docstring)."""
    import torch
    torch.set_num_threads(1)
    lss = load_by_path("lss_fixture", REPO_ROOT / "tools/reference/make_lss_parity_fixture.py")
    weights = load_by_path("parity_weights", REPO_ROOT / "tests" / "parity_weights.py")
    load_by_path("model_parity", REPO_ROOT / "tools/reference/make_model_parity_fixtures.py")
    pyramid_fixture = load_by_path("heal_pyramid_fixture",
                                   REPO_ROOT / "tools/reference/make_heal_pyramid_fixture.py")
    modules, _ = pyramid_fixture.import_heal_models(source, lss)
    yaml_utils = __import__("opencood.hypes_yaml.yaml_utils", fromlist=["load_yaml"])
    camera_utils = __import__("opencood.utils.camera_utils", fromlist=["img_transform"])
    geometry = lss.make_geometry(camera_utils)
    fixture = torch.load(REPO_ROOT / "tests/fixtures/parity/heal_pyramid.pt", weights_only=True)
    classes = {"heter_pyramid_collab": modules["collab"].HeterPyramidCollab,
               "heter_pyramid_single": modules["single"].HeterPyramidSingle,
               "heter_model_late": modules["late"].HeterModelLate}
    worst = 0.0
    for name in (*FIXTURE_CASES, "efficientnet_collab"):
        folder = exports / name
        hypes = yaml_utils.load_yaml(str(folder / "config.yaml"))
        core = hypes["model"]["core_method"]
        torch.manual_seed(0)
        model = classes[core](hypes["model"]["args"])
        (checkpoint,) = folder.glob("net_epoch*.pth")
        model.load_state_dict(torch.load(checkpoint, weights_only=True), strict=True)
        model.eval()
        errors = {}
        if core == "heter_pyramid_collab":
            expected = (torch.load(folder / "ours_heads.pt", weights_only=True)
                        if name == "efficientnet_collab" else fixture["collab"]["outputs"]["eval"])
            with torch.no_grad():
                out = model(heal_collab_input(pyramid_fixture, weights, geometry))
            errors = {head: relative(out[head], expected[head]) for head in HEADS}
        else:
            case = fixture[FIXTURE_CASES[core]]
            for batch, expected in zip(case["batches"], case["outputs"]):
                inputs = pyramid_fixture.materialized(batch["inputs"], weights)
                with torch.no_grad():
                    out = model({f"inputs_{batch['modality']}": inputs})
                for head in HEADS:
                    errors[head] = max(errors.get(head, 0.0), relative(out[head], expected[head]))
        worst = max(worst, *errors.values())
        print(f"{name} ({core}): strict load ok, {len(model.state_dict())} tensors;",
              {key: f"{value:.1e}" for key, value in errors.items()})
    print(f"worst relative difference {worst:.1e} (tolerance {TOLERANCE:.0e})")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--export"]:
        export(Path(sys.argv[2]))
    else:
        raise SystemExit(check(Path(sys.argv[1]), Path(sys.argv[2])))
