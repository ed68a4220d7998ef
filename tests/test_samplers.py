"""opencood.utils.samplers and opencood.utils.batching."""

import itertools

import pytest

from opencood.utils import dist as dist_utils
from opencood.utils.batching import describe_batch, split_global_batch
from opencood.utils.samplers import InferenceSampler, build_train_sampler
from dist_helpers import run_on_ranks


# ----------------------------------------------------------------------------------------------
# InferenceSampler
# ----------------------------------------------------------------------------------------------

def test_inference_sampler_hand_case():
    shards = [list(InferenceSampler(7, rank=r, world_size=3)) for r in range(3)]
    assert shards == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("num_samples, world_size",
                         list(itertools.product([0, 1, 2, 5, 7, 16], [1, 2, 3, 4, 8])))
def test_inference_sampler_covers_each_index_once(num_samples, world_size):
    shards = [list(InferenceSampler(num_samples, rank=r, world_size=world_size))
              for r in range(world_size)]
    assert sum(shards, []) == list(range(num_samples))  # disjoint, complete, in order
    sizes = [len(shard) for shard in shards]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == [len(InferenceSampler(num_samples, r, world_size)) for r in range(world_size)]


def test_inference_sampler_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank 2"):
        InferenceSampler(5, rank=2, world_size=2)


# ----------------------------------------------------------------------------------------------
# Training sampler
# ----------------------------------------------------------------------------------------------

def _epoch_batches(dataset_len, micro_batch, rank, world_size, seed, epoch):
    batch_sampler, distributed_sampler = build_train_sampler(dataset_len, micro_batch, rank,
                                                             world_size, seed)
    distributed_sampler.set_epoch(epoch)
    return list(batch_sampler)


def test_train_sampler_shards_disjoint_and_cover():
    batches = [_epoch_batches(12, 3, r, 2, seed=0, epoch=0) for r in range(2)]
    assert all(len(rank_batches) == 2 and all(len(b) == 3 for b in rank_batches)
               for rank_batches in batches)
    indices = [i for rank_batches in batches for batch in rank_batches for i in batch]
    assert sorted(indices) == list(range(12))


def test_train_sampler_epoch_and_seed():
    epoch0 = _epoch_batches(20, 2, 0, 2, seed=3, epoch=0)
    assert _epoch_batches(20, 2, 0, 2, seed=3, epoch=0) == epoch0  # reproducible
    assert _epoch_batches(20, 2, 0, 2, seed=3, epoch=1) != epoch0  # set_epoch reshuffles
    assert _epoch_batches(20, 2, 0, 2, seed=4, epoch=0) != epoch0  # seed matters


def test_train_sampler_equal_batch_counts_when_world_does_not_divide():
    # Unequal step counts would leave one rank waiting in the gradient all-reduce.
    counts = [len(_epoch_batches(11, 2, r, 3, seed=0, epoch=0)) for r in range(3)]
    assert counts == [2, 2, 2]


def test_train_sampler_single_process_and_no_shuffle():
    batch_sampler, _ = build_train_sampler(5, 2, rank=0, world_size=1, seed=0, shuffle=False)
    assert list(batch_sampler) == [[0, 1], [2, 3]]  # last incomplete batch dropped


def test_train_sampler_too_small_dataset():
    with pytest.raises(ValueError, match="micro-batch of 4"):
        build_train_sampler(6, 4, rank=0, world_size=2, seed=0)


def _sampler_body(rank, world_size):
    inference = list(InferenceSampler(7))  # rank and world from the process group
    batches = {}
    batch_sampler, distributed_sampler = build_train_sampler(
        10, 1, dist_utils.get_rank(), dist_utils.get_world_size(), seed=7)
    for epoch in (0, 1):
        distributed_sampler.set_epoch(epoch)
        batches[epoch] = [batch[0] for batch in batch_sampler]
    return inference, batches


def test_samplers_on_two_ranks():
    (inference0, train0), (inference1, train1) = run_on_ranks(_sampler_body, world_size=2)
    assert inference0 == [0, 1, 2, 3] and inference1 == [4, 5, 6]
    for epoch in (0, 1):
        assert not set(train0[epoch]) & set(train1[epoch])
        assert sorted(train0[epoch] + train1[epoch]) == list(range(10))
    assert train0[0] != train0[1]


# ----------------------------------------------------------------------------------------------
# Global batch split
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("global_batch, world_size, max_micro, expected", [
    (8, 2, None, (4, 1)),
    (8, 2, 2, (2, 2)),
    (8, 2, 3, (2, 2)),   # 3 does not divide the per-rank 4: next smaller divisor
    (8, 1, None, (8, 1)),
    (8, 8, None, (1, 1)),
    (12, 2, 4, (3, 2)),
    (7, 1, 2, (1, 7)),
    (6, 3, 100, (2, 1)),
])
def test_split_global_batch(global_batch, world_size, max_micro, expected):
    micro, accum = split_global_batch(global_batch, world_size, max_micro)
    assert (micro, accum) == expected
    assert micro * world_size * accum == global_batch


def test_split_global_batch_impossible():
    with pytest.raises(ValueError) as excinfo:
        split_global_batch(8, 3)
    message = str(excinfo.value)
    assert "global batch 8" in message and "world size 3" in message
    assert "6 or 9" in message and "1, 2, 4, 8" in message


def test_split_global_batch_rejects_nonpositive():
    with pytest.raises(ValueError):
        split_global_batch(8, 2, max_micro_batch=0)
    with pytest.raises(ValueError):
        split_global_batch(0, 2)


def test_describe_batch():
    assert describe_batch(2, 2, 2) == "global batch 8 = micro 2 x world 2 x accum 2"


def test_resumable_batch_sampler_skips_the_first_batches_of_one_epoch_only():
    batch_sampler, distributed = build_train_sampler(10, 2, rank=0, world_size=1, seed=3)
    distributed.set_epoch(4)
    whole = list(batch_sampler)
    assert len(whole) == 5
    batch_sampler.resume_in_epoch(4, 3)
    assert list(batch_sampler) == whole[3:]       # the same order, minus what was done
    assert list(batch_sampler) == whole[3:]       # every pass of that epoch (loader workers)
    distributed.set_epoch(5)
    assert len(list(batch_sampler)) == 5          # the next epoch is whole
    with pytest.raises(ValueError):
        batch_sampler.resume_in_epoch(4, -1)
