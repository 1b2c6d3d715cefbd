"""`POST /v1/chat/completions`: the OpenAI chat adapter over the chat pipeline (chat/). It translates the
request into a ChatRequestSpec and the run's events into `chat.completion` bodies or `chat.completion.chunk`
events: text, `reasoning_content` (and mlx-lm's `reasoning` alias), and tool calls streamed as OpenAI's client
assembles them (index, id, type and name once, then argument pieces as they are generated)."""

from __future__ import annotations

from mlxpaged_app.server.chat.pipeline import ChatRun, ChoiceResult, serve_chat_request
from mlxpaged_app.server.chat.spec import (
    ChatEvent,
    ChatRequestSpec,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgs,
    ToolCallStart,
)
from mlxpaged_app.server.formatting import TokenText, new_id
from mlxpaged_app.server.openai.chat_options import check_combination, output_format, reasoning_spec, tool_specs
from mlxpaged_app.server.openai.prompts import chat_messages
from mlxpaged_app.server.openai.protocol import ChatRequest
from mlxpaged_app.server.openai.shapes import Envelope, OpenAIShape, chat_logprobs
from mlxpaged_app.server.param_names import OPENAI_CHAT, OPENAI_CHAT_MAX_COMPLETION
from mlxpaged_app.server.params import check_chat_supported
from mlxpaged_app.server.state import ServedModel, ServerState
from mlxpaged_app.server.tool_choice import resolve_tool_choice

from starlette.requests import Request
from starlette.responses import Response

CHUNK = "chat.completion.chunk"


def chat_spec(body: ChatRequest) -> ChatRequestSpec:
    """The internal request; every 400 names the OpenAI field at fault."""
    check_chat_supported(body)
    tools = tool_specs(body.tools)
    choice = resolve_tool_choice(body.tool_choice, tools, "openai")
    output = output_format(body.response_format)
    check_combination(body, output, choice)
    completion = body.max_completion_tokens is not None  # OpenAI's newer name, and the one blamed when it is sent
    max_tokens = body.max_completion_tokens if completion else body.max_tokens
    return ChatRequestSpec(
        chat_messages(body),
        tools,
        choice,
        parallel_tool_calls=True if body.parallel_tool_calls is None else body.parallel_tool_calls,
        output=output,
        sampling=body,  # a ChatRequest is a SamplingRequest: the sampling fields as sent
        max_tokens=max_tokens,
        logprobs=bool(body.logprobs),
        top_logprobs=0 if body.top_logprobs is None else body.top_logprobs,
        reasoning=reasoning_spec(body),
        stream=bool(body.stream),
        api="openai",
        names=OPENAI_CHAT_MAX_COMPLETION if completion else OPENAI_CHAT,
    )


async def serve_chat(request: Request, state: ServerState) -> Response:
    return await serve_chat_request(request, state, ChatRequest, chat_spec, _shape)


def _shape(model: ServedModel, body: ChatRequest, spec: ChatRequestSpec, run: ChatRun) -> ChatShapes:
    usage = bool(body.stream_options and body.stream_options.include_usage)
    return ChatShapes(Envelope(new_id("chatcmpl-"), model.model_id), model.token_text, spec.logprobs, spec.n, usage)


class ChatShapes(OpenAIShape):
    """OpenAI's chat bodies and chunks for one response."""

    chunk_object = CHUNK

    def __init__(self, envelope: Envelope, token_text: TokenText, logprobs: bool, n: int, include_usage: bool) -> None:
        super().__init__(envelope, include_usage)
        self.token_text, self.logprobs = token_text, logprobs
        self.results = [ChoiceResult() for _ in range(n)]

    def opening(self) -> list[dict]:
        """OpenAI opens each choice with a chunk that carries only the role."""
        return [self.chunk(index, {"role": "assistant", "content": ""}) for index in range(len(self.results))]

    def add(self, choice: int, events: list[ChatEvent]) -> None:
        self.results[choice].extend(events)

    def body(self, usage: dict) -> dict:
        return self.envelope.body(
            "chat.completion", [self._choice(i, c) for i, c in enumerate(self.results)], usage=usage
        )

    def _choice(self, index: int, choice: ChoiceResult) -> dict:
        message: dict = {"role": "assistant", "content": choice.text if choice.text or not choice.tool_calls else None}
        if choice.reasoning:
            message["reasoning_content"] = message["reasoning"] = choice.reasoning
        if choice.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_text}}
                for c in choice.tool_calls
            ]
        logprobs = chat_logprobs(self.token_text, choice.logprobs) if self.logprobs else None
        finish = choice.finish.reason if choice.finish else None
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}

    def chunks(self, index: int, events: list[ChatEvent]) -> list[dict]:
        """One chunk per event that shows; the delta's logprobs ride on the first (or on an empty delta)."""
        entries = [e for event in events if isinstance(event, TokenLogprobs) for e in event.entries]
        logprobs = chat_logprobs(self.token_text, entries) if self.logprobs and entries else None
        out = []
        for event in events:
            delta = _delta(event)
            if delta is not None:
                finish = event.reason if isinstance(event, Finish) else None
                out.append(self.chunk(index, delta, logprobs if not out else None, finish))
        if logprobs and not out:
            out.append(self.chunk(index, {}, logprobs))
        return out

    def chunk(self, index: int, delta: dict, logprobs: dict | None = None, finish: str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return self.envelope.body(CHUNK, [choice])


def _delta(event: ChatEvent) -> dict | None:
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text, "reasoning": event.text}
    if isinstance(event, ToolCallStart):
        return {
            "tool_calls": [
                {
                    "index": event.index,
                    "id": event.id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            ]
        }
    if isinstance(event, ToolCallArgs):
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
    if isinstance(event, Finish):
        return {}
    return None  # ToolCallEnd (the arguments are all out already), TokenLogprobs (ride on a chunk)
