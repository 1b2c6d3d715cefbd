"""User-facing errors name the setting as the interface the user called spells it (mlxpaged.errors)."""

from __future__ import annotations

import mlxpaged
from mlxpaged.config import CacheConfig
from mlxpaged.errors import ConfigError, MlxpagedError, render_param, user_message
from mlxpaged.loading.model_store import UnknownModelError
from mlxpaged.platform.memory import InsufficientMemoryError
from mlxpaged_app.tui.errors import error_text

import pytest


@pytest.mark.parametrize(
    "param, value, python, cli",
    [
        ("kv_memory", None, "kv_memory=", "--kv-memory"),
        ("max_batch_tokens", "8", "max_batch_tokens=8", "--max-batch-tokens 8"),
        ("memory_fraction", "0.5", "memory_fraction=0.5", "--memory-fraction 0.5"),
    ],
)
def test_render_param(param, value, python, cli):
    assert render_param(param, "python", value) == python
    assert render_param(param, "cli", value) == cli


def test_messages_render_every_setting_they_name():
    error = MlxpagedError("{kv_memory:2GB} is too much; lower {max_batch_tokens} or {max_tokens}", param="kv_memory")
    assert str(error) == "kv_memory=2GB is too much; lower max_batch_tokens= or max_tokens="
    assert error.render("cli") == "--kv-memory 2GB is too much; lower --max-batch-tokens or --max-tokens"
    chat = error.render("cli", {"max_tokens": "--cache-tokens"})
    assert chat == "--kv-memory 2GB is too much; lower --max-batch-tokens or --cache-tokens"
    assert error.params == ("kv_memory", "max_batch_tokens", "max_tokens")
    with pytest.raises(ValueError, match="interface must be one of"):
        error.render("http")


def test_user_message_leaves_other_errors_alone():
    assert user_message(RuntimeError("{kv_memory} as written"), "cli") == "{kv_memory} as written"
    assert (
        user_message(ConfigError("{cache_tokens:0} is bad", param="cache_tokens"), "cli") == "--cache-tokens 0 is bad"
    )


def test_error_classes_keep_their_homes_and_bases():
    assert mlxpaged.InsufficientMemoryError is InsufficientMemoryError
    assert issubclass(InsufficientMemoryError, MlxpagedError)
    assert issubclass(ConfigError, ValueError)  # settings errors were ValueErrors and still are
    assert UnknownModelError("no such model").param == "model"


def test_cache_config_errors_name_the_setting():
    with pytest.raises(ConfigError) as info:
        CacheConfig(kv_memory="2 parsecs")
    assert info.value.param == "kv_memory"
    assert str(info.value).startswith("kv_memory='2 parsecs' is not a size: use bytes or a unit, e.g. '2GB'")
    assert info.value.render("cli").startswith("--kv-memory '2 parsecs' is not a size")


def test_chat_app_shows_its_own_flags():
    error = InsufficientMemoryError("use {cache_tokens:752} or less", needed_bytes=2, available_bytes=1)
    assert error_text(error) == "use --cache-tokens 752 or less"
    assert error_text(UnknownModelError("unknown model 'x'")) == "unknown model 'x'"
