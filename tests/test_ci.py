"""CI runs what the README tells a newcomer to run (issue: CI must prove the newcomer path)."""
from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def quick_start_commands() -> list:
    """The lines of the first ```bash block under the README's "Quick start" heading."""
    readme = (REPO_ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def ci_test_command() -> str:
    script = (REPO_ROOT / ".ci" / "run").read_text()
    return re.search(r"^TEST_COMMAND='(.*)'$", script, re.M).group(1)


def test_quick_start_is_two_commands_and_ci_runs_the_second():
    commands = quick_start_commands()
    assert commands == ["bash tools/quickstart.sh", ci_test_command()]


def test_ci_makes_a_fresh_venv_and_fails_on_no_tests():
    script = (REPO_ROOT / ".ci" / "run").read_text()
    assert "python3 -m venv .venv-ci" in script and ". .venv-ci/bin/activate" in script
    assert re.search(r'"\$status" -eq 5 \]; then\n.*\n\s+exit 1', script)


def test_test_requirements_pin_pytest_and_include_the_runtime():
    lines = (REPO_ROOT / "requirements-test.txt").read_text().splitlines()
    assert "-r requirements.txt" in lines
    assert any(re.fullmatch(r"pytest==[0-9.]+", line) for line in lines)


def test_every_runtime_requirement_is_bounded():
    """An unbounded requirement is how a new release breaks a fresh install overnight."""
    for line in (REPO_ROOT / "requirements.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            assert "==" in line or "<" in line, line
