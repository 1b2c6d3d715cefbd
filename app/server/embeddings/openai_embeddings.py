"""`POST /v1/embeddings` in OpenAI's shape: `input` as a string, strings, a token array or token arrays; `dimensions`;
`encoding_format` "float" (JSON numbers) or "base64" (each vector's little-endian float32 bytes, which the official
client asks for by default and decodes); usage counts the input tokens. Errors are OpenAI's (errors.py)."""

from __future__ import annotations

import base64
import time

from mlxpaged_app.server.embeddings.lookup import embedder_for
from mlxpaged_app.server.embeddings.protocol import MAX_INPUTS, EmbeddingRequest
from mlxpaged_app.server.embeddings.run import embed
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.request_body import parse_request, read_body
from mlxpaged_app.server.state import ServerState

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response


async def serve_embeddings(request: Request, state: ServerState) -> Response:
    arrived = time.perf_counter()
    state.check_accepting()
    body = parse_request(await read_body(request, state.config.max_body_size), EmbeddingRequest)
    inputs = openai_inputs(body.input)  # a malformed input is refused before any model is loaded for it
    served = await embedder_for(state, body.model)
    embedded = await embed(served, inputs, body.dimensions, False, arrived)
    result = embedded.result
    data = [
        {"object": "embedding", "index": i, "embedding": encode(vector, body.encoding_format)}
        for i, vector in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}
    return JSONResponse({"object": "list", "data": data, "model": body.model or served.model_id, "usage": usage})


def openai_inputs(value: str | list) -> list:
    """The request's `input` as a list of texts or of token arrays: a flat list of ints is one token array."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise invalid_param("input", "'input' is empty; send a string, strings, or token arrays", "empty_input")
    if len(value) > MAX_INPUTS:
        raise invalid_param("input", f"'input' has {len(value)} items; at most {MAX_INPUTS} per request")
    return [value] if isinstance(value[0], int) else value


def encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
