"""enter_stays_enter (and app/bootstrap.py's part, before the app's process starts): Enter typed before the app
takes the terminal reaches it as Enter (CR), not Ctrl+J (LF), and the terminal's own settings come back
afterwards. Driven through a real pty."""

from __future__ import annotations

import io
import os
import select
import termios
import time
import tty

from mlxpaged_app import bootstrap
from mlxpaged_app.bootstrap import TERMINAL_IFLAG_ENV
from mlxpaged_app.tui.terminal import enter_stays_enter

import pytest


@pytest.fixture
def pty_pair(monkeypatch):
    monkeypatch.delenv(TERMINAL_IFLAG_ENV, raising=False)  # whatever a test sets is undone
    main_fd, terminal_fd = os.openpty()
    yield main_fd, terminal_fd
    os.close(main_fd)
    os.close(terminal_fd)


def typed_then_read_as_the_app_does(main_fd: int, terminal_fd: int, keys: bytes) -> bytes:
    """Type `keys` while the terminal is in line mode, then switch it as Textual does and read."""
    os.write(main_fd, keys)
    _wait_for_echo(main_fd, len(keys))  # the line discipline works asynchronously: let it take the keys first
    tty.setraw(terminal_fd, termios.TCSANOW)  # raw mode keeps what line mode had buffered
    return os.read(terminal_fd, 1024)


def _wait_for_echo(main_fd: int, count: int, timeout: float = 5.0) -> None:
    """Read the terminal's echo of `count` typed keys (a pty echoes a key once it has processed it):
    switching modes before that raced the kernel under load (CR read back untranslated)."""
    echoed, deadline = b"", time.monotonic() + timeout
    while len(echoed) < count and time.monotonic() < deadline:
        if select.select([main_fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            echoed += os.read(main_fd, 1024)


def test_line_mode_turns_enter_into_ctrl_j(pty_pair):
    """The failure being fixed: without the adjustment Enter arrives as LF."""
    main_fd, terminal_fd = pty_pair
    assert typed_then_read_as_the_app_does(main_fd, terminal_fd, b"hi?\r") == b"hi?\n"


def test_enter_typed_at_launch_stays_enter(pty_pair):
    main_fd, terminal_fd = pty_pair
    with open(terminal_fd, closefd=False) as stream, enter_stays_enter(stream):
        assert typed_then_read_as_the_app_does(main_fd, terminal_fd, b"hi?\r") == b"hi?\r"


def test_the_terminal_settings_come_back(pty_pair):
    _, terminal_fd = pty_pair
    before = termios.tcgetattr(terminal_fd)
    with open(terminal_fd, closefd=False) as stream, enter_stays_enter(stream):
        assert not termios.tcgetattr(terminal_fd)[0] & termios.ICRNL
        assert termios.tcgetattr(terminal_fd)[3] & termios.ICANON  # still line mode: typing stays editable
    assert termios.tcgetattr(terminal_fd) == before


def test_not_a_terminal_is_left_alone():
    with enter_stays_enter(io.StringIO("piped")):  # no fileno: nothing to adjust, no error
        pass


def test_bootstrap_keeps_enter_from_its_own_start(pty_pair):
    """`python3 app/bootstrap.py chat` checks the install and the model for a second or more before the app
    starts: an Enter typed then stays Enter too."""
    main_fd, terminal_fd = pty_pair
    with open(terminal_fd, closefd=False) as stream:
        bootstrap.enter_stays_enter_from_now(stream)
        assert typed_then_read_as_the_app_does(main_fd, terminal_fd, b"hi?\r") == b"hi?\r"


def test_the_app_restores_the_flags_bootstrap_found(pty_pair):
    """bootstrap.py execs the app, which finds the translations already cleared: it restores the input flags
    bootstrap found (handed over in the environment, not passed on to the app's own children)."""
    _, terminal_fd = pty_pair
    before = termios.tcgetattr(terminal_fd)
    assert before[0] & termios.ICRNL  # a pty starts with it, as a terminal does
    with open(terminal_fd, closefd=False) as stream:
        bootstrap.enter_stays_enter_from_now(stream)
        assert os.environ[TERMINAL_IFLAG_ENV] == str(before[0])
        with enter_stays_enter(stream):
            assert not termios.tcgetattr(terminal_fd)[0] & termios.ICRNL
            assert TERMINAL_IFLAG_ENV not in os.environ
    assert termios.tcgetattr(terminal_fd) == before


def test_bootstrap_restores_the_terminal_when_it_stops_before_the_app(pty_pair):
    _, terminal_fd = pty_pair
    before = termios.tcgetattr(terminal_fd)
    with open(terminal_fd, closefd=False) as stream:
        restore = bootstrap.enter_stays_enter_from_now(stream)
    restore()
    assert termios.tcgetattr(terminal_fd) == before


def test_bootstrap_leaves_a_pipe_alone(monkeypatch):
    monkeypatch.delenv(TERMINAL_IFLAG_ENV, raising=False)
    bootstrap.enter_stays_enter_from_now(io.StringIO("piped"))()
    assert TERMINAL_IFLAG_ENV not in os.environ
