"""One internal chat request, whatever API it came through, and the events a run produces.

Messages are the dicts Hugging Face chat templates take: `role`, `content` (a string), assistant `tool_calls`
as `[{"id", "type": "function", "function": {"name", "arguments": dict}}]`, tool results with `tool_call_id`
(and `name`), and optional `reasoning_content`. Adapters build these; nothing after them knows the API."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxpaged_app.server.param_names import OPENAI_CHAT, ParamNames

from pydantic import BaseModel, ConfigDict

API = Literal["openai", "anthropic", "responses", "ollama"]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict  # a JSON schema for the arguments object
    description: str | None = None

    def as_template_tool(self) -> dict:
        """The OpenAI function shape every tool-aware chat template reads."""
        function = {
            "name": self.name,
            **({"description": self.description} if self.description else {}),
            "parameters": self.parameters,
        }
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class NamedTool:
    name: str


ToolChoice = Literal["none", "auto", "required"] | NamedTool


@dataclass(frozen=True)
class JsonObjectOutput:
    """Any JSON object (OpenAI's response_format json_object)."""


@dataclass(frozen=True)
class JsonSchemaOutput:
    schema: dict
    strict: bool = False
    name: str | None = None


OutputFormat = JsonObjectOutput | JsonSchemaOutput | None


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's reasoning efforts


@dataclass(frozen=True)
class ReasoningSpec:
    """What reaches the chat template about thinking. `template_kwargs` (chat_template_kwargs) wins."""

    enable_thinking: bool | None = None
    effort: str | None = None
    template_kwargs: dict = field(default_factory=dict)

    def kwargs(self) -> dict:
        out: dict = {}
        if self.effort is not None:
            out["reasoning_effort"] = self.effort
        thinking = self.enable_thinking
        if thinking is None and self.effort == "none":
            thinking = False  # OpenAI's effort "none" means no reasoning at all
        if thinking is not None:
            out["enable_thinking"] = thinking
        return {**out, **self.template_kwargs}


class SamplingRequest(BaseModel):
    """The sampling fields the client sent (None: not sent, the server's default applies). Attribute names
    are those params.sampling_params reads, so this is what it takes for every API. OpenAI's request schemas
    extend it (openai/protocol.py): its fields are theirs, typed as strictly, so the list is written once."""

    model_config = ConfigDict(extra="ignore", strict=True)

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
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool | None = None  # vLLM's extension; handy for benchmarks


@dataclass(frozen=True)
class ChatRequestSpec:
    messages: list[dict]
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    output: OutputFormat = None
    sampling: SamplingRequest = field(default_factory=SamplingRequest)
    max_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    reasoning: ReasoningSpec = field(default_factory=ReasoningSpec)
    stream: bool = False
    api: API = "openai"
    names: ParamNames = OPENAI_CHAT  # the API's parameter names, for errors raised after translation
    # The prompt, when it is not only the messages through the chat template (Ollama's /api/generate):
    raw_prompt: str | None = None  # text sent as it is, no template (`raw`); the messages are then unused
    prompt_prefix: tuple[int, ...] = ()  # token ids before the prompt (a previous reply's `context`)
    # The reply's room, when the request bounds it below the server's context (Ollama's options):
    context_limit: int | None = None  # prompt + reply at most this many tokens (`num_ctx`)
    reply_to_context_end: bool = False  # max_tokens None means "until the context ends" (`num_predict` -1)

    @property
    def n(self) -> int:
        return 1 if self.sampling.n is None else self.sampling.n

    @property
    def parses_tools(self) -> bool:
        """Whether the output is read for tool calls (tools are rendered either way: prefix-stable)."""
        return bool(self.tools) and self.tool_choice != "none"


def canonical_json(value: object) -> str:
    """JSON laid out as the grammar generates it (json.dumps' default separators), so history tool-call
    arguments re-render as the same bytes the model produced and the next turn's prompt extends the last."""
    return json.dumps(value, ensure_ascii=False)


# --- events: what a run reports per choice, in order ----------------------------------------------------


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # position among this choice's calls
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str  # the next piece of the arguments' JSON text, as generated


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: dict  # the complete arguments, parsed


@dataclass(frozen=True)
class TokenLogprobs:
    entries: list  # formatting.TokenLogprob, one per sampled token of the delta


@dataclass(frozen=True)
class Finish:
    reason: str  # "stop", "length", "tool_calls", "abort"
    stop_sequence: str | None = None


ChatEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgs | ToolCallEnd | TokenLogprobs | Finish
