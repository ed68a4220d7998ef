"""Generated weights for the OpenCOOD parity fixtures (``tests/fixtures/parity``).

The authors' V2VNet and F-Cooper hard-code 256-channel heads (V2VNet's ConvGRU alone holds 5.3 M
floats at that width), so their state dicts cannot be committed as tensors. Instead every floating
tensor of a fixture's state dict is *generated*: ``generated_tensor(key, shape, scale, offset)``
is a splitmix64 hash of the key and the element index, turned into a multiple of 2**-22 in
[-1, 1), times a power-of-two ``scale``, plus ``offset``. Every step is integer or exact in
float32, so this file (loaded by path by ``tools/reference/make_model_parity_fixtures.py`` in the
reference environment, and imported by ``tests/test_parity_opencood.py`` here) gives the same
bits with any numpy and torch. A fixture stores, per state-dict key, either a tensor (integer
buffers) or a recipe ``{"shape", "scale", "offset"}``; :func:`materialize` turns it back into the
state dict the authors' model ran with.

Depends on numpy and torch only (no ``opencood`` import: the reference environment has its own).
"""
from __future__ import annotations

import math
import zlib
from typing import Sequence

import numpy as np
import torch

MANTISSA_BITS = 22
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def generated_tensor(key: str, shape: Sequence[int], scale: float = 1.0,
                     offset: float = 0.0) -> torch.Tensor:
    """float32 tensor of ``shape``: ``offset + scale * u``, u a multiple of 2**-22 in [-1, 1)
    drawn from the hash of (``key``, element index). ``scale`` must be a power of two."""
    mantissa, exponent = math.frexp(scale)
    if mantissa != 0.5:
        raise ValueError(f"scale must be a power of two, got {scale}")
    count = int(np.prod(shape, dtype=np.int64))
    seed = np.uint64(zlib.crc32(key.encode()) << 20)
    with np.errstate(over="ignore"):
        bits = _splitmix64(np.arange(count, dtype=np.uint64) + seed)
    steps = (bits >> np.uint64(64 - MANTISSA_BITS - 1)).astype(np.int64)   # [0, 2**23)
    unit = (steps - (1 << MANTISSA_BITS)).astype(np.float64) / float(1 << MANTISSA_BITS)
    values = (offset + scale * unit).astype(np.float32)
    return torch.from_numpy(values.reshape(tuple(shape)))


def power_of_two_scale(fan_in: int) -> float:
    """The power of two nearest to sqrt(3 / fan_in): uniform weights of about unit gain."""
    return 2.0 ** round(math.log2(math.sqrt(3.0 / max(fan_in, 1))))


def materialize(recipes: dict) -> dict:
    """A fixture's ``state_dict`` entry (key -> tensor or recipe) -> plain state dict."""
    state = {}
    for key, entry in recipes.items():
        if isinstance(entry, torch.Tensor):
            state[key] = entry.clone()
        else:
            state[key] = generated_tensor(key, entry["shape"], entry["scale"], entry["offset"])
    return state
