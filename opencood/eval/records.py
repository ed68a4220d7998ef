"""Evaluation records: every evaluation says what it measured, and none overwrites another.

``tools/eval.py`` writes one record per evaluated setting to ``RUN/evals/<name>.yaml``::

    format: 1
    name: test_intermediate_noise0.2_3f9c1a2b      # settings in words, then their hash
    checkpoint: {file, epoch, step, sha256, weights: ema | raw,
                 imported_from: {codebase, run_dir, checkpoint, model, epoch} | null}
    data: {split, folder (absolute), frames,
           test_is_validation: the test split's folder is the config's validate_dir}
    settings: {fusion, protocol, wild_setting {loc_err, xyz_std, yaw_std, seed,
               latency_frames, ...}, overrides [--set k=v ...],
               agents {in_order | modality, use_cav}: only a heterogeneous step
               (opencood.eval.heter_order)}
    config_sha256: hash of the resolved config evaluated
    code: {version, git_commit}
    machine: {device, world_size, torch}
    date: ISO 8601
    results: {ap_30, ap_50, ap_70, num_gt, distance, visibility, visibility_rule,
              labels (label_type camera only), bytes_per_agent,
              protocol {name, description, gt_range}, ...,
              several classes only: per_class {name: {ap_30, ap_50, ap_70, num_gt, num_det}},
              class_mean {ap_30, ap_50, ap_70, classes}; ap_* are then the class means}

The name ends in a hash of the settings and the checkpoint's content, so evaluations of other
data, another checkpoint or other settings get other files (and TensorBoard tags
``eval/<name>/...``), while the same evaluation run again replaces its own record. Records of
older versions (``RUN/eval_<split>_<fusion>[...].yaml``: the results alone) still load, their
missing fields ``None`` ("unknown" in listings).
"""
from __future__ import annotations

import hashlib
import json
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

import torch
import yaml

import opencood
from opencood.config_schema import to_plain
from opencood.errors import OpencoodError
from opencood.utils.atomic import atomic_write

RECORD_FORMAT = 1
RECORDS_DIR = "evals"
LEGACY_PATTERN = "eval_*.yaml"       # records of versions before RECORD_FORMAT 1
UNKNOWN = "unknown"
# What a record keeps of an imported checkpoint's provenance (opencood.interop.importer).
IMPORT_FACTS = ("codebase", "run_dir", "checkpoint", "model", "epoch")


class RecordError(OpencoodError):
    """A record that cannot be read; the message names the file."""


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file's content, read in chunks (checkpoints are hundreds of MB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def config_sha256(cfg: Dict) -> str:
    """Hex sha256 of a resolved config (typed or plain: the hash of its plain data, what
    ``config.yaml`` saves), independent of key order."""
    return hashlib.sha256(json.dumps(to_plain(cfg), sort_keys=True, default=str)
                          .encode()).hexdigest()


def git_commit() -> Optional[str]:
    """The commit of the checkout the package runs from, or None (an installed copy, no git)."""
    source = Path(opencood.__file__).resolve().parent
    try:
        result = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"],
                                capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and commit else None


def checkpoint_facts(path: Path, checkpoint: Dict, weights: str) -> Dict:
    """{"file", "epoch", "step", "sha256", "weights", "imported_from"} of the evaluated
    checkpoint; ``weights`` is "ema" or "raw" (which of its weights were loaded);
    ``imported_from`` what tools/import_checkpoint.py wrote (codebase, run_dir, checkpoint,
    model, epoch; None for a checkpoint trained here)."""
    imported = checkpoint.get("imported_from")
    if imported is not None:
        imported = {key: imported.get(key) for key in IMPORT_FACTS}
    return {"file": str(Path(path).resolve()), "epoch": checkpoint.get("epoch"),
            "step": checkpoint.get("step"), "sha256": file_sha256(Path(path)),
            "weights": weights, "imported_from": imported}


def machine_facts(device: torch.device, world_size: int) -> Dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "world_size": int(world_size), "torch": str(torch.__version__)}


def uses_validation_as_test(cfg: Dict, split: str) -> bool | None:
    """For the test split: whether its folder is the config's validate_dir (an OpenCOOD
    import's config names no test_dir: its validation folder stands in); None for another."""
    if split != "test":
        return None
    folders = [cfg.get(key) for key in ("test_dir", "validate_dir")]
    return None not in folders and Path(folders[0]).resolve() == Path(folders[1]).resolve()


def record_name(split: str, fusion: str, tag: str, protocol: str, default_protocol: str,
                settings: Dict, checkpoint: Dict) -> str:
    """``<split>_<fusion>[_<tag>][_<protocol>]_<hash8>``: readable, then unique per settings,
    data folder and checkpoint content."""
    words = [split, fusion] + ([tag] if tag else []) + \
        ([protocol] if protocol != default_protocol else [])
    keyed = {"settings": to_plain(settings), "checkpoint": checkpoint["sha256"],
             "weights": checkpoint["weights"]}
    digest = hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()).hexdigest()
    return "_".join(words + [digest[:8]])


def build_record(name: str, checkpoint: Dict, data: Dict, settings: Dict, cfg: Dict,
                 machine: Dict, results: Dict) -> Dict:
    """The record (see the module doc); ``results`` as ``evaluate_loader`` returns them."""
    return {"format": RECORD_FORMAT, "name": name, "checkpoint": checkpoint, "data": data,
            "settings": settings, "config_sha256": config_sha256(cfg),
            "code": {"version": opencood.__version__, "git_commit": git_commit()},
            "machine": machine, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "results": results}


def record_path(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / RECORDS_DIR / f"{name}.yaml"


def write_record(run_dir: Path, record: Dict) -> Path:
    """Write ``record`` atomically to ``RUN/evals/<name>.yaml``; returns the path."""
    path = record_path(run_dir, record["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as stream:
        yaml.safe_dump(plain(record), stream, sort_keys=False)
    return path


def load_record(path: Path) -> Dict:
    """A record, in the current layout whatever version wrote it (missing fields None)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise RecordError(f"{path}: cannot read the evaluation record ({error})") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: not an evaluation record (a yaml mapping)")
    if "format" not in data:                # before RECORD_FORMAT 1: the results alone
        protocol = (data.get("protocol") or {}).get("name")
        data = {"format": 0, "name": data.get("name", Path(path).stem), "results": data,
                "settings": {"protocol": protocol}}
    empty = {"checkpoint": {}, "data": {}, "settings": {}, "code": {}, "machine": {}}
    record = {**{key: None for key in ("config_sha256", "date")}, **empty, **data}
    for key, fields in (("checkpoint", ("file", "epoch", "step", "sha256", "weights",
                                        "imported_from")),
                        ("data", ("split", "folder", "frames", "test_is_validation")),
                        ("settings", ("fusion", "protocol", "wild_setting", "overrides"))):
        record[key] = {**{field: None for field in fields}, **(record[key] or {})}
    return record


def list_records(run_dir: Path) -> List[Tuple[Path, Dict]]:
    """Every record of a run, oldest version first then by name: (path, record)."""
    run_dir = Path(run_dir)
    paths = sorted(run_dir.glob(LEGACY_PATTERN)) + sorted((run_dir / RECORDS_DIR).glob("*.yaml"))
    return [(path, load_record(path)) for path in paths if not path.stem.endswith("_spread")]


def describe(value) -> str:
    return UNKNOWN if value is None else str(value)


def format_record_line(path: Path, record: Dict) -> str:
    """One line of ``tools/eval.py --list``: name, settings, checkpoint, data, AP@0.5 (the
    class mean of a multi-class run, said so)."""
    checkpoint, data, settings = record["checkpoint"], record["data"], record["settings"]
    wild = settings["wild_setting"] or {}
    noise = (f"noise {wild.get('xyz_std')}m/{wild.get('yaw_std')}deg seed {wild.get('seed')}"
             if wild.get("loc_err") else "no noise")
    ap_50 = record["results"].get("ap_50")
    classes = (record["results"].get("class_mean") or {}).get("classes")
    mean_of = f" (mean of {len(classes)} classes)" if classes else ""
    split = describe(data["split"]) + (" (the validation folder)" if data["test_is_validation"]
                                       else "")
    return (f"{path.name}: AP@0.5 {describe(None if ap_50 is None else f'{ap_50:.4f}')}"
            f"{mean_of} | "
            f"{split} of {describe(data['folder'])} "
            f"({describe(data['frames'])} frames) | fusion {describe(settings['fusion'])}, "
            f"protocol {describe(settings['protocol'])}, {noise}, latency "
            f"{describe(wild.get('latency_frames'))} | {describe_weights(checkpoint)} "
            f"({describe(checkpoint['weights'])} weights, sha256 "
            f"{describe((checkpoint['sha256'] or '')[:12] or None)}) | {describe(record['date'])}")


def describe_weights(checkpoint: Dict) -> str:
    """Where the evaluated weights stand: ``step N`` of a run trained here, or, for an imported
    one (which has no step of ours), its codebase, epoch and file there."""
    imported = checkpoint.get("imported_from")
    if checkpoint["step"] is not None or not imported:
        return f"step {describe(checkpoint['step'])}"
    epoch = imported.get("epoch")
    epoch = None if epoch is None or epoch < 0 else epoch         # -1: the file names none
    return (f"imported from {describe(imported.get('codebase'))} epoch {describe(epoch)} "
            f"({describe(imported.get('checkpoint'))})")


def matching_records(records: Iterable[Tuple[Path, Dict]], **wanted) -> List[Tuple[Path, Dict]]:
    """The records whose data/settings fields equal ``wanted`` (keys: split, folder, fusion,
    protocol, clean: no pose noise, no latency and every agent taking part, not a
    ``--heter_in_order`` step or a ``--modality_ap`` row)."""
    found = []
    for path, record in records:
        wild = record["settings"]["wild_setting"] or {}
        fields = {"split": record["data"]["split"], "folder": record["data"]["folder"],
                  "fusion": record["settings"]["fusion"],
                  "protocol": record["settings"]["protocol"],
                  "clean": not wild.get("loc_err") and not wild.get("latency_frames")
                  and not record["settings"].get("agents")}
        if all(fields[key] == value for key, value in wanted.items()):
            found.append((path, record))
    return found


def plain(value):
    """Numpy/tensor scalars -> python numbers, tuples -> lists, config sections -> dicts, for
    yaml.safe_dump."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item"):
        return value.item()
    return value
