#!/usr/bin/env python
"""Build ``tests/fixtures/peer_runs/heal_merge_final.json`` by running HEAL's own merge
(github.com/yifanlu0227/HEAL ``opencood/tools/heal_tools.py``: ``merge_and_save_final``, what its
README's ``python opencood/tools/heal_tools.py merge_final ALIGNED... BASE OUT`` runs) on the run
folders ``tests/test_import_heal_heter.py`` builds (``write_merge_runs``: a stage-one base and two
aligned types split from the pyramid parity fixture's weights). The fixture keeps, per key of
HEAL's merged ``net_epoch1.pth``, its dtype, shape and a hash of its bytes
(``tensor_digest``); the test merges the same folders with ``--merge`` and compares. CI never
runs this script. Two steps::

    # 1. from OUR venv, in the checkout: the run folders
    PYTHONPATH=. python tools/reference/make_heal_merge_fixture.py --runs /tmp/heal_merge
    # 2. HEAL's side (any venv with torch; HEAL's sources unpacked), from outside the checkout
    cd /tmp && env -u PYTHONPATH /work/side/venv-lss/bin/python \\
        CHECKOUT/tools/reference/make_heal_merge_fixture.py --runs /tmp/heal_merge \\
        --heal /work/side/HEAL --out CHECKOUT/tests/fixtures/peer_runs/heal_merge_final.json

Step 2 loads ``heal_tools.py`` by its path (it imports only torch), so HEAL's package is not
imported. Deterministic: the folders' tensors are generated (tests/parity_weights.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO_ROOT = Path(__file__).resolve().parents[2]


def write_runs(out: Path) -> None:
    """Our side: the test's folders (needs our package and tests on the path)."""
    import torch
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from test_import_heal_heter import write_merge_runs
    from test_parity_heal_pyramid import FIXTURE
    folders = write_merge_runs(out, torch.load(FIXTURE, weights_only=True)["collab"])
    print("wrote", *folders.values(), sep="\n  ")


def run_heal_merge(heal: Path, runs: Path, out: Path) -> None:
    """HEAL's side: its merge_and_save_final on the folders, then the digests."""
    import hashlib
    import torch
    heal_tools = load_by_path("heal_tools", heal / "opencood" / "tools" / "heal_tools.py")
    order = [str(runs / name) for name in ("m2_alignto_m1", "m3_alignto_m1", "m1_base")]
    with tempfile.TemporaryDirectory() as merged_dir:
        heal_tools.merge_and_save_final(order, merged_dir)
        merged = torch.load(Path(merged_dir) / "net_epoch1.pth", map_location="cpu",
                            weights_only=True)

    def digest(tensor):          # tests/test_import_heal_heter.py's tensor_digest
        data = tensor.detach().contiguous().cpu().numpy().tobytes()
        return f"{tensor.dtype} {list(tensor.shape)} {hashlib.sha256(data).hexdigest()[:16]}"

    fixture = {"about": "Made by tools/reference/make_heal_merge_fixture.py: HEAL's "
                        "heal_tools.merge_and_save_final over m2_alignto_m1, m3_alignto_m1, "
                        "m1_base (tests/test_import_heal_heter.py write_merge_runs); per key "
                        "of its merged net_epoch1.pth: dtype, shape, sha256[:16] of the bytes",
               "merge_order": [Path(path).name for path in order],
               "torch": torch.__version__,
               "keys": {key: digest(merged[key]) for key in sorted(merged)}}
    out.write_text(json.dumps(fixture, indent=0) + "\n")
    print(f"wrote {out}: {len(merged)} keys")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--heal", type=Path, help="HEAL's sources (step 2)")
    parser.add_argument("--out", type=Path, help="the fixture to write (step 2)")
    args = parser.parse_args()
    if args.heal:
        run_heal_merge(args.heal, args.runs, args.out)
    else:
        write_runs(args.runs)
