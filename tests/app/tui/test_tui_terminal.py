"""enter_stays_enter: Enter typed before the app takes the terminal reaches it as Enter (CR), not
Ctrl+J (LF), and the terminal's own settings come back afterwards. Driven through a real pty."""

from __future__ import annotations

import io
import os
import select
import termios
import time
import tty

from mlxpaged_app.tui.terminal import enter_stays_enter

import pytest


@pytest.fixture
def pty_pair():
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
