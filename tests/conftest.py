"""Shared pytest fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

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


@pytest.fixture
def private_point_cache(tmp_path, monkeypatch):
    """The point cache of one test (``$OPENCOOD_CACHE``) in its own tmp folder."""
    monkeypatch.setenv("OPENCOOD_CACHE", str(tmp_path / "cache"))
