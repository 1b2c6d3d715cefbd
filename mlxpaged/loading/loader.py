"""Load models through mlx-lm, and the plain (non-paged) generate path.

The baseline path is mlx-lm's own `stream_generate`: it is what the paged engine is
checked against, token for token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.paged_support import unsupported_reasons
from mlxpaged.errors import UnsupportedModelError
from mlxpaged.loading.model_store import ModelRef, provision, resolve
from mlxpaged.loading.progress import Progress
from mlxpaged.platform.backend import current as current_backend
from mlxpaged.platform.backend import tuning
from mlxpaged.platform.model_facts import model_weight_bytes
from mlxpaged.vision.checkpoint import loads_with_images, text_load_refused

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load as mlx_lm_load

if TYPE_CHECKING:
    from mlxpaged.vision.loading import VisionParts


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    ref: ModelRef
    path: Path
    dtype: str  # as loaded: "float32" on the CPU backend, the checkpoint's ("bfloat16", ...) on a GPU
    config: dict  # the model's config.json
    # A vision-language model: its vision tower and processor (vision/loading.py); `model` is then its language
    # model as the engine runs it (vision/language.py). None: a text model.
    vision: VisionParts | None = None

    @property
    def name(self) -> str:
        return self.ref.name

    @property
    def names(self) -> tuple[str, ...]:
        """What the model is known by: its name, its hub repository, its directory, the file it was converted from,
        the name its config keeps (an adapter's config names its base by one of these: adapters/base_model.py)."""
        options = self.ref.preset.options if self.ref.preset is not None else {}
        found = [self.ref.name, self.ref.repo, str(self.path), options.get("repo"), options.get("file")]
        found.append(self.config.get("_name_or_path"))
        return tuple(dict.fromkeys(n for n in found if isinstance(n, str) and n))

    @property
    def weight_bytes(self) -> int:
        """Bytes of every weight loaded, what the memory plan counts: a vision-language model's tower and projector
        too (`vision.model` is mlx-vlm's whole model, its language model included), as its checkpoint holds them."""
        return model_weight_bytes(self.vision.model if self.vision is not None else self.model)


def default_dtype() -> str:
    """The dtype the embedded GGUF default model is converted to (its store directory's suffix): float32 on
    MLX's CPU backend, its fast dtype; float16 on any GPU, CUDA kept as Metal has it: the GGUF's block
    scales are float16, and MLX's fused attention on CUDA takes only half types."""
    return "float32" if tuning().float32_weights else "float16"


def locate_model(name: str | None = None, progress: Progress | None = None) -> tuple[ModelRef, Path]:
    """Resolve and provision (download, convert) a model without loading it; None: the default model."""
    ref = resolve(name)
    return ref, provision(ref, default_dtype(), progress)


def load_model(name: str | None = None, progress: Progress | None = None) -> LoadedModel:
    """Resolve, provision if needed, and load a model; None loads the embedded default model."""
    return load_local(*locate_model(name, progress))


def load_local(ref: ModelRef, path: Path, backend: str | None = None, lazy: bool = False) -> LoadedModel:
    """Load a provisioned model; `backend` ("cpu", "metal" or "cuda"; default: platform.backend.current())
    picks the dtypes: a GPU keeps the checkpoint's (bf16, fp16, quantized), the CPU makes half types float32.
    `lazy`: weights are read when first evaluated (a rank of a distributed engine shards first: only its share).
    A vision-language checkpoint loads through mlx-vlm where it can (vision/loading.py), else as a text model."""
    config = json.loads((path / "config.json").read_text())
    if not lazy and loads_with_images(config):
        return _load_vision(ref, path, config, backend)
    loaded = mlx_lm_load(str(path), lazy=lazy)  # typed as its 2- or 3-tuple (return_config): the first two are these
    model, tokenizer = loaded[0], loaded[1]
    fit_dtypes(model, backend)
    return LoadedModel(model, tokenizer, ref, path, dtype_name(weights_dtype(model)), config)


def _load_vision(ref: ModelRef, path: Path, config: dict, backend: str | None) -> LoadedModel:
    from mlxpaged.vision.loading import load_vision_model, vision_parts

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    vlm, processor = load_vision_model(path)
    fit_dtypes(vlm, backend)  # the tower too: the CPU computes in float32
    model, vision = vision_parts(vlm, processor)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(model, tokenizer, ref, path, dtype_name(weights_dtype(model)), config, vision=vision)


def fit_dtypes(model: nn.Module, backend: str | None = None) -> None:
    """The dtypes `backend` computes in (default: platform.backend.current()): the CPU makes half types float32,
    its fast dtype (checkpoint.as_loaded counts this); a GPU keeps the checkpoint's."""
    if tuning(backend or current_backend()).float32_weights and _has_half_dense_weights(model):
        model.set_dtype(mx.float32)


def unweighted_model(model_dir: Path) -> nn.Module:
    """mlx-lm's model for `model_dir`'s config.json, never given weights: its parameters are lazy
    (random init, never evaluated), so building it costs no memory. For reading shapes and caches. A
    vision-language checkpoint that loads with its images: its language model as the engine runs it."""
    from mlx_lm.utils import _get_classes, load_config  # load_model's own class lookup

    config = load_config(model_dir)
    if loads_with_images(config):
        from mlxpaged.vision.loading import unweighted_vision_model

        return unweighted_vision_model(model_dir)
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as exc:  # mlx-lm does not know the type: say so, and why not with its images when it has them
        reason = text_load_refused(config)
        if reason is None:
            raise
        raise UnsupportedModelError(reason) from exc
    return model_class(args_class.from_dict(config))


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's activations, hence of its K/V: look one token up in the embedding
    (a quantized embedding's weight is uint32). Without `model.embed_tokens`: the floating dtype
    holding the most parameter bytes, as checkpoint.kv_dtype_bytes reads it from the files."""
    inner = getattr(model, "model", None)
    if inner is not None and hasattr(inner, "embed_tokens"):
        return inner.embed_tokens(mx.array([[0]])).dtype
    return weights_dtype(model)


def weights_dtype(model: nn.Module) -> mx.Dtype:
    """The floating dtype holding the most parameter bytes: the dense weights', or a quantized model's
    scales' (its packed weights are uint32); float32 when no parameter is floating."""
    by_dtype: dict[mx.Dtype, int] = {}
    for value in _parameters(model):
        if mx.issubdtype(value.dtype, mx.floating):
            by_dtype[value.dtype] = by_dtype.get(value.dtype, 0) + value.nbytes
    return max(by_dtype, key=lambda dtype: by_dtype[dtype]) if by_dtype else mx.float32


def dtype_name(dtype: mx.Dtype) -> str:
    """ "bfloat16" for mx.bfloat16: the name mx.<name> and the store directories use."""
    return str(dtype).removeprefix("mlx.core.")


def _has_half_dense_weights(model: nn.Module) -> bool:
    return any(v.dtype in (mx.float16, mx.bfloat16) for v in _parameters(model))


def _parameters(model: nn.Module) -> list[mx.array]:
    """Every parameter array of `model`."""
    from mlx.utils import tree_flatten

    flat = tree_flatten(model.parameters())  # typed list | dict: the dict form only with `destination={}`
    return list(flat.values()) if isinstance(flat, dict) else [value for _, value in flat]


def chat_prompt(tokenizer: TokenizerWrapper, messages: list[dict]) -> list[int]:
    """Token ids of `messages` rendered with the model's chat template, ready for the reply."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def baseline_stream(
    loaded: LoadedModel,
    prompt: list[int] | str,
    max_tokens: int = 256,
    temperature: float = 0.0,
    ignore_eos: bool = False,
) -> Iterator:
    """mlx-lm's own streaming generation (no paged cache): yields GenerationResponse objects."""
    sampler = make_sampler(temp=temperature)
    if not ignore_eos:
        yield from stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=max_tokens, sampler=sampler)
        return
    from mlx_lm.generate import generate_step

    # stream_generate always stops at EOS; benchmarks need a fixed length. Text is encoded as it encodes it.
    bos = loaded.tokenizer.bos_token
    ids = (
        prompt
        if not isinstance(prompt, str)
        else loaded.tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    )
    yield from generate_step(mx.array(ids), loaded.model, max_tokens=max_tokens, sampler=sampler)


def check_paged_support(layout: ModelLayout) -> None:
    """Refuse, at load, a model whose cache the paged pools cannot hold: every reason names the layer,
    its cache kind and why. cache/paged_support.py decides: a cache class of the model's own, a sliding
    window attended with a mask the model builds itself, or no KV cache and no state at all."""
    reasons = [reason.text for reason in unsupported_reasons(layout)]
    if reasons:
        shown = "; ".join(reasons[:4]) + (f"; and {len(reasons) - 4} more" if len(reasons) > 4 else "")
        raise UnsupportedModelError(f"model type {layout.model_type!r} is not supported in paged mode: {shown}")
