"""Errors a user can cause, worded for the interface they called.

A message names the settings to change as placeholders: `{kv_memory}` (the setting) or
`{kv_memory:2.00 GB}` (the setting with a value). `render` writes them as the Python API spells
them (`kv_memory=`, `kv_memory=2.00 GB`) or as the command line does (`--kv-memory`,
`--kv-memory 2.00 GB`), so front ends print `render("cli")` instead of rewriting message strings.
`str(error)` is the Python rendering: the library's callers are Python callers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

INTERFACES = ("python", "cli")
_PLACEHOLDER = re.compile(r"\{([a-z][a-z0-9_]*)(?::([^{}]*))?\}")


def cli_flag(param: str, flags: Mapping[str, str] | None = None) -> str:
    """`max_batch_tokens` -> `--max-batch-tokens`, unless `flags` spells it otherwise (chat's --cache-tokens)."""
    return (flags or {}).get(param) or "--" + param.replace("_", "-")


def render_param(param: str, interface: str, value: str | None = None, flags: Mapping[str, str] | None = None) -> str:
    """A setting as `interface` spells it: python `kv_memory=` / `kv_memory=2GB`, cli `--kv-memory` /
    `--kv-memory 2GB`."""
    if interface == "python":
        return f"{param}=" if value is None else f"{param}={value}"
    if interface == "cli":
        flag = cli_flag(param, flags)
        return flag if value is None else f"{flag} {value}"
    raise ValueError(f"interface must be one of {INTERFACES}, got {interface!r}")


class MlxpagedError(Exception):
    """An error the user can fix; `param` is the setting to change first (its Python name), or None."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.template = message
        self.param = param

    @property
    def params(self) -> tuple[str, ...]:
        """Every setting the message names, in order."""
        return tuple(dict.fromkeys(m.group(1) for m in _PLACEHOLDER.finditer(self.template)))

    def render(self, interface: str = "python", flags: Mapping[str, str] | None = None) -> str:
        return _PLACEHOLDER.sub(lambda m: render_param(m.group(1), interface, m.group(2), flags), self.template)

    def __str__(self) -> str:
        return self.render("python")


class ConfigError(MlxpagedError, ValueError):
    """A setting with a bad value (still a ValueError, as settings errors always were)."""


def user_message(error: BaseException, interface: str, flags: Mapping[str, str] | None = None) -> str:
    """The text to show for `error` in `interface`: rendered for it when it is an MlxpagedError."""
    if isinstance(error, MlxpagedError):
        return error.render(interface, flags)
    return str(error)


# ---- the errors themselves, by where users meet them -----------------------------------------------


class ModelError(MlxpagedError):
    """Base class for errors a user can cause by naming a model (the `model` setting)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class UnknownModelError(ModelError):
    """Not a preset, a local model directory or a hub repo id."""


class ModelUnavailableError(ModelError):
    """The model exists but cannot be fetched (no network, download failed)."""


class ModelIntegrityError(ModelError):
    """A downloaded file does not match its checksum."""


class UnsupportedModelError(ModelError):
    """A model the paged engine cannot run; refused when it is loaded, never mid-request."""


class CheckpointError(MlxpagedError):
    """A model directory whose weight files cannot be read as safetensors."""


class ConversionError(MlxpagedError):
    """The GGUF file cannot be read or is not a model we can convert."""


class GenerationConfigError(MlxpagedError, ValueError):
    """A generation_config.json (or a preset's generation table) holds a value SamplingParams refuses."""


class InsufficientMemoryError(MlxpagedError):
    """The model and the cache asked for do not fit; the message says what to change, and
    `param` is the setting the user chose the size with (kv_memory, memory_fraction, cache_tokens),
    or None when no setting can make the model fit."""

    def __init__(self, message: str, *, needed_bytes: int, available_bytes: int, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes


class RequestTooLongError(MlxpagedError, ValueError):
    """prompt + max_tokens exceeds the model context or the whole KV cache."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, limit_name: str):
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{prompt_tokens + max_tokens} tokens exceeds the {limit_name} of {limit} tokens; "
            f"shorten the prompt or lower max_tokens",
            param="max_tokens",
        )
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.limit, self.limit_name = limit, limit_name


class EngineClosedError(MlxpagedError, RuntimeError):
    """The engine was closed (or is closing): no new requests, unfinished ones end with this."""


class RequestFailedError(MlxpagedError, RuntimeError):
    """A request failed inside the engine (for example its logits processor raised); the others go on."""


# ---- embeddings (mlxpaged/embedding/) --------------------------------------------------------------


class NotAnEmbeddingModelError(ModelError):
    """A model asked for embeddings that is not an embedding model (embedding/model_files.py says why)."""


class EmbeddingInputError(MlxpagedError, ValueError):
    """An embedding request the model cannot take: no input, an empty input, a token id out of the vocabulary,
    `dimensions` out of range. `param` names the field ("input" or "dimensions")."""


class InputTooLongError(EmbeddingInputError):
    """One input has more tokens than the embedding model's context (and truncation was not asked for)."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"input {index} has {tokens} tokens, more than the model's context of {limit} tokens; "
            "shorten it or ask for truncation",
            param="input",
        )
        self.index, self.tokens, self.limit = index, tokens, limit


class ImageInputError(MlxpagedError, ValueError):
    """An image a request cannot take: undecodable or truncated data, an unsupported format, too many images or
    pixels, a URL that failed or is too large, a path outside the allowed directory. `param` is "images"."""


class ImagesNotSupportedError(ImageInputError):
    """Images sent to a model that takes none (a text model), or where the vision extra is not installed: the
    message names the model, or the install command."""


class AdapterError(MlxpagedError, ValueError):
    """A LoRA / DoRA adapter that cannot be served: missing or corrupt files, a format not supported, or weights
    that do not fit the loaded model (its shapes, or its layers). Refused when the adapter is loaded."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="adapters")


class UnknownAdapterError(MlxpagedError, ValueError):
    """A request names an adapter this engine was not given."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="adapter")
