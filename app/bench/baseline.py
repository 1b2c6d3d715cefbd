"""Which model the mlx-lm side of a bench runs: what a user would run instead of mlxpaged.

On a GPU that is plain `mlx_lm.load(path)`, untouched: the checkpoint's own dtype (bf16, fp16 or
quantized), a separate copy from the engine's. Only on MLX's CPU backend, where the engine converts to
float32 (its fast dtype) and mlx-lm on half precision would be unfairly slow (3-40x), does the mlx-lm
side share the engine's float32 model. Every bench prints which (`MlxLmSide.note`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxpaged.loading.loader import LoadedModel
from mlxpaged.platform import backend


@dataclass(frozen=True)
class MlxLmSide:
    loaded: LoadedModel  # what baseline_stream / BatchGenerator run
    note: str  # one line for the bench header: which model and why


def weight_dtype(model) -> str:
    """The dtype holding most of the model's parameter bytes ("bfloat16", "float32", "uint32 (quantized)")."""
    from mlx.utils import tree_flatten

    by_dtype: dict[str, int] = {}
    for _, value in tree_flatten(model.parameters()):
        name = str(value.dtype).removeprefix("mlx.core.")
        by_dtype[name] = by_dtype.get(name, 0) + value.nbytes
    if not by_dtype:
        raise ValueError("the model has no parameters to read a dtype from")
    top = max(by_dtype, key=by_dtype.get)
    return f"{top} (quantized)" if top in ("uint32", "uint8") else top


def mlx_lm_side(engine) -> MlxLmSide:
    """The mlx-lm side for `engine`'s model: a fresh untouched load on a GPU, the engine's own on the CPU."""
    loaded = engine.loaded
    if not backend.is_gpu():
        return MlxLmSide(
            loaded,
            f"mlx-lm side: the engine's loaded model ({weight_dtype(loaded.model)}; "
            f"on {backend.describe()} float32 is the fast dtype, as the engine runs)",
        )
    from mlx_lm import load

    model, tokenizer = load(str(loaded.path))
    own = LoadedModel(model, tokenizer, loaded.ref, loaded.path, weight_dtype(model), loaded.config)
    return MlxLmSide(own, f"mlx-lm side: its own copy, mlx_lm.load({loaded.path}) untouched ({own.dtype})")
