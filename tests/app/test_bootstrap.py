"""app/bootstrap.py's Python floor: below it, one line and exit 2 before touching anything; at it, on.

Each run uses a copy of bootstrap.py in a temporary repository, so nothing can reach the real .venv.
Interpreters come from pyenv (or PATH); a version the machine lacks is skipped with that reason.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from mlxpaged_app import bootstrap

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOOR = bootstrap.MIN_PYTHON
BELOW_FLOOR = (FLOOR[0], FLOOR[1] - 1)
OLDEST_PARSED = (3, 7)  # bootstrap.py must parse here: the oldest python3 macOS shipped (10.15; now 3.9)


def find_python(version: tuple[int, int]) -> str:
    """A python{major}.{minor} interpreter from pyenv or PATH, or skip the test saying which is missing."""
    name = "python{}.{}".format(*version)
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = sorted(pyenv_root.glob(f"versions/{version[0]}.{version[1]}.*/bin/{name}"), reverse=True)
    if candidates:
        return str(candidates[0])
    if shutil.which(name):
        return shutil.which(name)
    pytest.skip(f"no {name} on this machine (looked in {pyenv_root}/versions and PATH)")


def repo_copy(tmp_path: Path) -> Path:
    """A repository with only bootstrap.py and pyproject.toml: bootstrap's ROOT, so .venv lands here."""
    (tmp_path / "app").mkdir()
    shutil.copy(ROOT / "app" / "bootstrap.py", tmp_path / "app" / "bootstrap.py")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def run_bootstrap(python: str, repo: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [python, str(repo / "app" / "bootstrap.py"), *args]
    return subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "version", sorted({BELOW_FLOOR, (3, 9), OLDEST_PARSED}, reverse=True), ids=lambda version: "{}.{}".format(*version)
)
@pytest.mark.parametrize("command", ["test", "chat", "check"])
def test_below_the_floor_refuses_in_one_line_and_touches_nothing(tmp_path, version, command):
    repo = repo_copy(tmp_path)
    result = run_bootstrap(find_python(version), repo, command, "-m", "not slow")
    lines = (result.stdout + result.stderr).splitlines()
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(lines) == 1, lines
    assert f"needs Python {FLOOR[0]}.{FLOOR[1]}+, this is {version[0]}.{version[1]}." in lines[0]
    assert "brew install python@3.12" in lines[0] and f"app/bootstrap.py {command} -m 'not slow'" in lines[0]
    assert sorted(path.name for path in repo.iterdir()) == ["app", "pyproject.toml"]  # no .venv


@pytest.mark.parametrize("version", [FLOOR, (3, 12), (3, 13)], ids=lambda version: "{}.{}".format(*version))
def test_the_floor_and_above_pass_the_check_and_change_nothing(tmp_path, version):
    repo = repo_copy(tmp_path)
    result = run_bootstrap(find_python(version), repo, "check")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith(f"Python {version[0]}.{version[1]}.")
    assert f"virtualenv {repo / '.venv'}: would be created" in result.stdout
    assert sorted(path.name for path in repo.iterdir()) == ["app", "pyproject.toml"]


def test_a_virtualenv_made_below_the_floor_is_recreated(tmp_path, monkeypatch):
    """An earlier run on 3.10 left a .venv that pip cannot fill; the next run replaces it."""
    venv_dir = tmp_path / ".venv"
    (venv_dir / "bin").mkdir(parents=True)
    (venv_dir / "bin" / "python").touch()
    monkeypatch.setattr(bootstrap, "VENV", venv_dir)
    monkeypatch.setattr(bootstrap, "BIN", venv_dir / "bin")
    for made_with, action in (("3.10.13", "recreate"), ("{}.{}.0".format(*FLOOR), None), ("3.13.0", None)):
        (venv_dir / "pyvenv.cfg").write_text(f"home = /usr/bin\nversion = {made_with}\n")
        assert bootstrap.venv_action() == action, made_with
    (venv_dir / "pyvenv.cfg").write_text("home = /usr/bin\n")  # says no version: keep what works
    assert bootstrap.venv_action() is None
    (venv_dir / "bin" / "python").unlink()
    assert bootstrap.venv_action() == "create"


def test_the_floor_is_the_same_in_bootstrap_pyproject_and_readme():
    floor = "{}.{}".format(*FLOOR)
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == f">={floor}"
    readme = (ROOT / "README.md").read_text()
    assert f"Python {floor}+" in readme
    assert not re.search(r"Python 3\.\d+\+", readme.replace(f"Python {floor}+", "")), "another floor in README"
    assert sys.version_info >= FLOOR  # the suite itself runs at or above the floor
