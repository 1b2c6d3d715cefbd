"""Exceptions as one-paragraph messages for notifications (never a traceback)."""

from __future__ import annotations

from mlxpaged.errors import MlxpagedError

CHAT_FLAGS = {"max_tokens": "--cache-tokens"}  # `mlxpaged chat` sizes the cache with --cache-tokens

# Errors whose message is written for users (they carry the numbers): shown as they are.
_USER_FACING = ("ModelError", "RequestTooLongError", "RequestFailedError", "EngineClosedError",
                "InsufficientMemoryError", "UnsupportedModelError", "NoFreeBlocksError")


def error_text(error: BaseException | None) -> str:
    if error is None:
        return "unknown error"
    if isinstance(error, MlxpagedError):  # names the flag to change, as `mlxpaged chat` spells it
        return error.render("cli", CHAT_FLAGS)
    names = {cls.__name__ for cls in type(error).__mro__}
    text = str(error) or type(error).__name__
    if names & set(_USER_FACING) or type(error) is ValueError:
        return text
    return f"{type(error).__name__}: {text}"
