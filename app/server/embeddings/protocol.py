"""The embedding request schemas (pydantic): OpenAI's and Ollama's. Types are strict, unknown fields ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class EmbeddingRequest(_Strict):
    """OpenAI: `input` is a string, a list of strings, a token array, or a list of token arrays."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    dimensions: int | None = None
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None


class OllamaEmbedRequest(_Strict):
    """Ollama: `input` is a string or a list of strings; `truncate` defaults to true; `keep_alive` as on every
    route (serving.request_keep_alive). `options` is accepted and not used (an embedding model samples nothing)."""

    model: str
    input: str | list[str] | None = None
    truncate: bool = True
    dimensions: int | None = None
    keep_alive: Any = None
    options: dict | None = None
