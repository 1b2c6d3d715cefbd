"""One embedding request against an Embedder: a queue slot, the model off the event loop, the library's refusals
as 400s naming the field."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.embedding.embedder import Embedder, EmbeddingResult
from mlxpaged.errors import EmbeddingInputError, EngineClosedError, InputTooLongError
from mlxpaged_app.server.errors import APIError, invalid_param, unavailable
from mlxpaged_app.server.served_model import ServedEmbedder

import anyio


@dataclass(frozen=True)
class Embedded:
    result: EmbeddingResult
    seconds: float  # from the request's arrival to the vectors


async def embed(
    served: ServedEmbedder,
    inputs: str | Sequence[str] | Sequence[Sequence[int]],
    dimensions: int | None,
    truncate: bool,
    arrived: float,
) -> Embedded:
    """Run the model's Embedder on `inputs` in a worker thread while holding one of its admission slots (429 when
    full; holding it keeps the registry from unloading the model under the request)."""
    with served.admission.slot(1):
        try:
            result = await anyio.to_thread.run_sync(_call, served.embedder, inputs, dimensions, truncate)
        except InputTooLongError as exc:
            raise APIError(400, str(exc), param="input", code="context_length_exceeded") from None
        except EmbeddingInputError as exc:
            raise invalid_param(exc.param, str(exc)) from None
        except EngineClosedError as exc:
            raise unavailable(str(exc)) from None
    served.metrics.count_usage(result.total_tokens, 0, 0)
    return Embedded(result, time.perf_counter() - arrived)


def _call(embedder: Embedder, inputs, dimensions: int | None, truncate: bool) -> EmbeddingResult:
    return embedder.embed(inputs, dimensions, truncate=truncate)
