"""Fingerprints of every yaml: what a refactor must leave bit-identical.

For each config: the model built from the config's seed (its real initialisation), one training
step's loss terms and every gradient on a fixed fake batch (``opencood.utils.fake_batch``), the
eval-mode head outputs, the decoded + NMS'd boxes (scores shifted up so decoding and NMS have
work to do on an untrained model) and their AP against the batch's GT; and, with ``--data``, the
first batches of the config's dataset read from a synthetic folder of its format (train and test
mode, collated; a ``heter`` config's batch holds its agents' modalities, from a ``--heter``
folder). Each tensor is reduced to a sha256 of its bytes, so two fingerprints compare
exactly (``--compare``), naming the first keys that differ.

    python tools/fingerprint.py --out before.json [--data /tmp/fp_data] [--configs GLOB ...]
    python tools/fingerprint.py --out after.json  [--data /tmp/fp_data]
    python tools/fingerprint.py --compare before.json after.json [--rename vfe.=encoder.vfe.]

Run from the repository root with ``PYTHONPATH=.``. CPU, float32, deterministic. The fingerprint
is of the code paths, not of the data's size: fewer pillars than a real frame, and the real-data
configs (256 channels) on a 128 x 64-cell crop of their own cell size (:func:`shrunk_range`).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
# Configs that are inherited pieces, not runnable models.
SKIP_NAMES = {"base.yaml"}
SCORE_SHIFT = 4.0     # added to the class logits before decoding: boxes for NMS and AP


def tensor_hash(value) -> str:
    """sha256 of a tensor's (or array's) dtype, shape and bytes."""
    array = value.detach().cpu().contiguous().numpy() if torch.is_tensor(value) else np.asarray(value)
    digest = hashlib.sha256(f"{array.dtype}{array.shape}".encode())
    digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def hash_tree(prefix: str, value, out: Dict[str, str]) -> None:
    """Every tensor / array / number of a nested batch or output -> ``out[prefix.key]``."""
    if isinstance(value, dict):
        for key in sorted(value):
            hash_tree(f"{prefix}.{key}", value[key], out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            hash_tree(f"{prefix}.{index}", item, out)
    elif torch.is_tensor(value) or isinstance(value, np.ndarray):
        out[prefix] = tensor_hash(value)
    elif value is None or isinstance(value, (bool, int, float, str)):
        out[prefix] = repr(value)
    else:
        out[prefix] = type(value).__name__


def config_paths(patterns: List[str]) -> List[Path]:
    paths = []
    for pattern in patterns:
        paths += [Path(p) for p in sorted(glob.glob(str(ROOT / pattern), recursive=True))]
    return [p for p in paths if p.name not in SKIP_NAMES]


def build_model(cfg: Dict):
    from opencood.engine.recipe import prepare_model
    from opencood.utils.dist import DistInfo
    torch.manual_seed(int(cfg["seed"]))
    info = DistInfo(0, 1, 0, False, None, torch.device("cpu"))
    _, model, _ = prepare_model(cfg, info, None, None)
    return model


def fake_batch(cfg: Dict, model) -> Dict:
    from opencood.strategies import fuses_agents
    from opencood.utils.fake_batch import fake_collated_batch
    import inspect
    # The whole config before issue 35, its preprocess section after.
    first = inspect.signature(fake_collated_batch).parameters
    source = cfg if "cfg" in first else cfg["preprocess"]
    single_agent = not fuses_agents(model)
    heter = cfg.get("heter")
    # A heterogeneous batch: its modalities' grids and images (trees before it: no heter).
    extra = {} if heter is None else {"heter": heter,
                                      "depth": "depth" in cfg.get("input_source", [])}
    # One agent per sample: a sample per modality, so that a late model trains every type.
    batch_size = 2 if heter is None or not single_agent else \
        max(2, len(heter["modality_setting"]))
    batch = fake_collated_batch(source, batch_size=batch_size, agents_per_sample=3,
                                pillars_per_agent=1500, points_per_pillar=4, max_gt=12,
                                single_agent=single_agent, seed=0, **extra)
    return batch if heter is not None else with_cameras(cfg, batch)


def with_cameras(cfg: Dict, batch: Dict) -> Dict:
    """A camera config's batch: the camera keys of ``fake_camera_batch`` at the encoder's image
    size for every agent (depth maps with "depth" in ``input_source``), and no points without
    "lidar" in ``input_source``."""
    sources = cfg.get("input_source", ["lidar"])
    if "camera" not in sources:
        return batch
    from opencood.utils.fake_batch import fake_camera_batch
    image_size = tuple(cfg["model"]["args"]["encoder"]["args"]["image_size"])
    batch.update(fake_camera_batch(int(batch["record_len"].sum()), image_size=image_size,
                                   **({"depth": True} if "depth" in sources else {})))
    if "lidar" not in sources:
        batch.pop("points"), batch.pop("agent_index")
    return batch


class ShiftedScores(torch.nn.Module):
    """The model with its class logits raised by SCORE_SHIFT (so an untrained model's boxes pass
    the score threshold)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, batch):
        outputs = dict(self.model(batch))
        outputs["cls_preds"] = outputs["cls_preds"] + SCORE_SHIFT
        return outputs


# The tool runs on trees before and after a refactor: these two ask whichever API the tree has.
def config_strategy(cfg: Dict):
    """The config's own fusion strategy."""
    try:
        from opencood.strategies import choose_strategy
    except ImportError:          # before the strategy was chosen once (issue 35)
        from opencood.strategies import get_strategy
        return get_strategy(cfg["fusion"]["core_method"]).configure(cfg)
    return choose_strategy(cfg)


def config_dataset(cfg: Dict, split: str, train: bool, cache_dir: Path):
    from opencood.data.datasets import build_dataset
    try:
        return build_dataset(cfg, split, train=train, strategy=config_strategy(cfg),
                             cache_dir=cache_dir)
    except TypeError:            # build_dataset without a strategy argument
        return build_dataset(cfg, split, train=train, cache_dir=cache_dir)


def model_fingerprint(cfg: Dict) -> Dict[str, str]:
    from opencood.engine.task import DetectionTask
    from opencood.eval.ap import APAccumulator
    from opencood.eval.inference import detect
    out: Dict[str, str] = {}
    device = torch.device("cpu")
    model = build_model(cfg)
    hash_tree("init", {name: p for name, p in model.state_dict().items()}, out)
    task = DetectionTask.from_config(cfg, device)
    batch = fake_batch(cfg, model)
    model.train()
    torch.manual_seed(1)
    loss, terms, _ = task.training_loss(model, batch)
    loss.backward()
    hash_tree("loss", {"loss": loss, **{k: torch.as_tensor(v) for k, v in terms.items()}}, out)
    hash_tree("grad", {name: p.grad for name, p in model.named_parameters()
                       if p.grad is not None}, out)
    hash_tree("buffers_after_step", dict(model.named_buffers()), out)
    model.eval()
    strategy = config_strategy(cfg)
    with torch.no_grad():
        inputs, _ = task.eval_preparer(batch, with_targets=False)
        hash_tree("eval_outputs", model(strategy.model_inputs(inputs)), out)
        results, _ = detect(ShiftedScores(model), batch, task.eval_preparer, strategy)
    accumulator = APAccumulator(order=task.eval_preparer.postprocessor.order)
    for row, (boxes, scores, sent, *classes) in enumerate(results):
        # Trees before issue 38 give (boxes, scores, sent); class ids only of a class list.
        extra = {"classes": classes[0]} if cfg["postprocess"].get("classes") else {}
        hash_tree(f"detections.{row}", {"boxes": boxes, "scores": scores,
                                        "sent": torch.as_tensor(sent), **extra}, out)
        accumulator.add_frame(boxes, scores, batch["gt_boxes"][row][batch["gt_mask"][row]],
                              sample_key=tuple(batch["sample_keys"][row]))
    out["ap"] = json.dumps(accumulator.compute(), sort_keys=True, default=str)
    return out


def data_folder(data_root: Path, data_format: str, cameras: bool = False,
                depth: bool = False, heter: bool = False) -> Path:
    """A tiny synthetic data set of ``data_format`` under ``data_root`` (written once; V2XSet
    data is OPV2V's layout; ``cameras``: a second one with OPV2V's 4 cameras per agent;
    ``depth``: a third one with their depth images too; ``heter``: OPV2V-H's extra LiDARs and
    HEAL's modality assignment json, ``generate_synthetic.py --heter``)."""
    data_format = "opv2v" if data_format == "v2xset" else data_format
    folder = data_root / (data_format + ("_cameras" if cameras else "")
                          + ("_depth" if cameras and depth else "") + ("_heter" if heter else ""))
    extra = ["--cameras"] if cameras else []          # 800 x 600, what the configs read
    extra += ["--depth"] if cameras and depth else []
    extra += ["--heter"] if heter else []
    if not (folder / "generation.yaml").exists() and not any(folder.glob("*/generation.yaml")):
        subprocess.run([sys.executable, str(ROOT / "tools/generate_synthetic.py"), "--out",
                        str(folder), "--preset", "tiny", "--format", data_format, "--seed", "0",
                        "--frames", "3", "--scenarios", "1", "1", "1", "--quiet", *extra],
                       check=True)
    return folder


def split_paths(folder: Path, data_format: str) -> List[Path]:
    """train, validate, test of a synthetic folder (DAIR-V2X-C: split json files)."""
    try:
        from opencood.data.formats import get_format
    except ImportError:          # before the format registry (issue 35)
        base = (folder / "cooperative-vehicle-infrastructure" if data_format == "dairv2x"
                else folder)
        names = (("train.json", "val.json", "test.json") if data_format == "dairv2x"
                 else ("train", "validate", "test"))
        return [base / name for name in names]
    return get_format(data_format).split_paths(folder)


def data_fingerprint(cfg: Dict, folder: Path) -> Dict[str, str]:
    from opencood.config import resolve
    from opencood.config_schema import to_plain
    from opencood.data.collate import collate_samples
    out: Dict[str, str] = {}
    cfg = to_plain(cfg)             # a plain copy to point at the data; resolved again below
    for key, split_path in zip(("root_dir", "validate_dir", "test_dir"),
                               split_paths(folder, cfg["fusion"]["dataset"])):
        cfg[key] = str(split_path)
    if cfg.get("heter") is not None:         # the folder's own assignment (--heter writes it)
        from opencood.data.synthetic.writer import ASSIGNMENT_FILES, ASSIGNMENT_FOLDER
        cfg["heter"]["assignment_path"] = str(folder / ASSIGNMENT_FOLDER / ASSIGNMENT_FILES[0])
    cfg = resolve(cfg, "fingerprint")
    for split, train in (("train", True), ("test", False)):
        dataset = config_dataset(cfg, split, train, folder / ".cache")
        count = min(len(dataset), 3)
        batch = collate_samples([dataset[index] for index in range(count)])
        hash_tree(f"data_{split}", batch, out)
    return out


def shrunk_range(path: Path) -> List[str]:
    """``--set`` overrides narrowing a config's crop to 128 x 64 of its own cells (its
    256-channel real-data geometry takes minutes a step on a CPU); the synthetic configs are
    fingerprinted as they are."""
    from opencood.config import load_config
    if "synthetic" in path.parts:
        return []
    cfg = load_config(str(path))
    voxel = cfg["preprocess"]["args"]["voxel_size"]
    z_low, z_high = cfg["preprocess"]["cav_lidar_range"][2::3]
    half_x, half_y = 64 * voxel[0], 32 * voxel[1]
    crop = [-half_x, -half_y, z_low, half_x, half_y, z_high]
    return [f"preprocess.cav_lidar_range=[{', '.join(repr(v) for v in crop)}]",
            f"postprocess.gt_range=[{', '.join(repr(v) for v in crop)}]"]


def fingerprint(paths: List[Path], data_root: Path | None) -> Dict[str, Dict[str, str]]:
    from opencood.config import load_config
    results = {}
    for path in paths:
        name = str(path.relative_to(ROOT))
        cfg = load_config(str(path), shrunk_range(path))
        try:
            record = model_fingerprint(cfg)
            if data_root is not None:
                sources = cfg.get("input_source", ["lidar"])
                record.update(data_fingerprint(cfg, data_folder(
                    data_root, cfg["fusion"]["dataset"], "camera" in sources,
                    "depth" in sources, heter=cfg.get("heter") is not None)))
        except Exception as error:           # a config that cannot run is part of the print
            record = {"error": f"{type(error).__name__}: {error}"}
        results[name] = record
        print(f"{name}: {record.get('error') or f'{len(record)} entries'}", flush=True)
    return results


def renamed(record: Dict[str, str], renames: List[str]) -> Dict[str, str]:
    """``record`` with parameter names renamed by ``OLD=NEW`` prefixes (``vfe.=encoder.vfe.``:
    a module moved), matched right after a section name (``grad.vfe.`` -> ``grad.encoder.vfe.``)."""
    pairs = [rename.split("=", 1) for rename in renames]
    out = {}
    for key, value in record.items():
        section, _, rest = key.partition(".")
        for old, new in pairs:
            if rest.startswith(old):
                rest = new + rest[len(old):]
                break
        out[f"{section}.{rest}" if rest else key] = value
    return out


def compare(before: Dict, after: Dict, renames: List[str] = ()) -> int:
    before = {name: renamed(record, renames) for name, record in before.items()}
    differing = 0
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old is None or new is None:
            print(f"{name}: only in {'after' if old is None else 'before'}")
            differing += 1
            continue
        keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if keys:
            differing += 1
            print(f"{name}: {len(keys)} of {len(old)} entries differ, first: {keys[:5]}")
    total = len(set(before) | set(after))
    print(f"{total - differing} of {total} configs identical")
    return 1 if differing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the fingerprints here (json)")
    parser.add_argument("--configs", nargs="+", default=["hypes_yaml/**/*.yaml"],
                        help="glob patterns relative to the repository root")
    parser.add_argument("--data", type=Path, help="also fingerprint the datasets' batches "
                        "(tiny synthetic folders are written here once per format)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--rename", nargs="*", default=[], metavar="OLD=NEW",
                        help="with --compare: parameter name prefixes of BEFORE renamed")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(before, after, args.rename)
    if not args.out:
        parser.error("--out is required unless --compare")
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)          # reductions in one order: bit-stable across machines loads
    results = fingerprint(config_paths(args.configs), args.data)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
