"""The engine core: one step of continuous batching, as nano-vllm's LLMEngine.step() reads.

    schedule -> execute -> update -> process

The scheduler picks this step's chunks (and preempts when the pool is dry); the runner runs them
and samples (and pipelines the next decode pass); the scheduler records the computed KV and the
sampled tokens in their requests; the output processor hands tokens to callers and finishes,
forks or fails requests. No thread here: `Engine` (engine.py) owns the thread and the command
queue and calls `step()`; tests drive it directly.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable

from mlxpaged.adapters.adapter_set import AdapterSet
from mlxpaged.cache.block_pool import BlockPool
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.kv_cache_manager import KVCacheManager
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.state_cache import CheckpointTable, StateCache, StateStore
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.engine.drafting import BatchDrafter, Speculator
from mlxpaged.engine.kv_tiering import KVTiering
from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.engine.output_processor import OutputProcessor, split_results
from mlxpaged.engine.request import ImageSpan, Request
from mlxpaged.engine.scheduler import Scheduler, SchedulerOutput
from mlxpaged.engine.step_budget import Chunk, StepBudget
from mlxpaged.errors import ConfigError, UnknownAdapterError
from mlxpaged.runner.model_runner import Runner
from mlxpaged.sampling_params import SamplingParams

LOAD_POLL_S = 0.05  # a step with nothing to run waits this long at most for a disk load (commands wait as long)


class EngineCore:
    """`has_commands`: whether callers queued anything since the step began (a request may arrive,
    so the next step is not predictable and nothing is pipelined)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: Runner,
        tokenizer,
        stats: StatsCounter | None = None,
        has_commands: Callable[[], bool] = lambda: False,
        num_speculative_tokens: int | None = None,
        model_drafter: BatchDrafter | None = None,
    ):
        self.scheduler, self.runner = scheduler, runner
        self.stats = stats or StatsCounter()
        self.outputs = OutputProcessor(scheduler, tokenizer, self.stats, fork=self._fork)
        self._has_commands = has_commands
        self.tiering: KVTiering | None = None  # the prefix cache's disk tier, when on (attach_disk_tier)
        # The adapters requests may run with (set by build_core; None across ranks): checked as each request comes in.
        self.adapters: AdapterSet | None = None
        # Across mlx.launch ranks (set by build_core on every rank): whether every rank says True.
        self.all_ranks_ok: Callable[[bool], bool] | None = None
        # Speculative decoding (drafting.py), when a draft length is given: a draft model's, else prompt lookup.
        self.speculator = (
            None
            if num_speculative_tokens is None
            else Speculator(scheduler, num_speculative_tokens, self._can_draft, model_drafter)
        )

    @classmethod
    def create(
        cls,
        model,
        tokenizer,
        kv: PagedKVCache,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        *,
        max_model_len: int,
        extra_key: object = None,
        serial: bool = False,
        layout: ModelLayout | None = None,
        num_checkpoints: int = 0,
        buffer_budget: int | None = None,
        **kwargs,
    ) -> EngineCore:
        """A core over `kv`'s blocks: block pool, cache manager (one spec per layer group), scheduler, runner
        (`layout`: the model's cache layout, which the runner assembles its cache list from; `serial`: one
        sequence per pass). A `layout` with state layers also gets max_num_seqs state slots and
        `num_checkpoints` checkpoints (the memory plan's: pending ones included). `buffer_budget`: bytes the runner's
        decode buffers may take (the memory plan's spare; None: no limit)."""
        specs = kv.specs  # one per layer group: how each table grows, shares and frees
        budget_ms = scheduler_config.step_budget_ms
        long_prompt_s = _seconds(scheduler_config.long_prompt_step_budget_ms)
        streams_s = _seconds(scheduler_config.streams_step_budget_ms)
        prefix_cache = cache_config.enable_prefix_cache and kv.supports_prefix_cache
        state = None
        if layout is not None and layout.state_leaves:
            # Each slot may hold one pending checkpoint (StateCache): the table gets the rest.
            table = max(0, num_checkpoints - scheduler_config.max_num_seqs) if prefix_cache else 0
            state = StateCache(StateStore(layout.state_leaves, scheduler_config.max_num_seqs), CheckpointTable(table))
        manager = KVCacheManager(
            [BlockPool(n) for n in kv.space_blocks],  # one per block space (specs.block_spaces)
            specs,
            spaces=kv.group_spaces,
            extra_key=extra_key,
            enable_prefix_cache=prefix_cache,
            prefix_filter=state.usable_blocks if state is not None else None,
            prepare_resume=state.prepare if state is not None else None,
        )
        scheduler = Scheduler(
            manager,
            max_batch_tokens=scheduler_config.max_batch_tokens,
            max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=max_model_len,
            state=state,
            step_budget=None if budget_ms is None else StepBudget(budget_ms / 1000, long_prompt_s, streams_s),
        )
        if scheduler_config.speculative is not None:
            _check_speculation(scheduler_config.speculative, kv)
            kwargs["num_speculative_tokens"] = scheduler_config.num_speculative_tokens
        runner = Runner(
            model, kv, layout, state.store if state is not None else None, serial=serial, buffer_budget=buffer_budget
        )
        return cls(scheduler, runner, tokenizer, **kwargs)

    def attach_disk_tier(self, tiering: KVTiering) -> None:
        """Keep the prefix cache's blocks on disk too: the manager reads misses from it, the steps write to it."""
        self.scheduler.kv_manager.lower_tier = tiering
        self.tiering = tiering

    def idle(self) -> None:
        """Nothing to run: write the disk tier's pending blocks, and over ranks let the others hear rank 0 is alive
        (the engine thread calls this while it waits)."""
        self.runner.settle_recording(quiet=True)
        if self.tiering is not None:
            self.tiering.idle()
        if self.runner.mirror is not None:
            self.runner.mirror.idle()

    def close(self) -> None:
        """The engine stops: the disk tier writes what it still holds in RAM only; other ranks stop."""
        if self.tiering is not None:
            self.tiering.close()
        if self.runner.mirror is not None:
            self.runner.mirror.close()

    @property
    def idle_wait_s(self) -> float | None:
        """How long the idle engine thread may wait for a command before calling `idle` again (None: its own
        default): across ranks, rank 0's keep-alive tick (distributed/leader.py)."""
        return self.runner.mirror.idle_tick_s if self.runner.mirror is not None else None

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def warm_up(self) -> None:
        """Compile the decode pass before serving, on the thread that will step; a model whose attention
        cannot be traced decodes eagerly instead."""
        drafter = getattr(self.speculator.model, "runner", None) if self.speculator is not None else None
        for runner, which in ((self.runner, "this model"), (drafter, "the draft model")):
            if runner is None or runner.decoder is None:
                continue
            try:
                runner.decoder.warm_up(self.all_ranks_ok)
            except Exception as exc:
                warnings.warn(
                    f"compiled decode is off for {which} ({exc!r}); decoding eagerly", RuntimeWarning, stacklevel=1
                )
                runner.decoder = None

    def add_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        sink,
        images: tuple[ImageSpan, ...] = (),
        multimodal: object | None = None,
        adapter: str | None = None,
        both_ways: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """Queue a request; its events (StreamDelta, or an exception) go to `sink`. Raises on bad input. A prompt
        with images comes with where they are and what its prefill is fed (engine/request.py); `adapter` is the id of
        the adapter it runs with (adapters/), None for the base model; `both_ways` the prompt's spans attended both
        ways (Request.both_ways)."""
        if adapter is not None and (self.adapters is None or not self.adapters.has_id(adapter)):
            raise UnknownAdapterError(f"the adapter the request named ({adapter}) was removed before it started")
        request = Request(
            request_id,
            token_ids,
            params.max_tokens,
            images=images,
            multimodal=multimodal,
            adapter=adapter,
            both_ways=both_ways,
        )
        self.scheduler.add_request(request)
        self.outputs.add(request, params, sink)

    def requests_with_adapter(self, adapter: str) -> int:
        """How many unfinished requests run with the adapter of id `adapter`."""
        return sum(1 for request in self.scheduler.unfinished() if request.adapter == adapter)

    def abort(self, request_id: str) -> None:
        """Stop every sequence of a request now and free its blocks (unknown ids are ignored)."""
        self.outputs.abort(request_id)

    def step(self) -> None:
        """One engine step over every unfinished request."""
        if self.runner.recorder is not None and (self.tiering is not None or not self.predictable()):
            # Only a step that continues the same rows schedules and builds while the recorder thread queues the pass
            # built ahead (runner/recorder.py); anything else may evaluate (aborts, admissions, drafts, the disk tier).
            self.runner.settle_recording()
        while self.outputs.pending_aborts:  # requests whose sink raised during the last step
            self.abort(self.outputs.pending_aborts.pop(0))
        if self.tiering is not None:
            self.tiering.before_schedule()  # blocks the pool may evict go to disk first
        started = time.perf_counter()
        out = self.scheduler.schedule()  # 1. schedule
        self.stats.preemptions += len(out.preempted)
        if not out.chunks:
            self.runner.drop_look_ahead()
            if self.tiering is not None:
                self.tiering.loads.wait(LOAD_POLL_S)  # only disk loads to wait for: not a busy loop
            return
        if self.speculator is not None:
            self.speculator.extend(out)  # decode chunks get their drafts appended
        rows = self.outputs.sampling_rows(out)
        results = self.runner.execute(out.chunks, rows, planner=self)  # 2. execute
        sampled, failed = split_results(rows, results)
        accepted = {
            t.request.request_id: [a.token for a in r.accepted if a.token is not None]
            for t, r in zip(rows.sequences, results, strict=True)
            if r.accepted
        }
        self.scheduler.update_from_output(out, sampled, failed, accepted)  # 3. update
        if self.speculator is not None:
            self.speculator.observe(out, accepted)  # before n > 1 forks start from what the drafter keeps
        self.outputs.process(out, rows, results)  # 4. process outputs
        seconds = time.perf_counter() - started
        if self.speculator is not None:
            self.speculator.record(out, accepted, seconds)
        if self.scheduler.step_budget is not None:
            _record_cost(self.scheduler.step_budget, out, seconds)
        if self.tiering is not None:
            self.tiering.after_step()  # snapshots only: the writer thread writes

    def fail_all(self, exc: BaseException) -> None:
        """A step raised: fail every request (not the engine), and forget the pipelined pass."""
        self.runner.drop_look_ahead(failed=True)
        self.outputs.fail_all(exc)

    # ---- the runner's NextStepPlanner: what it may pipeline ----------------------------------

    def predictable(self) -> bool:
        """Also False when a sequence may draft next step: its chunk will not be one token."""
        return not (
            self.scheduler.num_waiting
            or self.outputs.pending_aborts
            or self._has_commands()
            or (self.speculator is not None and self.speculator.may_draft(self.scheduler.running))
        )

    def _can_draft(self, request: Request) -> bool:
        """Sequences with logits processors never draft (a caller's processor may keep state of its own), nor a
        sequence whose n > 1 forks still wait: they fork from its first sample, not from a run of drafts. Penalties
        and grammars draft: each drafted position is verified with the drafts before it as history
        (draft_verify.ShiftedState) and under its own mask (RowConstraint.drafted_masks)."""
        try:
            tracked = self.outputs[request.request_id]
        except KeyError:
            return False
        return not tracked.sampler.params.logits_processors and not tracked.forks

    def reserve_next_slot(self, request: Request) -> list[list[int]] | None:
        return self.scheduler.reserve_next_slot(request)

    def _fork(self, parent_id: str, child: Request, first_token: int) -> None:
        """Start an n > 1 sequence: the scheduler shares the parent's blocks, the runner copies the rest."""
        copies = self.scheduler.fork(parent_id, child, first_token)
        self.runner.copy_blocks(copies)
        if self.speculator is not None:
            self.speculator.fork(parent_id, child.request_id, copies)


def _seconds(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


def _record_cost(budget: StepBudget, out: SchedulerOutput, seconds: float) -> None:
    """What the step cost, for the next steps' chunks: a chunk of more than one new token (drafts aside) prefills."""
    prefills = [Chunk(c.start, len(c.token_ids)) for c in out.chunks if len(c.token_ids) - len(c.drafts) > 1]
    budget.record(seconds, decoding=len(prefills) < len(out.chunks), prefills=prefills)


def _check_speculation(method: str, kv: PagedKVCache) -> None:
    """Refuse speculation, at load, for layers whose rejected drafts cannot be rolled back by freeing blocks (state
    layers can: the scheduler returns them to the state before the verify pass)."""
    rings: dict[str, set[int]] = {}  # a ring reuses its slots: rejected drafts would overwrite KV still in it
    for spec in kv.specs:
        label, size = spec.ring_label, spec.size
        if not spec.rolls_back and label is not None and size is not None:  # a ring has both
            rings.setdefault(label, set()).add(size)
    if rings:
        kinds = [label.format(sizes=sorted(sizes)) for label, sizes in rings.items()]
        raise ConfigError(
            f"{{speculative:{method!r}}} needs full attention in every layer; this model has {' and '.join(kinds)}",
            param="speculative",
        )
