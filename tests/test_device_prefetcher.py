"""DevicePrefetcher (issue 28, point 4): the next batch's host-to-device copy overlaps the step.

On CPU it is a pass-through; on CUDA batch i+1 is drawn and its copies queued on a side stream
before batch i is handed over, and what the consumer gets is on the device, in loader order.
"""
import pytest
import torch

from opencood.data.collate import DevicePrefetcher


class CountingLoader:
    """A loader of ``count`` small batches that records which batches have been drawn."""

    def __init__(self, count: int, pin: bool = False):
        self.count, self.pin, self.drawn = count, pin, []

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        for index in range(self.count):
            self.drawn.append(index)
            points = torch.full((2000, 4), float(index))
            yield {"points": points.pin_memory() if self.pin else points,
                   "early_fusion": {"record_len": torch.tensor([index, index + 1])},
                   "sample_keys": [("scenario", f"{index:06d}")]}


def test_on_the_cpu_the_loaders_batches_pass_through_in_order():
    loader = CountingLoader(4)
    prefetcher = DevicePrefetcher(loader, torch.device("cpu"))
    assert len(prefetcher) == 4
    for epoch in range(2):                        # every iteration is a fresh pass
        keys = []
        for position, batch in enumerate(prefetcher):
            # Nothing is drawn ahead: batch i is the last one the loader gave.
            assert loader.drawn[-1] == position
            keys.append(batch["sample_keys"][0][1])
            assert batch["points"].device.type == "cpu"
        assert keys == ["000000", "000001", "000002", "000003"]
    assert loader.drawn == [0, 1, 2, 3] * 2


def test_on_the_cpu_the_prefetcher_hands_over_the_loaders_own_batch_objects():
    batches = [{"points": torch.zeros(3, 4)}, {"points": torch.ones(2, 4)}]
    assert [id(b) for b in DevicePrefetcher(batches, "cpu")] == [id(b) for b in batches]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_next_copy_is_queued_before_a_batch_is_handed_over():
    device = torch.device("cuda", torch.cuda.current_device())
    loader = CountingLoader(5, pin=True)
    sums, keys = [], []
    for position, batch in enumerate(DevicePrefetcher(loader, device)):
        # Batch i+1 is drawn (its copy queued on the side stream) before batch i is handed over.
        assert loader.drawn == list(range(min(position + 2, 5)))
        assert batch["points"].device == device
        assert batch["early_fusion"]["record_len"].device == device
        keys.append(batch["sample_keys"][0][1])
        # Read on the consumer's stream at once: it waited for the copy.
        sums.append(float(batch["points"].sum()))
        torch.cuda._sleep(1_000_000)              # a long "step" the next copy overlaps
    assert keys == [f"{i:06d}" for i in range(5)]
    assert sums == [8000.0 * i for i in range(5)]


# -- tests that fail when the stream ordering is broken (issue 40, point 4) ----------------------
# Written without a GPU: tools/gpu_checks.sh runs them, and runs them again on copies of the
# prefetcher without ``wait_stream`` and without ``record_stream``, where they must fail.

SLEEP_CYCLES = 500_000_000          # torch.cuda._sleep: about 0.2-0.5 s of GPU clock cycles


class DistinctBatches:
    """``count`` pinned batches, batch i's points all ``i + 1`` (never 0: fresh memory often
    holds zeros, and a wrong batch must not pass for a right one), all of one size (so the
    caching allocator hands a freed batch's block to the next one)."""

    def __init__(self, count: int):
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        for index in range(self.count):
            yield {"points": torch.full((250_000, 4), float(index + 1)).pin_memory()}


def expected_sum(index: int) -> float:
    return 250_000 * 4 * float(index + 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_batch_is_read_only_after_its_slow_copy(monkeypatch):
    """The copy stream is made slow (a sleep queued on it before each copy), and the consumer
    reads each batch at once: without ``consumer.wait_stream(copy_stream)`` the read runs
    while the copy still sleeps and sees the memory's old contents."""
    from opencood.data import collate
    copy_to_device = collate._to_device

    def slow_copy(value, device):            # runs inside ``with torch.cuda.stream(copy)``
        assert torch.cuda.current_stream(device) != torch.cuda.default_stream(device)
        torch.cuda._sleep(SLEEP_CYCLES)
        return copy_to_device(value, device)

    monkeypatch.setattr(collate, "_to_device", slow_copy)
    device = torch.device("cuda", torch.cuda.current_device())
    sums = [float(batch["points"].sum())      # on the consumer's stream, synced by float()
            for batch in DevicePrefetcher(DistinctBatches(4), device)]
    assert sums == [expected_sum(index) for index in range(4)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_batch_memory_is_not_reused_while_the_step_still_reads_it():
    """The consumer queues a slow step (a sleep, then a read of the batch) and drops the batch
    before that step ran. The batch's block was allocated on the copy stream: without
    ``record_stream`` the allocator frees it at once for that stream, and the copy of batch
    i + 2 (queued when batch i + 1 is handed over) overwrites it before the read."""
    device = torch.device("cuda", torch.cuda.current_device())
    consumer = torch.cuda.current_stream(device)
    results = []
    for batch in DevicePrefetcher(DistinctBatches(6), device):
        torch.cuda._sleep(SLEEP_CYCLES)               # the step's kernels, still queued...
        results.append(batch["points"].sum())        # ...when its read is queued behind them
        del batch                                     # no host reference is left
    consumer.synchronize()
    assert [float(total) for total in results] == [expected_sum(index) for index in range(6)]
