"""The Messages API request schemas (pydantic), after anthropic-sdk-python 2.x's `message_create_params`.

Types are checked strictly, as in ../protocol.py; unknown fields are ignored (Claude Code sends `metadata`,
`context_management`, `cache_control` on blocks, beta fields), so newer clients keep working. Content blocks
this server cannot use (document, server tool results) validate here as `OtherBlock` and are refused
by convert.py with a message naming their type. temperature / top_p / top_k are not in SDK 2.x's params but
older SDKs and Claude Code send them: accepted, in Anthropic's ranges.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str | None = None


class OtherBlock(_Strict):
    """A block type this server does not take (document, ...): refused in convert.py."""

    type: str


class Base64ImageSource(_Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlImageSource(_Strict):
    type: Literal["url"]
    url: str


class ImageBlock(_Strict):
    type: Literal["image"]
    source: Annotated[Base64ImageSource | UrlImageSource, Field(discriminator="type")]


KNOWN_BLOCKS = {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}


def _tag(value: object, known: set[str]) -> str | None:
    """The union member for a block: its own type if known, "other" for any other type, None if untyped."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in known else ("other" if isinstance(kind, str) else None)


def _block_tag(value: object) -> str | None:
    return _tag(value, KNOWN_BLOCKS)


def _result_part_tag(value: object) -> str | None:
    return _tag(value, {"text", "image"})


ResultPart = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")] | Annotated[OtherBlock, Tag("other")],
    Discriminator(
        _result_part_tag,
        custom_error_type="invalid_block",
        custom_error_message="a content block must be an object with a 'type'",
    ),
]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: list[ResultPart] | str | None = None
    is_error: bool | None = None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(
        _block_tag,
        custom_error_type="invalid_block",
        custom_error_message="a content block must be an object with a 'type' ('text', 'tool_use', 'tool_result', ...)",
    ),
]


class Message(_Strict):
    role: Literal["user", "assistant", "system"]
    content: list[ContentBlock] | str  # list first: its errors say more than "not a string"


class Tool(_Strict):
    name: str
    input_schema: dict | None = None  # required for custom tools: checked in convert.py (server tools have none)
    description: str | None = None
    type: str | None = None  # None or "custom"; "web_search_...", "bash_..." are Anthropic's server tools


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool" only
    disable_parallel_tool_use: bool | None = None


class Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None  # accepted; the model's template decides how long it thinks


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(_Strict):
    """`/v1/messages/count_tokens`: what shapes the prompt (max_tokens and stream are not needed)."""

    model: str
    messages: list[Message]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    keep_alive: str | int | float | None = None  # Ollama's, as an extension: how long the model stays loaded


class MessagesRequest(CountTokensRequest):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict | None = None  # ignored (user_id for abuse tracking: nothing to track locally)
