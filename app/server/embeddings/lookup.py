"""Which model serves an embedding request: the one lookup /v1/embeddings and /api/embed go through.

The server's model registry (state.served_model) finds the model the request names, loading it on demand as for
every route; an embedding model (the library's rule, mlxpaged/embedding/model_files.py: catalog kind "embed")
comes back as a ServedEmbedder, while a generative model is refused before loading, with the reason it cannot
embed (400).
"""

from __future__ import annotations

from mlxpaged_app.server.model_registry import UNSET
from mlxpaged_app.server.served_model import ServedEmbedder
from mlxpaged_app.server.state import ServerState


async def embedder_for(
    state: ServerState, requested: str | None, keep_alive: object = UNSET, *, ollama: bool = False
) -> ServedEmbedder:
    """The loaded embedding model `requested` names (None: the server's default model), loaded if needed; 404 for
    a model this server cannot serve, 400 with the reason for one that is not an embedding model. `ollama`: the
    name may carry Ollama's `:latest` tag."""
    if ollama:
        from mlxpaged_app.server.ollama.models import served_model

        return await served_model(state, requested, keep_alive, kind="embed")
    return await state.served_model(requested, keep_alive, kind="embed")
