"""The architecture sweep in the background of the test suite.

The sweep is ~4 minutes of CPU on 2 cores (tests/engine/test_architectures.py). Run in the foreground it adds ~2
minutes to the suite; started when collection ends (tests/conftest.py) at the lowest CPU priority, it takes the
CPU that the rest of the suite leaves idle while it waits on live servers, ranks and subprocesses (about a third
of 2 cores), and the tests beside it keep nearly all of theirs. test_architectures.py then takes the verdicts,
waiting for them if it gets there first.
"""

from __future__ import annotations

import threading

from tests.archs.configs import text_modules
from tests.archs.sweep import Stop, sweep

VARIANTS = ("cpu", "cuda", "kv8")  # the engine's CPU path, the path a GPU takes, quantized pages


class BackgroundSweep:
    def __init__(self) -> None:
        self._stop = Stop()
        self._done = threading.Event()
        self._verdicts: dict[str, dict[str, dict]] | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, name="architecture sweep", daemon=True).start()

    def _run(self) -> None:
        try:
            self._verdicts = sweep(text_modules(), variants=VARIANTS, background=True, stop=self._stop)
        except BaseException as error:  # re-raised in the test session's thread by verdicts()
            self._error = error
        finally:
            self._done.set()

    def verdicts(self) -> dict[str, dict[str, dict]]:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._verdicts is not None
        return self._verdicts

    def stop(self) -> None:
        self._stop()


_started: BackgroundSweep | None = None


def start() -> None:
    global _started
    if _started is None:
        _started = BackgroundSweep()


def verdicts() -> dict[str, dict[str, dict]]:
    """Verdicts by variant, then by module: the background sweep's, or one run now if none was started."""
    if _started is None:
        return sweep(text_modules(), variants=VARIANTS)
    return _started.verdicts()


def stop() -> None:
    """End a background sweep whose verdicts nobody will read (the session ends first)."""
    if _started is not None:
        _started.stop()
