"""Global batch -> per-rank micro-batch x gradient accumulation.

The yaml states the global batch (samples per optimizer step), so one config trains the same on
1, 2 or 8 GPUs: ``global = micro x world x accum``.
"""

from __future__ import annotations

import math
from typing import Optional


def _divisors(number: int) -> list[int]:
    return [candidate for candidate in range(1, number + 1) if number % candidate == 0]


def _impossible_split_message(global_batch: int, world_size: int) -> str:
    lower = global_batch // world_size * world_size
    higher = lower + world_size
    batch_options = f"{lower} or {higher}" if lower > 0 else f"{higher}"
    worlds = ", ".join(str(d) for d in _divisors(global_batch))
    return (f"global batch {global_batch} cannot be split over world size {world_size}: it must "
            f"be a multiple of the world size; use a global batch of {batch_options}, or run "
            f"with a number of processes that divides {global_batch} ({worlds})")


def split_global_batch(global_batch: int, world_size: int,
                       max_micro_batch: int | None = None) -> tuple[int, int]:
    """``(micro_batch, accum_steps)`` such that ``global = micro * world_size * accum``.

    ``micro_batch`` is the largest divisor of ``global_batch // world_size`` that is at most
    ``max_micro_batch`` (default: the whole per-rank share, i.e. no accumulation), so memory limits
    are met with the fewest accumulation steps.
    """
    if global_batch < 1 or world_size < 1:
        raise ValueError(f"global batch ({global_batch}) and world size ({world_size}) "
                         "must both be >= 1")
    if global_batch % world_size != 0:
        raise ValueError(_impossible_split_message(global_batch, world_size))
    per_rank = global_batch // world_size
    limit = per_rank if max_micro_batch is None else max_micro_batch
    if limit < 1:
        raise ValueError(f"max_micro_batch must be >= 1, got {max_micro_batch}")
    micro_batch = max(d for d in _divisors(per_rank) if d <= limit)
    return micro_batch, per_rank // micro_batch


def describe_batch(micro_batch: int, world_size: int, accum_steps: int) -> str:
    """``"global batch 8 = micro 2 x world 2 x accum 2"`` for the training log."""
    global_batch = micro_batch * world_size * accum_steps
    return (f"global batch {global_batch} = micro {micro_batch} x world {world_size} "
            f"x accum {accum_steps}")


def steps_per_epoch(num_examples: int, global_batch: int, world_size: int = 1,
                    max_micro_batch: Optional[int] = None) -> int:
    """Optimizer steps of one epoch, as tools/train.py's loader yields them.

    Each of ``world_size`` ranks gets ceil(N / world) indices, cut into micro-batches (an
    incomplete one dropped), grouped ``accum`` at a time. When ``global_batch`` divides N this is
    N / global_batch; otherwise the trainer drops the tail (the floor, not the ceiling).
    """
    micro, accum = split_global_batch(int(global_batch), int(world_size), max_micro_batch)
    per_rank = -(-int(num_examples) // int(world_size))
    return (per_rank // micro) // accum


def epochs_for_steps(target_steps: int, epoch_steps: int) -> int:
    """Fewest whole epochs reaching ``target_steps`` optimizer steps: ceil(target / per epoch)."""
    if epoch_steps < 1:
        raise ValueError(f"an epoch of {epoch_steps} steps cannot reach {target_steps} steps")
    return max(1, math.ceil(int(target_steps) / int(epoch_steps)))
