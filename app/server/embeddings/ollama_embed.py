"""`POST /api/embed` in Ollama's shape: `{"model", "input": str | [str], "truncate", "dimensions", "keep_alive",
"options"}` -> `{"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}`, durations in
nanoseconds. As Ollama does: `truncate` defaults to true (an input past the context is cut to it), an empty
`input` loads the model and answers no embeddings (clients send one to load a model), `keep_alive` is how long
the model stays loaded once idle (as on every route), `load_duration` how long the request waited for its model,
and errors are `{"error": "..."}` with the status. Ollama normalizes every vector; here normalization follows the
model's own files (model_files.py), as on /v1/embeddings, so the two APIs give one model's vectors alike.
"""

from __future__ import annotations

import time

from mlxpaged_app.server.embeddings.lookup import embedder_for
from mlxpaged_app.server.embeddings.protocol import OllamaEmbedRequest
from mlxpaged_app.server.embeddings.run import embed
from mlxpaged_app.server.errors import APIError, log_refusal
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.serving import request_keep_alive
from mlxpaged_app.server.state import ServerState

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

NANOSECONDS = 1_000_000_000


async def serve_ollama_embed(request: Request, state: ServerState) -> Response:
    try:
        return await _serve(request, state)
    except APIError as exc:
        return ollama_error(exc, request.url.path)


async def _serve(request: Request, state: ServerState) -> Response:
    arrived = time.perf_counter()
    state.check_accepting()
    body = parse_request(await read_body(request, state.config.max_body_size), OllamaEmbedRequest)
    keep_alive = request_keep_alive(body.keep_alive)
    waited = time.perf_counter()
    served = await embedder_for(state, body.model, keep_alive, ollama=True)
    load = time.perf_counter() - waited
    inputs = [body.input] if isinstance(body.input, str) and body.input else body.input or []
    if not inputs:
        return JSONResponse(_reply(body.model, [], 0, time.perf_counter() - arrived, load))
    embedded = await embed(served, inputs, body.dimensions, body.truncate, arrived)
    vectors = embedded.result.vectors.tolist()
    return JSONResponse(_reply(body.model, vectors, embedded.result.total_tokens, embedded.seconds, load))


def _reply(model: str, embeddings: list, tokens: int, seconds: float, load_seconds: float) -> dict:
    return {
        "model": model,
        "embeddings": embeddings,
        "total_duration": int(seconds * NANOSECONDS),
        "load_duration": int(load_seconds * NANOSECONDS),
        "prompt_eval_count": tokens,
    }


def ollama_error(exc: APIError, path: str) -> JSONResponse:
    """Ollama's error shape: `{"error": message}` with the status (its clients show the message as it is)."""
    if exc.status < 500:
        log_refusal(exc, path)
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=exc.headers)
