"""The OpenAI chat and completions request schemas (pydantic), as vLLM's protocol.py holds them.

Types are checked strictly (a string is not a number, `true` is not 1, 1.5 is not an integer);
ranges are checked by `SamplingParams` (see params.py). Unknown fields are ignored, as
OpenAI-compatible servers do, so newer clients keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from mlxpaged_app.server.chat.spec import SamplingRequest

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # a string or a list of text parts: checked in prompts.py with better messages
    name: str | None = None
    tool_calls: Any = None  # assistant turns: checked in prompts.py (arguments are JSON strings)
    tool_call_id: str | None = None  # tool turns: the call this result answers
    reasoning_content: str | None = None  # an earlier reply's reasoning (mlx-lm and vLLM name it `reasoning`)
    reasoning: str | None = None


class _GenerationFields(SamplingRequest):
    """Fields both endpoints share: the sampling fields (chat/spec.py) and these. None means "not sent": the
    server's default applies."""

    model: str | None = None
    max_tokens: int | None = None
    keep_alive: str | int | float | None = None  # Ollama's, as an extension: how long the model stays loaded
    stream: bool | None = None
    stream_options: StreamOptions | None = None


class ChatRequest(_GenerationFields):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Any = None  # tools, tool_choice, response_format: checked in chat_options.py, naming the field
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    reasoning_effort: str | None = None
    reasoning: dict | None = None  # {"effort": ...}, the Responses API's spelling, accepted here too
    enable_thinking: bool | None = None  # vLLM / mlx-lm's extension, passed to the chat template
    chat_template_kwargs: dict | None = None


class CompletionRequest(_GenerationFields):
    prompt: Any  # a string, a list of strings, a list of token ids, or a list of such lists
    logprobs: int | None = None  # the legacy API: how many top alternatives per token
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None
