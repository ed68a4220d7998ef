"""Make tests/fixtures/v2xreal_runs/quantv2x_*: QuantV2X's multi-class LiDAR runs on V2X-Real
(``opencood/hypes_yaml/v2x_real/LiDAROnly/lidar_attfuse.yaml``, ``lidar_fcooper.yaml``: HEAL's
``heter_model_baseline`` made multi-class as ``heter_model_baseline_mc``, three classes x two
yaws), for ``tools/import_checkpoint.py --from quantv2x``. Never run in CI.

As ``make_peer_run_fixtures.py`` does for HEAL (whose helpers it uses): its yaml at small
widths (``small_heal``) on a 6.4 x 6.4 m range, parsed by its own ``yaml_utils.load_yaml`` and
dumped as its ``train.py`` writes ``config.yaml``; its ``HeterModelBaselineMC`` built by its own
class, generated weights (recipes only), its ``forward`` in eval mode on samples of 1, 2 and 3
agents (its pillars; identity pairwise transforms) and its ``cls_preds`` / ``reg_preds`` /
``dir_preds`` maps. Output: ``quantv2x_<fusion>.config.yaml`` and ``.parity.pt``, and
``quantv2x_pillars.pt`` (the two models' pillars, stored once).

Run from OUTSIDE the repository, QuantV2X's sources first on PYTHONPATH::

    git --git-dir=/work/.mirror/ucla-mobility+QuantV2X/repo archive HEAD opencood | \\
        tar -x -C /tmp/quantv2x_src
    cd /tmp && env -u PYTHONPATH PYTHONPATH=/tmp/quantv2x_src \\
        /work/side/venv-v2xreal/bin/python REPO/tools/reference/make_quantv2x_run_fixtures.py \\
        /tmp/quantv2x_src REPO/tests/fixtures/v2xreal_runs

(torchvision, icecream and the camera modules its model file imports are stubbed.)
"""
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_env import load_by_path  # noqa: E402  (tools/reference/side_env.py)

REPO = Path(__file__).resolve().parents[2]
MODELS = {"attfuse": "lidar_attfuse.yaml", "fcooper": "lidar_fcooper.yaml"}
SMALL_RANGE = [-3.2, -3.2, -3.0, 3.2, 3.2, 1.0]      # 16 x 16 pillars, 8 x 8 head cells
RECORD_LEN = [1, 2, 3]


def main(source_root: str, out_dir: str) -> None:
    import torch
    out = Path(out_dir)
    peer = load_by_path("make_peer_run_fixtures",
                        REPO / "tools" / "reference" / "make_peer_run_fixtures.py")
    peer.RANGE = SMALL_RANGE                              # small_heal's range
    weights = load_by_path("parity_weights", REPO / "tests" / "parity_weights.py")
    parity = load_by_path("make_model_parity_fixtures",
                          REPO / "tools" / "reference" / "make_model_parity_fixtures.py")
    yaml_utils = peer.import_with_stubs("opencood.hypes_yaml.yaml_utils")
    folder = Path(source_root) / "opencood" / "hypes_yaml" / "v2x_real" / "LiDAROnly"
    shared = {}
    for name, filename in MODELS.items():
        raw = peer.small_heal(yaml.load((folder / filename).read_text(), Loader=yaml.Loader))
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
            yaml.dump(raw, handle)
        hypes = yaml_utils.load_yaml(handle.name)
        with open(out / f"quantv2x_{name}.config.yaml", "w") as handle:
            yaml.dump(hypes, handle)
        peer.import_with_stubs("opencood.models.heter_encoders")
        cls = peer.import_with_stubs("opencood.models.heter_model_baseline_mc") \
            .HeterModelBaselineMC
        model = cls(hypes["model"]["args"])
        recipes = parity.weight_recipes(model, weights)
        model.load_state_dict(weights.materialize(recipes), strict=True)
        model.eval()
        data = peer.heal_inputs(hypes, RECORD_LEN, parity.SEED, parity)
        with torch.no_grad():
            outputs = model(data)
        path = out / f"quantv2x_{name}.parity.pt"
        pillars = {k: v.contiguous() for k, v in data["inputs_m1"].items()}
        if shared:                      # the same pillars for both models: stored once
            assert all(torch.equal(shared["quantv2x"][k], pillars[k]) for k in pillars)
        shared["quantv2x"] = pillars
        torch.save({"about": f"QuantV2X heter_model_baseline_mc ({filename}, small), "
                             "tools/reference/make_quantv2x_run_fixtures.py",
                    "state_dict": recipes,
                    "inputs": {"pillars": "quantv2x", "record_len": data["record_len"]},
                    "outputs": {k: outputs[k].contiguous()
                                for k in ("cls_preds", "reg_preds", "dir_preds")}}, path)
        print(name, len(recipes), "tensors",
              {k: tuple(outputs[k].shape) for k in ("cls_preds", "reg_preds", "dir_preds")},
              f"{path.stat().st_size / 1024:.0f} KiB")
    torch.save(shared, out / "quantv2x_pillars.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
