"""Kernel self-check: run each paged-kernel variant a model needs (Metal, or its CUDA twin) once on a small
random case and compare it with the pure-MLX reference, so a kernel that does not compile or gives wrong
numbers on this GPU is replaced by the reference (mlxpaged.kernels.attention) instead of reaching a user's chat.

A variant is one compiled specialisation: dtype, key and value head dims, block size, GQA group and
sinks are template parameters, one-pass and two-pass are different kernels. The number of KV heads
and the lengths are runtime values, so a small case (3 sequences, 2 KV heads, at most 4 blocks
each) exercises the same code as a long chat. Results are cached per process per (variant, launcher).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.quantized_pages import Pool, QuantizedPages
from mlxpaged.kernels import paged_attention as pa
from mlxpaged.kernels.reference import paged_attention_reference

import mlx.core as mx
import numpy as np

# Largest |kernel - reference| / (1 + |reference|) accepted: about 8 units in the last place of the
# output dtype (measured through the CPU harness: float32 3e-7, float16 5e-4, bfloat16 4e-3).
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
# What MLX (Metal; CUDA's NVRTC) and the CPU harnesses (g++) say when a kernel source does not compile.
COMPILE_ERROR_MARKERS = ("Unable to build metal library", "Failed to compile kernel", "g++ failed")
CHECK_KV_HEADS = 2
REASON_CHARS = 300


@dataclass(frozen=True)
class KernelVariant:
    dtype: str  # "float16" | "bfloat16" | "float32"
    head_dim: int
    block_size: int
    gqa: int  # query heads per KV head
    two_pass: bool
    v_dim: int | None = None  # value head dim; None (also when given equal): the same as head_dim
    sinks: bool = False  # a sink logit per query head (gpt-oss)
    kv_bits: int | None = None  # quantized pages (the kernel's quantized variant); None: full precision
    kv_group: int | None = None  # their group size

    def __post_init__(self):
        if self.v_dim == self.head_dim:
            object.__setattr__(self, "v_dim", None)

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_dim is None else self.v_dim

    def describe(self) -> str:
        widths = f"D={self.head_dim}" + ("" if self.v_dim is None else f" DV={self.v_dim}")
        quantized = "" if self.kv_bits is None else f" q{self.kv_bits}/{self.kv_group}"
        return (
            f"{self.dtype} {widths} BS={self.block_size} G={self.gqa}{' sinks' if self.sinks else ''}{quantized} "
            f"{'two-pass' if self.two_pass else 'one-pass'}"
        )

    @property
    def quantization(self) -> KVQuantization | None:
        return None if self.kv_bits is None else KVQuantization(self.kv_bits, self.kv_group)


@dataclass(frozen=True)
class VariantCheck:
    variant: KernelVariant
    ok: bool
    reason: str | None  # None when ok; "compile error: ...", "exception: ..." or "mismatch: ..."
    seconds: float


def variants_for(
    *,
    dtype: str,
    head_dim: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    v_dim: int | None = None,
    sinks: bool = False,
    quantization: KVQuantization | None = None,
) -> list[KernelVariant]:
    """The one-pass and two-pass variants of one model's decode attention."""
    if dtype not in TOLERANCE:
        raise ValueError(f"kernel dtype must be one of {', '.join(TOLERANCE)}, got {dtype!r}")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads is not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    bits, size = (None, None) if quantization is None else (quantization.bits, quantization.group_size)
    return [
        KernelVariant(dtype, head_dim, block_size, group, two_pass, v_dim, sinks, bits, size)
        for two_pass in (False, True)
    ]


def unsupported_reason(variant: KernelVariant) -> str | None:
    """Why the kernel has no such variant (None: it has); the wrapper's own shape rules."""
    dtype = getattr(mx, variant.dtype)
    q = mx.zeros((1, variant.gqa, 1, variant.head_dim), dtype)
    k_pool = _pool(mx.zeros((1, 1, variant.block_size, variant.head_dim), dtype), variant)
    v_pool = _pool(mx.zeros((1, 1, variant.block_size, variant.value_dim), dtype), variant)
    sinks = mx.zeros((variant.gqa,)) if variant.sinks else None
    return pa.unsupported_reason(q, k_pool, v_pool, mx.zeros((1, 1), mx.int32), sinks=sinks)


def _pool(pool: mx.array, variant: KernelVariant) -> Pool:
    """`pool` as the variant's pages hold it: quantized by `mx.quantize` for a quantized variant."""
    quantization = variant.quantization
    if quantization is None:
        return pool
    blocks, heads, size, dim = pool.shape
    pages = QuantizedPages.zeros((blocks, heads, size, dim), pool.dtype, quantization)
    return pages.with_arrays(pages.quantize(pool))


_results: dict[tuple[KernelVariant, int, str], VariantCheck] = {}
_launchers: dict[int, object] = {}  # holds each launcher so its id stays unique while cached


def check_variant(variant: KernelVariant, launcher: Callable | None = None, language: str = "metal") -> VariantCheck:
    """Run ``variant`` of the ``language`` source ("metal" or "cuda") once on a small random case against the
    reference path (cached per process). ``launcher`` None runs on the GPU; tests and ``mlxpaged doctor`` pass
    a CPU harness."""
    key = (variant, id(launcher), language)
    if key not in _results:
        _launchers[id(launcher)] = launcher
        _results[key] = _run_check(variant, launcher, language)
    return _results[key]


def clear_checks() -> None:
    """Forget every cached result (tests that change the kernel source)."""
    _results.clear()
    _launchers.clear()


def _run_check(variant: KernelVariant, launcher: Callable | None, language: str) -> VariantCheck:
    start = time.perf_counter()
    try:
        reason = _compare(variant, launcher, language)
    except Exception as exc:  # a kernel that fails in any way is not used; the reason says how
        reason = failure_reason(exc)
    return VariantCheck(variant, reason is None, reason, time.perf_counter() - start)


def failure_reason(exc: Exception) -> str:
    """ "compile error: <the compiler's first error line>" or "exception: <type>: <message>"."""
    text = str(exc)
    if any(marker in text for marker in COMPILE_ERROR_MARKERS):
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        errors = [line for line in lines if "error:" in line] or lines[-1:]
        return f"compile error: {errors[0][:REASON_CHARS]}"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"exception: {type(exc).__name__}: {first[:REASON_CHARS]}"


def _compare(variant: KernelVariant, launcher: Callable | None, language: str) -> str | None:
    """None when the kernel matches the reference within the dtype's tolerance, else why not."""
    unsupported = unsupported_reason(variant)
    if unsupported:
        raise ValueError(f"no such kernel variant: {unsupported}")
    args, sinks = _random_case(variant)
    partition = variant.block_size * 3 // 2  # partition edges inside blocks as well as on them
    got = pa.paged_attention_kernel(
        *args,
        sinks=sinks,
        two_pass=variant.two_pass,
        partition_tokens=partition,
        launcher=launcher,
        language=language,
    )
    want = paged_attention_reference(*args, sinks=sinks)
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    error = float(mx.max(mx.abs(got - want) / (1.0 + mx.abs(want))))
    tolerance = TOLERANCE[variant.dtype]
    if not np.isfinite(error):
        return "mismatch: non-finite values in the kernel's output"
    if error > tolerance:
        return f"mismatch: max error {error:.3g} > tolerance {tolerance:g}"
    return None


def _random_case(
    variant: KernelVariant,
) -> tuple[tuple[mx.array, Pool, Pool, mx.array, mx.array, float], mx.array | None]:
    """((q, k_pool, v_pool, block_tables, context_lens, scale), sinks): 3 sequences over a shuffled pool.
    Lengths 1, BS + 1 and 3 BS + 5 cover a partial block, a block edge and several partitions; the
    tables' padding points at a block of other data, so reading past a length shows as a mismatch."""
    bs, dim = variant.block_size, variant.head_dim
    rng = np.random.default_rng(0)
    lens = [1, bs + 1, 3 * bs + 5]
    needed = [-(-n // bs) for n in lens]
    num_blocks = sum(needed) + 1
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), max(needed)), ids[-1], dtype=np.int32)
    at = 0
    for row, n in enumerate(needed):
        tables[row, :n] = ids[at : at + n]
        at += n
    dtype = getattr(mx, variant.dtype)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    heads = variant.gqa * CHECK_KV_HEADS
    q = normal(len(lens), heads, 1, dim)
    k_pool = _pool(normal(num_blocks, CHECK_KV_HEADS, bs, dim), variant)
    v_pool = _pool(normal(num_blocks, CHECK_KV_HEADS, bs, variant.value_dim), variant)
    # Sinks around the scores' range: some heads' sinks dominate, others barely count.
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32) * 2 + 1) if variant.sinks else None
    return (q, k_pool, v_pool, mx.array(tables), mx.array(lens, dtype=mx.int32), dim**-0.5), sinks
