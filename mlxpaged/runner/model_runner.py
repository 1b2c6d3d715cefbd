"""One model step over a ragged batch on the paged cache (which inputs share a pass: passes.py).

`execute` is the engine step's "execute" stage: the passes, sampling, the look-ahead pipeline
(`Lookahead`) and, through `copy_blocks`, the copy-on-write block copies of n > 1 forks.

Pipelining differs per backend (platform/backend.py). On a GPU the next decode pass is queued before
this step's tokens are read, as mlx-lm's generate_step does, and writes nothing to the pools while it
is queued (deferred_writes.py). On the CPU backend it is built ahead and launched once this step is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

from mlxpaged.adapters.layers import PassRows
from mlxpaged.cache.cache_view import paged_views
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.state_cache import StatePass, StateStore
from mlxpaged.platform import backend
from mlxpaged.runner import cache_tree, decode_buffers
from mlxpaged.runner.activation_routing import engine_activations
from mlxpaged.runner.decode_pass import CompiledDecode, compiled_rows_asked
from mlxpaged.runner.deferred_writes import (
    MAX_PENDING,
    MAX_PENDING_BUFFERED,
    DeferredPass,
    PendingKV,
    deferred_views,
    defers_writes,
)
from mlxpaged.runner.draft_verify import sample_with_drafts
from mlxpaged.runner.layer_outputs import LayerOutputs
from mlxpaged.runner.passes import (
    StepInput,
    body_of,
    logit_positions,
    prefill_passes,
    split_head,
    state_model_passes,
)
from mlxpaged.runner.recorder import Recorder
from mlxpaged.runner.routing import is_routed
from mlxpaged.runner.sampling import LazySample, SampleResult, sample_batch
from mlxpaged.runner.sampling_rows import SamplingRows
from mlxpaged.vision.embedding import chunk_embedding, position_delta
from mlxpaged.vision.positions import row_positions

import mlx.core as mx
import mlx.nn as nn

# Decode passes of up to `backend.tuning().compiled_decode_max_batch` sequences run compiled
# (decode_pass.py); the measurements are in platform/backend.py.
# Verify chunks [last, d1..dk] of up to this many tokens run compiled too, one graph per length
# (the drafter's k <= 7 by default, so at most 7 lengths per page bucket). SmolLM2-135M at 300 tokens, 6-token
# chunk: 66.8 ms compiled vs 72.1 eager (one token: 40.6); the rest is OpenBLAS gemm at M=6 vs gemv.
COMPILED_VERIFY_MAX_TOKENS = 8


def _by_adapter(rows: list[int], inputs: Sequence[StepInput]) -> list[list[int]]:
    """`rows` split into one list per adapter (the base model's too), in order of first appearance."""
    groups: dict[str | None, list[int]] = {}
    for i in rows:
        groups.setdefault(inputs[i].adapter, []).append(i)
    return list(groups.values())


def _rows(values: mx.array, rows: list[int]) -> mx.array:
    """`values[rows]`, without a gather when `rows` is every row in order."""
    return values if rows == list(range(values.shape[0])) else values[mx.array(rows)]


class StepMirror(Protocol):
    """Another process runs the same passes (distributed/leader.py): it is told each step's inputs and block
    copies before this runner queues them, so every rank queues the same collectives in the same order."""

    def watch(self, tell: Callable[[Exception], None]) -> AbstractContextManager[None]:
        """Around each engine step (engine_thread.py): the other processes may fail or hang it; `tell` fails
        the requests in flight then (the mirror ends the process: the ranks are out of step for good)."""
        ...

    def before_step(self, inputs: Sequence[StepInput]) -> None: ...

    idle_tick_s: float  # how often `idle` is called while the engine waits for work

    def idle(self) -> None:
        """The engine waits for work: the other processes may be told it is alive."""

    def before_copy(self, copies: list[tuple[int, int]]) -> None: ...

    def close(self) -> None:
        """The engine stops: so do the other processes."""


class NextStepPlanner(Protocol):
    """The scheduler's side of pipelining (EngineCore implements it)."""

    def predictable(self) -> bool:
        """True when the next step will be this step's rows again (nothing waits to be admitted)."""

    def reserve_next_slot(self, request) -> list[list[int]] | None:
        """The request's tables with room for the token after its last one, or None."""


@dataclass
class Lookahead:
    """A decode pass queued on the previous step's lazy tokens before its own step was scheduled
    (Runner._look_ahead); the runner adopts it when the schedule asks for these rows."""

    rows: list[tuple[str, int]]  # (request id, position) of each row
    sample: LazySample
    state_pass: StatePass | None = None  # its state rows, stored only if the pass is adopted
    deferred: DeferredPass | None = None  # a pass that writes no pages (deferred_writes.py), queued already

    @property
    def launched(self) -> bool:
        return self.deferred is not None

    def covers(self, chunks: list) -> bool:
        """True when the scheduled step is only decode rows this pass computed (a row whose
        request finished meanwhile is simply not asked for)."""
        known = set(self.rows)
        return all(len(c.token_ids) == 1 and (c.request.request_id, c.start) in known for c in chunks)

    def rows_of(self, chunks: list) -> list[int]:
        """This pass's row of each chunk."""
        index = {row: i for i, row in enumerate(self.rows)}
        return [index[(c.request.request_id, c.start)] for c in chunks]


class Runner:
    """`layout`: the model's cache layout (loading/probe.py); None: one KV view per layer, in order.
    `state_store`: the state slots of a model with state layers (ArraysCache): prefill passes then run one
    sequence at a time. `serial`: one sequence per pass, for models that are not exact in a ragged batch
    (paged_support.serial_reason, batch_check.py)."""

    def __init__(
        self,
        model: nn.Module,
        kv_cache: PagedKVCache,
        layout: ModelLayout | None = None,
        state_store: StateStore | None = None,
        serial: bool = False,
        buffer_budget: int | None = None,
    ):
        self.model = model
        self.kv = kv_cache
        self.layout, self.state_store = layout, state_store
        self.serial = serial
        if (state_store is None) != (layout is None or not layout.state_leaves):
            raise ValueError("a model with state layers needs a state store, and only such a model")
        self._built_state_pass: StatePass | None = None  # of the last pass built without launching
        self.head = split_head(model)
        body = body_of(model)
        self.body: nn.Module = body if body is not None else model  # what the split head reads (when it splits)
        # M-RoPE: every pass gives the model its rows' positions (vision/positions.py).
        self.takes_positions = bool(getattr(model, "takes_positions", False))
        # The compiled pass reads the pools only: every leaf must be attended by the routed SDPA alone.
        plain = layout is None or (cache_tree.simple(layout) and all(leaf.routed for leaf in layout.kv_leaves))
        compiled = state_store is None and plain and is_routed(model) and CompiledDecode.supports(kv_cache)
        self.tuning = backend.tuning()
        # MLXPAGED_COMPILE_BATCH (decode_pass.py) in place of the tuned value: the GPU kit's lever; None: the tuning's.
        self._compiled_rows = compiled_rows_asked()
        self.decoder = (
            CompiledDecode(model, kv_cache, self.head, self.takes_positions)
            if compiled and self.most_compiled_rows
            else None
        )
        self._ahead: Lookahead | None = None  # the next step's decode pass, already queued
        # A GPU queues the next pass before reading this one; its K/V wait in `_pending` (deferred_writes.py),
        # and those of rows that left the run in `_orphans`, until nothing in flight reads the pools.
        self.defers = (
            self.tuning.queue_before_read
            and state_store is None
            and plain
            and not serial
            and is_routed(model)
            and defers_writes(kv_cache)
        )
        self._pending: PendingKV | None = None
        self._orphans: list[PendingKV] = []
        # Row columns (one token of one row, all layers) the queued-ahead passes' decode buffers may hold: the memory
        # plan's spare bytes over a column's bytes, worked out once here rather than per pass (decode_buffers.py).
        # None: no limit. Above it a pass gathers its pages instead.
        self.buffer_columns = (
            None if buffer_budget is None else buffer_budget // max(1, decode_buffers.token_bytes(kv_cache))
        )
        # Set on rank 0 of a distributed engine (engine/build.py): passes are mirrored, none is built ahead.
        self.mirror: StepMirror | None = None
        # Set by the engine thread with MLXPAGED_RECORD_THREAD=1 (recorder.py): the passes built ahead are queued
        # from a thread of its own; every other launch or read here waits until it is done (`settle_recording`).
        self.recorder: Recorder | None = None
        # Set when the model serves adapters (engine/build.py): each pass tells the adapted layers its rows' adapters.
        self.adapter_rows: PassRows | None = None
        # `capture_hidden()`: each step keeps the model's last hidden state of every position it computed, per input.
        self.last_hidden: list[mx.array | None] | None = None
        self._captured: dict[int, mx.array] = {}  # id(StepInput) -> its positions' hidden states, this step
        self._layer_outputs: LayerOutputs | None = None  # capture_hidden(layers)

    def capture_hidden(self, layers: Sequence[int] = ()) -> None:
        """From now on `last_hidden[i]` holds the last step's input i's hidden states [L, H], lazy: the body's output
        (the LM head's input), which MTP layers draft from (runner/chained_drafter.py), or with `layers` the outputs of
        those decoder layers side by side [L, n * H] (DFlash: runner/dflash_drafter.py). Every pass then runs eagerly:
        no compiled decode pass, none queued ahead."""
        if layers:
            self._layer_outputs = LayerOutputs(self.model.layers, layers)
        elif self.head is None and not getattr(self.model, "returns_hidden", False):
            raise ValueError("the model's LM head cannot be split from its body: its hidden states are not reachable")
        self.decoder, self.defers = None, False
        self.last_hidden = []

    def execute(self, chunks: list, sampling: SamplingRows, planner: NextStepPlanner) -> list[SampleResult]:
        """Run a scheduled step (ScheduledChunks) and sample it: one result per sampling row. A
        step the previous one already queued (`_look_ahead`) is adopted instead of recomputed."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or not ahead.covers(chunks):
            self._settle(ahead)
            return self._compute(chunks, sampling, planner)
        # This step was computed while the last one ran: queue the next one, then read it.
        rows_of = ahead.rows_of(chunks)
        if ahead.state_pass is not None:
            ahead.state_pass.commit(rows_of)  # before the next pass is built on these rows
        if ahead.deferred is not None:
            self._adopt_pending(ahead.deferred.pending_after(), [c.request.request_id for c in chunks])
        self._ahead = self._look_ahead(chunks, _rows(ahead.sample.tokens, rows_of), sampling.chunk_samplers, planner)
        everything = ahead.sample.results()  # with a recorder thread, read while it records the next pass
        self._launch_ahead()
        return [everything[i] for i in rows_of]

    @property
    def pools_settled(self) -> bool:
        """No pass is queued ahead and no K/V waits outside the pools: reading the pools now reads every
        computed token and pins nothing in flight (the disk tier snapshots blocks only then)."""
        recording = self.recorder is not None and self.recorder.busy
        return self._ahead is None and self._pending is None and not self._orphans and not recording

    def drop_look_ahead(self, failed: bool = False) -> None:
        """Forget the queued pass (a step with nothing scheduled, or a failed one) and write the pending K/V:
        passes already read produced them, and their full blocks may be prefix-cache hits. After a failure
        the queued pass is not waited for (it may be what failed)."""
        ahead, self._ahead = self._ahead, None
        self.settle_recording(quiet=failed)
        self._settle(None if failed else ahead)

    def settle_recording(self, quiet: bool = False) -> None:
        """Wait until the recorder thread (if any) has queued the pass it was given: then this thread may evaluate
        (recorder.py). `quiet`: do not raise what queuing it raised (a failed step is being handled)."""
        if self.recorder is not None:
            self.recorder.settle(quiet)

    def copy_blocks(self, copies: Sequence) -> None:
        """Do a fork's copy-on-write copies (CopyOnWrite) and land them before the next pass writes."""
        if copies:
            self.settle_recording()
            self._flush_pending()  # a fork starts after a step that settled: nothing is in flight
            if self.mirror is not None:  # across ranks there is one block space (build.py refuses several)
                self.mirror.before_copy([(c.src_block, c.dst_block) for c in copies])
            self.kv.copy_on_write(copies)

    def _settle(self, ahead: Lookahead | None) -> None:
        """The pipeline stops: let a queued pass nobody adopts finish (a pool write queued while it reads
        the pools would copy them), then write the pending K/V into their slots."""
        self.settle_recording()
        if ahead is not None and ahead.launched:
            mx.eval(*ahead.sample.arrays)
        self._flush_pending()

    def _flush_pending(self) -> None:
        """Queue the writes of every pending K/V, rows that left the run first (their slots may hold a
        running row's newer tokens, which must win). Lazy: the next pass evaluates them, in place."""
        for pending in [*self._orphans, *([self._pending] if self._pending is not None else [])]:
            pending.flush(self.kv)
        self._pending, self._orphans = None, []

    def _adopt_pending(self, pending: PendingKV, kept: list[str]) -> None:
        """An adopted deferred pass's K/V become the run's pending ones; rows the step no longer schedules
        (finished, aborted, preempted) and rows the pass skipped keep theirs until the next flush."""
        carried = set(pending.request_ids)
        for left in (self._pending.without(carried) if self._pending is not None else None, pending.without(kept)):
            if left is not None:
                self._orphans.append(left)
        self._pending = pending.select(kept)

    def _compute(self, chunks: list, sampling: SamplingRows, planner: NextStepPlanner) -> list[SampleResult]:
        """Run the step's passes and sample; pipeline the next decode pass when it is predictable."""
        drafts = [c.drafts for c in chunks if c.samples]
        logits = self.step(
            [
                StepInput(
                    c.token_ids,
                    c.start,
                    c.block_tables,
                    c.samples,
                    state_slot=c.state_slot,
                    num_logits=len(c.drafts) + 1 if c.samples else 1,
                    embedding=chunk_embedding(c.request, c.start, len(c.token_ids)),
                    position_delta=position_delta(c.request) if self.takes_positions else 0,
                    adapter=c.request.adapter,
                    both_ways=c.request.both_ways_between(c.start, c.start + len(c.token_ids)),
                )
                for c in chunks
            ]
        )
        if not sampling.rows:
            return []
        if logits is None:
            raise RuntimeError("rows to sample, yet no input of the step samples")
        if any(drafts):  # verified as a whole; the next step depends on how many are kept: no look-ahead
            return sample_with_drafts(logits, drafts, sampling.sampler_rows)
        if sampling.has_forks:
            logits = logits[mx.array(sampling.chunk_of_row)]
        samplers = sampling.samplers
        if any(sampler.has_processors for sampler in samplers):
            return sample_batch(logits, samplers)  # processors read the history: no pipelining
        sample = LazySample(logits, samplers, separate_read=self.recorder is not None)
        # Only steady decoding is pipelined: every chunk samples, no forks are pending, and no
        # request gets its first token here (queuing the next pass first would delay that token
        # by a step, and time to first token is what a user waits on).
        if not sampling.has_forks and len(samplers) == len(chunks) and all(c.request.output_token_ids for c in chunks):
            self._ahead = self._look_ahead(chunks, sample.tokens, samplers, planner)
        results = sample.results()
        self._launch_ahead()
        return results

    def _launch_ahead(self) -> None:
        """Start the pass built ahead, now that the one before it has been read (`launch`); a deferred pass
        was started when it was built."""
        if self._ahead is not None and not self._ahead.launched:
            state_pass = self._ahead.state_pass
            arrays = [*self._ahead.sample.arrays, *(state_pass.new_arrays() if state_pass is not None else ())]
            self._start_ahead(self._ahead.sample, [*arrays, *self.kv.pools])

    def _start_ahead(self, sample: LazySample, arrays: list[mx.array]) -> None:
        """Queue a pass built ahead: from the recorder thread when there is one (recorder.py), else from this one."""
        if self.recorder is not None:
            sample.recording = self.recorder.record(arrays)
        else:
            mx.async_eval(*arrays)

    def _look_ahead(self, chunks: list, tokens: mx.array, samplers: list, planner: NextStepPlanner) -> Lookahead | None:
        """Build the next step's decode pass on this step's lazy tokens (mlx-lm's async_eval
        pipelining): building it overlaps this step's computation, and once this step is read it
        is launched (`_launch_ahead`), so delivering and scheduling overlap it. Only when the next
        step is predictable: nothing waits, and each row continues with one token. A guess that
        turns out wrong costs one pass; its page writes land in the rows' reserved next slots,
        which the real step then writes again."""
        if self.mirror is not None or not planner.predictable() or (self.serial and len(chunks) > 1):
            return None  # a serial model's rows each need a pass of their own; a mirrored pass needs its plan
        if self.last_hidden is not None:
            return None  # a step's hidden states are kept as it runs (capture_hidden)
        if self._one_adapter_per_pass and len({c.request.adapter for c in chunks}) > 1:
            return None  # the rows need a pass per adapter (adapters of switch layers: adapters/layers.py)
        compiled = self.compiles(len(chunks)) and len({c.request.adapter for c in chunks}) == 1
        if compiled and not self.tuning.pipeline_compiled:
            return None  # the CPU backend: see Tuning.pipeline_compiled (rows of several adapters run eagerly)
        picked, inputs = [], []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if len(request.output_token_ids) + 2 > request.max_tokens:
                continue  # this step's token is its last
            tables = planner.reserve_next_slot(request)
            if tables is not None:
                picked.append(i)
                delta = position_delta(request) if self.takes_positions else 0
                start = chunk.start + len(chunk.token_ids)
                inputs.append(
                    StepInput(
                        [0],
                        start,
                        tables,
                        True,
                        state_slot=chunk.state_slot,
                        position_delta=delta,
                        adapter=request.adapter,
                    )
                )
        if not picked:
            return None
        rows = [(chunks[i].request.request_id, x.start) for i, x in zip(picked, inputs, strict=True)]
        picked_samplers = [samplers[i] for i in picked]
        # A compiled pass reads the pools only (a GPU's MLXPAGED_COMPILE_BATCH): built ahead on flushed pools instead.
        deferrable = self.defers and not compiled
        if deferrable and (self._pending is None or self._pending.length < _pending_limit(self._pending)):
            # Queued now, before this step is read: it writes no pages, so nothing in flight is copied.
            ids = [rid for rid, _ in rows]
            pending = self._pending.select(ids) if self._pending is not None else None
            logits, deferred = self._deferred_pass(inputs, ids, _rows(tokens, picked), pending)
            sample = LazySample(logits, picked_samplers, ahead=1, launch=False, separate_read=self.recorder is not None)
            self._start_ahead(sample, sample.arrays)  # before the step is read (with a recorder: while it is read)
            return Lookahead(rows, sample, deferred=deferred)
        if self.defers:
            self._flush_pending()  # every _pending_limit tokens: launched after this step is read, in place
        logits = self.decode_ahead(inputs, _rows(tokens, picked))
        state_pass, self._built_state_pass = self._built_state_pass, None
        sample = LazySample(logits, picked_samplers, ahead=1, launch=False, separate_read=self.recorder is not None)
        return Lookahead(rows, sample, state_pass)

    def _deferred_pass(
        self, inputs: list[StepInput], ids: list[str], tokens: mx.array, pending: PendingKV | None
    ) -> tuple[mx.array, DeferredPass]:
        """A decode pass of one token per input (`tokens` [B], lazy) that writes no pages (deferred_writes.py):
        lazy float32 logits [B, V] and the pass, whose pending K/V the runner takes if it is adopted."""
        views, deferred = deferred_views(
            self.kv, ids, [x.start for x in inputs], [x.block_tables[0] for x in inputs], pending, self.buffer_columns
        )
        cache = cache_tree.model_cache(self.layout, views, None)
        tokens = tokens.astype(mx.int32).reshape(-1, 1)
        with self._adapted(inputs), engine_activations():
            return self._deferred_logits(inputs, tokens, cache), deferred

    def _deferred_logits(self, inputs: list[StepInput], tokens: mx.array, cache) -> mx.array:
        if self.takes_positions:
            starts, deltas = [x.start for x in inputs], [x.position_delta for x in inputs]
            logits = self.model(tokens, cache=cache, position_ids=row_positions(starts, deltas, 1))[:, -1]
        elif self.head is not None:
            logits = self.head(self.body(tokens, cache=cache)[:, -1])
        else:
            logits = self.model(tokens, cache=cache)[:, -1]
        return logits.astype(mx.float32)

    def step(self, inputs: Sequence[StepInput]) -> mx.array | None:
        """Queue the step; return float32 logits [S, V] of the inputs that sample, in order (an input's
        `num_logits` rows each). The passes run in the background (mx.async_eval): reading the logits
        waits for them."""
        if self.mirror is not None:
            self.mirror.before_step(inputs)
        decode = [i for i, x in enumerate(inputs) if len(x.token_ids) == 1 and x.embedding is None]
        if self.serial:
            passes = [[i] for i in range(len(inputs))]
        elif self.state_store is not None:
            passes = state_model_passes(inputs)
        else:
            # Chunks with drafts (a few tokens, each sampled) share one pass whatever their context length.
            drafting = {i for i, x in enumerate(inputs) if x.num_logits > 1}
            prefill = [[i for i in rows if i not in drafting] for rows in prefill_passes(inputs)]
            passes = [rows for rows in [decode, sorted(drafting), *prefill] if rows]
        if self._one_adapter_per_pass:
            passes = [group for rows in passes for group in _by_adapter(rows, inputs)]
        results: list[mx.array] = []
        for rows in passes:
            logits, state_pass = self._build([inputs[i] for i in rows])
            if results:
                # Queued while the pass before still reads the pools (or the state store), this pass's writes
                # would copy each one it writes (whole pools: on a GPU, on every step that mixes decode rows and a
                # prefill chunk). Built meanwhile, it is launched once that pass is done.
                mx.eval(results[-1])
            self._launch_pass(logits, state_pass)
            results.append(logits)
        if self.last_hidden is not None:
            self.last_hidden = [self._captured.pop(id(x), None) for x in inputs]
            self._captured.clear()
        wanted = [i for i, x in enumerate(inputs) if x.samples]
        if not wanted:
            return None
        if len(passes) == 1 and passes[0] == wanted:  # the common all-decode step: no regathering
            logits = results[0]
        else:
            where = {}  # input -> (its pass, its first logits row there)
            for p, rows in enumerate(passes):
                firsts = [0]
                for i in rows:
                    firsts.append(firsts[-1] + inputs[i].num_logits)
                where.update({i: (p, r) for i, r in zip(rows, firsts[:-1], strict=True)})  # firsts[-1]: the total
            logits = mx.concatenate(
                [results[where[i][0]][where[i][1] : where[i][1] + inputs[i].num_logits] for i in wanted]
            )
        return logits.astype(mx.float32)

    @property
    def _one_adapter_per_pass(self) -> bool:
        return self.adapter_rows is not None and self.adapter_rows.one_adapter_per_pass

    def _compiled_pass(self, batch: list[StepInput], length: int) -> bool:
        """A decode pass, or a verify chunk (every position's logits) of at most COMPILED_VERIFY_MAX_TOKENS,
        at a batch size that compiles: the compiled pass returns every position's logits."""
        if not self.compiles(len(batch)) or any(x.embedding is not None for x in batch):
            return False
        if len({x.adapter for x in batch}) > 1:
            return False  # a compiled pass applies one adapter (or none) to every row (decode_pass.py)
        return length == 1 or (
            length <= COMPILED_VERIFY_MAX_TOKENS and all(x.num_logits == len(x.token_ids) == length for x in batch)
        )

    @property
    def most_compiled_rows(self) -> int:
        """The most sequences a decode pass may have and run compiled."""
        return self.tuning.compiled_decode_max_batch if self._compiled_rows is None else self._compiled_rows

    def compiles(self, batch: int) -> bool:
        """True when a decode pass of `batch` sequences runs compiled (decode_pass.py)."""
        return self.decoder is not None and batch <= self.most_compiled_rows

    def decode_ahead(self, inputs: Sequence[StepInput], tokens: mx.array) -> mx.array:
        """A decode pass of one token per input whose ids are still being computed (`tokens` [B],
        lazy; `token_ids` of the inputs are ignored): the engine builds the next step on them
        while the current one runs. Returns lazy float32 logits [B, V]; nothing runs until
        `launch`, which must wait until the current pass is done (see `launch`)."""
        return self._pass(list(inputs), tokens.astype(mx.int32).reshape(-1, 1), launch=False).astype(mx.float32)

    def launch(self, *arrays: mx.array) -> None:
        """Start computing `arrays` and the pools' pending writes. A pass's page writes stay in
        place only if nothing else still reads those pools when they are queued, so a pass built
        ahead is launched only after the pass before it has been read (measured on compiled
        passes: launching one while the pass before ran copied pools, 55 -> 115-175 ms per step
        with 6 GB of pools)."""
        self.settle_recording()
        mx.async_eval(*arrays, self.kv.pools)

    def _pass(self, batch: list[StepInput], tokens: mx.array | None = None, launch: bool = True) -> mx.array:
        """Build one forward pass and its cache writes, and launch it unless told not to; returns
        the logits of each row's last `num_logits` positions, rows in order ([B, V] when each wants
        one). Passes run in order on one stream."""
        logits, state_pass = self._build(batch, tokens)
        if not launch:
            self._built_state_pass = state_pass  # stored only if the pass is adopted (Lookahead.state_pass)
            return logits
        self._launch_pass(logits, state_pass)
        return logits

    def _build(self, batch: list[StepInput], tokens: mx.array | None = None) -> tuple[mx.array, StatePass | None]:
        """One forward pass and its cache writes as a lazy graph: its logits (see `_pass`) and its state pass."""
        with engine_activations():  # the routed swiglu takes the CPU backend's (activation_routing.py)
            return self._build_pass(batch, tokens)

    def _build_pass(self, batch: list[StepInput], tokens: mx.array | None) -> tuple[mx.array, StatePass | None]:
        length = max(len(x.token_ids) for x in batch)
        if tokens is None:
            tokens = mx.array([list(x.token_ids) + [0] * (length - len(x.token_ids)) for x in batch], dtype=mx.int32)
        if self.decoder is not None and self._compiled_pass(batch, length):
            deltas = [x.position_delta for x in batch] if self.takes_positions else None
            starts, tables = [x.start for x in batch], [x.block_tables[0] for x in batch]
            return self.decoder(starts, tables, tokens, deltas, batch[0].adapter, self.adapter_rows), None
        with self._adapted(batch):
            return self._forward(batch, tokens)

    def _adapted(self, batch: Sequence[StepInput]) -> AbstractContextManager[None]:
        """Around building a pass: the adapted layers apply each row's adapter (adapters/layers.py)."""
        if self.adapter_rows is None:
            return nullcontext()
        return self.adapter_rows.building([x.adapter for x in batch], max(len(x.token_ids) for x in batch))

    def _launch_pass(self, logits: mx.array, state_pass: StatePass | None) -> None:
        if state_pass is not None:
            state_pass.commit()  # a launched pass is used: its rows are the sequences' state now
        self.launch(logits, *(state_pass.new_arrays() if state_pass is not None else ()))

    def _forward(self, batch: list[StepInput], tokens: mx.array) -> tuple[mx.array, StatePass | None]:
        """The model over `batch` through paged KV views (and state views): lazy logits of each row's last
        `num_logits` positions and the pass's state, not stored yet."""
        num_new = [len(x.token_ids) for x in batch]
        both_ways = [x.both_ways for x in batch]
        views = paged_views(self.kv, [x.block_tables for x in batch], [x.start for x in batch], num_new, both_ways)
        state_pass = None
        if self.state_store is not None:
            slots = [x.state_slot for x in batch if x.state_slot is not None]
            if len(slots) < len(batch):
                raise ValueError("every row of a model with state layers needs its state slot")
            state_pass = StatePass(self.state_store, slots, num_new)
        views = cache_tree.model_cache(self.layout, views, state_pass.views if state_pass is not None else None)
        layers = self._layer_outputs if self.last_hidden is not None else None
        # The body's output, kept (capture_hidden without layers).
        hidden_out: list | None = [] if self.last_hidden is not None and layers is None else None
        with layers.recording() if layers is not None else nullcontext():
            logits = self._logits(batch, tokens, views, hidden_out)
        kept = layers.stacked() if layers is not None else hidden_out[0] if hidden_out else None
        if kept is not None:
            self._captured.update({id(x): kept[b, : len(x.token_ids)] for b, x in enumerate(batch)})
        return logits, state_pass

    def _logits(self, batch: list[StepInput], tokens: mx.array, views: list, hidden_out: list | None) -> mx.array:
        """Logits of each row's last `num_logits` positions; the body's output [B, L, H] appended to `hidden_out`
        when given (capture_hidden)."""
        rows, columns = logit_positions(batch)
        embedding = batch[0].embedding  # a chunk with one runs alone (passes.py)
        # A vision-language model (vision/language.py) hands back its hidden states when asked (`hidden_out`).
        asked: dict = {"hidden_out": hidden_out} if hidden_out is not None and self.head is None else {}
        if embedding is not None:  # a vision-language model's own language model
            arguments = {**embedding.arguments, **asked}
            return self.model(tokens, cache=views, inputs_embeds=embedding.inputs_embeds, **arguments)[rows, columns]
        if self.takes_positions:
            starts, deltas = [x.start for x in batch], [x.position_delta for x in batch]
            positions = row_positions(starts, deltas, tokens.shape[1])
            return self.model(tokens, cache=views, position_ids=positions, **asked)[rows, columns]
        if self.head is not None:
            hidden = self.body(tokens, cache=views)
            if hidden_out is not None:
                hidden_out.append(hidden)
            return self.head(hidden[rows, columns])
        return self.model(tokens, cache=views)[rows, columns]


def _pending_limit(pending: PendingKV) -> int:
    """Tokens a run may keep off the pools before it waits once to write them (deferred_writes.py)."""
    return MAX_PENDING_BUFFERED if pending.buffers else MAX_PENDING
