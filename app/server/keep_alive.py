"""Keep-alive durations as Ollama spells them (Go's time.ParseDuration: "5m", "1h30m", ".5h", "30s", "250ms",
"10us", "5ns"), a number of seconds, 0 (unload as soon as the request is done) or any negative value (never
unload). Plain Python: `flags.py` parses --keep-alive with it before any HTTP module is imported."""

from __future__ import annotations

import math
import re

NEVER = None  # a keep-alive of None: the model stays loaded until the server stops
_PART = re.compile(r"([0-9]*\.?[0-9]*)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class KeepAliveError(ValueError):
    """A keep-alive the server cannot read; the message shows the forms it takes."""


def parse_keep_alive(value: str | float | int) -> float | None:
    """Seconds to keep an idle model loaded, or None for never (any negative value, as Ollama's -1)."""
    if isinstance(value, bool):
        raise _error(value)
    if isinstance(value, (int, float)):
        return _seconds(float(value), value)
    if not isinstance(value, str):
        raise _error(value)
    text = value.strip().lower()
    try:
        return _seconds(float(text), value)  # "300", "-1", "0"
    except ValueError:
        pass
    negative = text.startswith("-")
    body = text[1:] if text[:1] in "+-" else text
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body or any(n in ("", ".") for n, _ in parts):
        raise _error(value)
    total = sum(float(number) * _UNIT_SECONDS[unit] for number, unit in parts)
    return NEVER if negative and total > 0 else total


def _seconds(seconds: float, shown: object) -> float | None:
    if math.isnan(seconds) or math.isinf(seconds):
        raise _error(shown)
    return NEVER if seconds < 0 else seconds


def _error(value: object) -> KeepAliveError:
    return KeepAliveError(
        f"keep_alive {value!r} is not a duration: use seconds (300), a duration such as '5m', '1h' or '30s', "
        "0 to unload as soon as the request is done, or -1 to keep the model loaded"
    )


def describe_keep_alive(seconds: float | None) -> str:
    if seconds is NEVER:
        return "never unloaded"
    return "unloaded when idle" if seconds == 0 else f"unloaded after {seconds:g} s idle"
