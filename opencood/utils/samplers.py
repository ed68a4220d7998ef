"""Samplers for distributed training and evaluation.

* Training: every rank must run the same number of steps (a rank that runs out of batches early
  leaves the others waiting in the gradient all-reduce), so shards are equal-sized and shuffled by
  a seed shared by all ranks plus the epoch.
* Evaluation: every sample exactly once across ranks, so metrics are not biased by the duplicates
  that padding to equal shards would add.
"""

from __future__ import annotations

import itertools
from typing import Iterator

from torch.utils.data import BatchSampler, DistributedSampler, Sampler

from opencood.utils.collectives import get_rank, get_world_size


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world size {world_size}")


def shard_bounds(num_samples: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[begin, end)`` of rank's contiguous shard; shard sizes differ by at most one.

    The first ``num_samples % world_size`` ranks take one extra sample.
    """
    base_size, remainder = divmod(num_samples, world_size)
    begin = rank * base_size + min(rank, remainder)
    end = begin + base_size + (1 if rank < remainder else 0)
    return begin, end


class InferenceSampler(Sampler[int]):
    """Contiguous, unpadded shard of ``range(num_samples)`` for this rank.

    Across ranks every index appears exactly once. Shards may differ in length by one, which is
    fine for inference because no collective runs per batch (results are gathered at the end).
    """

    def __init__(self, num_samples: int, rank: int | None = None, world_size: int | None = None):
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.rank = get_rank() if rank is None else rank
        self.world_size = get_world_size() if world_size is None else world_size
        _check_rank(self.rank, self.world_size)
        self.begin, self.end = shard_bounds(num_samples, self.rank, self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.begin, self.end))

    def __len__(self) -> int:
        return self.end - self.begin


class ResumableBatchSampler(BatchSampler):
    """A ``BatchSampler`` over a ``DistributedSampler`` whose passes in one given epoch start
    part-way through.

    A run resumed from a checkpoint saved inside an epoch must see exactly the batches an
    uninterrupted run would see next: the same shuffled order (``set_epoch`` on the wrapped
    sampler), minus the batches already trained on. Skipping here, on indices, costs nothing;
    skipping loaded batches would read and augment them for nothing. The skip is tied to the
    epoch, not to one ``iter()`` call: a DataLoader with workers calls ``iter()`` twice per pass.
    """

    def __init__(self, sampler: DistributedSampler, batch_size: int, drop_last: bool):
        super().__init__(sampler, batch_size, drop_last)
        self._skip_epoch, self._skip_batches = None, 0

    def resume_in_epoch(self, epoch: int, batches: int) -> None:
        """Passes while the sampler is at ``epoch`` omit their first ``batches`` batches."""
        if batches < 0:
            raise ValueError(f"cannot skip {batches} batches")
        self._skip_epoch, self._skip_batches = epoch, batches

    def __iter__(self):
        skip = self._skip_batches if self.sampler.epoch == self._skip_epoch else 0
        return itertools.islice(super().__iter__(), skip, None)


def build_train_sampler(dataset_len: int, micro_batch: int, rank: int, world_size: int,
                        seed: int, shuffle: bool = True
                        ) -> tuple[ResumableBatchSampler, DistributedSampler]:
    """Per-rank batches of ``micro_batch`` sample indices for training.

    Returns ``(batch_sampler, distributed_sampler)``: pass the first to
    ``DataLoader(batch_sampler=...)`` and call ``distributed_sampler.set_epoch(epoch)`` before every epoch, or every epoch repeats the
    same order. One process uses the same ``DistributedSampler`` (one replica), so the order for a
    given seed comes from one code path. All ranks get the same number of batches: the sampler pads
    shards to equal length and the last incomplete batch is dropped.
    """
    _check_rank(rank, world_size)
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    samples_per_rank = -(-dataset_len // world_size)  # DistributedSampler pads up to this
    if samples_per_rank < micro_batch:
        raise ValueError(
            f"a data set of {dataset_len} samples over {world_size} ranks gives each rank "
            f"{samples_per_rank} samples, not one full micro-batch of {micro_batch}; "
            "use a smaller batch size or fewer processes")
    # DistributedSampler only needs len(dataset); a range stands in for the data set.
    distributed_sampler = DistributedSampler(range(dataset_len), num_replicas=world_size,
                                             rank=rank, shuffle=shuffle, seed=seed)
    batch_sampler = ResumableBatchSampler(distributed_sampler, micro_batch, drop_last=True)
    return batch_sampler, distributed_sampler
