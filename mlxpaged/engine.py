"""Engine: continuous batching over the paged cache. One thread owns MLX.

Callers on any thread (or asyncio task) submit requests; the engine thread runs the
scheduler, the model and the samplers, and pushes events into each request's sink
(live_requests.py: what happens to a request after each step).

Models that mix sliding-window and full attention (gemma3, `layer_types`) run too: each
request holds one block table per layer group, a window group's table being a ring of at
most ceil(window / block_size) + 1 blocks, and their prefix cache is off (kv_cache.py).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import threading
import warnings
from typing import AsyncIterator, Callable, Iterator, Sequence

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx

from mlxpaged.attention import attention_status, prepare_attention
from mlxpaged.blocks import BlockPool
from mlxpaged.cache_view import layer_windows
from mlxpaged.config import DEFAULT_CACHE_TOKENS, CacheConfig
from mlxpaged.generation_defaults import GenerationDefaults, load_defaults
from mlxpaged.kv_cache import PagedKVCache
from mlxpaged.live_requests import EngineClosedError, LiveRequests, RequestFailedError, Tracked  # noqa: F401  (re-exported)
from mlxpaged.metrics import StatsCounter
from mlxpaged.results import Completion, StreamDelta, collect, drain  # noqa: F401  (re-exported)
from mlxpaged.memory import DeviceFacts, ModelFacts, model_weight_bytes, plan_memory, wired_limit
from mlxpaged.checkpoint import facts_before_load
from mlxpaged.model import (LoadedModel, activation_dtype, chat_prompt, check_paged_support, load_local, locate_model,
                            route_paged_attention)
from mlxpaged.models import Progress
from mlxpaged.runner import Lookahead, Runner, StepInput
from mlxpaged.sampling import LazySample, SamplingParams, sample_batch
from mlxpaged.scheduler import (CACHE_CAPACITY, MODEL_CONTEXT, Request, RequestTooLongError, Scheduler,
                                SchedulerOutput)


def _rows(values: mx.array, rows: list[int]) -> mx.array:
    """`values[rows]`, without a gather when `rows` is every row in order."""
    return values if rows == list(range(values.shape[0])) else values[mx.array(rows)]


class Engine:
    def __init__(self, loaded: LoadedModel, cache_config: CacheConfig | None = None):
        self.loaded = loaded
        self.cache_config = cache_config or CacheConfig(max_tokens=DEFAULT_CACHE_TOKENS)
        check_paged_support(loaded.model)
        route_paged_attention()
        kv_dtype = activation_dtype(loaded.model)  # K/V have the activations' dtype
        self.facts = self._model_facts(kv_dtype)
        self.plan = plan_memory(DeviceFacts.detect(), self.facts, self.cache_config, weights_resident=True)
        self.kv = self._make_kv_cache(kv_dtype)
        # Before the first decode: a Metal kernel variant that fails its self-check is replaced by the reference.
        prepare_attention(kv_dtype, self.facts.kv.head_dim, self.cache_config.block_size,
                          loaded.config["num_attention_heads"], self.facts.kv.num_kv_heads)
        block_size = self.cache_config.block_size
        self.pool = BlockPool(self.plan.num_blocks, block_size,
                              enable_prefix_cache=self.cache_config.enable_prefix_cache and self.kv.supports_prefix_cache,
                              extra_key=str(loaded.path),
                              group_max_blocks=[g.max_blocks(block_size) for g in self.kv.groups])
        self.max_model_len = int(loaded.config.get("max_position_embeddings") or self.plan.token_capacity)
        self.scheduler = Scheduler(self.pool, max_batch_tokens=self.cache_config.max_batch_tokens,
                                   max_num_seqs=self.cache_config.max_num_seqs, max_model_len=self.max_model_len)
        self.runner = Runner(loaded.model, self.kv)
        self._commands: queue.Queue = queue.Queue()
        self._ids = itertools.count()
        self._closed = False
        self._stats = StatsCounter()
        self.live = LiveRequests(self.scheduler, self.kv, loaded.tokenizer, self._stats,
                                 abort=lambda group: self._commands.put(("abort", group)))
        self._ahead: Lookahead | None = None  # the next step's decode pass, already queued
        self._thread = threading.Thread(target=self._run, name="mlxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_pretrained(cls, model: str | None = None, progress: Progress | None = None, **settings) -> "Engine":
        """A preset name, local path or hub id (None: the embedded default model); settings are CacheConfig
        fields (kv_memory="2GB" too). A cache that cannot fit raises InsufficientMemoryError before any
        weight is read (once the model's files are local: a hub model is downloaded first)."""
        settings.setdefault("max_tokens", DEFAULT_CACHE_TOKENS)
        config = CacheConfig(**settings)
        ref, path = locate_model(model, progress)
        device = DeviceFacts.detect()
        plan_memory(device, facts_before_load(path, device.backend), config)
        return cls(load_local(ref, path), config)

    @property
    def model(self):
        return self.loaded.model

    @functools.cached_property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's recommended sampling (its generation_config.json, gaps filled from its preset), read once."""
        return load_defaults(self.loaded.path, self.loaded.ref.preset)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's recommended settings, `overrides` winning over them. Plain
        `SamplingParams()` keeps the API's own defaults (temperature 1.0, top_p 1.0) whatever the model."""
        return SamplingParams(**self.generation_defaults.sampling_kwargs(overrides))

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    # --- setup ---------------------------------------------------------------------------------
    def _model_facts(self, kv_dtype: mx.Dtype) -> ModelFacts:
        """The one reading of the model's KV shape, for the plan and the pools alike; the windows are
        those of mlx-lm's own caches (configs spell them several ways)."""
        model = self.loaded.model
        return ModelFacts.from_config(self.loaded.config, model_weight_bytes(model), kv_dtype.size, layer_windows(model))

    def _make_kv_cache(self, dtype: mx.Dtype) -> PagedKVCache:
        kv = self.facts.kv
        return PagedKVCache(num_layers=kv.num_layers, num_blocks=self.plan.num_blocks,
                            block_size=self.cache_config.block_size, num_kv_heads=kv.num_kv_heads,
                            head_dim=kv.head_dim, dtype=dtype, layer_windows=kv.layer_windows)

    # --- public API ----------------------------------------------------------------------------
    def submit(self, prompt: str | Sequence[int], params: SamplingParams | None,
               sink: Callable[[object], None]) -> str:
        """Queue a request; events (StreamDelta, or an exception) go to `sink` from the engine thread."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        params = params or SamplingParams()
        tokens = self._tokenize(prompt)
        self._check_token_ids("logit_bias token ids", params.logit_bias)
        self._check_fits(len(tokens), params.max_tokens)
        request_id = f"req-{next(self._ids)}"
        self._commands.put(("add", request_id, tokens, params, sink))
        return request_id

    def generate(self, prompts: str | Sequence[int] | list,
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Run prompts (text or token-id lists) concurrently; return their completions in order
        (with n > 1, a prompt's n completions follow each other, by index).
        `params` is one SamplingParams for all prompts, or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        sinks = [queue.Queue() for _ in prompts]
        ids = []
        try:
            for prompt, p, sink in zip(prompts, per_prompt, sinks):
                ids.append(self.submit(prompt, p, sink.put))
        except Exception:
            for request_id in ids:  # a bad prompt in the list: the ones already queued are withdrawn
                self.abort(request_id)
            raise
        out = []
        for rid, sink, p in zip(ids, sinks, per_prompt):
            out += collect(rid, drain(sink, (p or SamplingParams()).n))
        return out

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        return self.generate([self.chat_tokens(messages)], params)[0]

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        return chat_prompt(self.tokenizer, messages)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield deltas as tokens arrive. Closing the iterator early aborts the request."""
        sink: queue.Queue = queue.Queue()
        request_id = self.submit(prompt, params, sink.put)
        remaining = (params or SamplingParams()).n
        try:
            for delta in drain(sink, remaining):
                remaining -= delta.finish_reason is not None
                yield delta
        finally:
            if remaining:
                self.abort(request_id)

    async def astream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> AsyncIterator[StreamDelta]:
        """Async version of stream(); cancelling the consuming task aborts the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        request_id = self.submit(prompt, params, lambda e: loop.call_soon_threadsafe(events.put_nowait, e))
        remaining = (params or SamplingParams()).n
        try:
            while remaining:
                event = await events.get()
                if isinstance(event, BaseException):
                    remaining = 0  # a failed request is already finished in the engine
                    raise event
                remaining -= event.finish_reason is not None
                yield event
        finally:
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the start of the engine's next step."""
        if not self._closed:
            self._commands.put(("abort", request_id))

    def stats(self) -> dict:
        pool = self.pool.stats()
        return {
            "blocks_total": pool.num_blocks, "blocks_free": pool.num_free + pool.num_cached_free,
            "blocks_used": pool.num_owned, "blocks_cached": pool.num_cached_free,
            "prefix_hit_rate": pool.hit_rate, "prefix_hit_tokens": pool.hit_tokens,
            "requests_running": self.scheduler.num_running, "requests_waiting": self.scheduler.num_waiting,
            **self._stats.snapshot(), "memory_plan": self.plan,
            "attention": attention_status(),  # {"path", "reason", "variants"}: see mlxpaged.attention
        }

    def block_states(self) -> list[str]:
        """Per block: "free", "owned", "shared" or "cached" (a snapshot; for the block map)."""
        return list(self.pool.block_state())

    def request_blocks(self, request_id: str) -> list[int]:
        """Block ids a live request holds in all its tables (empty once it finished); for the block map."""
        try:
            return [b for table in self.pool.block_tables(request_id) for b in table]
        except KeyError:
            return []

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._commands.put(("close",))
        self._thread.join(timeout=30)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- caller-side helpers ---------------------------------------------------------------------
    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        tokens = [int(t) for t in prompt]
        self._check_token_ids("prompt token ids", tokens)
        return tokens

    def _check_token_ids(self, what: str, tokens) -> None:
        vocab = self.loaded.config.get("vocab_size")
        bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise ValueError(f"{what} out of range [0, {vocab}): {bad[:5]}")

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        if prompt_tokens + max_tokens > self.max_model_len:
            raise RequestTooLongError(prompt_tokens, max_tokens, self.max_model_len, MODEL_CONTEXT)
        if self.pool.num_blocks_for(prompt_tokens + max_tokens) > self.pool.num_blocks:
            raise RequestTooLongError(prompt_tokens, max_tokens, self.scheduler.capacity_tokens, CACHE_CAPACITY)

    # --- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())  # MLX streams belong to the thread that made them
        try:
            with mx.stream(stream), wired_limit(self.plan, enabled=self.cache_config.wire, streams=[stream]):
                self._warm_up()
                self._loop()
            self.live.fail_all(EngineClosedError("the engine was closed"))
        finally:
            # MLX requires a thread to release its streams before it ends, or the process can
            # abort at exit ("terminate called without an active exception").
            mx.clear_streams()

    def _warm_up(self) -> None:
        """Compile the decode pass before serving (requests submitted meanwhile wait in the queue);
        a model whose attention cannot be traced decodes eagerly instead."""
        if self.runner.decoder is None:
            return
        try:
            self.runner.decoder.warm_up()
        except Exception as exc:
            warnings.warn(f"compiled decode is off for this model ({exc!r}); decoding eagerly", RuntimeWarning)
            self.runner.decoder = None

    def _loop(self) -> None:
        while True:
            if not self._handle_commands(block=not self.scheduler.has_unfinished):
                return
            if self.scheduler.has_unfinished:
                try:
                    self._step()
                except Exception as exc:  # a failed step fails its requests, not the engine
                    self._ahead = None
                    self.live.fail_all(exc)

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued adds / aborts; False when the engine must stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return True
            block = False
            if command[0] == "close":
                return False
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                self.live.abort(command[1])

    def _add(self, request_id: str, tokens: list[int], params: SamplingParams, sink) -> None:
        try:
            request = Request(request_id, tokens, params.max_tokens)
            self.scheduler.add_request(request)
        except Exception as exc:
            sink(exc)
            return
        self.live.add(request, params, sink)

    def _step(self) -> None:
        out = self.scheduler.schedule()
        self._stats.preemptions += len(out.preempted)
        ahead, self._ahead = self._ahead, None
        if not out.chunks:
            return
        sampling = [self.live[c.request.request_id] for c in out.chunks if c.samples]
        # n > 1: the forks sample their first token from their parent's logits row.
        rows = [(i, t) for i, parent in enumerate(sampling) for t in [parent, *parent.forks]]
        if ahead is not None and ahead.covers(out.chunks):
            # This step was computed while the last one ran: queue the next one, then read it.
            rows_of = ahead.rows_of(out.chunks)
            tokens = _rows(ahead.sample.tokens, rows_of)
            self._ahead = self._look_ahead(out.chunks, tokens, [t.sampler for t in sampling])
            everything = ahead.sample.results()
            self._launch_ahead()
            results = [everything[i] for i in rows_of]
        else:
            results = self._compute(out, sampling, rows)
        self.live.complete(out, rows, results)

    def _compute(self, out: SchedulerOutput, sampling: list[Tracked], rows: list) -> list:
        """Run the step's passes and sample; pipeline the next decode pass when it is predictable."""
        inputs = [StepInput(c.token_ids, c.start, c.block_tables, c.samples) for c in out.chunks]
        logits = self.runner.step(inputs)
        if not rows:
            return []
        if len(rows) > len(sampling):
            logits = logits[mx.array([i for i, _ in rows])]
        states = [t.sampler for _, t in rows]
        if any(state.has_processors for state in states):
            return sample_batch(logits, states)  # processors read the history: no pipelining
        sample = LazySample(logits, states)
        # Only steady decoding is pipelined: every chunk samples, no forks are pending, and no
        # request gets its first token here (queuing the next pass first would delay that token
        # by a step, and time to first token is what a user waits on).
        if len(rows) == len(sampling) == len(out.chunks) and all(c.request.output_token_ids for c in out.chunks):
            self._ahead = self._look_ahead(out.chunks, sample.tokens, states)
        results = sample.results()
        self._launch_ahead()
        return results

    def _launch_ahead(self) -> None:
        """Start the pass built ahead, now that the one before it has been read (runner.launch)."""
        if self._ahead is not None:
            self.runner.launch(*self._ahead.sample.arrays)

    def _look_ahead(self, chunks: list, tokens: mx.array, states: list) -> Lookahead | None:
        """Build the next step's decode pass on this step's lazy tokens (mlx-lm's async_eval
        pipelining): building it overlaps this step's computation, and once this step is read it
        is launched (`_launch_ahead`), so delivering and scheduling overlap it. Only when the next
        step is predictable: nothing waits, and each row continues with one token. A guess that
        turns out wrong costs one pass; its page writes land in the rows' reserved next slots,
        which the real step then writes again."""
        if self.scheduler.num_waiting or not self._commands.empty():
            return None
        if self.runner.compiles(len(chunks)):
            # A compiled pass is cheap to build, and building it during the last one's tail
            # slowed that tail (2 cores): batch-1 decode, synchronous 19.6 / 20.3 / 19.1 tok/s,
            # pipelined 19.0 / 19.4 / 18.4 (3 alternating A/B runs).
            return None
        picked, inputs = [], []
        for i, chunk in enumerate(chunks):
            request = chunk.request
            position = chunk.start + len(chunk.token_ids)
            if len(request.output_token_ids) + 2 > request.max_tokens:
                continue  # this step's token is its last
            tables = self.scheduler.reserve_next_slot(request)
            if tables is not None:
                picked.append(i)
                inputs.append(StepInput([0], position, tables, True))
        if not picked:
            return None
        logits = self.runner.decode_ahead(inputs, _rows(tokens, picked))
        return Lookahead([(chunks[i].request.request_id, x.start) for i, x in zip(picked, inputs)],
                      LazySample(logits, [states[i] for i in picked], ahead=1, launch=False))
