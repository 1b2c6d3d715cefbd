"""Python side of the paged-attention decode kernel: paged_attention.metal for Apple GPUs and its CUDA twin
paged_attention.cu for NVIDIA GPUs (the same inputs, grid, outputs and results; `kernel_language`).

Kernels are built once per variant with ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` and specialised
by template on dtype, key and value head dims, block size, GQA group size, simdgroup (warp) count and
whether the heads have sink logits (gpt-oss). Any ``launcher`` with the call signature of a kernel can run
them (tests pass the Metal-on-CPU emulator, or the CUDA-on-CPU one, which reads a `CudaKernel`'s source).

One pass or two: a one-pass dispatch has ``batch * num_kv_heads`` threadgroups. When that is
too few to fill an Apple GPU (< ``TWO_PASS_MAX_GROUPS``) and a sequence can attend at least
``TWO_PASS_MIN_TOKENS`` tokens, each sequence's span is split into ``PARTITION_TOKENS``-token
partitions (vLLM's v2 partition size), computed in parallel, then merged by a reduce kernel.
The span bound comes from the block table width (and the window), so choosing costs no sync.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property, lru_cache
from pathlib import Path

from mlxpaged.cache.quantized_pages import Pool, QuantizedPages
from mlxpaged.config import VALID_BLOCK_SIZES
from mlxpaged.platform import backend as compute_backend

import mlx.core as mx

SOURCE_PATHS = {
    "metal": Path(__file__).with_name("paged_attention.metal"),
    "cuda": Path(__file__).with_name("paged_attention.cu"),
}
LANGUAGES = tuple(SOURCE_PATHS)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
BLOCK_SIZES = VALID_BLOCK_SIZES  # the settings accept exactly what the kernel has variants for
MAX_HEAD_DIM = 256
MAX_QUERY_VALUES_PER_LANE = 64  # G * D / 32 registers each for q and o: bounds register use
NUM_SIMDGROUPS = 8
PARTITION_TOKENS = 512
TWO_PASS_MIN_TOKENS = 2048
TWO_PASS_MAX_GROUPS = 64

Launcher = Callable[..., list]

DECODE_INPUTS = ["queries", "k_pool", "v_pool", "block_tables", "context_lens", "params", "scale", "sinks"]
QUANTIZED_INPUTS = ["k_scales", "k_biases", "v_scales", "v_biases"]  # after DECODE_INPUTS, quantized variant only

REDUCE_INPUTS = ["o_part", "m_part", "l_part", "params", "sinks"]


def kernel_language() -> str:
    """The kernel source this process runs: "cuda" on MLX's CUDA backend, else "metal" (a Mac, or the Metal
    kernel forced elsewhere through a launcher: the tests' Metal-on-CPU emulator)."""
    return "cuda" if compute_backend.current() == "cuda" else "metal"


def _check_language(language: str) -> str:
    if language not in LANGUAGES:
        raise ValueError(f"kernel language must be one of {', '.join(LANGUAGES)}, got {language!r}")
    return language


@cache
def source_sections(language: str = "metal") -> dict[str, str]:
    """The kernel file split at its ``// ==== name ====`` markers (the part before the first marker dropped)."""
    parts = re.split(r"^// ==== (\w+) ====\n", SOURCE_PATHS[_check_language(language)].read_text(), flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@dataclass(frozen=True)
class CudaKernel:
    """An ``mx.fast.cuda_kernel``, built on its first call: MLX refuses to build one without a CUDA GPU, and the
    CUDA-on-CPU emulator reads these fields instead (it writes the signature as MLX would)."""

    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str

    @cached_property
    def built(self):
        return mx.fast.cuda_kernel(
            name=self.name,
            input_names=list(self.input_names),
            output_names=list(self.output_names),
            source=self.source,
            header=self.header,
        )

    def __call__(self, **call) -> list:
        return self.built(**call)


def _make_kernel(language: str, name: str, inputs: list[str], outputs: list[str], body: str, header: str):
    if language == "cuda":
        return CudaKernel(name, tuple(inputs), tuple(outputs), body, header)
    return mx.fast.metal_kernel(name=name, input_names=inputs, output_names=outputs, source=body, header=header)


@cache
def decode_kernel(partitioned: bool, quantized: bool = False, language: str = "metal"):
    sections = source_sections(language)
    flag = int(partitioned)
    body = (
        f"#define PA_PARTITIONED {flag}\n#define PA_QUANTIZED {int(quantized)}\n{sections['paged_attention_decode']}"
        "#undef PA_PARTITIONED\n#undef PA_QUANTIZED\n#undef PA_LOAD_K\n#undef PA_LOAD_V\n"
    )
    outputs = ["o_part", "m_part", "l_part"] if partitioned else ["out"]
    name = ("paged_attention_partitioned" if partitioned else "paged_attention_decode") + (
        "_quantized" if quantized else ""
    )
    inputs = DECODE_INPUTS + (QUANTIZED_INPUTS if quantized else [])
    return _make_kernel(language, name, inputs, outputs, body, sections["header"])


@cache
def reduce_kernel(language: str = "metal"):
    sections = source_sections(language)
    return _make_kernel(
        language,
        "paged_attention_reduce",
        REDUCE_INPUTS,
        ["out"],
        sections["paged_attention_reduce"],
        sections["header"],
    )


def _width_reason(name: str, dim: int) -> str | None:
    if dim % 32 or not 32 <= dim <= MAX_HEAD_DIM:
        return f"{name} head dim {dim}: need a multiple of 32 up to {MAX_HEAD_DIM}"
    return None


def unsupported_reason(
    q: mx.array, k_pool: Pool, v_pool: Pool, block_tables, window=None, sinks: mx.array | None = None
) -> str | None:
    """Why the kernel cannot take these shapes (None: it can); such calls use the reference path. Quantized
    pages (QuantizedPages, K and V alike) take the quantized variant."""
    k_quant, v_quant = (p.quantization if isinstance(p, QuantizedPages) else None for p in (k_pool, v_pool))
    if k_quant != v_quant:
        return f"K pages {k_quant or 'full precision'}, V pages {v_quant or 'full precision'}: need them alike"
    if q.ndim != 4 or q.shape[2] != 1:
        return f"decode needs q [B, heads, 1, D], got {tuple(q.shape)}"
    if len(k_pool.shape) != 4 or len(v_pool.shape) != 4 or k_pool.shape[:3] != v_pool.shape[:3]:
        return f"K/V pools must share [blocks, kv_heads, block_size]: {k_pool.shape}, {v_pool.shape}"
    _, heads, _, head_dim = q.shape
    _, kv_heads, block_size, pool_dim = k_pool.shape
    v_dim = v_pool.shape[3]
    if not (q.dtype == k_pool.dtype == v_pool.dtype and q.dtype in DTYPES):
        return f"dtypes {q.dtype}/{k_pool.dtype}/{v_pool.dtype}: need one of float16, bfloat16, float32"
    if head_dim != pool_dim:
        return f"query head dim {head_dim} differs from the K pool's {pool_dim}"
    reason = _width_reason("key", head_dim) or _width_reason("value", v_dim)
    if reason:
        return reason
    if block_size not in BLOCK_SIZES:
        return f"block size {block_size}: need one of {BLOCK_SIZES}"
    if kv_heads == 0 or heads % kv_heads:
        return f"{heads} query heads is not a multiple of {kv_heads} KV heads"
    if heads // kv_heads * max(head_dim, v_dim) // 32 > MAX_QUERY_VALUES_PER_LANE:
        return f"GQA group {heads // kv_heads} x head dim {max(head_dim, v_dim)} needs too many registers"
    if window is not None and window < 1:
        return f"window {window}"
    if sinks is not None and tuple(sinks.shape) != (heads,):
        return f"sinks {tuple(sinks.shape)}: need one logit per query head ({heads},)"
    return None


def kernel_supports(q, k_pool, v_pool, block_tables, window=None, sinks=None) -> bool:
    return unsupported_reason(q, k_pool, v_pool, block_tables, window, sinks) is None


def attended_span(max_blocks: int, block_size: int, window: int | None) -> int:
    """Upper bound on the tokens one query attends, known without reading context_lens."""
    capacity = max_blocks * block_size
    return capacity if window is None else min(capacity, window)


def use_two_pass(batch: int, kv_heads: int, span: int) -> bool:
    """The documented rule: few threadgroups and a long span -> partition the span."""
    return batch * kv_heads < TWO_PASS_MAX_GROUPS and span >= TWO_PASS_MIN_TOKENS


def tail_partials(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """The kernel's partial sums (o unnormalised, running max m, sum l; float32, natural exp) of one query
    per sequence over contiguous ``keys`` [B, KVH, T, D] / ``values`` [B, KVH, T, DV], all attended:
    [B, H, 1, DV], [B, H, 1], [B, H, 1]."""
    batch, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(batch, kv_heads, heads // kv_heads, dim).astype(mx.float32) * scale
    scores = grouped @ keys.astype(mx.float32).swapaxes(-1, -2)  # [B, KVH, G, T]
    top = scores.max(axis=-1, keepdims=True)
    weights = mx.exp(scores - top)
    o = weights @ values.astype(mx.float32)  # [B, KVH, G, DV]
    return (o.reshape(batch, heads, 1, -1), top.reshape(batch, heads, 1), weights.sum(axis=-1).reshape(batch, heads, 1))


# Every layer of a pass passes the same small inputs (lengths, parameters, scale): built once, not per layer.
@lru_cache(maxsize=16)
def _int32s(values: tuple[int, ...]) -> mx.array:
    return mx.array(values, dtype=mx.int32)


@lru_cache(maxsize=16)
def _float32s(values: tuple[float, ...]) -> mx.array:
    return mx.array(values, dtype=mx.float32)


def _gpu_launch(kernel, **call) -> list:
    return kernel(**call)


def paged_attention_kernel(
    q: mx.array,
    k_pool: Pool,
    v_pool: Pool,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    *,
    two_pass: bool | None = None,
    partition_tokens: int = PARTITION_TOKENS,
    num_simdgroups: int = NUM_SIMDGROUPS,
    launcher: Launcher | None = None,
    tail: tuple | None = None,
    language: str | None = None,
) -> mx.array:
    """Decode attention with the paged kernel; same contract as ``attention.paged_attention``.

    ``language``: "metal" or "cuda", the source to run (default: the launcher's ``language`` attribute, which a
    CPU harness has, else `kernel_language`).
    ``two_pass`` forces the variant (default: ``use_two_pass``); the two-pass variant splits the
    attended span into ``partition_tokens``-token partitions. ``tail``: (o, m, l) float32 partial sums
    [B, H, 1, DV], [B, H, 1], [B, H, 1] of keys outside the pool (``tail_partials``), merged in the
    reduce as one more partition (forces two passes).
    """
    language = _check_language(language or getattr(launcher, "language", None) or kernel_language())
    reason = unsupported_reason(q, k_pool, v_pool, block_tables, window, sinks)
    if reason:
        raise ValueError(f"paged-attention kernel: unsupported call ({reason})")
    batch, heads, _, head_dim = q.shape
    _, kv_heads, block_size, _ = k_pool.shape
    v_dim = v_pool.shape[3]
    if batch == 0:
        return mx.zeros((batch, heads, 1, v_dim), q.dtype)
    tables = block_tables.astype(mx.int32)
    lens = (
        _int32s(tuple(context_lens))
        if isinstance(context_lens, (tuple, list))
        else mx.array(context_lens).astype(mx.int32)
    )
    max_blocks = tables.shape[1]
    span = attended_span(max_blocks, block_size, window)
    if tail is not None:
        two_pass = True
    elif two_pass is None:
        two_pass = use_two_pass(batch, kv_heads, span)
    if partition_tokens < 1:
        raise ValueError(f"partition_tokens must be positive, got {partition_tokens}")
    partitions = max(1, -(-span // partition_tokens)) if two_pass else 1
    params = _int32s((max_blocks, window or 0, partition_tokens, partitions, kv_heads, heads))
    # Without sinks the kernel never reads the buffer (SINKS 0); one zero keeps the signature.
    sink_logits = _float32s((0.0,)) if sinks is None else sinks.astype(mx.float32)
    has_sinks = int(sinks is not None)
    quantized = isinstance(k_pool, QuantizedPages) and isinstance(v_pool, QuantizedPages)
    pools = [p.data if isinstance(p, QuantizedPages) else p for p in (k_pool, v_pool)]  # packed words, or the pool
    inputs = [q.reshape(batch, heads, head_dim), *pools, tables, lens, params, _float32s((scale,)), sink_logits]
    threads = num_simdgroups * 32
    template = [
        ("T", q.dtype),
        ("D", head_dim),
        ("DV", v_dim),
        ("BS", block_size),
        ("G", heads // kv_heads),
        ("NSG", num_simdgroups),
        ("SINKS", has_sinks),
    ]
    if isinstance(k_pool, QuantizedPages) and isinstance(v_pool, QuantizedPages):
        inputs += [k_pool.scales, k_pool.biases, v_pool.scales, v_pool.biases]
        template += [("QBITS", k_pool.bits), ("QGROUP", k_pool.group_size)]
    launch = launcher or _gpu_launch
    if not two_pass:
        (out,) = launch(
            decode_kernel(False, quantized, language),
            inputs=inputs,
            template=template,
            grid=(threads, kv_heads, batch),
            threadgroup=(threads, 1, 1),
            output_shapes=[(batch, heads, v_dim)],
            output_dtypes=[q.dtype],
        )
        return out.reshape(batch, heads, 1, v_dim)
    part_shape = (batch, heads, partitions)
    o_part, m_part, l_part = launch(
        decode_kernel(True, quantized, language),
        inputs=inputs,
        template=template,
        grid=(threads, kv_heads, batch * partitions),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*part_shape, v_dim), part_shape, part_shape],
        output_dtypes=[mx.float32] * 3,
    )
    if tail is not None:  # the tail joins as partition `partitions` (the reduce reads the count from params)
        o_part = mx.concatenate([o_part, tail[0]], axis=2)
        m_part, l_part = mx.concatenate([m_part, tail[1]], axis=2), mx.concatenate([l_part, tail[2]], axis=2)
        params = _int32s((max_blocks, window or 0, partition_tokens, partitions + 1, kv_heads, heads))
    (out,) = launch(
        reduce_kernel(language),
        inputs=[o_part, m_part, l_part, params, sink_logits],
        template=[("T", q.dtype), ("DV", v_dim), ("SINKS", has_sinks)],
        grid=(32, heads, batch),
        threadgroup=(32, 1, 1),
        output_shapes=[(batch, heads, v_dim)],
        output_dtypes=[q.dtype],
    )
    return out.reshape(batch, heads, 1, v_dim)
