"""What a model directory tells the memory plan before any weight is read.

Tensor sizes come from the safetensors headers (8-byte little-endian length, then a JSON map of
name -> dtype, shape, data_offsets): reading them reads no weights. The KV shape comes from
the cache layout of mlx-lm's own model class built without weights (loading/probe.py: its parameters
are lazy and never evaluated), so the plan made here is the plan the engine makes after loading
(tests/loading/test_plan_before_load.py holds them equal).

Weights as loaded: on MLX's CPU backend the loader casts every floating tensor to float32 when any
is half precision (mlxpaged.loading.loader.load_local), so they count 4 bytes there; on a GPU (Metal or
CUDA) they keep the checkpoint's dtypes. `backend` below is the one the loader follows
(platform/backend.py: "cpu", "metal" or "cuda"). Tensors mlx-lm's `sanitize` drops (a tied lm_head, rotary
tables in some Hugging Face checkpoints) still count, so for such checkpoints the figure is an upper bound.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpaged.errors import CheckpointError
from mlxpaged.platform.backend import tuning
from mlxpaged.platform.model_facts import ModelFacts, context_length
from mlxpaged.vision.checkpoint import loads_with_images

if TYPE_CHECKING:
    from mlxpaged.cache.layout import ModelLayout

# safetensors dtype names (the format's spec) -> bytes per element.
DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
HALF = frozenset({"F16", "BF16"})
FLOATING = frozenset({"F16", "BF16", "F32", "F64"})  # what nn.Module.set_dtype casts
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # a safetensors dtype name: "F32", "BF16", "U32", ...
    num_elements: int

    @property
    def nbytes(self) -> int:
        return self.num_elements * DTYPE_BYTES[self.dtype]


def read_safetensors_header(path: Path) -> list[TensorHeader]:
    """The tensors one .safetensors file holds, from its header alone."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        if length is None or length > min(size - 8, MAX_HEADER_BYTES):
            raise CheckpointError(f"{path} is not a safetensors file: header length {length} for a {size:,}-byte file")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CheckpointError(f"{path} has an unreadable safetensors header: {exc}") from exc
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry.get("dtype") not in DTYPE_BYTES:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown dtype {entry.get('dtype')!r}")
        count = 1
        for dim in entry["shape"]:
            count *= dim
        tensors.append(TensorHeader(name, entry["dtype"], count))
    return tensors


def weight_files(model_dir: Path) -> list[Path]:
    """The files mlx-lm loads: the shards model.safetensors.index.json names, else model*.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = [model_dir / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [path.name for path in shards if not path.exists()]
        if missing:  # an interrupted download
            raise CheckpointError(
                f"{index} names {len(shards)} weight files but {len(missing)} are missing "
                f"from {model_dir}: {', '.join(missing)}"
            )
        return shards
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"no model*.safetensors in {model_dir}; it is not an MLX model directory")
    return files


def checkpoint_tensors(model_dir: Path) -> list[TensorHeader]:
    return [t for path in weight_files(model_dir) for t in read_safetensors_header(path)]


def as_loaded(tensors: list[TensorHeader], backend: str) -> list[TensorHeader]:
    """The tensors with the dtypes they have once loaded on `backend` (see the module docstring)."""
    if tuning(backend).float32_weights and any(t.dtype in HALF for t in tensors):
        return [TensorHeader(t.name, "F32", t.num_elements) if t.dtype in FLOATING else t for t in tensors]
    return tensors


KV_DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def kv_dtype(loaded: list[TensorHeader]) -> str:
    """The K/V dtype (safetensors name): the activations' dtype, that of the floating tensors holding
    the most bytes (the dense weights, or a quantized model's scales); F32 if none is floating."""
    by_dtype: Counter[str] = Counter()
    for t in loaded:
        if t.dtype in FLOATING:
            by_dtype[t.dtype] += t.nbytes
    return by_dtype.most_common(1)[0][0] if by_dtype else "F32"


def kv_dtype_bytes(loaded: list[TensorHeader]) -> int:
    return DTYPE_BYTES[kv_dtype(loaded)]


def kv_dtype_before_load(model_dir: Path, backend: str) -> str:
    """The K/V dtype's MLX name ("float32", "float16", ...) once the model is loaded on `backend`."""
    return KV_DTYPE_NAMES[kv_dtype(as_loaded(checkpoint_tensors(model_dir), backend))]


def facts_before_load(model_dir: Path, backend: str) -> ModelFacts:
    """The ModelFacts the engine will read from the loaded model, from headers, config.json and the
    layout of mlx-lm's model built without weights. Raises UnsupportedModelError for models the paged
    cache cannot hold, before any weight is read."""
    return read_before_load(model_dir, backend)[0]


def read_before_load(
    model_dir: Path, backend: str, image_memory_pixels: int | None = None
) -> tuple[ModelFacts, ModelLayout]:
    """facts_before_load, and the layout it read them from (each cache leaf's kind and shapes). A model that takes
    images: its vision tower's activations for the largest images it may be planned for (CacheConfig's
    `image_memory_pixels`), from its processor (vision/tower_memory.py)."""
    from mlxpaged.loading.loader import check_paged_support, unweighted_model
    from mlxpaged.loading.probe import probe_layout

    config = json.loads((model_dir / "config.json").read_text())
    loaded = as_loaded(checkpoint_tensors(model_dir), backend)
    layout = probe_layout(unweighted_model(model_dir))
    check_paged_support(layout)
    takes_images = loads_with_images(config)
    facts = ModelFacts.from_layout(
        layout, sum(t.nbytes for t in loaded), kv_dtype_bytes(loaded), context_length(config), takes_images
    )
    if takes_images:
        from mlxpaged.vision.loading import tower_before_load

        rungs = tower_before_load(model_dir, kv_dtype_bytes(loaded), backend, image_memory_pixels)
        facts = dataclasses.replace(facts, tower_rungs=rungs)
    return facts, layout
