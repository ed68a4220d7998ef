"""Shared pytest fixtures, and one CPU thread per test process (see below)."""
from __future__ import annotations

import os
from pathlib import Path

# One intra-op thread for the test process and, through the environment, for every process it
# starts (tools, spawned ranks, loader workers), set before torch is imported. The tests' tensors
# are tiny: a second OpenMP thread only adds its spin-waits, and on a loaded 2-core machine those
# multiplied the suite's CPU time (tests/test_models.py: 101 s of CPU with torch's default of
# 2 threads, 16 s with 1). Tests that need another count set it themselves.
for _thread_variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_thread_variable, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO_ROOT = Path(__file__).resolve().parents[1]
# The OPV2V conformance fixture (docs/DESIGN.md §2.1): synthetic OPV2V folders plus what OpenCOOD
# computes from them, made by tools/reference/make_opv2v_fixture.py and committed with the tests.
OPV2V_FIXTURE_ROOT = REPO_ROOT / "tests" / "fixtures" / "opv2v_mini"


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    """Path of ``tests/fixtures/opv2v_mini``; a checkout without it fails the tests using it."""
    if not (OPV2V_FIXTURE_ROOT / "expected.json").is_file():
        pytest.fail(f"OPV2V fixture {OPV2V_FIXTURE_ROOT} is missing or lacks expected.json "
                    "(it is part of the repository; see tools/reference/make_opv2v_fixture.py)",
                    pytrace=False)
    return OPV2V_FIXTURE_ROOT


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests whatever OMP_NUM_THREADS says, as the parity
    fixtures were made: thread counts change convolution kernels' last bits, which the
    lift-splat cumsum pooling turns into errors of float32 eps x a running total (about 1e-5 of
    the map's maximum). Used as ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def private_point_cache(tmp_path, monkeypatch):
    """The point cache of one test (``$OPENCOOD_CACHE``) in its own tmp folder."""
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))
