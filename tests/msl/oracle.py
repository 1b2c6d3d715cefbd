"""NumPy float64 oracle for paged attention, and builders of paged test cases.

Cases use shuffled (non-contiguous) block tables whose padding entries are out-of-range ids, so
any path that reads a table entry past a sequence's length gets caught. Cases may have V narrower
or wider than K (``v_dim``) and a sink logit per query head (``sinks``), written out here from the
definition: the sink is one more softmax term with no value.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlxpaged  # noqa: F401  (loads OpenBLAS before mlx)

import mlx.core as mx
import numpy as np

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
PAD_BLOCK_ID = 1 << 20  # never a valid block id


def quantize(x: np.ndarray, dtype: str) -> tuple[mx.array, np.ndarray]:
    """The array in ``dtype`` and the exact float64 values it holds."""
    arr = mx.array(x.astype(np.float32)).astype(DTYPES[dtype])
    return arr, np.array(arr.astype(mx.float32), dtype=np.float64)


@dataclass
class DecodeCase:
    q: mx.array
    k_pool: mx.array
    v_pool: mx.array
    block_tables: mx.array
    context_lens: mx.array
    scale: float
    window: int | None
    dtype: str
    q64: np.ndarray
    k64: np.ndarray
    v64: np.ndarray
    tables_np: np.ndarray
    lens: list[int]
    sinks: mx.array | None = None  # [heads] float32
    sinks64: np.ndarray | None = None

    def args(self):
        return (self.q, self.k_pool, self.v_pool, self.block_tables, self.context_lens, self.scale)

    def expected(self) -> np.ndarray:
        return decode_oracle(
            self.q64, self.k64, self.v64, self.tables_np, self.lens, self.scale, self.window, self.sinks64
        )

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


def shuffled_tables(
    rng: np.random.Generator, lens: list[int], block_size: int, spare: int, max_blocks: int | None = None
) -> tuple[np.ndarray, int]:
    """Block tables over a shuffled pool; returns (tables [B, max_blocks], num_blocks)."""
    needed = [-(-n // block_size) for n in lens]
    width = max(max(needed, default=0), 1) if max_blocks is None else max_blocks
    num_blocks = sum(needed) + spare
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), width), PAD_BLOCK_ID, dtype=np.int32)
    at = 0
    for b, n in enumerate(needed):
        tables[b, :n] = ids[at : at + n]
        at += n
    return tables, num_blocks


def random_sinks(rng: np.random.Generator, heads: int) -> tuple[mx.array, np.ndarray]:
    """Sink logits [heads] (float32, as models keep them) spread around the scores' own range, so
    some heads' sinks dominate and others barely count."""
    return quantize(rng.standard_normal(heads) * 2.0 + 1.0, "float32")


def make_decode_case(
    seed: int,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str = "float32",
    window: int | None = None,
    spare_blocks: int = 3,
    max_blocks: int | None = None,
    v_dim: int | None = None,
    sinks: bool = False,
) -> DecodeCase:
    rng = np.random.default_rng(seed)
    tables, num_blocks = shuffled_tables(rng, lens, block_size, spare_blocks, max_blocks)
    q, q64 = quantize(rng.standard_normal((len(lens), heads, 1, head_dim)), dtype)
    pool_shape = (num_blocks, kv_heads, block_size)
    k, k64 = quantize(rng.standard_normal((*pool_shape, head_dim)), dtype)
    v, v64 = quantize(rng.standard_normal((*pool_shape, v_dim or head_dim)), dtype)
    sink, sink64 = random_sinks(rng, heads) if sinks else (None, None)
    return DecodeCase(
        q,
        k,
        v,
        mx.array(tables),
        mx.array(np.asarray(lens, dtype=np.int32)),
        head_dim**-0.5,
        window,
        dtype,
        q64,
        k64,
        v64,
        tables,
        list(lens),
        sink,
        sink64,
    )


def gather_sequence(pool64: np.ndarray, table: np.ndarray, length: int) -> np.ndarray:
    """[KVH, length, D] keys (or values) of one sequence, token by token."""
    block_size = pool64.shape[2]
    rows = [pool64[table[t // block_size], :, t % block_size, :] for t in range(length)]
    if not rows:
        return np.zeros((pool64.shape[1], 0, pool64.shape[3]))
    return np.stack(rows, axis=1)


def attend(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, allowed: np.ndarray, sinks: np.ndarray | None = None
) -> np.ndarray:
    """q [H, L, Dk], k [KVH, N, Dk], v [KVH, N, Dv], allowed [L, N], sinks [H] or None -> [H, L, Dv].
    A sink s_h is one more term of head h's softmax with no value:
    out = sum_i e^(x_i - m) v_i / (e^(s_h - m) + sum_i e^(x_i - m)), m = max(s_h, max_i x_i).
    Rows with nothing allowed are 0."""
    heads, length = q.shape[:2]
    if k.shape[1] == 0:
        return np.zeros((heads, length, v.shape[-1]))
    group = heads // k.shape[0]
    kk = np.repeat(k, group, axis=0)
    vv = np.repeat(v, group, axis=0)
    scores = np.einsum("hld,hnd->hln", q, kk) * scale
    scores = np.where(allowed[None], scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    sink = None if sinks is None else np.asarray(sinks, np.float64)[:, None, None]
    if sink is not None:
        top = np.maximum(top, sink)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    if sink is not None:
        total = total + np.exp(sink - top)
    out = np.einsum("hln,hnd->hld", weights, vv)
    return np.where(total > 0, out / np.where(total > 0, total, 1.0), 0.0)


def decode_oracle(q64, k64, v64, tables, lens, scale, window=None, sinks64=None) -> np.ndarray:
    out = np.zeros(q64.shape[:-1] + v64.shape[-1:])
    for b, n in enumerate(lens):
        k = gather_sequence(k64, tables[b], n)
        v = gather_sequence(v64, tables[b], n)
        pos = np.arange(n)
        allowed = (pos >= n - window) if window else np.ones(n, bool)
        out[b] = attend(q64[b], k, v, scale, allowed[None, :], sinks64)
    return out


def causal_oracle(q64, k64, v64, scale, window=None, query_offset=0, sinks64=None) -> np.ndarray:
    """Causal attention of queries at positions query_offset.. over contiguous keys [KVH, N, D]."""
    qpos = np.arange(q64.shape[1])[:, None] + query_offset
    kpos = np.arange(k64.shape[1])[None, :]
    allowed = kpos <= qpos
    if window:
        allowed &= kpos > qpos - window
    return attend(q64, k64, v64, scale, allowed, sinks64)


def max_error(actual: mx.array, expected: np.ndarray) -> float:
    """Largest |actual - expected| / (1 + |expected|): absolute near 0, relative for large values."""
    got = np.array(actual.astype(mx.float32), dtype=np.float64)
    assert got.shape == expected.shape, (got.shape, expected.shape)
    assert np.all(np.isfinite(got)), "non-finite values in output"
    return float(np.max(np.abs(got - expected) / (1.0 + np.abs(expected)), initial=0.0))
