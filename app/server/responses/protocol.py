"""The Responses request schema (pydantic, strict types as protocol.py), and what this stateless server refuses.

Nothing is stored, whatever `store` says: a request must carry the whole conversation in `input`. Fields that
need stored state or features this server lacks get a 400 naming them; fields that change nothing here
(`store`, `metadata`, `user`, `truncation`, ...) are accepted so agents' usual bodies work unchanged.
"""

from __future__ import annotations

from typing import Any

from mlxpaged_app.server.errors import invalid_param

from pydantic import BaseModel, ConfigDict

# What `include` may ask for: reasoning is returned in the clear, so there is nothing encrypted to add
# (Codex and other stateless agents send this one with store=false).
HARMLESS_INCLUDES = ("reasoning.encrypted_content",)
STATELESS = (
    "this server is stateless (nothing is stored, whatever 'store' says): send the whole conversation in 'input'"
)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: Any = None  # a string or a list of items: checked in inputs.py, naming the item at fault
    instructions: str | None = None
    tools: Any = None  # tools, tool_choice, text, reasoning: checked in options.py
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: Any = None
    reasoning: Any = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    keep_alive: str | int | float | None = None  # Ollama's, as an extension: how long the model stays loaded
    include: list[str] | None = None
    top_logprobs: int | None = None
    previous_response_id: Any = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


def check_supported(body: ResponsesRequest) -> None:
    """400 for what needs stored state or a feature this server does not have."""
    if body.previous_response_id is not None:
        raise invalid_param(
            "previous_response_id", f"previous_response_id is not supported: {STATELESS}", "unsupported_parameter"
        )
    if body.conversation is not None:
        raise invalid_param("conversation", f"conversation is not supported: {STATELESS}", "unsupported_parameter")
    if body.prompt is not None:
        raise invalid_param(
            "prompt",
            "prompt (a stored prompt template) is not supported: this server stores "
            "nothing; send the text in 'instructions' and 'input'",
            "unsupported_parameter",
        )
    if body.background:
        raise invalid_param(
            "background",
            "background: true is not supported: this server keeps no responses to "
            "poll; leave it out and use 'stream' to see progress",
            "unsupported_parameter",
        )
    for i, item in enumerate(body.include or []):
        if item not in HARMLESS_INCLUDES:
            raise invalid_param(
                f"include[{i}]",
                f"include {item!r} is not supported; this server accepts only {', '.join(HARMLESS_INCLUDES)}",
                "unsupported_value",
            )
    if body.top_logprobs:
        raise invalid_param(
            "top_logprobs",
            "top_logprobs is not supported by this server's Responses API (use /v1/chat/completions with logprobs)",
            "unsupported_parameter",
        )
    if body.temperature is not None and not 0 <= body.temperature <= 2:
        raise invalid_param(
            "temperature",
            f"temperature must be between 0 and 2 (OpenAI's range), got {body.temperature}",
            "decimal_above_max_value",
        )
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise invalid_param(
            "max_output_tokens",
            f"max_output_tokens must be at least 1, got {body.max_output_tokens}",
            "integer_below_min_value",
        )
