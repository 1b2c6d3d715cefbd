"""One embedding request against an Embedder: a queue slot, the model off the event loop, the library's refusals
as 400s naming the field."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.embedding.embedder import Embedder, EmbeddingResult
from mlxpaged.errors import EmbeddingInputError, EngineClosedError, InputTooLongError
from mlxpaged_app.server.errors import APIError, invalid_param, unavailable
from mlxpaged_app.server.state import ServerState

import anyio


@dataclass(frozen=True)
class Embedded:
    result: EmbeddingResult
    seconds: float  # from the request's arrival to the vectors


async def embed(
    state: ServerState,
    embedder: Embedder,
    inputs: str | Sequence[str] | Sequence[Sequence[int]],
    dimensions: int | None,
    truncate: bool,
    arrived: float,
) -> Embedded:
    """Run `embedder` on `inputs` in a worker thread while holding one admission slot (429 when full)."""
    with state.admission.slot(1):
        try:
            result = await anyio.to_thread.run_sync(_call, embedder, inputs, dimensions, truncate)
        except InputTooLongError as exc:
            raise APIError(400, str(exc), param="input", code="context_length_exceeded") from None
        except EmbeddingInputError as exc:
            raise invalid_param(exc.param, str(exc)) from None
        except EngineClosedError as exc:
            raise unavailable(str(exc)) from None
    state.metrics.count_usage(result.total_tokens, 0, 0)
    return Embedded(result, time.perf_counter() - arrived)


def _call(embedder: Embedder, inputs, dimensions: int | None, truncate: bool) -> EmbeddingResult:
    return embedder.embed(inputs, dimensions, truncate=truncate)
