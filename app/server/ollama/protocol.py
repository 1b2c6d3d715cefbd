"""Ollama's request schemas (pydantic), after its api/types.go: ChatRequest, GenerateRequest, ShowRequest and the
`options` map.

Types are checked strictly, as in ../openai/protocol.py (a string is not a number, `true` is not 1), with Ollama's
one leniency kept: a whole number sent as 100.0 is the integer 100 (Go decodes every JSON number as a float).
Unknown fields are ignored, so newer clients keep working; unknown `options` keys too, as Ollama ignores them
(kept in `model_extra` for a log line). `tools` and `format` are checked where they are translated (convert.py,
options.py), naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def _whole(value: object) -> object:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_whole)]
THINK_LEVELS = ("low", "medium", "high", "max")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Options(_Strict):
    """Ollama's options (api.Options and its Runner). Mapped to this server's settings: num_ctx, num_predict,
    temperature, top_k, top_p, min_p, seed, stop, repeat_penalty, presence_penalty, frequency_penalty. The rest
    are checked for their type and have no effect here: the runner's (the engine is sized once, at start) and
    samplers this server does not have (typical_p, tfs_z, mirostat*, penalize_newline; repeat_last_n: the
    penalties here see the whole reply)."""

    model_config = ConfigDict(extra="allow", strict=True)

    num_ctx: Int | None = None
    num_predict: Int | None = None
    temperature: float | None = None
    top_k: Int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: Int | None = None
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # no effect here (checked for type only)
    num_keep: Int | None = None
    typical_p: float | None = None
    repeat_last_n: Int | None = None
    tfs_z: float | None = None
    mirostat: Int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    numa: bool | None = None
    num_batch: Int | None = None
    num_gpu: Int | None = None
    main_gpu: Int | None = None
    low_vram: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    num_thread: Int | None = None
    draft_num_predict: Int | None = None


class ToolCallFunction(_Strict):
    name: str
    arguments: dict = Field(default_factory=dict)  # an object, as Ollama sends it (not OpenAI's JSON text)
    index: Int | None = None


class ToolCall(_Strict):
    function: ToolCallFunction
    id: str | None = None


class Message(_Strict):
    role: str  # lower-cased and checked in convert.py (Ollama lower-cases it)
    content: str = ""
    thinking: str | None = None
    images: list[Any] | None = None  # base64 strings: a vision-language model reads them (convert.py)
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class _Generation(_Strict):
    """What /api/chat and /api/generate share."""

    model: str
    stream: bool | None = None  # None: true, as in Ollama
    format: Any = None  # "json", "" (none) or a JSON schema object: options.output_format checks it
    options: Options | None = None
    keep_alive: float | str | None = None  # seconds, or a duration such as "5m"; serving.request_keep_alive
    think: Any = None  # true, false or a level (THINK_LEVELS): options.reasoning checks it
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    truncate: bool | None = None  # accepted: a prompt too long is refused here, never cut
    shift: bool | None = None  # accepted: a reply stops at the context's end ("length"), never shifts


class ChatRequest(_Generation):
    messages: list[Message] | None = None  # none (or empty): only load the model
    tools: Any = None


class GenerateRequest(_Generation):
    prompt: str | None = None  # none (or empty): only load the model
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[Int] | None = None
    raw: bool | None = None
    images: list[Any] | None = None


class ShowRequest(_Strict):
    model: str | None = None
    name: str | None = None  # Ollama's older spelling of `model`
    verbose: bool | None = None
