"""Collate samples into batches (any number of agents each); seed and start loader workers;
prefetch the next batch onto the GPU while the current step runs (:class:`DevicePrefetcher`).

The batch layout (CPU tensors; ``opencood.data.pipeline`` moves them and pillarises on the
device) is declared in ``opencood.batch_keys.BATCH``, grouped by modality: the common keys
always, ``points`` / ``agent_index`` when the samples carry clouds, the camera keys when they
carry images. ``early_fusion`` (DiscoNet's teacher input) only when samples carry
``early_fusion_points``.
"""
from __future__ import annotations

import math
import multiprocessing
import random
from typing import Dict, Iterator, List

import numpy as np
import torch

from opencood.batch_keys import CAMERA_TENSORS

# The per-agent camera tensors, concatenated over a batch's agents.
CAMERA_SAMPLE_KEYS = CAMERA_TENSORS


def collate_samples(samples: List[Dict]) -> Dict:
    """List of dataset samples -> batch dict (``opencood.batch_keys.BATCH``)."""
    record_len, transforms, clean = [], [], []
    for sample in samples:
        # One transform per agent of the model input, whatever sensors the sample carries.
        record_len.append(len(sample["transforms_to_ego"]))
        transforms.append(torch.from_numpy(sample["transforms_to_ego"]))
        clean.append(torch.from_numpy(sample["transforms_to_ego_clean"]))
    max_gt = max([len(s["gt_boxes"]) for s in samples] + [1])
    gt_boxes = torch.zeros((len(samples), max_gt, 7), dtype=torch.float32)
    gt_mask = torch.zeros((len(samples), max_gt), dtype=torch.bool)
    for row, sample in enumerate(samples):
        count = len(sample["gt_boxes"])
        gt_boxes[row, :count] = torch.from_numpy(sample["gt_boxes"])
        gt_mask[row, :count] = True
    batch = {
        **collate_lidar(samples),
        "record_len": torch.tensor(record_len, dtype=torch.int64),
        "agent_types": torch.from_numpy(np.concatenate(
            [np.asarray(s["agent_types"], dtype=np.int64) for s in samples])),
        "agent_latency": torch.from_numpy(np.concatenate(
            [np.asarray(s.get("agent_latency", np.zeros(len(s["transforms_to_ego"]))),
                        dtype=np.int64) for s in samples])),
        "transforms_to_ego": torch.cat(transforms).reshape(-1, 4, 4),
        "transforms_to_ego_clean": torch.cat(clean).reshape(-1, 4, 4),
        "gt_boxes": gt_boxes,
        "gt_mask": gt_mask,
        "shared_points": torch.tensor([s["shared_points"] for s in samples], dtype=torch.int64),
        "sample_keys": [tuple(s["sample_key"]) for s in samples],
        "gt_ids": [s["gt_ids"] for s in samples],
        "gt_ego_points": [s["gt_ego_points"] for s in samples],
        "points_in_agent_frame": bool(samples[0].get("points_in_agent_frame", False)),
    }
    if "gt_classes" in samples[0]:
        batch["gt_classes"] = padded_classes([s["gt_classes"] for s in samples], max_gt)
    if "early_fusion_points" in samples[0]:
        batch["early_fusion"] = collate_early_fusion([s["early_fusion_points"] for s in samples])
    if "agent_gt_boxes" in samples[0]:
        batch["agent_gt_boxes"], batch["agent_gt_mask"] = pad_boxes(
            [boxes for s in samples for boxes in s["agent_gt_boxes"]])
    batch.update(collate_camera(samples))
    batch.update(collate_modalities(samples))
    return batch


def pad_boxes(box_sets: List[np.ndarray]):
    """Per row a (G_i, 7) array -> ((R, G_max, 7) float32 zero padded, (R, G_max) bool)."""
    max_gt = max([len(boxes) for boxes in box_sets] + [1])
    padded = torch.zeros((len(box_sets), max_gt, 7), dtype=torch.float32)
    mask = torch.zeros((len(box_sets), max_gt), dtype=torch.bool)
    for row, boxes in enumerate(box_sets):
        padded[row, :len(boxes)] = torch.from_numpy(np.asarray(boxes, dtype=np.float32))
        mask[row, :len(boxes)] = True
    return padded, mask


def padded_classes(classes: List[np.ndarray], max_gt: int) -> torch.Tensor:
    """Per sample (G,) class ids -> (B, max_gt) int64, zero padded like ``gt_boxes``."""
    padded = torch.zeros((len(classes), max_gt), dtype=torch.int64)
    for row, sample_classes in enumerate(classes):
        padded[row, :len(sample_classes)] = torch.as_tensor(np.asarray(sample_classes,
                                                                       dtype=np.int64))
    return padded


def collate_lidar(samples: List[Dict]) -> Dict:
    """``points`` (N, 4) and ``agent_index`` (N,) of samples carrying ``agent_points``; nothing
    for samples without clouds (camera-only)."""
    if "agent_points" not in samples[0]:
        return {}
    clouds = [points[:, :4] for sample in samples for points in sample["agent_points"]]
    return {"points": concatenate_points(clouds),
            "agent_index": agent_index_of([len(cloud) for cloud in clouds])}


def collate_camera(samples: List[Dict]) -> Dict:
    """The camera keys of ``opencood.batch_keys`` (each (n, C, ...) per sample) concatenated over
    the batch's agents -> (A, C, ...); nothing for samples without images."""
    return {key: torch.cat([torch.as_tensor(s[key]) for s in samples])
            for key in CAMERA_SAMPLE_KEYS if key in samples[0]}


def collate_modalities(samples: List[Dict]) -> Dict:
    """Heterogeneous samples (opencood.data.heter): ``agent_modality`` over the batch's agents
    and ``modality_cameras``, each modality's camera tensors concatenated over the samples
    (agent order kept within a modality); nothing for other samples."""
    if "agent_modality" not in samples[0]:
        return {}
    groups: Dict[str, List[Dict]] = {}
    for sample in samples:
        for modality, tensors in sample["modality_cameras"].items():
            groups.setdefault(modality, []).append(tensors)
    return {"agent_modality": [name for s in samples for name in s["agent_modality"]],
            "modality_cameras": {modality: {key: torch.cat([torch.as_tensor(p[key])
                                                            for p in parts])
                                            for key in parts[0]}
                                 for modality, parts in groups.items()}}


# The batch's big arrays: in a loader worker they are made in shared memory at once (as torch's
# default_collate does), so handing the batch to the trainer does not copy them again; in the
# process itself numpy allocates them, asking Linux for huge pages for arrays of 4 MB and more
# (madvise): a fresh 13 MB batch from torch's allocator costs ~3,000 page faults, more than
# copying the points into it.

_NUMPY_DTYPES = {torch.float32: np.float32, torch.int64: np.int64}


def batch_array(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor (float32 or int64) for one of the batch's big arrays."""
    if torch.utils.data.get_worker_info() is None:
        return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def concatenate_points(clouds: List[np.ndarray]) -> torch.Tensor:
    """A (N_i, 4) float32 cloud per agent -> (sum N_i, 4) float32 tensor, one copy."""
    points = batch_array((sum(len(cloud) for cloud in clouds), 4), torch.float32)
    if clouds:
        np.concatenate(clouds, axis=0, out=points.numpy())
    return points


def agent_index_of(counts: List[int]) -> torch.Tensor:
    """Points per agent (A,) -> (sum(counts),) int64, agent k's index over its points.

    One buffer filled slice by slice: ~15x faster on one thread than torch.repeat_interleave
    or torch.full per agent + cat (which also writes every value twice).
    """
    index = batch_array((sum(counts),), torch.int64)
    start = 0
    for agent, count in enumerate(counts):
        index[start:start + count] = agent
        start += count
    return index


def collate_early_fusion(clouds: List[np.ndarray]) -> Dict:
    """B merged (N_b, 4) clouds -> the model-input part of a batch, one agent per sample."""
    count = len(clouds)
    return {
        "points": concatenate_points([c[:, :4] for c in clouds]),
        "agent_index": agent_index_of([len(c) for c in clouds]),
        "record_len": torch.ones(count, dtype=torch.int64),
        "agent_types": torch.zeros(count, dtype=torch.int64),
        "shared_points": torch.zeros(count, dtype=torch.int64),
        "transforms_to_ego": torch.eye(4).expand(count, 4, 4).clone(),
        "transforms_to_ego_clean": torch.eye(4).expand(count, 4, 4).clone(),
    }


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: seed numpy and ``random`` from torch's per-worker seed.

    torch gives every worker ``base_seed + worker_id`` where the base seed is drawn from the
    loader's generator once per epoch, so workers differ from each other and from epoch to epoch
    while a seeded generator repeats the whole run. (Our datasets also derive their augmentation
    from (seed, epoch, index), so samples do not depend on which worker loads them.)
    """
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


# Imported by the forkserver before its first fork: each loader worker is a fork of that
# already-initialised, single-threaded process, so starting one costs no re-import. "__main__" is
# the script that builds the loader (tools/train.py, eval.py, bench.py), run once there under the
# name "__mp_main__" as the stdlib's spawn does, so a worker does not run it again.
WORKER_PRELOAD = ("__main__", "numpy", "numpy.random", "torch", "opencood.data.collate",
                  "opencood.data.datasets")


def worker_context(num_workers: int):
    """The ``multiprocessing_context`` of every DataLoader we build (None without workers).

    Workers are started by a forkserver, never by forking the trainer: the trainer has threads
    (gloo, pin-memory, queue feeders, TensorBoard), and on CPython before 3.11.8 (gh-112275) a
    fork made while one of them creates or deletes its thread state deadlocks the child in
    ``PyOS_AfterFork_Child``. The server is started by fork+exec and stays single-threaded. What a
    worker receives is pickled (dataset, collate_fn, worker_init_fn), so they are module-level,
    and a script that builds a loader runs its work under ``if __name__ == "__main__":``.
    """
    if num_workers == 0:
        return None                     # DataLoader refuses a context without workers
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context()          # e.g. spawn on macOS / Windows
    context = multiprocessing.get_context("forkserver")
    # Read when the server first starts (the first loader's first epoch); a no-op afterwards.
    context.set_forkserver_preload(list(WORKER_PRELOAD))
    return context


def build_loader(dataset, device: torch.device, num_workers: int,
                 **sampling) -> torch.utils.data.DataLoader:
    """The one DataLoader builder of the project (training, validation, eval, bench).

    Our collate and worker seeding, workers from :func:`worker_context`, and pinned host memory
    when the batches go to a GPU: the preparer's ``non_blocking`` copies from pinned memory then
    queue behind the running step instead of waiting for the GPU. ``sampling``: the DataLoader's
    ``batch_size`` + ``sampler``, or ``batch_sampler``, and ``generator``.
    """
    return torch.utils.data.DataLoader(
        dataset, num_workers=num_workers, collate_fn=collate_samples, worker_init_fn=seed_worker,
        multiprocessing_context=worker_context(num_workers),
        pin_memory=torch.device(device).type == "cuda", **sampling)


class DevicePrefetcher:
    """Wraps a loader: iterating it yields the loader's batches with every tensor (nested dicts
    included) already on ``device``, the next batch's host-to-device copy running on a side
    CUDA stream while the current batch's step runs.

    On CUDA: before batch i is handed over, batch i+1 is taken from the loader and its copies
    are queued (non-blocking, from the loader's pinned memory) on the copy stream, so they
    overlap step i even when the step ends in a host sync (a logged loss). The consuming
    stream waits for the copy stream before it gets a batch, and every copied tensor is
    recorded on it (``record_stream``), so the caching allocator does not hand its memory to
    the copy stream while the step still reads it. Non-tensor entries (keys, GT id arrays) stay
    as they are. On any other device the loader's batches pass through untouched (the same
    objects, in the same order). ``len()`` is the loader's.
    """

    def __init__(self, loader, device: torch.device | str):
        self.loader = loader
        self.device = torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Dict]:
        if self.device.type != "cuda":
            return iter(self.loader)
        return self._prefetched(iter(self.loader))

    def _prefetched(self, batches: Iterator[Dict]) -> Iterator[Dict]:
        copy_stream = torch.cuda.Stream(self.device)
        pending = self._copy_next(batches, copy_stream)
        while pending is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_stream(copy_stream)
            batch = pending
            _record_stream(batch, consumer)
            pending = self._copy_next(batches, copy_stream)   # overlaps the step of ``batch``
            yield batch

    def _copy_next(self, batches: Iterator[Dict], copy_stream):
        """The next batch with its copies queued on ``copy_stream``, or None at the end."""
        batch = next(batches, None)
        if batch is None:
            return None
        with torch.cuda.stream(copy_stream):
            return _to_device(batch, self.device)


def _to_device(value, device: torch.device):
    """Tensors (in nested dicts too) copied to ``device`` non-blocking; other values as they are."""
    if torch.is_tensor(value):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    return value


def _record_stream(value, stream) -> None:
    """``record_stream(stream)`` on every CUDA tensor of a (nested) batch dict."""
    if torch.is_tensor(value):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record_stream(item, stream)
