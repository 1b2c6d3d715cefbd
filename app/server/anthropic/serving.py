"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic adapter over the chat pipeline.

It translates the request (convert.py) and shapes what the pipeline reports (shapes.py, streaming.py); the
generation itself, admission, cancellation and the prefix cache are the pipeline's, as for every API.
`anthropic-version` / `anthropic-beta` headers are accepted and not needed; `?beta=true` is ignored."""

from __future__ import annotations


import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from mlxpaged_app.server.anthropic.convert import messages_spec
from mlxpaged_app.server.anthropic.errors import new_request_id
from mlxpaged_app.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from mlxpaged_app.server.anthropic.shapes import envelope, message_body
from mlxpaged_app.server.anthropic.streaming import message_events
from mlxpaged_app.server.chat.pipeline import accept_chat, start_chat
from mlxpaged_app.server.chat.render import render_prompt
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.serving import CLIENT_CLOSED, reply_or_gone
from mlxpaged_app.server.sse import ClientGone, EventStream
from mlxpaged_app.server.state import ServerState


async def serve_messages(request: Request, state: ServerState) -> Response:
    body, spec, arrived = await accept_chat(request, state, MessagesRequest, messages_spec)
    run, cleanup = await start_chat(state, spec, arrived)
    env = envelope(body.model)
    headers = {"request-id": new_request_id()}
    if spec.stream:
        return EventStream(message_events(run, env), on_close=cleanup.close, headers=headers)
    try:
        [choice] = await reply_or_gone(request, run.collect(), cleanup)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(message_body(env, choice, run.usage()), headers=headers)


async def serve_count_tokens(request: Request, state: ServerState) -> Response:
    """The prompt's length, tools and system included: what `input_tokens + cache_read_input_tokens` of the
    same request will report."""
    body = parse_request(await read_body(request, state.config.max_body_size), CountTokensRequest)
    state.check_model(body.model)
    prompt = await anyio.to_thread.run_sync(render_prompt, state.engine.tokenizer, messages_spec(body))
    return JSONResponse({"input_tokens": len(prompt)})
