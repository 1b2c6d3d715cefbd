"""Ollama's routes over the chat pipeline: POST /api/chat and /api/generate (streamed as NDJSON unless
`"stream": false`), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, and `/` ("Ollama is running",
which clients probe before anything else).

A chat with no messages, or a generate with no prompt, only loads the model: Ollama answers `done_reason` "load",
or "unload" with `keep_alive` 0; both go through models.keep_model_alive, the seam multi-model serving fills.
The generation itself, admission, cancellation and the prefix cache are the pipeline's, as for every API.
"""

from __future__ import annotations

from mlxpaged_app.server.chat.pipeline import ChatRun, reply_to_chat
from mlxpaged_app.server.chat.spec import ChatRequestSpec
from mlxpaged_app.server.ollama import model_info
from mlxpaged_app.server.ollama.convert import chat_spec, generate_spec
from mlxpaged_app.server.ollama.models import keep_model_alive, served_model
from mlxpaged_app.server.ollama.options import keep_alive_seconds
from mlxpaged_app.server.ollama.protocol import ChatRequest, GenerateRequest, ShowRequest
from mlxpaged_app.server.ollama.shapes import ChatShape, GenerateShape, done_reply
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.serving import accept
from mlxpaged_app.server.state import ServerState

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

# The Ollama release whose API this server follows (docs/api.md, api/types.go): clients gate features on it.
OLLAMA_VERSION = "0.33.0"
RUNNING = "Ollama is running"


async def serve_chat(request: Request, state: ServerState) -> Response:
    body, arrived = await accept(request, state, ChatRequest, served_model)
    seconds = keep_alive_seconds(body.keep_alive)
    spec = chat_spec(body, state)  # checked even when only loading, as Ollama checks the options first
    keep_model_alive(state, served_model(state, body.model), seconds)
    if not body.messages:
        return JSONResponse(done_reply(body.model, "unload" if seconds == 0 else "load", chat=True))
    return await reply_to_chat(request, state, body, spec, arrived, _chat_shape)


def _chat_shape(state: ServerState, body: ChatRequest, spec: ChatRequestSpec, run: ChatRun) -> ChatShape:
    return ChatShape(body.model, run, state.token_text)


async def serve_generate(request: Request, state: ServerState) -> Response:
    body, arrived = await accept(request, state, GenerateRequest, served_model)
    seconds = keep_alive_seconds(body.keep_alive)
    spec = generate_spec(body, state)
    keep_model_alive(state, served_model(state, body.model), seconds)
    if not body.prompt:
        return JSONResponse(done_reply(body.model, "unload" if seconds == 0 else "load", chat=False))
    return await reply_to_chat(request, state, body, spec, arrived, _generate_shape)


def _generate_shape(state: ServerState, body: GenerateRequest, spec: ChatRequestSpec, run: ChatRun) -> GenerateShape:
    return GenerateShape(body.model, run, state.token_text)


async def tags(request: Request, state: ServerState) -> Response:
    """The models this server can serve (today: the one it holds)."""
    return JSONResponse({"models": [model_info.tags_entry(state)]})


async def show(request: Request, state: ServerState) -> Response:
    body = parse_request(await read_body(request, state.config.max_body_size), ShowRequest)
    served_model(state, body.model or body.name)
    return JSONResponse(model_info.show_body(state))


async def running(request: Request, state: ServerState) -> Response:
    """The models loaded now (today: the one the server holds for its lifetime)."""
    return JSONResponse({"models": [model_info.ps_entry(state)]})


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


async def root(request: Request) -> Response:
    return PlainTextResponse(RUNNING)
