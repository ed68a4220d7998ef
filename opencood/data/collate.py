"""Collate samples with a variable number of agents into one batch, and seed loader workers.

Batch layout (CPU tensors; ``opencood.data.pipeline`` moves them and pillarises on the device)::

    points            (N, 4) float32   every agent's points, concatenated agent after agent
    agent_index       (N,) int64       global agent index of each point (0 .. sum(record_len)-1)
    record_len        (B,) int64       agents per sample (ego first within each sample)
    agent_types       (A,) int64       per agent: 0 vehicle, 1 infrastructure (A = sum(record_len))
    agent_latency     (A,) int64       per agent: frames its data lags the ego's (0 for the ego)
    transforms_to_ego (A, 4, 4) float32, A = sum(record_len)
    gt_boxes          (B, M_max, 7) float32, zero padded
    gt_mask           (B, M_max) bool
    shared_points     (B,) int64   points each non-ego agent sent (early fusion)
    sample_keys       list of B keys (scenario, timestamp[, cav])
    gt_ids            list of B int64 arrays
    gt_ego_points     list of B int64 arrays: ego points in each GT box (-1: not computed)
    points_in_agent_frame  bool: clouds in their agent's own frame (late fusion) or the ego's
    early_fusion      only when samples carry ``early_fusion_points`` (DiscoNet's teacher
                      input): a batch of one merged cloud per sample with the keys above that
                      ``BatchPreparer.model_inputs`` reads (points, agent_index = the sample,
                      record_len of ones, agent_types, shared_points, transforms_to_ego)
"""
from __future__ import annotations

import random
import threading
from typing import Dict, List

import numpy as np
import torch


def collate_samples(samples: List[Dict]) -> Dict:
    """List of dataset samples -> batch dict (see module docstring)."""
    clouds, agent_index, record_len, transforms = [], [], [], []
    agent_counter = 0
    for sample in samples:
        record_len.append(len(sample["agent_points"]))
        for points in sample["agent_points"]:
            clouds.append(torch.from_numpy(np.ascontiguousarray(points[:, :4], np.float32)))
            agent_index.append(torch.full((len(points),), agent_counter, dtype=torch.int64))
            agent_counter += 1
        transforms.append(torch.from_numpy(sample["transforms_to_ego"]))
    max_gt = max([len(s["gt_boxes"]) for s in samples] + [1])
    gt_boxes = torch.zeros((len(samples), max_gt, 7), dtype=torch.float32)
    gt_mask = torch.zeros((len(samples), max_gt), dtype=torch.bool)
    for row, sample in enumerate(samples):
        count = len(sample["gt_boxes"])
        gt_boxes[row, :count] = torch.from_numpy(sample["gt_boxes"])
        gt_mask[row, :count] = True
    batch = {
        "points": torch.cat(clouds) if clouds else torch.zeros((0, 4)),
        "agent_index": torch.cat(agent_index) if agent_index else torch.zeros(0, dtype=torch.int64),
        "record_len": torch.tensor(record_len, dtype=torch.int64),
        "agent_types": torch.from_numpy(np.concatenate(
            [np.asarray(s["agent_types"], dtype=np.int64) for s in samples])),
        "agent_latency": torch.from_numpy(np.concatenate(
            [np.asarray(s.get("agent_latency", np.zeros(len(s["agent_points"]))),
                        dtype=np.int64) for s in samples])),
        "transforms_to_ego": torch.cat(transforms).reshape(-1, 4, 4),
        "gt_boxes": gt_boxes,
        "gt_mask": gt_mask,
        "shared_points": torch.tensor([s["shared_points"] for s in samples], dtype=torch.int64),
        "sample_keys": [tuple(s["sample_key"]) for s in samples],
        "gt_ids": [s["gt_ids"] for s in samples],
        "gt_ego_points": [s["gt_ego_points"] for s in samples],
        "points_in_agent_frame": bool(samples[0].get("points_in_agent_frame", False)),
    }
    if "early_fusion_points" in samples[0]:
        batch["early_fusion"] = collate_early_fusion([s["early_fusion_points"] for s in samples])
    return batch


def collate_early_fusion(clouds: List[np.ndarray]) -> Dict:
    """B merged (N_b, 4) clouds -> the model-input part of a batch, one agent per sample."""
    count = len(clouds)
    return {
        "points": torch.cat([torch.from_numpy(np.ascontiguousarray(c[:, :4], np.float32))
                             for c in clouds]),
        "agent_index": torch.cat([torch.full((len(c),), row, dtype=torch.int64)
                                  for row, c in enumerate(clouds)]),
        "record_len": torch.ones(count, dtype=torch.int64),
        "agent_types": torch.zeros(count, dtype=torch.int64),
        "shared_points": torch.zeros(count, dtype=torch.int64),
        "transforms_to_ego": torch.eye(4).expand(count, 4, 4).clone(),
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


def settle_loader_threads(timeout_s: float = 2.0) -> None:
    """Wait for the queue-feeder threads of finished DataLoader iterators to end.

    A loader starts its workers with fork. On CPython before 3.11.8 / 3.12 (gh-112275) a fork at
    the moment another thread is ending can deadlock the child in ``PyOS_AfterFork_Child``; the
    threads that end right then are the feeders of the loader that has just finished (training,
    then validation at once). Joining them first closes that window. Each join is bounded.
    """
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread" and thread is not threading.current_thread():
            thread.join(timeout_s)
