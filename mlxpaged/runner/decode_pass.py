"""The decode pass (one new token per sequence, or a short verify chunk of k+1) as one `mx.compile`d graph.

mlx-lm does not compile its decode step, as its cache is sliced with Python ints. A paged pass can
be compiled: positions, write slots and page rows are arrays, so the graph depends only on the
batch size and the number of pages read, which is rounded up to a bucket (at most ~25% padding,
masked out) so a growing context retraces about four times per doubling (~40 ms each). Compiled,
MLX fuses the elementwise ops that RMSNorm, RoPE and SDPA expand into on the CPU backend, and a
call replaces Python graph building. Batch-1 step of SmolLM2-135M at 130 tokens (in one process,
8 alternating rounds): 48.0 ms to evaluate and 2.8 ms to build, against 51.0 and 3.5 ms for
mlx-lm's own step (the matmuls, most of the step, are the same OpenBLAS calls either way).

The pools go in as arguments and come back as results; the cache swaps in the results before
the pass is evaluated, so nothing else holds the old pools and the writes stay in place. Quantized pools go in
as their (data, scales, biases) arrays and are rebuilt inside (cache/quantized_pages.py `as_arguments`).
Only models whose layers all attend fully (one layer group) take this path. A model whose positions come from
its prompt's images (M-RoPE: vision/positions.py) gets each row's offset plus its request's delta as a traced
array too, so its passes share the graphs a text model's do.

Passes of several rows are traced at bucketed batch sizes (`batch_bucket`: 2, 4, 8, then multiples of 8, as vLLM
captures its CUDA graphs), so a batch that grows and shrinks retraces a handful of times instead of once per size:
the rows past the real ones repeat the first row (its token, position and pages), and each writes the first row's
K/V into the first row's slots (`sources`), so the pages end as they would without them; their logits are dropped.
How many rows run compiled is the backend's `Tuning.compiled_decode_max_batch` (CPU 1; GPUs 0, compiled passes having
measured slower on an H200 in session 13) or MLXPAGED_COMPILE_BATCH=N, the lever the GPU kit measures at bucketed sizes
(docs/design/issue38-load.md).

A pass whose rows all run with one LoRA / DoRA adapter (adapters/) takes a compiled function of its own for that
adapter: the trace applies the adapter's update in every layer it adapts, its arrays held by the graph as the base
weights are. Batch-1 decode with an adapter is the case mlx-lm serves (`generate --adapter-path`), and eager it ran at
0.85x mlx-lm here (docs/design/issue40-adapters.md). Rows of several adapters in one pass run eagerly (the graphs
would multiply with the mixes); at most MAX_ADAPTER_GRAPHS adapters keep a function, the least recently used go.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial

from mlxpaged.adapters.layers import PassRows
from mlxpaged.cache.kv_cache import PagedKVCache, Pool
from mlxpaged.cache.kv_transform import KVTransform
from mlxpaged.cache.quantized_pages import QuantizedPages, as_arguments, from_arguments, pool_arrays, store_pair
from mlxpaged.kernels.attention import decode_attention, resolved_backend, sdpa
from mlxpaged.kernels.reference import gather_pages
from mlxpaged.runner.passes import body_of

import mlx.core as mx
import mlx.nn as nn

ENV_VAR = "MLXPAGED_COMPILE"  # "0" turns compiled decode passes off (A/B runs, debugging)
ROWS_ENV_VAR = "MLXPAGED_COMPILE_BATCH"  # N: decode passes of up to N rows run compiled (the backend's tuned value)
MIN_PAGES = 8  # contexts up to 128 tokens (block size 16) share one graph
MAX_ADAPTER_GRAPHS = 16  # adapters whose compiled pass is kept (each holds its traced graphs, one per page bucket)


def page_bucket(pages: int) -> int:
    """Pages a pass reads, rounded up: exact up to MIN_PAGES, then in steps of an eighth to a
    quarter of the count (4 graphs per doubling, at most ~25% padding)."""
    if pages <= MIN_PAGES:
        return MIN_PAGES
    step = 1 << (pages.bit_length() - 3)
    return -(-pages // step) * step


def batch_bucket(rows: int) -> int:
    """Rows a compiled pass of `rows` sequences is traced for: powers of two up to 8, then multiples of 8."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    return -(-rows // 8) * 8


def compile_enabled() -> bool:
    return os.environ.get(ENV_VAR, "1").strip() != "0"


def compiled_rows_asked() -> int | None:
    """The most rows a decode pass may have and run compiled, as MLXPAGED_COMPILE_BATCH asks (None: not set)."""
    value = os.environ.get(ROWS_ENV_VAR, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{ROWS_ENV_VAR} must be a whole number of rows (0: none compiled), got {value!r}")
    return int(value)


class _PassState:
    """The traced inputs of one pass, shared by every layer's view; derived once per pass. A pass
    feeds L tokens per sequence (L = 1: decode; L > 1: a speculative verify chunk, causal within)."""

    def __init__(
        self,
        starts: mx.array,
        tables: mx.array,
        keys: list[Pool],
        values: list[Pool],
        length: int = 1,
        sources: mx.array | None = None,
    ):
        _, heads, size, _ = keys[0].shape
        # [B] the row whose K/V each row writes (a padding row: the first row's, into the same slots), or None: its own
        self.sources = sources
        batch, width = tables.shape
        self.positions = starts  # [B] position of each first new token (the RoPE offset)
        new = starts[:, None] + mx.arange(length, dtype=mx.int32)[None, :]  # [B, L] positions written
        blocks = mx.take_along_axis(tables, new // size, axis=1)  # [B, L]
        head_ids = mx.arange(heads, dtype=mx.int32)
        # [B, L, KVH] index arrays of each new token's slot, broadcast once for every layer's write
        self.slot = tuple(mx.broadcast_arrays(blocks[..., None], head_ids[None, None, :], (new % size)[..., None]))
        self.rows = tables[:, None, :] * heads + head_ids[None, :, None]  # [B, KVH, nb] page rows
        self.mask = (mx.arange(width * size)[None, None, :] <= new[..., None]).reshape(batch, 1, length, -1)
        self.keys, self.values = keys, values


class DecodeView:
    """The cache an mlx-lm attention layer sees inside the compiled pass."""

    def __init__(self, state: _PassState, layer: int, transform: KVTransform | None = None):
        self._state, self._layer = state, layer
        # the pages' K/V coordinates (cache/kv_transform.py): writes go in, queries go in, outputs come back
        self._transform = transform if transform is not None and transform.applies(layer) else None
        self._returned: tuple[mx.array, mx.array] | None = None

    @property
    def offset(self) -> mx.array:
        return self._state.positions

    # mlx-lm's storage attributes, as cache_view.PagedCacheView has them: models assign them only to chain graph
    # dependencies (a pipeline stage's `cache[-1].keys = mx.depends(cache[-1].keys, sent)`); the pools come back
    # from the compiled pass anyway, so reads give the traced pool and assignments are dropped.
    @property
    def keys(self) -> mx.array:
        return pool_arrays([self._state.keys[self._layer]])[0]

    @keys.setter
    def keys(self, value) -> None:
        pass

    @property
    def values(self) -> mx.array:
        return pool_arrays([self._state.values[self._layer]])[0]

    @values.setter
    def values(self, value) -> None:
        pass

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None  # key lengths and the causal order of a verify chunk are masked in `attend`

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Write the new K/V [B, KVH, L, D] into the traced pools; attention reads the pages."""
        s, j, t = self._state, self._layer, self._transform
        stored_k = keys if t is None else t.keys_in(j, keys)
        stored_v = values if t is None else t.values_in(j, values)
        if s.sources is not None:  # padding rows write what the first row writes, where it writes it
            stored_k, stored_v = stored_k[s.sources], stored_v[s.sources]
        store_pair(s.keys[j], s.values[j], s.slot, stored_k.swapaxes(1, 2), stored_v.swapaxes(1, 2))  # in place
        self._returned = keys, values
        return keys, values

    def returned(self, keys: mx.array, values: mx.array) -> bool:
        """True when `keys` and `values` are the arrays `update_and_fetch` returned (routing.py)."""
        return self._returned is not None and keys is self._returned[0] and values is self._returned[1]

    def attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        j, t = self._layer, self._transform
        if t is not None:  # attention in the pages' coordinates, its output mapped back
            return t.output_out(j, self._attend(t.queries_in(j, queries), scale, sinks))
        return self._attend(queries, scale, sinks)

    def _attend(self, queries: mx.array, scale: float, sinks: mx.array | None) -> mx.array:
        s, j = self._state, self._layer
        if queries.shape[2] == 1:
            return decode_attention(queries, s.keys[j], s.values[j], s.rows, s.mask, scale, sinks)
        # A verify chunk: its few queries attend the gathered pages under the causal mask, like a prefill chunk.
        keys, values = gather_pages(s.keys[j], s.rows), gather_pages(s.values[j], s.rows)
        return sdpa(queries, keys, values, scale, s.mask, sinks)


class PositionedDecodeView(DecodeView):
    """The view of a compiled pass that gives the model its positions (M-RoPE)."""

    @property
    def _idx(self) -> int:
        """mlx-vlm's `cache_position_offset` asks a batched cache for its shared timeline as a Python int, to slice
        metadata of a whole prompt (positions longer than the pass, an image mask). This pass holds none of that
        (every row gets its L positions) and has no int to give, only traced offsets: 0 slices nothing. Only these
        views answer: other mlx-vlm models take `_idx` as a sign of a batched cache of their own."""
        return 0


class CompiledDecode:
    """Runs decode passes of an all-full-attention model through one compiled function."""

    def __init__(
        self,
        model: nn.Module,
        kv: PagedKVCache,
        head: Callable[[mx.array], mx.array] | None,
        takes_positions: bool = False,
    ):
        self.model, self.kv, self.head = model, kv, head
        body = body_of(model)
        self.body: nn.Module = body if body is not None else model  # what `head` reads (when it is given)
        self.takes_positions = takes_positions  # M-RoPE: position_ids [3, B, L] from each row's start and delta
        self._forward = mx.compile(self._trace)
        self._bucketed = mx.compile(self._trace_rows)  # passes of several rows, padded to batch_bucket rows
        # adapter id -> the compiled pass whose rows all run with it, most recently used last
        self._adapted: OrderedDict[str, Callable] = OrderedDict()

    @staticmethod
    def supports(kv: PagedKVCache) -> bool:
        """One full-attention layer group of one geometry, attended on the CPU / reference path (the Metal kernel
        reads host lengths, so it stays on the eager path)."""
        return compile_enabled() and kv.plain_full_attention and resolved_backend() != "kernel"

    def __call__(
        self,
        starts: Sequence[int],
        tables: Sequence[Sequence[int]],
        tokens: mx.array,
        deltas: Sequence[int] | None = None,
        adapter: str | None = None,
        rows: PassRows | None = None,
    ) -> mx.array:
        """Build the pass of `tokens` [B, L] at positions `starts`.. over block `tables` (a model that takes
        positions: each row's shifted by its `deltas`); returns lazy logits [B * L, V] (every position, row-major)
        and leaves the pools' pending writes in `kv.keys` / `kv.values`. `adapter`: the id of the adapter every row
        runs with, told to the adapted layers through `rows` (the model's PassRows) while the pass is traced."""
        size, length = self.kv.block_size, tokens.shape[1]
        needed = [(start + length - 1) // size + 1 for start in starts]
        for table, n in zip(tables, needed, strict=True):
            if len(table) < n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {n * size} tokens")
        width = page_bucket(max(needed))
        # Padding entries repeat a valid block (masked out) so the gathers stay inside the pool.
        padded = [list(t[:n]) + [t[n - 1]] * (width - n) for t, n in zip(tables, needed, strict=True)]
        starts, deltas = list(starts), list(deltas) if deltas is not None else [0] * len(starts)
        kv, real = self.kv, len(starts)
        extra: tuple[mx.array, ...] = ()
        if adapter is not None:  # a graph per adapter and batch size (adapted passes are not padded)
            forward = self._adapted_forward(adapter, rows)
        elif real == 1:
            forward = self._forward
        else:  # padded to its bucket with copies of the first row, which write only what the first row writes
            forward, pad = self._bucketed, batch_bucket(real) - real
            starts, deltas, padded = starts + starts[:1] * pad, deltas + deltas[:1] * pad, padded + padded[:1] * pad
            if pad:
                tokens = mx.concatenate([tokens, mx.repeat(tokens[:1], pad, axis=0)])
            extra = (mx.array(list(range(real)) + [0] * pad, dtype=mx.int32),)
        logits, keys, values = forward(
            tokens,
            mx.array(starts, dtype=mx.int32),
            mx.array(padded, dtype=mx.int32),
            mx.array(deltas, dtype=mx.int32),
            as_arguments(kv.keys),
            as_arguments(kv.values),
            *extra,
        )
        # Drop the old pools: the writes stay in place.
        kv.keys[:], kv.values[:] = from_arguments(keys, kv.keys), from_arguments(values, kv.values)
        return logits if len(starts) == real else logits[: real * length]

    def _adapted_forward(self, adapter: str, rows: PassRows | None) -> Callable:
        if rows is None:
            raise ValueError("a pass with an adapter needs the model's PassRows")
        forward = self._adapted.pop(adapter, None)
        if forward is None:
            forward = mx.compile(partial(self._trace, adapter=adapter, rows=rows))
            while len(self._adapted) >= MAX_ADAPTER_GRAPHS:
                self._adapted.popitem(last=False)
        self._adapted[adapter] = forward  # most recently used
        return forward

    @property
    def compiled_adapters(self) -> tuple[str, ...]:
        """The adapters with a compiled pass, least recently used first."""
        return tuple(self._adapted)

    def forget_adapter(self, adapter: str) -> None:
        """Drop the compiled pass of an adapter the engine no longer serves (its graphs hold the adapter's arrays)."""
        self._adapted.pop(adapter, None)

    def warm_up(self, all_ranks_ok: Callable[[bool], bool] | None = None) -> None:
        """Run one pass on throwaway pools: MLX compiles the fused kernels of a new graph once per
        machine (about 6 s here, cached on disk), which would otherwise stall a user's second token.
        `all_ranks_ok` (across mlx.launch ranks): whether every rank traced the pass, asked before it is
        evaluated, as the pass's collectives need every rank: a trace that fails on some ranks only (a pipeline
        stage's code differs by rank) raises on all of them, so all decode eagerly instead of some waiting."""
        try:
            logits = self._warm_up_pass()
        except Exception:
            if all_ranks_ok is not None:
                all_ranks_ok(False)
            raise
        if all_ranks_ok is not None and not all_ranks_ok(True):
            raise RuntimeError("the compiled decode pass failed on another rank")
        mx.eval(logits)

    def _warm_up_pass(self) -> mx.array:
        kv = self.kv
        # Pools of the cache's own geometry: V may be narrower than K (one geometry, K and V apart).
        pools = [
            as_arguments([self._zeros(g.kv_heads, g.k_dim) for g in kv.pool_geometries]),
            as_arguments([self._zeros(g.kv_heads, g.v_dim) for g in kv.pool_geometries]),
        ]
        table = mx.arange(MIN_PAGES, dtype=mx.int32)[None]
        start = mx.zeros((1,), mx.int32)
        logits, _, _ = self._forward(mx.zeros((1, 1), mx.int32), start, table, start, *pools)
        return logits

    def _zeros(self, heads: int, dim: int) -> Pool:
        shape = (MIN_PAGES, heads, self.kv.block_size, dim)
        if self.kv.quantization is None:
            return mx.zeros(shape, self.kv.dtype)
        return QuantizedPages.zeros(shape, self.kv.dtype, self.kv.quantization)

    def _trace_rows(self, tokens, starts, tables, deltas, keys, values, sources):
        return self._trace(tokens, starts, tables, deltas, keys, values, sources=sources)

    def _trace(self, tokens, starts, tables, deltas, keys, values, adapter=None, rows=None, sources=None):
        if adapter is not None:
            with rows.building([adapter] * tokens.shape[0], tokens.shape[1]):
                return self._trace(tokens, starts, tables, deltas, keys, values)
        keys, values = from_arguments(keys, self.kv.keys), from_arguments(values, self.kv.values)
        state = _PassState(starts, tables, list(keys), list(values), tokens.shape[1], sources)
        view = PositionedDecodeView if self.takes_positions else DecodeView
        views = [view(state, layer, self.kv.transform) for layer in range(len(keys))]
        if self.takes_positions:
            rows = (starts + deltas)[:, None] + mx.arange(tokens.shape[1], dtype=mx.int32)[None, :]
            position_ids = mx.broadcast_to(rows[None], (3, *rows.shape))  # as positions.row_positions
            logits = self.model(tokens, cache=views, position_ids=position_ids)
        elif self.head is not None:
            logits = self.head(self.body(tokens, cache=views))
        else:
            logits = self.model(tokens, cache=views)
        return logits.reshape(-1, logits.shape[-1]), as_arguments(state.keys), as_arguments(state.values)
