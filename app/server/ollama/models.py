"""Which model an Ollama request names, and what its `keep_alive` does; every Ollama route goes through here to
the server's model registry (state.served_model: loaded on demand, unloaded when idle).

Ollama's names carry a tag, `name:tag`, with `latest` when none is given: clients list /api/tags and send a name
back as they saw it ("smollm2-135m:latest"), so `name:latest` means `name` (and a model whose own name ends in
`:latest` is still found by it).

keep_alive (parsed as on every API: keep_alive.py) is how long the model stays loaded once idle after this
request; 0 with nothing to run (no messages, no prompt) unloads it now (`expire`), as Ollama does.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from mlxpaged_app.server.errors import APIError, invalid_param
from mlxpaged_app.server.model_registry import UNSET
from mlxpaged_app.server.state import ServerState

LATEST = ":latest"


async def served_model(state: ServerState, requested: str | None, keep_alive: object = UNSET, kind="generate"):
    """The loaded model (a ServedModel; a ServedEmbedder for kind "embed"; either for None) that `requested`
    names, its `:latest` tag optional, loaded first if needed; the registry's APIErrors (404, 400 for the other
    kind, 503, 500) otherwise."""
    return await _by_name(requested, lambda name: state.served_model(name, keep_alive, kind))


async def expire(state: ServerState, requested: str | None) -> None:
    """keep_alive 0 with nothing to run: unload the model now if it is loaded and idle (else once its requests
    end); a model that is not loaded stays so. 404 for a name the server cannot serve."""
    await _by_name(requested, state.expire_model)


async def _by_name(requested: str | None, call: Callable[[str], Awaitable]):
    if not requested:
        raise invalid_param("model", "model is required")
    base = requested.removesuffix(LATEST)
    try:
        return await call(base)
    except APIError as exc:
        if base == requested or exc.code != "model_not_found":
            raise
    return await call(requested)


def tagged(model_id: str) -> str:
    """The model's name as Ollama lists it."""
    return model_id if ":" in model_id else model_id + LATEST
