"""The field's own checks, run by the README's test command (so CI runs them): ruff's lint and format check over
mlxpaged/, app/ and tests/, and mypy over mlxpaged/ (configured in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests import background_runs

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ["mlxpaged", "app", "tests"]


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def tool(name: str) -> str:
    """The tool beside this interpreter (the dev extra installs it there); never a copy found elsewhere."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        found = shutil.which(name)
        pytest.fail(f"{name} is not installed beside {sys.executable} (the dev extra installs it); PATH has {found}")
    return str(path)


def test_ruff_lint_is_clean():
    result = run(tool("ruff"), "check", *TREES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_ruff_format_is_clean():
    result = run(tool("ruff"), "format", "--check", *TREES)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


# mypy takes ~40 s of CPU on 2 cores: it runs in the background of the suite (tests/background_runs.py).
BACKGROUND_RUNS = {"mypy": background_runs.Run((str(Path(sys.executable).parent / "mypy"),), timeout_s=600)}


@pytest.mark.background_run("mypy")
def test_mypy_is_clean_on_the_library():
    tool("mypy")  # installed where the run looks for it
    result = background_runs.result("mypy", BACKGROUND_RUNS["mypy"])
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
