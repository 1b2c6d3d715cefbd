"""A chat request's run, for every API: queue slots, the prompt and grammar (off the event loop), submission,
then events per choice. An adapter translates its request and shapes what comes out (a serving.ReplyShape)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

from mlxpaged.sampling_params import SamplingParams
from mlxpaged.vision.prompt import ImagePrompt
from mlxpaged_app.server.chat.output import OutputParser
from mlxpaged_app.server.chat.render import reasoning_open
from mlxpaged_app.server.chat.render_images import render_chat
from mlxpaged_app.server.chat.spec import (
    ChatEvent,
    ChatRequestSpec,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from mlxpaged_app.server.chat.structure import compile_constraint, grammar_for, grammar_notes
from mlxpaged_app.server.chat.tool_formats import ToolFormat, tool_format
from mlxpaged_app.server.engine_client import Generation
from mlxpaged_app.server.images import ImagePolicy
from mlxpaged_app.server.params import sampling_params
from mlxpaged_app.server.reply_budget import reply_budget
from mlxpaged_app.server.server_log import log
from mlxpaged_app.server.serving import ReplyShape, accept, launch, model_for, reply_id, respond, sane_n
from mlxpaged_app.server.state import ServedModel, ServerState

import anyio

CALL_ID_PREFIX = {"openai": "call_", "responses": "call_", "anthropic": "toolu_", "ollama": "call_"}


@dataclass
class Prepared:
    """What the worker thread works out before submission."""

    prompt: list[int]
    constraint: object | None  # mlxpaged.constraints.Constraint
    reasoning_open: bool
    format: ToolFormat
    submitted: list[int] | ImagePrompt  # what the engine is given: the prompt, or it with its images


def prepare(engine, spec: ChatRequestSpec, images: ImagePolicy) -> Prepared:
    """Runs in a worker thread: template rendering (image URLs fetched, images processed) and a grammar's first
    compile take real time."""
    tokenizer = engine.tokenizer
    fmt = tool_format(tokenizer)
    submitted = render_chat(engine, spec, images)
    prompt = submitted.token_ids if isinstance(submitted, ImagePrompt) else submitted
    grammar = grammar_for(spec, fmt, thinking=bool(getattr(tokenizer, "has_thinking", False)))
    return Prepared(prompt, compile_constraint(engine, grammar), reasoning_open(tokenizer, prompt), fmt, submitted)


@dataclass
class CallResult:
    id: str
    name: str
    arguments_text: str = ""
    arguments: dict | None = None  # None until the call ended


@dataclass
class ChoiceResult:
    """One choice, folded from its events (what a non-streamed reply shows)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[CallResult] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: Finish | None = None

    def add(self, event: ChatEvent) -> None:
        if isinstance(event, TextDelta):
            self.text += event.text
        elif isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, ToolCallStart):
            self.tool_calls.append(CallResult(event.id, event.name))
        elif isinstance(event, ToolCallArgs):
            self.tool_calls[event.index].arguments_text += event.text
        elif isinstance(event, ToolCallEnd):
            self.tool_calls[event.index].arguments = event.arguments
        elif isinstance(event, TokenLogprobs):
            self.logprobs += event.entries
        elif isinstance(event, Finish):
            self.finish = event

    def extend(self, events: list[ChatEvent]) -> None:
        for event in events:
            self.add(event)


class ChatRun:
    def __init__(self, spec: ChatRequestSpec, generation: Generation, prepared: Prepared, tokenizer) -> None:
        self.spec, self.generation = spec, generation
        self.prompt = prepared.prompt
        self.prompt_tokens = len(prepared.prompt)  # known before any token (Anthropic's message_start reports it)
        self.output_ids: list[list[int]] = [[] for _ in range(spec.n)]  # per choice (Ollama's `context` returns them)
        self.grammar_warnings = prepared.constraint.warnings if prepared.constraint is not None else ()
        think = (tokenizer.think_start, tokenizer.think_end) if getattr(tokenizer, "has_thinking", False) else None
        prefix = CALL_ID_PREFIX[spec.api]
        self.parsers = [
            OutputParser(
                think=think,
                tools=prepared.format if spec.parses_tools else None,
                tool_dicts=[t.as_template_tool() for t in spec.tools],
                new_call_id=lambda: f"{prefix}{uuid.uuid4().hex[:24]}",
                reasoning_open=prepared.reasoning_open,
                logprobs=spec.logprobs,
            )
            for _ in range(spec.n)
        ]

    async def events(self) -> AsyncIterator[tuple[int, list[ChatEvent]]]:
        """(choice, the events one engine delta completed); GenerationFailed if the engine failed."""
        async for choice, delta in self.generation.deltas():
            if delta.token_id is not None:
                self.output_ids[choice].append(delta.token_id)
            yield choice, self.parsers[choice].feed(delta)

    def usage(self) -> dict:
        return self.generation.usage()


def _params(model: ServedModel, spec: ChatRequestSpec, prepared: Prepared) -> SamplingParams:
    max_tokens = reply_budget(
        model, len(prepared.prompt), spec.max_tokens, spec.names, spec.context_limit, spec.reply_to_context_end
    )
    params = sampling_params(
        spec.sampling,
        max_tokens=max_tokens,
        logprobs=spec.logprobs,
        top_logprobs=spec.top_logprobs,
        names=spec.names,
        defaults=model.config.sampling_defaults,
    )
    if prepared.constraint is not None:
        params = dataclasses.replace(params, constraint=prepared.constraint)
    params.trim_leading_space = spec.raw_prompt is None  # a raw prompt's reply continues its text exactly
    return params


async def start_chat(
    model: ServedModel, spec: ChatRequestSpec, route: str, arrived: float | None = None
) -> tuple[ChatRun, ExitStack]:
    """Submit the request (`route`: its path); close the ExitStack when the reply is done (it withdraws what has
    not finished)."""
    arrived = time.perf_counter() if arrived is None else arrived
    prepared: list[Prepared] = []

    async def start() -> Generation:
        prepared.append(await anyio.to_thread.run_sync(prepare, model.engine, spec, model.config.images))
        params = _params(model, spec, prepared[0])
        generation = Generation(model.engine, model.metrics, params.n, arrived, model.adapter)
        generation.submit([prepared[0].submitted], params, spec.names.prompt)
        return generation

    generation, cleanup = await launch(model, sane_n(spec.sampling.n), start, route)
    return ChatRun(spec, generation, prepared[0], model.engine.tokenizer), cleanup


async def accept_chat(request, state: ServerState, schema, to_spec) -> tuple[object, ChatRequestSpec, float]:
    """serving.accept, then the translation to the internal request. Returns (body, spec, arrived)."""
    body, arrived = await accept(request, state, schema)
    return body, to_spec(body), arrived


ShapeFor = Callable[[ServedModel, object, ChatRequestSpec, ChatRun], ReplyShape]


async def serve_chat_request(request, state: ServerState, schema, to_spec, shape_for: ShapeFor):
    """A chat-shaped API end to end: its schema, its translation to the internal request (`to_spec`), and its
    reply shape (`shape_for(model, body, spec, run)`); everything else is this pipeline's."""
    body, spec, arrived = await accept_chat(request, state, schema, to_spec)
    model = await model_for(state, body)
    return await reply_to_chat(request, model, body, spec, arrived, shape_for)


async def reply_to_chat(request, model: ServedModel, body, spec: ChatRequestSpec, arrived: float, shape_for: ShapeFor):
    """The run and the reply of an accepted request on its model (an API that accepts in its own way, as Ollama's,
    starts here)."""
    run, cleanup = await start_chat(model, spec, request.url.path, arrived)
    try:
        shape = shape_for(model, body, spec, run)
    except BaseException:
        cleanup.close()
        raise
    for line in grammar_notes(spec, run.grammar_warnings):
        log.warning("POST %s %s: %s", request.url.path, reply_id(shape), line)
    return await respond(request, shape, spec.stream, run.events(), run.usage, cleanup)
