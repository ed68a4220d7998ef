"""Host-to-device copies of a batch (issue 22, point 6): every copy the preparer makes is
non-blocking, and every loader pins its batches when they go to a GPU, so the copies queue
behind the running step instead of waiting for it. (On CUDA a blocking copy waits for the GPU;
the CPU host-sync counter cannot see that, so the copies are checked by their arguments.)"""
from __future__ import annotations

from pathlib import Path

import torch

from opencood.config import load_config
from opencood.data.collate import build_loader
from opencood.data.pipeline import BatchPreparer
from opencood.engine import recipe
from opencood.strategies import choose_strategy
from opencood.utils.dist import DistInfo
from opencood.utils.fake_batch import fake_collated_batch

REPO = Path(__file__).resolve().parents[1]

CUDA_INFO = DistInfo(rank=0, world_size=1, local_rank=0, distributed=False, backend=None,
                     device=torch.device("cuda", 0))


def test_every_copy_of_a_batch_to_the_device_is_non_blocking(monkeypatch):
    cfg = load_config(REPO / "hypes_yaml" / "synthetic" / "point_pillar_v2xvit.yaml")
    batch = fake_collated_batch(cfg["preprocess"], batch_size=2, agents_per_sample=2,
                                pillars_per_agent=50)
    batch["agent_latency"] = torch.zeros(4, dtype=torch.int64)
    batch_tensors = {id(value): key for key, value in batch.items() if torch.is_tensor(value)}
    copies, real_to = {}, torch.Tensor.to

    def recording_to(self, *args, **kwargs):
        to_device = isinstance(args[0] if args else kwargs.get("device"), torch.device)
        # The first move of each batch tensor (on CPU .to returns the tensor itself, whose later
        # casts and on-device moves are no host copies).
        if id(self) in batch_tensors and to_device:
            copies.setdefault(batch_tensors[id(self)], kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", recording_to)
    BatchPreparer.from_config(cfg, torch.device("cpu"))(batch)
    assert {"points", "agent_index", "record_len", "agent_types", "agent_latency",
            "shared_points", "transforms_to_ego", "gt_boxes", "gt_mask"} <= set(copies)
    assert all(copies.values()), {key: flag for key, flag in copies.items() if not flag}


def test_loaders_pin_memory_for_a_gpu_and_not_for_the_cpu(tmp_path):
    assert build_loader([1, 2], torch.device("cuda", 0), 0, batch_size=1).pin_memory
    assert not build_loader([1, 2], torch.device("cpu"), 0, batch_size=1).pin_memory
    from opv2v_factory import write_simple_split
    split = write_simple_split(tmp_path / "validate", num_cavs=2, timestamps=("000000",))
    cfg = load_config(REPO / "hypes_yaml" / "synthetic" / "smoke.yaml",
                      [f"root_dir={split}", f"validate_dir={split}", "train_params.num_workers=0"])
    loss_loader, ap_loader = recipe.build_validation_loaders(cfg, CUDA_INFO, micro_batch=1,
                                                             strategy=choose_strategy(cfg))
    assert loss_loader.pin_memory and ap_loader.pin_memory
