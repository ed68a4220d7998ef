"""Reading the committed reference fixtures (arrays made by the authors' code, plus a json
``meta`` entry describing how they were made; the parity ``.pt`` files of tests/fixtures/parity)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch


def load_npz_fixture(path: Path) -> tuple[dict, dict]:
    """(arrays by name, the json ``meta``) of a fixture ``.npz``."""
    data = np.load(path)
    return {key: data[key] for key in data.files}, json.loads(str(data["meta"]))


def load_parity_fixture(path: Path, maker: str) -> dict:
    """A committed parity fixture (``torch.load``, tensors only); a checkout without it fails
    the test in one line naming the file and ``maker``, the tools/reference script that made it."""
    if not path.is_file():
        pytest.fail(f"parity fixture {path} is missing (part of the repository; see "
                    f"tools/reference/{maker})", pytrace=False)
    return torch.load(path, weights_only=True)
