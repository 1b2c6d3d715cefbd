"""mlx-lm's greedy decode with its K/V stored as quantized pages would store them: the twin the engine's
quantized pages (`kv_bits`) are checked against.

mlx-lm's own QuantizedKVCache only replaces KVCache (a sliding window's RotatingKVCache cannot be quantized
there) and mlx-lm's generate attends the prompt's prefill pass in full precision before it quantizes. So the
twin runs mlx-lm's own caches (`make_prompt_cache`), each of whose `update_and_fetch` receives its new K/V
already quantized and dequantized (as the pages quantize, at the engine's bits and group size): every
attention, the prompt's prefill pass included, then reads exactly the values the engine's pages hold. The
prompt goes in one pass (`one_at_a_time=False`, as the engine prefills it) or token by token; for
full-attention models the latter equals QuantizedKVCache fed token by token (tests/engine/test_engine_quantized.py
checks the engine against both).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache import group_fit
from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.kv_transform import KVTransform
from mlxpaged.runner.activation_routing import engine_activations, route_for_backend

import mlx.core as mx
import mlx_lm.models.cache as mlx_cache

# mlx-lm's cache classes that take new K/V (QuantizedKVCache and the batch caches are not what models make).
LAYER_ATTR = "_mlxpaged_twin_layer"  # the KV layer a twin's cache holds (for the transform)
_KV_CLASSES = (mlx_cache.KVCache, mlx_cache.RotatingKVCache, mlx_cache.ChunkedKVCache, mlx_cache.ConcatenateKVCache)


def round_trip(x: mx.array, bits: int, group_size: int | None) -> mx.array:
    """`x` as a quantized page holds it: quantized over its last axis as the pages quantize it (`mx.quantize`'s
    groups, or least-squares fitted 4-bit groups: cache/group_fit.py, checked against its NumPy twin in
    tests/cache/test_group_fit.py), then dequantized."""
    return group_fit.round_trip(x, KVQuantization(bits, group_size))


@contextmanager
def quantized_kv_caches(
    bits: int, group_size: int | None = None, transform: KVTransform | None = None
) -> Iterator[None]:
    """While inside, every mlx-lm KV cache stores (and returns) its new K/V round-tripped through quantization;
    with `transform` (the engine's `kv.transform`), a cache tagged with its layer (`LAYER_ATTR`) round-trips
    them in the pages' coordinates: into them, quantized, dequantized, and back. Models run the engine's
    activations meanwhile (on the CPU backend its SwiGLU, runner/activation_routing.py): a value an ulp from a
    rounding boundary would otherwise round to the level next to the engine's."""
    originals = {cls: cls.__dict__["update_and_fetch"] for cls in _KV_CLASSES}

    def wrap(original):
        def update_and_fetch(self, keys, values):
            same = values is keys  # K-is-V caches pass one array twice: keep them one
            layer = getattr(self, LAYER_ATTR, None)
            if transform is not None and layer is not None and transform.applies(layer) and not same:
                keys = transform.keys_out(layer, round_trip(transform.keys_in(layer, keys), bits, group_size))
                values = transform.values_out(layer, round_trip(transform.values_in(layer, values), bits, group_size))
                return original(self, keys, values)
            keys = round_trip(keys, bits, group_size)
            return original(self, keys, keys if same else round_trip(values, bits, group_size))

        return update_and_fetch

    route_for_backend()  # the engine's activations too (runner/activation_routing.py): the values its pages hold
    try:
        for cls, original in originals.items():
            cls.update_and_fetch = wrap(original)
        with engine_activations():
            yield
    finally:
        for cls, original in originals.items():
            cls.update_and_fetch = original


def quantized_greedy(
    model,
    prompt: list[int],
    max_tokens: int,
    bits: int,
    group_size: int | None = None,
    one_at_a_time: bool = False,
    transform: KVTransform | None = None,
):
    """(tokens, top-2 log-prob gaps) of greedy decoding over quantized K/V (`transform`: in the coordinates
    the engine's pages hold them in; models with one KV cache per layer, in layer order, like the engine's)."""
    tokens: list[int] = []
    gaps: list[float] = []
    with quantized_kv_caches(bits, group_size, transform):
        cache = mlx_cache.make_prompt_cache(model)
        if transform is not None:
            if len(cache) != len(transform.layers):
                raise ValueError(f"{len(cache)} caches for a transform of {len(transform.layers)} layers")
            for layer, c in enumerate(cache):
                setattr(c, LAYER_ATTR, layer)
        for piece in [[t] for t in prompt[:-1]] if one_at_a_time else [prompt[:-1]] if len(prompt) > 1 else []:
            mx.eval(model(mx.array([piece]), cache=cache))
        last = prompt[-1]
        for _ in range(max_tokens):
            logits = model(mx.array([[last]]), cache=cache)[0, -1].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits)
            top2 = mx.sort(logprobs)[-2:].tolist()
            last = int(mx.argmax(logprobs).item())
            tokens.append(last)
            gaps.append(top2[1] - top2[0])
    return tokens, gaps


# How far one K/V element stored at the neighbouring level moves a greedy step's log-probs, at most, in the tests'
# tiny models (seen: 1.3e-2 at 8 bits, 9e-2 at 4). A twin whose float rounding differs from the engine's stores
# such neighbours now and then: another row count in a matmul (OpenBLAS's Haswell kernels round a row by how many
# rows share the call: a ragged batch against one prompt a pass, issue 41), another attention form. A step whose
# top-2 gap in the twin is below this is a near-tie: either token is a fair answer, and what follows it differs.
FLIP_GAP = {8: 2e-2, 4: 2e-1}


def assert_equal_up_to_near_ties(got: list[list[int]], references: list[tuple[list[int], list[float]]], bits: int):
    """Each of `got` equals its reference's tokens up to the reference's first near-tie (FLIP_GAP); a reference is
    (tokens, top-2 log-prob gaps), as `quantized_greedy` returns them."""
    for tokens, (want, gaps) in zip(got, references, strict=True):
        assert len(tokens) == len(want), (tokens, want)
        for step, (g, w) in enumerate(zip(tokens, want, strict=True)):
            if g != w:
                assert gaps[step] < FLIP_GAP[bits], f"token {step}: {g} != the reference's {w} (gap {gaps[step]:.3g})"
                break


def assert_greedy_matches(got: list[list[int]], model, prompts: list[list[int]], bits: int, **twin) -> None:
    """Each of `got` equals the quantized twin's greedy tokens for its prompt (`quantized_greedy` with `twin`'s
    settings, as many tokens as got), up to the twin's first near-tie."""
    references = [quantized_greedy(model, p, len(t), bits, **twin) for t, p in zip(got, prompts, strict=True)]
    assert_equal_up_to_near_ties(got, references, bits)
