#!/usr/bin/env python
"""Run ``tools/export_checkpoint.py --to heal`` folders through HEAL's own code: its
``yaml_utils.load_yaml`` parses the exported ``config.yaml``, its ``HeterModelBaseline`` is
built from it, takes ``net_epoch<N>.pth`` with ``load_state_dict(strict=True)`` and runs its
``forward`` on the camera fixture's inputs; the cls / reg / dir maps must equal those HEAL's
model gave with the original weights (``tests/fixtures/peer_runs/heal_camera_<name>.parity.pt``,
tools/reference/make_heal_camera_fixtures.py), since the export carries those weights back.
Never run in CI. Two steps::

    # 1. from OUR venv: import each fixture run (its generated weights) and export it back
    PYTHONPATH=. python tools/reference/check_heal_export.py --export /tmp/heal_exports
    # 2. HEAL's side (make_heal_camera_fixtures.py's environment), from outside the checkout
    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        CHECKOUT/tools/reference/check_heal_export.py /tmp/heal /tmp/heal_exports

Prints, per run, the largest relative difference of each head (HEAL's forward on the export vs
the fixture); exit status 1 above 1e-6.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNS = ("heal_camera_fcooper", "heal_camera_attfuse", "heal_camera_attfuse_resnet")
HEADS = ("cls_preds", "reg_preds", "dir_preds")


def export(out: Path) -> None:
    """Our side: each fixture run imported with its generated weights, then exported."""
    from collections import OrderedDict
    import torch
    from opencood.interop.heal_export import export_heal_run
    from opencood.interop.importer import import_run
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from parity_weights import materialize
    from test_import_heal_v2v4real import write_peer_run
    fixtures = REPO_ROOT / "tests" / "fixtures" / "peer_runs"
    for name in RUNS:
        state = OrderedDict(materialize(torch.load(fixtures / f"{name}.parity.pt",
                                                   weights_only=True)["state_dict"]))
        with tempfile.TemporaryDirectory() as folder:
            peer = write_peer_run(Path(folder) / "peer", name, state=state)
            ours, _ = import_run(peer, Path(folder) / "ours", None, "heal")
            export_heal_run(ours, out / name)
        print(f"exported {out / name}")


def check(source: Path, exports: Path) -> int:
    """HEAL's side: load, build, strict load, forward, compare (module docstring)."""
    import torch
    torch.set_num_threads(1)
    fixtures = load_by_path("heal_camera_fixtures",
                            REPO_ROOT / "tools/reference/make_heal_camera_fixtures.py")
    lss = load_by_path("lss_fixture", REPO_ROOT / "tools/reference/make_lss_parity_fixture.py")
    weights = load_by_path("parity_weights", REPO_ROOT / "tests" / "parity_weights.py")
    _, camera_utils, _ = lss.import_heal(source)
    baseline = __import__("opencood.models.heter_model_baseline",
                          fromlist=["HeterModelBaseline"])
    yaml_utils = __import__("opencood.hypes_yaml.yaml_utils", fromlist=["load_yaml"])
    geometry = lss.make_geometry(camera_utils)
    worst = 0.0
    for name in RUNS:
        folder = exports / name
        hypes = yaml_utils.load_yaml(str(folder / "config.yaml"))
        model = baseline.HeterModelBaseline(hypes["model"]["args"])
        (checkpoint,) = folder.glob("net_epoch*.pth")
        model.load_state_dict(torch.load(checkpoint, weights_only=True), strict=True)
        model.eval()
        with torch.no_grad():
            outputs = model(fixtures.heal_inputs(hypes, lss, weights, geometry))
        expected = torch.load(REPO_ROOT / "tests" / "fixtures" / "peer_runs" /
                              f"{name}.parity.pt", weights_only=True)["outputs"]
        errors = {head: float((outputs[head] - expected[head]).abs().max()
                              / expected[head].abs().max()) for head in HEADS}
        worst = max(worst, *errors.values())
        print(name, "strict load ok;", {k: f"{v:.1e}" for k, v in errors.items()})
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--export"]:
        export(Path(sys.argv[2]))
    else:
        raise SystemExit(check(Path(sys.argv[1]), Path(sys.argv[2])))
