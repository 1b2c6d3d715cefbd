"""Ollama's routes over the chat pipeline: POST /api/chat and /api/generate (streamed as NDJSON unless
`"stream": false`), GET /api/tags, POST /api/show, GET /api/ps, GET /api/version, and `/` ("Ollama is running",
which clients probe before anything else).

Every route finds its model through models.py (the server's registry: loaded on demand). A chat with no
messages, or a generate with no prompt, only loads the model (`done_reason` "load"), or with `keep_alive` 0 unloads
it (`done_reason` "unload"). `load_duration` is how long the request waited for its model (the load, when this
request's model was not loaded). /api/show loads a model that is not loaded: what it reports (the context this
server runs it with, its chat template, whether it thinks) is the loaded model's. The generation itself,
admission, cancellation and the prefix cache are the pipeline's, as for every API.
"""

from __future__ import annotations

import time

from mlxpaged_app.server.chat.pipeline import reply_to_chat
from mlxpaged_app.server.ollama import model_info
from mlxpaged_app.server.ollama.convert import chat_spec, generate_spec
from mlxpaged_app.server.ollama.models import expire, served_model
from mlxpaged_app.server.ollama.protocol import ChatRequest, GenerateRequest, ShowRequest
from mlxpaged_app.server.ollama.shapes import ChatShape, GenerateShape, done_reply
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.serving import accept, request_keep_alive
from mlxpaged_app.server.state import ServerState

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

# The Ollama release whose API this server follows (docs/api.md, api/types.go): clients gate features on it.
OLLAMA_VERSION = "0.33.0"
RUNNING = "Ollama is running"


async def serve_chat(request: Request, state: ServerState) -> Response:
    return await _serve(request, state, ChatRequest, chat=True)


async def serve_generate(request: Request, state: ServerState) -> Response:
    return await _serve(request, state, GenerateRequest, chat=False)


async def _serve(request: Request, state: ServerState, schema: type, chat: bool) -> Response:
    body, arrived = await accept(request, state, schema)
    keep_alive = request_keep_alive(body.keep_alive)
    nothing_to_run = not (body.messages if chat else body.prompt)
    if nothing_to_run and keep_alive == 0:
        await expire(state, body.model)
        return JSONResponse(done_reply(body.model, "unload", chat))
    waited = time.perf_counter()
    model = await served_model(state, body.model, keep_alive)
    load_seconds = time.perf_counter() - waited
    spec = chat_spec(body, model) if chat else generate_spec(body, model)  # checked when only loading too
    if nothing_to_run:
        return JSONResponse(done_reply(body.model, "load", chat))
    shape = ChatShape if chat else GenerateShape

    def shape_for(model, body, spec, run):
        return shape(body.model, run, model.token_text, load_seconds)

    return await reply_to_chat(request, model, body, spec, arrived, shape_for)


async def tags(request: Request, state: ServerState) -> Response:
    """Every model this server can serve (what /v1/models lists), loaded or not; reading them loads none."""
    entries = await anyio.to_thread.run_sync(state.registry.catalog.servable)  # reads the store
    adapters = await anyio.to_thread.run_sync(state.registry.catalog.adapters.listed)
    listed = await anyio.to_thread.run_sync(model_info.tags_entries, entries, adapters)  # and the safetensors headers
    return JSONResponse({"models": listed})


async def show(request: Request, state: ServerState) -> Response:
    body = parse_request(await read_body(request, state.config.max_body_size), ShowRequest)
    model = await served_model(state, body.model or body.name, kind=None)
    return JSONResponse(await anyio.to_thread.run_sync(model_info.show_body, model))


async def running(request: Request, state: ServerState) -> Response:
    """The models loaded now, with their memory and when their keep-alive unloads them."""
    loaded = [served for served in list(state.registry.loaded.values()) if not served.unloaded]
    return JSONResponse({"models": await anyio.to_thread.run_sync(model_info.ps_entries, loaded)})


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


async def root(request: Request) -> Response:
    return PlainTextResponse(RUNNING)
