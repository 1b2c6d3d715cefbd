"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: the Anthropic adapter over the chat pipeline.

It translates the request (convert.py) and shapes what the pipeline reports (shapes.py, streaming.py); the
generation itself, admission, cancellation and the prefix cache are the pipeline's, as for every API.
`anthropic-version` / `anthropic-beta` headers are accepted and not needed; `?beta=true` is ignored."""

from __future__ import annotations

from mlxpaged.vision.prompt import ImagePrompt
from mlxpaged_app.server.anthropic.convert import messages_spec
from mlxpaged_app.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from mlxpaged_app.server.anthropic.shapes import MessageShape
from mlxpaged_app.server.chat.pipeline import ChatRun, serve_chat_request
from mlxpaged_app.server.chat.render_images import render_chat
from mlxpaged_app.server.chat.spec import ChatRequestSpec
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.serving import model_for
from mlxpaged_app.server.state import ServedModel, ServerState

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def serve_messages(request: Request, state: ServerState) -> Response:
    return await serve_chat_request(request, state, MessagesRequest, messages_spec, _shape)


def _shape(model: ServedModel, body: MessagesRequest, spec: ChatRequestSpec, run: ChatRun) -> MessageShape:
    return MessageShape(body.model, run.prompt_tokens)


async def serve_count_tokens(request: Request, state: ServerState) -> Response:
    """The prompt's length, tools and system included: what `input_tokens + cache_read_input_tokens` of the
    same request will report."""
    body = parse_request(await read_body(request, state.config.max_body_size), CountTokensRequest)
    spec = messages_spec(body)
    model = await model_for(state, body)
    prompt = await anyio.to_thread.run_sync(render_chat, model.engine, spec, model.config.images)
    return JSONResponse({"input_tokens": len(prompt.token_ids if isinstance(prompt, ImagePrompt) else prompt)})
