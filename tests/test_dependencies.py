"""pyproject.toml declares exactly what the code imports, checked by deptry ([tool.deptry] configures it)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_deptry(*flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "deptry", ".", "--no-ansi", *flags]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def files_scanned(result: subprocess.CompletedProcess) -> int:
    return int(re.search(r"Scanning (\d+) files", result.stdout + result.stderr).group(1))


def test_code_imports_exactly_the_dependencies():
    """mlxpaged/ and app/: nothing missing or only transitive, nothing unused, no dev-only package."""
    result = run_deptry()
    assert result.returncode == 0, result.stdout + result.stderr


def test_tests_import_only_declared_packages():
    """tests/ too, with the dev extra counted as ordinary dependencies (no group named "" is dev),
    so a test's import must be declared and every dev package must be used by something."""
    result = run_deptry("--exclude", r"venv|\.venv|\.direnv|\.git", "--optional-dependencies-dev-groups", "")
    tests = len(list((ROOT / "tests").rglob("*.py")))
    assert files_scanned(result) >= files_scanned(run_deptry()) + tests, "tests/ was not scanned"
    assert result.returncode == 0, result.stdout + result.stderr
