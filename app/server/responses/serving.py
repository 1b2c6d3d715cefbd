"""`POST /v1/responses`: a Responses request becomes a ChatRequestSpec, runs through the chat pipeline, and its
events become a response object or the Responses event stream (`event: <type>` + `data:` per event, no
`[DONE]`: OpenAI ends the stream with `response.completed`, `.incomplete` or `.failed`)."""

from __future__ import annotations

import json
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxpaged_app.server.chat.pipeline import ChatRun, accept_chat, start_chat
from mlxpaged_app.server.chat.spec import ChatRequestSpec, SamplingRequest
from mlxpaged_app.server.engine_client import GenerationFailed
from mlxpaged_app.server.errors import APIError
from mlxpaged_app.server.responses.inputs import input_messages
from mlxpaged_app.server.responses.options import (check_combination, output_format, reasoning_spec, tool_choice,
                                                   tool_specs)
from mlxpaged_app.server.responses.protocol import ResponsesRequest, check_supported
from mlxpaged_app.server.responses.shapes import ResponseBuilder, response_head
from mlxpaged_app.server.serving import CLIENT_CLOSED, reply_or_gone
from mlxpaged_app.server.sse import ClientGone, EventStream
from mlxpaged_app.server.state import ServerState

RENAMED = {"response_format": "text.format", "messages": "input", "max_tokens": "max_output_tokens"}


def responses_spec(body: ResponsesRequest) -> ChatRequestSpec:
    """The internal request; every 400 names the Responses field at fault."""
    check_supported(body)
    messages = input_messages(body.input, body.instructions)
    tools = tool_specs(body.tools)
    choice = tool_choice(body.tool_choice, tools)
    output = output_format(body.text)
    check_combination(output, choice)
    sampling = SamplingRequest(temperature=body.temperature, top_p=body.top_p)
    parallel = True if body.parallel_tool_calls is None else body.parallel_tool_calls
    return ChatRequestSpec(messages, tools, choice, parallel, output, sampling, body.max_output_tokens,
                           reasoning=reasoning_spec(body.reasoning), stream=bool(body.stream), api="responses")


def renamed(exc: APIError) -> APIError:
    """The pipeline names chat's parameters; the client sent Responses' ones."""
    name = RENAMED.get(exc.param)
    if name is not None:
        if exc.param != "messages":  # "these messages" in a template error is prose, not the parameter
            exc.message = exc.message.replace(exc.param, name)
        exc.param = name
    return exc


def echoed(body: ResponsesRequest, spec: ChatRequestSpec) -> dict:
    """The request settings a response object repeats back."""
    tools = [{"type": "function", "name": t["name"], "description": t.get("description"),
              "parameters": t.get("parameters"), "strict": t.get("strict")} for t in body.tools or []]
    choice = spec.tool_choice if isinstance(spec.tool_choice, str) else {"type": "function",
                                                                         "name": spec.tool_choice.name}
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "parallel_tool_calls": spec.parallel_tool_calls,
            "tool_choice": choice, "tools": tools, "text": body.text or {"format": {"type": "text"}},
            "reasoning": {"effort": spec.reasoning.effort, "summary": None}, "metadata": body.metadata or {}}


async def serve_responses(request: Request, state: ServerState) -> Response:
    body, spec, arrived = await accept_chat(request, state, ResponsesRequest, responses_spec)
    try:
        run, cleanup = await start_chat(state, spec, arrived)
    except APIError as exc:
        raise renamed(exc) from None
    builder = ResponseBuilder(response_head(state.model_id, echoed(body, spec)))
    headers = {"x-request-id": builder.id}
    if spec.stream:
        return EventStream(_stream(run, builder), on_close=cleanup.close, headers=headers)
    try:
        await reply_or_gone(request, _build(run, builder), cleanup)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(builder.response(), headers=headers)


async def _build(run: ChatRun, builder: ResponseBuilder) -> None:
    async for _, events in run.events():
        builder.feed(events)
    builder.complete(run.usage())


async def _stream(run: ChatRun, builder: ResponseBuilder) -> AsyncIterator[bytes]:
    for event in builder.start():
        yield named_event(event)
    try:
        async for _, events in run.events():
            for event in builder.feed(events):
                yield named_event(event)
    except GenerationFailed as exc:  # headers are sent: report in-band, as OpenAI does
        for event in builder.fail(str(exc)):
            yield named_event(event)
    else:
        yield named_event(builder.complete(run.usage())[0])


def named_event(event: dict) -> bytes:
    """One server-sent event named by its type, as OpenAI frames Responses events."""
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()
