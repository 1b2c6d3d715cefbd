"""Paged attention entry point: the Metal kernel on Apple GPUs, MLX's fused attention on other GPUs
(CUDA; its CUDA twin of the kernel when asked for), the CPU path on MLX's CPU backend, the pure-MLX
reference as the oracle and fallback.

The engine's routed attention calls ``paged_attention`` for decode passes (one new token per
sequence: the pages are read in place by the kernel) and ``eager_sdpa`` for prefill and chunked prefill
(over the K/V the cache view gathered), except a batch-1 chunk of a few queries on the cpu backend,
which ``paged_prefill_attention`` computes straight from the pages (``reads_pages_in_place``). Shapes:

- K/V pools, per layer: K ``[num_blocks, num_kv_heads, block_size, k_dim]``, V the same with its own
  ``v_dim`` (latent caches); token ``t`` of a sequence is at ``pool[table[t // block_size], :, t % block_size, :]``.
  A call reads the pools only; new K/V are written by the cache (indexed assignment) *before* attending.
  Outputs have V's width.
- ``sinks``: ``None`` or one float32 logit per query head (gpt-oss) that joins each softmax as a key
  with no value (reference.py has the formula); every path takes it.
- ``num_heads`` must be a multiple of ``num_kv_heads`` (GQA: query head ``h`` reads KV head
  ``h // (num_heads // num_kv_heads)``).
- ``window``: ``None`` for full attention, else a query at position ``p`` sees keys ``p-window+1 .. p``.

Backend choice: ``set_attention_backend`` / ``attention_backend(...)`` or the environment variable
``MLXPAGED_ATTENTION`` = ``auto`` (default, from platform/backend.py: ``kernel`` on a Metal GPU,
``fused`` on a CUDA GPU, ``cpu`` on MLX's CPU backend), ``kernel`` (the paged kernel: paged_attention.metal on
a Mac, its CUDA twin paged_attention.cu on MLX's CUDA backend, where it is not the default until measured on a
GPU), ``fused`` (the K/V the cache view
gathered, attended by ``mx.fast.scaled_dot_product_attention`` with no mask array where none is
needed, so MLX's fused decode kernels run; never NumPy or host math), ``cpu``
(kernels/cpu_attention.py: pages read in place with ``mx.gather_mm`` and a cheaper softmax, quantized
pages' integer levels through float32 matmuls, prefill in NumPy) or ``reference`` (gathered pages +
``mx.fast.scaled_dot_product_attention``; quantized pages: ``mx.quantized_matmul``).
Forcing ``kernel`` without a GPU raises unless a kernel launcher is installed
(``set_kernel_launcher``: tests run either source through its CPU harness); shapes a fast path does not
support (kernel: see ``kernel_supports``; cpu: pools that are not float32, or quantized pages whose scales
are not) run on the reference path.

Kernel self-check: before the kernel's first use, each variant a model needs is run once on a small
case against the reference (kernels/self_check.py; the engine calls ``prepare_attention``). A variant
that fails to compile, raises or gives wrong numbers is attended by the reference path instead, with
one RuntimeWarning. ``prepare_model_attention`` returns the model's ``PreparedAttention``, which its engine
keeps: ``status()`` says which path attends that model now and why (two engines, two statuses).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from mlxpaged.cache.kv_quant import KVQuantization
from mlxpaged.cache.quantized_pages import Pool, QuantizedPages, is_quantized
from mlxpaged.kernels import paged_attention as pa
from mlxpaged.kernels.cpu_attention import attend, decode_attention_cpu, paged_attention_cpu
from mlxpaged.kernels.numpy_attention import (
    attend_numpy,
    attend_pages_numpy,
    numpy_attention_applies,
    pages_in_place_apply,
)
from mlxpaged.kernels.quantized_attention import UNPACKED_4BIT_MIN_KEYS
from mlxpaged.kernels.reference import (
    attend_pages,
    check_pools,
    fast_sinks,
    paged_attention_reference,
    paged_prefill_attention_reference,
)
from mlxpaged.kernels.self_check import KernelVariant, VariantCheck, check_variant, variants_for
from mlxpaged.platform import backend as compute_backend

import mlx.core as mx

ENV_VAR = "MLXPAGED_ATTENTION"
BACKENDS = ("auto", "kernel", "fused", "cpu", "reference")
AUTO_CHOICE = {"metal": "kernel", "cuda": "fused", "cpu": "cpu"}  # platform/backend.py's name -> path

_override: str | None = None
_launcher: Callable | None = None  # runs the kernel; None: this process's GPU (Metal or CUDA)
_decisions: dict[KernelVariant, VariantCheck] = {}  # checked for the current launcher: kernel if ok, else reference
_warned: set[KernelVariant] = set()
DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


def set_attention_backend(name: str | None) -> None:
    """Force "kernel" or "reference" ("auto" or None: back to the environment / automatic choice)."""
    global _override
    _override = None if name is None else _check_backend(name)


@contextmanager
def attention_backend(name: str) -> Iterator[None]:
    """Temporarily force a backend (tests, benchmarks)."""
    global _override
    previous = _override
    set_attention_backend(name)
    try:
        yield
    finally:
        _override = previous


def set_kernel_launcher(launcher: Callable | None) -> None:
    """Run the kernel through ``launcher`` (``launcher(kernel, **call) -> outputs``, e.g. the CPU
    harness's ``Emulator``), which lets ``kernel`` be forced without a GPU; None: the GPU.
    Variants are checked again for a new launcher."""
    global _launcher
    _launcher = launcher
    _decisions.clear()
    _warned.clear()


@contextmanager
def kernel_launcher(launcher: Callable | None) -> Iterator[None]:
    """Temporarily run the kernel through ``launcher`` (tests)."""
    previous = _launcher
    set_kernel_launcher(launcher)
    try:
        yield
    finally:
        set_kernel_launcher(previous)


def metal_available() -> bool:
    return compute_backend.current() == "metal"


def gpu_kernel_available() -> bool:
    """A GPU the paged kernel has a source for: Metal, or MLX's CUDA backend (its CUDA twin)."""
    return compute_backend.current() in compute_backend.GPU_BACKENDS


def _requested() -> str:
    """The backend asked for: the override, else the environment variable, else "auto"."""
    return _override or _check_backend(os.environ.get(ENV_VAR, "auto").strip().lower() or "auto")


def resolved_backend() -> str:
    """ "kernel", "fused", "cpu" or "reference": what ``paged_attention`` would use for supported shapes."""
    name = _requested()
    if name == "auto":
        return AUTO_CHOICE[compute_backend.current()]
    if name == "kernel" and not gpu_kernel_available() and _launcher is None:
        raise RuntimeError(
            f"the paged-attention kernel was forced ({ENV_VAR} or "
            "set_attention_backend) but MLX has no Metal GPU here, nor a CUDA one"
        )
    return name


def _float32(k_pool: Pool, v_pool: Pool) -> bool:
    """The NumPy prefill paths' pools: float32, the CPU backend's fast dtype, stored as such (quantized pages
    are gathered dequantized by the reference's prefill instead)."""
    plain = not is_quantized(k_pool) and not is_quantized(v_pool)
    return plain and k_pool.dtype == mx.float32 and v_pool.dtype == mx.float32


def _cpu_decode_pools(k_pool: Pool, v_pool: Pool) -> bool:
    """The CPU decode path's pools: float32 (others take the reference), or quantized pages of float32 scales
    both (kernels/quantized_attention.py `attend_quantized_unpacked`, or the quantized matmuls where faster)."""
    if is_quantized(k_pool) or is_quantized(v_pool):
        both = is_quantized(k_pool) and is_quantized(v_pool)
        return both and k_pool.dtype == mx.float32 and v_pool.dtype == mx.float32
    return _float32(k_pool, v_pool)


def paged_attention(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode: one query token per sequence over its pages.

    q [B, num_heads, 1, Dk]; block_tables [B, max_blocks] int32 (entries past a sequence's blocks
    are ignored; keep the table no wider than the longest sequence needs); context_lens [B] int32
    (an mx.array, or a tuple of ints), tokens in the pool including the current one (0 gives a
    zero output); sinks [num_heads] or None.
    Returns [B, num_heads, 1, Dv] in q's dtype.
    """
    backend = resolved_backend()
    if backend == "kernel" and pa.kernel_supports(q, k_pool, v_pool, block_tables, window, sinks):
        two_pass = pa.use_two_pass(
            q.shape[0], k_pool.shape[1], pa.attended_span(block_tables.shape[1], k_pool.shape[2], window)
        )
        if _kernel_passed(_variant(q, k_pool, v_pool, sinks, two_pass)):
            return pa.paged_attention_kernel(
                q,
                k_pool,
                v_pool,
                block_tables,
                context_lens,
                scale,
                window,
                sinks,
                two_pass=two_pass,
                launcher=_launcher,
                language=_language(),
            )
    if backend == "cpu" and _cpu_decode_pools(k_pool, v_pool):
        return paged_attention_cpu(q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)
    return paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale, window, sinks)


def kernel_attention_with_tail(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens,
    tail_k: mx.array,
    tail_v: mx.array,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array | None:
    """Decode over each sequence's first ``context_lens`` tokens in the pools, then the ``tail_k`` /
    ``tail_v`` [B, KVH, T, D] keys after them (K/V not written yet: runner/deferred_writes.py), by the
    paged kernel with the tail merged as one more partition; None when the kernel does not attend here
    (another backend, a shape it cannot take, a variant that failed its self-check)."""
    if isinstance(k_pool, QuantizedPages) or isinstance(v_pool, QuantizedPages):
        return None
    if resolved_backend() != "kernel" or not pa.kernel_supports(q, k_pool, v_pool, block_tables, None, sinks):
        return None
    if not _kernel_passed(_variant(q, k_pool, v_pool, sinks, two_pass=True)):
        return None
    tail = pa.tail_partials(q, tail_k, tail_v, scale)
    return pa.paged_attention_kernel(
        q,
        k_pool,
        v_pool,
        block_tables,
        context_lens,
        scale,
        None,
        sinks,
        launcher=_launcher,
        tail=tail,
        language=_language(),
    )


def reads_pools(backend: str | None = None) -> bool:
    """True when routed decode calls read the page pools (``paged_attention``); False on the fused
    path, which attends the K/V the cache view gathered (routing.py)."""
    return (backend or resolved_backend()) != "fused"


def sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
    backend: str | None = None,
) -> mx.array:
    """Attention over contiguous K/V (prefill over the K/V a cache view gathered), with
    ``mx.fast.scaled_dot_product_attention``'s contract; ``cpu_attention.attend`` on the cpu path.
    ``backend``: `resolved_backend()` when the caller already has it (a pass resolves it once, not per layer)."""
    if (backend or resolved_backend()) == "cpu":
        return attend(q, k, v, scale, mask, sinks)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=fast_sinks(sinks, q.dtype))


def eager_sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask=None,
    sinks: mx.array | None = None,
    backend: str | None = None,
) -> mx.array:
    """``sdpa`` for eager passes (never inside ``mx.compile``): on the cpu backend a call big enough
    to pay for a sync is computed by NumPy (numpy_attention.py), ~3.5x faster on long prefills."""
    backend = backend or resolved_backend()
    if _numpy_allowed(backend) and numpy_attention_applies(q, k, mask):
        return attend_numpy(q, k, v, scale, mask, sinks)
    return sdpa(q, k, v, scale, mask, sinks, backend)


def reads_pages_in_place(q: mx.array, k_pool: Pool, v_pool: Pool, context: int) -> bool:
    """True when a batch-1 prefill chunk over ``context`` positions is faster through
    ``paged_prefill_attention`` (pages read in place) than through ``eager_sdpa`` over gathered K/V."""
    return _numpy_allowed() and _float32(k_pool, v_pool) and pages_in_place_apply(q, context)


def _numpy_allowed(backend: str | None = None) -> bool:
    """NumPy attention only on the cpu path of MLX's CPU backend: on a GPU it would sync and copy to the host."""
    return (backend or resolved_backend()) == "cpu" and compute_backend.tuning().numpy_attention


def paged_prefill_attention(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_table,
    prefix_len: int,
    chunk_len: int,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Prefill / chunked prefill of one request: ``chunk_len`` new queries after ``prefix_len`` cached tokens.

    q [1, num_heads, chunk_len, D]; block_table [n_blocks] int32 covering at least
    ``prefix_len + chunk_len`` tokens; the chunk's K/V must already be in the pool. Query ``i``
    sits at position ``prefix_len + i`` (causal offset). Returns [1, num_heads, chunk_len, D].
    On the cpu backend, full attention over float32 pools reads the pages in place with NumPy
    (numpy_attention.py); elsewhere pure MLX over gathered pages (see reference.py for where a Metal
    varlen kernel would go).
    """
    numpy_case = window is None and q.shape[0] == 1 and q.shape[2] == chunk_len >= 1 and prefix_len >= 0
    if isinstance(k_pool, QuantizedPages) or isinstance(v_pool, QuantizedPages):
        pass  # quantized pages: the reference gathers them dequantized
    elif numpy_case and _numpy_allowed() and _float32(k_pool, v_pool):
        check_pools(q, k_pool, v_pool, sinks)
        return attend_pages_numpy(q, k_pool, v_pool, block_table, prefix_len + chunk_len, scale, sinks)
    return paged_prefill_attention_reference(
        q, k_pool, v_pool, block_table, prefix_len, chunk_len, scale, window, sinks
    )


def decode_attention(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    rows: mx.array,
    mask: mx.array,
    scale: float,
    sinks: mx.array | None = None,
) -> mx.array:
    """Decode attention from array inputs only, for compiled passes (no host lengths): ``rows``
    [B, KVH, nb] page rows (``reference.page_rows``), ``mask`` [B, 1, 1, nb * BS] bool (key in the
    sequence; every sequence has at least one). Same result as ``paged_attention``."""
    if resolved_backend() == "cpu" and _cpu_decode_pools(k_pool, v_pool):
        return decode_attention_cpu(q, k_pool, v_pool, rows, mask, scale, sinks)
    return attend_pages(q, k_pool, v_pool, rows, mask, scale, sinks)  # quantized pages: the quantized matmuls


# --- kernel self-check: which variants the kernel attends, and why -------------------------------


def _variant(q: mx.array, k_pool: Pool, v_pool: Pool, sinks: mx.array | None, two_pass: bool) -> KernelVariant:
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    quantization = k_pool.quantization if isinstance(k_pool, QuantizedPages) else None
    return KernelVariant(
        DTYPE_NAMES[q.dtype],
        q.shape[3],
        k_pool.shape[2],
        heads // kv_heads,
        two_pass,
        v_pool.shape[3],
        sinks is not None,
        None if quantization is None else quantization.bits,
        None if quantization is None else quantization.group_size,
    )


def _kernel_passed(variant: KernelVariant) -> bool:
    """The hot path's lookup; a variant no engine prepared is checked here, once, on first use."""
    check = _decisions.get(variant)
    return (check or _check_variants([variant])[0]).ok


def _language() -> str:
    """The kernel source in use: the launcher's own (a CPU harness says which it runs), else this GPU's."""
    return getattr(_launcher, "language", None) or pa.kernel_language()


def _check_variants(variants: list[KernelVariant]) -> list[VariantCheck]:
    """Check (or look up) each variant; one RuntimeWarning names the failures not reported yet."""
    checks = [check_variant(variant, _launcher, _language()) for variant in variants]
    _decisions.update((check.variant, check) for check in checks)
    new = [check for check in checks if not check.ok and check.variant not in _warned]
    if new:
        _warned.update(check.variant for check in new)
        warnings.warn(fallback_warning(new), RuntimeWarning, stacklevel=4)
    return checks


def fallback_warning(failed: list[VariantCheck]) -> str:
    what = "; ".join(f"{check.variant.describe()} ({check.reason})" for check in failed)
    return (
        f"the {_SOURCE_NAMES[_language()]} paged-attention kernel failed its self-check for {what}: the pure-MLX "
        f"reference path attends for {'it' if len(failed) == 1 else 'them'} instead (correct, slower). "
        f"Please report this with the output of `mlxpaged doctor`."
    )


@dataclass(frozen=True)
class PreparedAttention:
    """What one model asks of decode attention, kept by the engine that prepared it: its K/V dtype, why the
    kernel cannot take its pools (None: it can) and the kernel variants it needs."""

    dtype: str
    unsupported: str | None
    variants: tuple[KernelVariant, ...] = ()
    quantized: bool = False  # quantized pages: the kernel's quantized variant, elsewhere quantized matmuls

    def status(self) -> dict:
        """``attention_status`` for this model: the path that attends it now and why."""
        return attention_status(self)


def prepare_attention(
    dtype: mx.Dtype,
    head_dim: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    v_dim: int | None = None,
    sinks: bool = False,
    quantization: KVQuantization | None = None,
) -> PreparedAttention:
    """Called once per engine before its first decode: on the kernel path, self-check the variants
    this model needs (cached per process); ``v_dim`` None: V as wide as K; ``quantization``: quantized pages."""
    q = mx.zeros((1, num_heads, 1, head_dim), dtype)
    k_pool = _empty_pool((1, num_kv_heads, block_size, head_dim), dtype, quantization)
    v_pool = _empty_pool((1, num_kv_heads, block_size, v_dim or head_dim), dtype, quantization)
    sink_logits = mx.zeros((num_heads,)) if sinks else None
    unsupported = pa.unsupported_reason(q, k_pool, v_pool, mx.zeros((1, 1), mx.int32), sinks=sink_logits)
    name = DTYPE_NAMES.get(dtype, str(dtype))
    quantized = quantization is not None
    if unsupported is not None:
        return PreparedAttention(name, unsupported, quantized=quantized)
    variants = tuple(
        variants_for(
            dtype=name,
            head_dim=head_dim,
            block_size=block_size,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            v_dim=v_dim,
            sinks=sinks,
            quantization=quantization,
        )
    )
    if resolved_backend() == "kernel":
        _check_variants(list(variants))
    return PreparedAttention(name, None, variants, quantized)


def _empty_pool(shape: tuple[int, int, int, int], dtype: mx.Dtype, quantization: KVQuantization | None) -> Pool:
    return mx.zeros(shape, dtype) if quantization is None else QuantizedPages.zeros(shape, dtype, quantization)


def prepare_model_attention(
    dtype: mx.Dtype,
    block_size: int,
    geometries: list[tuple[int, int, int, int, bool]],
    quantization: KVQuantization | None = None,
) -> PreparedAttention:
    """`prepare_attention` for each (query heads, KV heads, K width, V width, sinks) a model's pools hold
    (paged_support.attention_geometries); the result names every geometry the kernel cannot take.
    `quantization`: the pools hold quantized pages (the kernel's quantized variants)."""
    prepared = [
        prepare_attention(dtype, k_dim, block_size, heads, kv_heads, v_dim, sinks, quantization)
        for heads, kv_heads, k_dim, v_dim, sinks in geometries
    ]
    reasons = list(dict.fromkeys(p.unsupported for p in prepared if p.unsupported is not None))
    variants = tuple(dict.fromkeys(v for p in prepared for v in p.variants))
    name = DTYPE_NAMES.get(dtype, str(dtype))
    return PreparedAttention(name, "; ".join(reasons) or None, variants, quantization is not None)


def attention_status(prepared: PreparedAttention | None = None) -> dict:
    """{"path": "kernel" | "fused" | "cpu" | "reference" | "kernel (with reference fallback)", "reason": str,
    "variants": [VariantCheck, ...]}: the decode attention in use now and why, for a prepared model (its
    variants) or, with None, for any model (every variant checked in this process)."""
    backend = resolved_backend()
    forced = _requested() != "auto"
    variants = _checked(prepared) if backend == "kernel" else []
    if backend == "reference":
        return _status("reference", f"forced ({ENV_VAR} or set_attention_backend)", variants)
    if backend == "fused":
        why = "forced" if forced else "a CUDA GPU (MLX's CUDA backend)"
        return _status(
            "fused",
            f"{why}: gathered pages attended by MLX's fused attention "
            "(no mask array at batch 1, so its decode kernels run)",
            variants,
        )
    if backend == "cpu":
        why = "forced" if forced else "MLX's CPU backend"
        if prepared is not None and prepared.dtype != "float32":
            what = "quantized pages of float32 scales" if prepared.quantized else "float32 K/V"
            return _status(
                "reference", f"{why}; the CPU path takes {what}, this model's are {prepared.dtype}", variants
            )
        if prepared is not None and prepared.quantized:
            return _status(
                "cpu",
                f"{why}: quantized pages taken packed, their integer levels attended by float32 matmuls with the "
                f"scales and biases folded around them (4-bit below {UNPACKED_4BIT_MIN_KEYS} keys: quantized matmuls)",
                variants,
            )
        return _status("cpu", f"{why}: pages read in place", variants)
    if prepared is not None and prepared.unsupported is not None:
        return _status("reference", f"the paged kernel cannot take this model: {prepared.unsupported}", variants)
    return _kernel_status(variants)


def _checked(prepared: PreparedAttention | None) -> list[VariantCheck]:
    """The self-check results of a prepared model's variants (None: of every variant checked so far)."""
    if prepared is None:
        return list(_decisions.values())
    return [_decisions[v] for v in prepared.variants if v in _decisions]


_SOURCE_NAMES = {"metal": "Metal", "cuda": "CUDA"}


def _kernel_status(variants: list[VariantCheck]) -> dict:
    source = _SOURCE_NAMES[_language()]
    where = f"the {source} GPU" if _launcher is None else f"launcher {type(_launcher).__name__} ({source} source)"
    failed = [check for check in variants if not check.ok]
    if not variants:
        return _status("kernel", f"on {where}; each variant is self-checked before its first use", variants)
    if not failed:
        names = ", ".join(check.variant.describe() for check in variants)
        return _status("kernel", f"self-check passed on {where} for {names}", variants)
    what = "; ".join(f"{check.variant.describe()}: {check.reason}" for check in failed)
    path = "reference" if len(failed) == len(variants) else "kernel (with reference fallback)"
    return _status(path, f"self-check failed on {where} for {what}; the reference path attends for those", variants)


def _status(path: str, reason: str, variants: list[VariantCheck]) -> dict:
    return {"path": path, "reason": reason, "variants": variants}
