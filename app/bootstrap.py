#!/usr/bin/env python3
"""Set up everything on a fresh machine, then chat or run the tests.

    python3 app/bootstrap.py chat [mlxpaged chat options]
    python3 app/bootstrap.py test [pytest options]
    python3 app/bootstrap.py check      (say what chat/test would do; change nothing)

Standard library only: it runs before anything is installed. Steps: the system
OpenBLAS on Linux (when root and apt-get are available; otherwise a hint), a
virtualenv in .venv, the package (editable, with test extras for `test`), the
embedded default model, then the command. Re-running skips what is already done.
"""

# No syntax newer than Python 3.7 (tests/app/test_bootstrap.py runs it there): the oldest python3
# a Mac ships must reach the version check and be refused in one line, not a traceback.
from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import venv
from pathlib import Path

# mlx-lm 0.32 has no build for 3.10; pyproject.toml's requires-python says the same (tested).
MIN_PYTHON = (3, 11)
ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
OPENBLAS_PKG = "libopenblas0-pthread"
OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
)


def dotted(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


def python_too_old(argv: list[str]) -> str | None:
    """One line saying what to install when this Python is below the floor, else None."""
    if sys.version_info >= MIN_PYTHON:
        return None
    again = " ".join(shlex.quote(word) for word in ["python3.12", sys.argv[0], *argv])
    return (
        f"mlxpaged needs Python {dotted(MIN_PYTHON)}+, this is {dotted(sys.version_info[:3])} (mlx-lm 0.32 "
        f"has no build for it): install one (macOS: `brew install python@3.12`, the python.org installer "
        f"or `uv python install 3.12`; Linux: your distribution's python3.12 or `uv python install 3.12`), "
        f"then: {again}"
    )


# The terminal's input flags as `chat` found them, for the app to restore when it ends (app/tui/terminal.py).
TERMINAL_IFLAG_ENV = "MLXPAGED_TERMINAL_IFLAG"
CR_TRANSLATIONS = ("ICRNL", "INLCR", "IGNCR")  # the input flags Textual's driver clears on start


def enter_stays_enter_from_now(stream=None):
    """`chat`: checking the install and the model takes a second or more before the app starts. Clear the
    terminal's CR/LF input translations now, as app/tui/terminal.py does once the app is imported, so an Enter
    typed meanwhile reaches the app as Enter rather than Ctrl+J (a new line). The flags found are handed to the
    app, which restores them at its end; the function returned restores them if this script stops first."""
    stream = sys.stdin if stream is None else stream
    try:
        import termios

        fd = stream.fileno()
        before = termios.tcgetattr(fd)
    except Exception:  # no termios here, or not a terminal (piped, captured): nothing to adjust
        return lambda: None
    attrs = list(before)
    for name in CR_TRANSLATIONS:
        attrs[0] &= ~getattr(termios, name)
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
    os.environ[TERMINAL_IFLAG_ENV] = str(before[0])
    return lambda: termios.tcsetattr(fd, termios.TCSANOW, before)


def step(message: str) -> None:
    print(f"==> {message}", flush=True)


def run(cmd: list[str], **kwargs) -> None:
    subprocess.run(cmd, check=True, **kwargs)


def openblas_action() -> str | None:
    """What OpenBLAS needs: install (apt-get can), hint (it cannot), or None (not Linux, or there)."""
    if not sys.platform.startswith("linux") or any(Path(p).exists() for p in OPENBLAS_PATHS):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "hint"
    return "install"


def ensure_openblas() -> None:
    action = openblas_action()
    if action == "hint":
        print(f"hint: MLX runs ~20x slower on the CPU without OpenBLAS: sudo apt-get install {OPENBLAS_PKG}")
    if action != "install":
        return
    step(f"installing {OPENBLAS_PKG} (fast BLAS for MLX's CPU backend)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    try:
        run(["apt-get", "update", "-qq"], env=env)
        run(["apt-get", "install", "-y", "-qq", OPENBLAS_PKG], env=env, stdout=subprocess.DEVNULL)
    except subprocess.CalledProcessError as exc:
        print(f"hint: could not install {OPENBLAS_PKG} ({exc}); continuing with MLX's slower bundled BLAS")


def venv_python() -> tuple[int, ...] | None:
    """The Python version .venv was made with (from pyvenv.cfg); None when it does not say."""
    config = VENV / "pyvenv.cfg"
    if not config.exists():
        return None
    for line in config.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() in ("version", "version_info"):
            return tuple(int(part) for part in value.strip().split(".")[:3] if part.isdigit())
    return None


def venv_action() -> str | None:
    """What .venv needs: create, recreate (made by a Python below the floor, as an earlier run on
    3.10 left it), or None (ready)."""
    if not (BIN / "python").exists():
        return "create"
    made_with = venv_python()
    return "recreate" if made_with is not None and made_with < MIN_PYTHON else None


def ensure_venv() -> None:
    action = venv_action()
    if action == "create":
        step(f"creating virtualenv {VENV}")
    elif action == "recreate":
        step(
            f"recreating virtualenv {VENV}: it has Python {dotted(venv_python())}, mlxpaged needs {dotted(MIN_PYTHON)}+"
        )
    if action is not None:
        venv.create(VENV, with_pip=True, clear=action == "recreate")


def install_stamp(extras: str) -> tuple[Path, str]:
    """Where the last install of these extras is recorded, and what it must say to be current."""
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    return VENV / f".mlxpaged-installed-{extras or 'base'}", digest


def install_current(extras: str) -> bool:
    stamp, digest = install_stamp(extras)
    return stamp.exists() and stamp.read_text() == digest


def ensure_installed(extras: str) -> None:
    """pip install -e .[extras], skipped when pyproject.toml has not changed since the last install."""
    if install_current(extras):
        return
    spec = f".[{extras}]" if extras else "."
    step(f"installing mlxpaged{'[' + extras + ']' if extras else ''} and its dependencies")
    run([str(BIN / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-e", spec], cwd=ROOT)
    stamp, digest = install_stamp(extras)
    stamp.write_text(digest)


def ensure_default_model() -> None:
    step("checking the default model (downloaded and converted once)")
    run([str(BIN / "mlxpaged"), "pull"], cwd=ROOT)


def check() -> int:
    """Say what `chat` and `test` would do here, doing none of it."""
    print(f"Python {dotted(sys.version_info[:3])}: ok (mlxpaged needs {dotted(MIN_PYTHON)}+)")
    blas = {
        None: "not needed or already installed",
        "install": f"would apt-get install {OPENBLAS_PKG}",
        "hint": f"missing, and apt-get cannot install it here: {OPENBLAS_PKG}",
    }
    print(f"OpenBLAS: {blas[openblas_action()]}")
    venv_state = {"create": "would be created", "recreate": "would be recreated (made by an older Python)"}
    print(f"virtualenv {VENV}: {venv_state.get(venv_action(), 'ready')}")
    for command, extras in (("chat", ""), ("test", "dev")):
        ready = venv_action() is None and install_current(extras)
        print(f"`{command}`: mlxpaged{'[dev]' if extras else ''} {'installed' if ready else 'would be installed'}")
    return 0


def main(argv: list[str]) -> int:
    too_old = python_too_old(argv)
    if too_old is not None:  # before anything else: no virtualenv, no apt-get
        print(too_old, file=sys.stderr)
        return 2
    if not argv or argv[0] not in ("chat", "test", "check"):
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "check":
        return check()
    restore_terminal = enter_stays_enter_from_now() if command == "chat" else (lambda: None)
    try:
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
    finally:  # reached only when a step failed or the command could not start
        restore_terminal()
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
