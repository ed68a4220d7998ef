"""Shared pytest fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The OPV2V mini fixture lives beside the repository (DESIGN §2), not inside it.
OPV2V_FIXTURE_ROOT = REPO_ROOT.parent / "shared" / "fixtures" / "opv2v_mini"


@pytest.fixture(scope="session")
def fixture_root() -> Path:
    """Path of ``opv2v_mini``; skips when absent, except under CI (``CI=true``) where it fails."""
    if OPV2V_FIXTURE_ROOT.is_dir():
        return OPV2V_FIXTURE_ROOT
    if os.environ.get("CI", "").strip().lower() == "true":
        pytest.fail(f"OPV2V fixture folder {OPV2V_FIXTURE_ROOT} is missing; CI=true requires it "
                    "(it is expected beside the repository at ../shared/fixtures/opv2v_mini)",
                    pytrace=False)
    pytest.skip(f"OPV2V fixture folder {OPV2V_FIXTURE_ROOT} not found (it lives beside the "
                "repository, not in it)")
