"""Which model serves an embedding request: the one function the registry of models loaded on demand replaces.

Today `mlxpaged serve` holds one model for its lifetime (state.py): an Embedder when it is an embedding model, else
a generative Engine, which cannot embed (the reason comes from the library's rule, mlxpaged/embedding/
model_files.py).
"""

from __future__ import annotations

from mlxpaged.embedding.embedder import Embedder
from mlxpaged.embedding.model_files import embedding_spec
from mlxpaged.errors import MlxpagedError
from mlxpaged_app.server.errors import model_not_found, not_an_embedding_model
from mlxpaged_app.server.state import ServerState


def embedder_for(state: ServerState, requested: str | None) -> Embedder:
    """The Embedder for a request naming `requested` (None: the served model); 404 for a model this server does
    not serve, 400 with the reason for one that is not an embedding model."""
    if requested is not None and requested not in state.model_names:
        raise model_not_found(requested, [state.model_id])
    if state.embedder is None:
        raise not_an_embedding_model(state.model_id, _why_not(state))
    return state.embedder


def _why_not(state: ServerState) -> str:
    loaded = state.engine.loaded if state.engine is not None else None
    path = getattr(loaded, "path", None)
    if path is None:
        return "it is a generative model"
    preset = getattr(getattr(loaded, "ref", None), "preset", None)
    try:
        embedding_spec(path, preset.options if preset else None)
    except MlxpagedError as exc:
        return str(exc)
    return "it was loaded as a generative model; start the server with it to serve embeddings"
