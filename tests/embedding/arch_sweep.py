"""Every mlx-lm architecture's tiny model (tests/archs/configs.json) through the Embedder.

    python -m tests.embedding.arch_sweep [MODULE ...]   -> one JSON line per module, then a summary line

Each architecture's vectors of three inputs (mean and last-token pooling) are compared with a plain reference:
its body called the ordinary way (`body(tokens)`, no cache, one unpadded input at a time), pooled in NumPy.
Verdicts: "exact" (the embedder's one right-padded pass, and the same inputs in chunks of 4 tokens through the
cache, both equal the reference within TOLERANCE), "chunks differ" (the padded pass is exact; chunks through the
model's cache are not: the architecture's own chunked prefill differs from one call), "mismatch" (the padded pass
differs), "refused" (the Embedder refused the model: no body returns hidden states), "error" (anything else,
where a body needs a cache, the reference is one call with a fresh cache). tests/embedding/test_architectures.py
runs a few of them in the suite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.embedding.embedder import Embedder
from mlxpaged.embedding.model_files import EmbeddingSpec
from mlxpaged.errors import UnsupportedModelError
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.model_store import ModelRef
from tests.archs.configs import MLX_LM_CANNOT_RUN, config_for, has_config, text_modules
from tests.archs.harness import build

import mlx.core as mx
import numpy as np

TOLERANCE = 1e-4  # float32 vectors of norm 1 (mean pooling: normalized too); padded shapes change BLAS blocking
LENGTHS = (5, 9, 13)


def embedder_for(module: str, pooling: str, max_batch_tokens: int = 2048) -> Embedder:
    model = build(module)
    config = config_for(module)
    vocab = int(model(mx.array([[1]])).shape[-1]) if "vocab_size" not in config else config["vocab_size"]
    config["vocab_size"] = vocab
    loaded = LoadedModel(model, None, ModelRef(module, "path"), Path(module), "float32", config)  # type: ignore[arg-type]
    return Embedder(loaded, EmbeddingSpec(pooling, True, source="sweep"), max_batch_tokens)


def token_arrays(vocab: int) -> list[list[int]]:
    return [[(11 * i + 5 * n) % (vocab - 1) + 1 for i in range(n)] for n in LENGTHS]


def plain_hidden(embedder: Embedder, row: list[int]) -> mx.array:
    """The body on one input in one call: without a cache, or with a fresh one where the body requires it (as
    mlx-lm's generate calls such a model on a prompt)."""
    try:
        return embedder.body.call(mx.array([row]))
    except TypeError:
        return embedder.body.call(mx.array([row]), cache=embedder.body.make_cache())


def plain_reference(embedder: Embedder, inputs: list[list[int]], pooling: str) -> np.ndarray:
    rows = []
    for row in inputs:
        hidden = np.array(plain_hidden(embedder, row)[0].astype(mx.float32))
        vector = hidden.mean(axis=0) if pooling == "mean" else hidden[-1]
        rows.append(vector / np.linalg.norm(vector))
    return np.stack(rows)


def check_architecture(module: str) -> dict:
    out: dict = {"module": module}
    try:
        padded_error = chunked_error = 0.0
        for pooling in ("mean", "last"):
            embedder = embedder_for(module, pooling)
            out["body"] = embedder.body.path
            inputs = token_arrays(embedder.vocab_size)
            expected = plain_reference(embedder, inputs, pooling)
            batched = embedder.embed(inputs)
            assert batched.forward_passes == 1
            embedder.max_batch_tokens = 4  # every input in chunks of 4 tokens through the cache
            chunked = embedder.embed(inputs).vectors
            padded_error = max(padded_error, float(np.abs(batched.vectors - expected).max()))
            chunked_error = max(chunked_error, float(np.abs(chunked - expected).max()))
        out.update(padded_error=padded_error, chunked_error=chunked_error)
        exact = padded_error <= TOLERANCE
        out["status"] = "mismatch" if not exact else "exact" if chunked_error <= TOLERANCE else "chunks differ"
    except UnsupportedModelError as exc:
        out.update(status="refused", reason=str(exc)[:300])
    except Exception as exc:
        out.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
    return out


def runnable_modules() -> list[str]:
    skip = set(MLX_LM_CANNOT_RUN)
    return [m for m in text_modules() if has_config(m) and m not in skip]


def main(argv: list[str]) -> None:
    counts: dict[str, int] = {}
    for module in argv or runnable_modules():
        result = check_architecture(module)
        counts[result["status"]] = counts.get(result["status"], 0) + 1
        print(json.dumps(result), flush=True)
    print(json.dumps({"summary": counts}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
