#!/usr/bin/env python3
"""Set up everything on a fresh machine, then chat or run the tests.

    python3 app/bootstrap.py chat [mlxpaged chat options]
    python3 app/bootstrap.py test [pytest options]

Standard library only: it runs before anything is installed. Steps: the system
OpenBLAS on Linux (when root and apt-get are available; otherwise a hint), a
virtualenv in .venv, the package (editable, with test extras for `test`), the
embedded default model, then the command. Re-running skips what is already done.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
OPENBLAS_PKG = "libopenblas0-pthread"
OPENBLAS_PATHS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
                  "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0")


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def run(cmd: list[str], **kwargs) -> None:
    subprocess.run(cmd, check=True, **kwargs)


def ensure_openblas() -> None:
    if not sys.platform.startswith("linux") or any(Path(p).exists() for p in OPENBLAS_PATHS):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        print(f"hint: MLX runs ~20x slower on the CPU without OpenBLAS: sudo apt-get install {OPENBLAS_PKG}")
        return
    step(f"installing {OPENBLAS_PKG} (fast BLAS for MLX's CPU backend)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", OPENBLAS_PKG], env=env, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as exc:
        print(f"hint: could not install {OPENBLAS_PKG} ({exc}); continuing with MLX's slower bundled BLAS")


def ensure_venv() -> None:
    if not (BIN / "python").exists():
        step(f"creating virtualenv {VENV}")
        venv.create(VENV, with_pip=True)


def ensure_installed(extras: str) -> None:
    """pip install -e .[extras], skipped when pyproject.toml has not changed since the last install."""
    spec = f".[{extras}]" if extras else "."
    stamp = VENV / f".mlxpaged-installed-{extras or 'base'}"
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    step(f"installing mlxpaged{'[' + extras + ']' if extras else ''} and its dependencies")
    run([str(BIN / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e", spec], cwd=ROOT)
    stamp.write_text(digest)


def ensure_default_model() -> None:
    step("checking the default model (downloaded and converted once)")
    run([str(BIN / "mlxpaged"), "pull"], cwd=ROOT)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("chat", "test"):
        print(__doc__)
        return 2
    if sys.version_info < (3, 10):
        print(f"mlxpaged needs Python 3.10 or newer (this is {sys.version.split()[0]})")
        return 2
    command, rest = argv[0], argv[1:]
    ensure_openblas()
    ensure_venv()
    ensure_installed("dev" if command == "test" else "")
    ensure_default_model()
    if command == "chat":
        step("starting mlxpaged chat")
        cmd = [str(BIN / "mlxpaged"), "chat", *rest]
    else:
        step("running the test suite")
        cmd = [str(BIN / "python"), "-m", "pytest", *rest]
    sys.stdout.flush()
    os.chdir(ROOT)
    os.execv(cmd[0], cmd)  # hand the terminal and signals straight to the command
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
