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
