"""Read a model's cache layout from the model itself: a lazy forward through mlx-lm's own caches.

`probe_layout(model)` builds the graph of a 3-token prompt and one decode token with the caches
`make_prompt_cache(model)` gives, never evaluating it, and records what each cache saw: the K/V shapes
written (`update_and_fetch`), the state arrays set, which attention call read the returned K/V and
how. Shapes of lazy arrays are known without computing them, so this works on a model built without
weights (`loader.unweighted_model`) as well as on a loaded one. Config spellings play no part.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mlxpaged.cache.layout import CacheListNode, KVLeaf, ModelLayout, StateLeaf, UnknownLeaf, UnusedLeaf
from mlxpaged.errors import UnsupportedModelError

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_cache

# A lazy forward evaluates nothing; a model that forces evaluation (.item(), tolist()) on lazy random
# weights would read them all, so more growth than this means the probe cannot be trusted.
MEMORY_GUARD_BYTES = 64 * 2**20
PROMPT, DECODE = [[1, 2, 3]], [[4]]
_KV_KINDS = {mlx_cache.KVCache: "full", mlx_cache.RotatingKVCache: "window", mlx_cache.ChunkedKVCache: "chunked"}


@dataclass
class _Call:
    """One attention call seen during the decode step."""

    via: str  # "base" (mlx-lm's scaled_dot_product_attention) or "fast" (mx.fast directly)
    cache: object
    q_heads: int
    k_from: tuple | None  # (path, "k"/"v") when the array is one a leaf returned
    v_from: tuple | None
    mask: object
    sinks: bool


@dataclass
class _Recorder:
    leaves: dict  # path -> cache object
    decoding: bool = False
    writes: dict = field(default_factory=dict)  # path -> list of (k shape, v shape, dtype, k is v)
    returned: dict = field(default_factory=dict)  # id(array) -> (path, "k"/"v")
    keep: list = field(default_factory=list)  # keeps returned arrays alive so their ids stay unique
    masks: set = field(default_factory=set)  # ids of masks the caches made
    calls: list = field(default_factory=list)  # decode-step attention calls
    q_heads: dict = field(default_factory=dict)  # path -> query heads of a call reading its K
    thread: int = field(default_factory=threading.get_ident)
    paths: dict = field(default_factory=dict)  # id(cache object) -> path
    inside_base: bool = False


def probe_layout(model: nn.Module) -> ModelLayout:
    """The model's ModelLayout. Raises UnsupportedModelError naming the model type when the lazy
    forward fails or evaluates more than MEMORY_GUARD_BYTES."""
    model_type = model_type_of(model)
    caches = mlx_cache.make_prompt_cache(model)
    leaves: dict = {}
    structure = tuple(_structure(c, (i,), leaves) for i, c in enumerate(caches))
    recorder = _Recorder(leaves, paths={id(obj): path for path, obj in leaves.items()})
    before = mx.get_active_memory()
    try:
        with _recording(recorder):
            logits = model(mx.array(PROMPT), cache=caches)
            recorder.decoding = True
            logits = model(mx.array(DECODE), cache=caches)
    except Exception as exc:
        raise UnsupportedModelError(
            f"model type {model_type!r}: running it through its own mlx-lm caches "
            f"failed ({type(exc).__name__}: {exc}); it cannot be served paged"
        ) from exc
    grown = mx.get_active_memory() - before
    if grown > MEMORY_GUARD_BYTES:
        raise UnsupportedModelError(
            f"model type {model_type!r}: reading its cache layout evaluated "
            f"{grown / 2**20:.0f} MB (limit {MEMORY_GUARD_BYTES / 2**20:.0f} MB): its "
            "forward forces evaluation, so its layout cannot be read safely"
        )
    logits = logits[0] if isinstance(logits, (tuple, list)) else logits
    layout_leaves = tuple(_leaf(path, obj, recorder) for path, obj in leaves.items())
    refuse = tuple(
        f"cache entry {' cache '.join(map(str, leaf.path))}: mlx-lm cache class {leaf.cache_class} has "
        "no paged equivalent"
        for leaf in layout_leaves
        if isinstance(leaf, UnknownLeaf)
    )
    layers = getattr(model, "layers", None)
    return ModelLayout(
        model_type,
        layout_leaves,
        structure,
        int(logits.shape[-1]),
        hidden_size(model, int(logits.shape[-1])),
        len(layers) if layers is not None else None,
        refuse,
        batch_error(model, caches),
    )


def batch_error(model: nn.Module, caches: list) -> str | None:
    """Run two sequences at different offsets (mlx-lm's batch caches: per-row offsets as an array)
    lazily; the error's text when the forward cannot take them. Only for plain KV cache lists (the
    other kinds are refused before batching matters)."""
    batch_caches: list[object] = []
    for cache in caches:
        if type(cache) is mlx_cache.KVCache:
            batch_caches.append(mlx_cache.BatchKVCache(left_padding=[1, 0]))
        elif type(cache) is mlx_cache.RotatingKVCache and cache.keep == 0:
            batch_caches.append(mlx_cache.BatchRotatingKVCache(cache.max_size, left_padding=[1, 0]))
        else:
            return None
    try:
        model(mx.array([PROMPT[0], PROMPT[0]]), cache=batch_caches)
        model(mx.array([DECODE[0], DECODE[0]]), cache=batch_caches)
    except Exception as exc:  # the model's own code: any error means batches cannot run
        return f"{type(exc).__name__}: {exc}"
    return None


def model_type_of(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    return model_type or type(model).__module__.rsplit(".", 1)[-1]


def hidden_size(model: nn.Module, vocab_size: int) -> int:
    """Width of the token embedding (the one with `vocab_size` rows, else the largest table);
    models without one count the vocabulary instead, an over-estimate for the activation plan."""
    tables = [
        (_rows(m), _width(m)) for _, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))
    ]
    matching = [width for rows, width in tables if rows == vocab_size]
    if matching:
        return max(matching)
    return max(tables)[1] if tables else vocab_size


def _rows(embedding) -> int:
    return embedding.weight.shape[0]


def _width(embedding) -> int:
    return embedding.dims if isinstance(embedding, nn.QuantizedEmbedding) else embedding.weight.shape[1]


def _structure(cache, path: tuple, leaves: dict):
    if cache is None:
        return None
    if isinstance(cache, mlx_cache.CacheList):
        return CacheListNode(tuple(_structure(c, (*path, j), leaves) for j, c in enumerate(cache.caches)))
    leaves[path] = cache
    return path


@contextmanager
def _recording(rec: _Recorder):
    """Wrap every leaf's update_and_fetch / make_mask and every module's attention entry points for
    the duration; other threads' calls pass through unrecorded."""
    undo = [_wrap_leaf(rec, path, obj) for path, obj in rec.leaves.items()]
    loaded: list[tuple[str, Any]] = list(sys.modules.items())  # Any: modules get an attribute set
    modules = [
        m
        for name, m in loaded
        if name.startswith(("mlx_lm.models.", "mlx_vlm.models."))  # mlx-vlm's language models (vision/language.py)
        and callable(getattr(m, "scaled_dot_product_attention", None))
    ]
    originals = {m: m.scaled_dot_product_attention for m in modules}
    fast = mx.fast.scaled_dot_product_attention
    for m, original in originals.items():
        m.scaled_dot_product_attention = _base_recorder(rec, original)
    mx.fast.scaled_dot_product_attention = _fast_recorder(rec, fast)
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = fast
        for m, original in originals.items():
            m.scaled_dot_product_attention = original
        for restore in undo:
            restore()


def _wrap_leaf(rec: _Recorder, path: tuple, obj):
    wrapped = {}
    if hasattr(obj, "update_and_fetch"):
        original_update = obj.update_and_fetch

        def update_and_fetch(keys, values, *args, **kwargs):
            rec.writes.setdefault(path, []).append((keys.shape, values.shape, keys.dtype, keys is values))
            k, v = original_update(keys, values, *args, **kwargs)
            rec.returned[id(k)], rec.returned[id(v)] = (path, "k"), (path, "v")
            rec.keep += [k, v]
            return k, v

        wrapped["update_and_fetch"] = update_and_fetch
    if hasattr(obj, "make_mask"):
        original_mask = obj.make_mask

        def make_mask(*args, **kwargs):
            mask = original_mask(*args, **kwargs)
            rec.masks.add(id(mask))
            rec.keep.append(mask)
            return mask

        wrapped["make_mask"] = make_mask
    for name, function in wrapped.items():
        setattr(obj, name, function)

    def restore() -> None:
        for name in wrapped:
            delattr(obj, name)

    return restore


def _record(rec: _Recorder, via, q, k, v, cache, mask, sinks) -> None:
    if threading.get_ident() != rec.thread:
        return
    k_from, v_from = rec.returned.get(id(k)), rec.returned.get(id(v))
    reader = k_from[0] if k_from is not None else rec.paths.get(id(cache))
    if reader is not None:
        rec.q_heads.setdefault(reader, q.shape[1])
    if rec.decoding:
        rec.calls.append(_Call(via, cache, q.shape[1], k_from, v_from, mask, sinks is not None))


def _base_recorder(rec: _Recorder, original):
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        if rec.inside_base:  # a wrapper calling another module's binding: record once
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        _record(rec, "base", queries, keys, values, cache, mask, sinks)
        rec.inside_base = threading.get_ident() == rec.thread
        try:
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
        finally:
            rec.inside_base = False

    return scaled_dot_product_attention


def _fast_recorder(rec: _Recorder, original):
    def scaled_dot_product_attention(q, k, v, *args, **kwargs):
        if not rec.inside_base:
            _record(rec, "fast", q, k, v, None, kwargs.get("mask"), kwargs.get("sinks"))
        return original(q, k, v, *args, **kwargs)

    return scaled_dot_product_attention


def _leaf(path: tuple, obj, rec: _Recorder):
    kind = _KV_KINDS.get(type(obj))
    if isinstance(obj, mlx_cache.ArraysCache):
        return StateLeaf(path, tuple(None if a is None else (tuple(a.shape[1:]), _dtype(a.dtype)) for a in obj.cache))
    if kind is None or (kind == "window" and obj.keep != 0):
        name = type(obj).__name__ + (f"(keep={obj.keep})" if kind else "")
        return UnknownLeaf(path, name)
    writes = rec.writes.get(path)
    if not writes:
        return UnusedLeaf(path, type(obj).__name__)
    k_shape, v_shape, dtype, _ = writes[-1]
    span = None if kind == "full" else (obj.max_size if kind == "window" else obj.chunk_size)
    consumers, routed, sinks = _consumption(path, obj, rec)
    return KVLeaf(
        path,
        kind,
        span,
        k_shape[1],
        k_shape[-1],
        v_shape[-1],
        _dtype(dtype),
        k_is_v=all(w[3] for w in writes),
        q_heads=rec.q_heads.get(path),
        sinks=sinks,
        consumers=consumers,
        routed=routed,
    )


def _consumption(path: tuple, obj, rec: _Recorder) -> tuple[tuple[str, ...], bool, bool]:
    """How the decode step used this leaf's K/V: consumer words (layout.CONSUMERS), routed, sinks."""
    words, sinks = set(), False
    for call in rec.calls:
        mine = call.k_from is not None and call.k_from[0] == path
        if not mine and not (call.via == "base" and call.cache is obj):
            continue
        sinks |= call.sinks
        words.add(_consumer_word(path, obj, call, rec))
    consumers = tuple(sorted(words))
    return consumers, consumers == ("sdpa",), sinks


def _consumer_word(path: tuple, obj, call: _Call, rec: _Recorder) -> str:
    if call.via == "fast":
        return "fast"
    if call.cache is not obj:
        return "sdpa-other-cache"
    if call.k_from != (path, "k"):
        return "sdpa-other-k"
    if call.v_from != (path, "v"):
        return "sdpa-other-v"
    if call.mask is not None and id(call.mask) not in rec.masks:
        return "sdpa-masked"
    return "sdpa"


def _dtype(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]
