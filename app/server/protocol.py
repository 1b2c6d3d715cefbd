"""The OpenAI chat and completions request schemas (pydantic), as vLLM's protocol.py holds them.

Types are checked strictly (a string is not a number, `true` is not 1, 1.5 is not an integer);
ranges are checked by `SamplingParams` (see params.py). Unknown fields are ignored, as
OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = None  # a string or a list of text parts: checked in prompts.py with better messages
    name: str | None = None


class _GenerationFields(_Strict):
    """Fields both endpoints share. None means "not sent": the server's default applies."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: Any = None  # a string or a list of strings: SamplingParams says which when it is neither
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None  # vLLM's extension; handy for benchmarks


class ChatRequest(_GenerationFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    response_format: dict | None = None


class CompletionRequest(_GenerationFields):
    prompt: Any  # a string, a list of strings, a list of token ids, or a list of such lists
    logprobs: int | None = None  # the legacy API: how many top alternatives per token
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
