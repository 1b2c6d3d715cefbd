"""Exceptions as one-paragraph messages for notifications (never a traceback)."""

from __future__ import annotations

from mlxpaged.errors import MlxpagedError


def error_text(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    if isinstance(error, MlxpagedError):  # written for users, with the numbers; names the flag to change
        return error.render("cli")
    text = str(error) or type(error).__name__
    if type(error) is ValueError:  # a bad setting (SamplingParams and friends name the field)
        return text
    return f"{type(error).__name__}: {text}"
