"""Which served model an Ollama request names, and what its `keep_alive` does: the two seams multi-model serving
(models loaded on demand, idle ones unloaded) changes; every Ollama route goes through them.

Ollama's names carry a tag, `name:tag`, with `latest` when none is given: clients list /api/tags and send a name
back as they saw it ("smollm2-135m:latest"), so `name:latest` means `name`.
"""

from __future__ import annotations

import math

from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.server_log import log
from mlxpaged_app.server.state import ServerState

LATEST = ":latest"


def served_model(state: ServerState, requested: str | None) -> str:
    """The id of the served model `requested` names (the client's name, its `:latest` tag optional), or the
    server's model-name check's 404. Today the server holds one model; with models loaded on demand this is
    where a name picks (and loads) its model."""
    if not requested:
        raise invalid_param("model", "model is required")
    base = requested.removesuffix(LATEST)
    state.check_model(base if base in state.model_names else requested)
    return state.model_id


def tagged(model_id: str) -> str:
    """The model's name as Ollama lists it."""
    return model_id if ":" in model_id else model_id + LATEST


def keep_model_alive(state: ServerState, model_id: str, seconds: float | None) -> None:
    """Where a request's keep_alive takes effect: how long `model_id` stays loaded after this request (None: the
    server's default; 0: unload it now; math.inf: never). The server holds its one model for its lifetime, so
    there is nothing to schedule yet; multi-model serving replaces this body."""
    if seconds is not None and seconds != math.inf:
        log.debug("ollama: keep_alive %.1f s for %s: the server keeps its one model loaded", seconds, model_id)
