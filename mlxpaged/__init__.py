"""mlxpaged: local LLM inference on MLX with a paged KV cache.

from mlxpaged import Engine, SamplingParams
with Engine.from_pretrained() as engine:          # the embedded default model
    print(engine.chat([{"role": "user", "content": "Hi!"}]).text)
"""

# Must run before anything imports mlx.core (see blas.py).
from mlxpaged.platform.blas import blas_status, load_fast_blas
from mlxpaged.platform.malloc import keep_freed_memory

load_fast_blas()
keep_freed_memory()

__version__ = "0.1.0"

_LAZY = {
    "Engine": "mlxpaged.engine.engine",
    "Embedder": "mlxpaged.embedding.embedder",
    "EmbeddingResult": "mlxpaged.embedding.embedder",
    "Completion": "mlxpaged.outputs",
    "StreamDelta": "mlxpaged.outputs",
    "RequestFailedError": "mlxpaged.errors",
    "EngineClosedError": "mlxpaged.errors",
    "SamplingParams": "mlxpaged.sampling_params",
    "CacheConfig": "mlxpaged.config",
    "SchedulerConfig": "mlxpaged.config",
    "RequestTooLongError": "mlxpaged.errors",
    "InsufficientMemoryError": "mlxpaged.errors",
    "MlxpagedError": "mlxpaged.errors",
}
__all__ = ["__version__", "blas_status"]
__all__ += list(_LAZY)  # not `*_LAZY` inside the literal: ruff reads that as a non-string entry


def __getattr__(name: str):
    # The engine pulls in mlx-lm and transformers; load them only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlxpaged' has no attribute {name!r}")
