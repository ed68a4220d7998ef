"""Reading the committed reference fixtures (arrays made by the authors' code, plus a json
``meta`` entry describing how they were made)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load_npz_fixture(path: Path) -> tuple[dict, dict]:
    """(arrays by name, the json ``meta``) of a fixture ``.npz``."""
    data = np.load(path)
    return {key: data[key] for key in data.files}, json.loads(str(data["meta"]))
