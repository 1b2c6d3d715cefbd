"""Continuous-batching scheduler: waiting/running queues, chunked prefill, preemption.

Plain Python (no MLX), modelled on vLLM v1's scheduler. Each step spends at most
`max_batch_tokens` tokens: one per decoding request first, then chunks of unfinished
prefills (each at most a quarter of the budget while a request waits), then new admissions
in FIFO order (a request whose blocks are being read from the disk tier waits apart, passed
by the others). With a step budget (step_budget.py) prefill chunks also take only the tokens
that end the step in time, as measured while the engine runs: decoding streams never wait long.
When the block pool runs dry the newest running request is preempted by recompute: its blocks
are freed and it later re-prefills prompt + generated tokens (cheaply, if its blocks are still
in the prefix cache).

A request holds one block table per layer group (see kv_cache_manager.py); the manager sizes
and grows all of them, so admission, preemption and capacity here count every group's blocks.
The scheduler is the one writer of a `Request` (request.py): its computed count, tokens and status (the
output processor ends requests through `finish` and `drop_last_outputs`).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from mlxpaged.cache.block_pool import NoFreeBlocksError
from mlxpaged.cache.kv_cache_manager import CopyOnWrite, KVCacheManager, UnknownRequestError
from mlxpaged.engine.request import Request, RequestStatus
from mlxpaged.engine.step_budget import StepBudget, StepPlan
from mlxpaged.errors import RequestTooLongError
from mlxpaged.validation import require_int

__all__ = [
    "CACHE_CAPACITY",
    "MODEL_CONTEXT",
    "Request",
    "RequestStatus",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
]


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # == request.num_computed_tokens at schedule time
    token_ids: list[int]  # all_token_ids[start:start + n], fed to the model this step
    block_tables: list[list[int]]  # one per layer group; the KV layer maps positions to slots
    samples: bool  # the chunk reaches the last known token: sample from its last position
    state_slot: int | None = None  # the request's state slot (models with state layers)
    # Speculative tokens appended to token_ids (engine/drafting.py): every position samples,
    # and only the drafts the model agrees with are kept (update_from_output).
    drafts: list[int] = field(default_factory=list)
    # A model with state layers: the request's state before this chunk's verify pass (StateSlots.hold), which a
    # rejected draft rolls back to (update_from_output).
    state_before: object | None = None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # decode chunks first, then prefill chunks
    preempted: list[Request]  # preempted in this schedule(): drop their runtime state
    num_batch_tokens: int


class StateSlots(Protocol):
    """Per-sequence state of state-space layers (cache/state_cache.StateCache): one slot per running
    request, checkpoints of it at block boundaries for the prefix cache."""

    @property
    def num_free(self) -> int: ...
    @property
    def checkpoints_enabled(self) -> bool: ...

    def allocate(self) -> int: ...
    def fork(self, slot: int) -> int: ...
    def free(self, slot: int) -> None: ...
    def restore(self, slot: int, block_hash: Hashable) -> None: ...
    def checkpoint(self, slot: int, block_hash: Hashable, publish: bool) -> None: ...
    def hold(self, slot: int) -> Any: ...
    def roll_back(self, slot: int, held: Any) -> None: ...


# While requests wait to be admitted, one running prefill takes at most 1/LONG_PREFILL_SHARE of a
# step's tokens, so a burst is admitted beside a long prompt instead of queuing behind all of its
# chunks (vLLM's long_prefill_token_threshold). Alone, a long prompt keeps the whole budget.
LONG_PREFILL_SHARE = 4
# A waiting request whose next JOIN_MIN_TOKENS tokens or more a running prefill is computing (the same prefix before
# them) waits for them to be cached (KVCacheManager.joins_prefill): agents sharing a system prompt. Fewer shared
# tokens (a chat template's first block) are not worth a step's wait.
JOIN_MIN_TOKENS = 256

MODEL_CONTEXT = "model context"
CACHE_CAPACITY = "KV cache capacity"


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        *,
        max_batch_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        state: StateSlots | None = None,
        step_budget: StepBudget | None = None,
    ):
        for name, value in (
            ("max_batch_tokens", max_batch_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_model_len", max_model_len),
        ):
            require_int(name, value, low=1)
        if max_batch_tokens < max_num_seqs:
            # Otherwise some decoding requests would be skipped every step.
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be >= max_num_seqs ({max_num_seqs})")
        self.kv_manager = kv_manager
        self.state = state
        self.step_budget = step_budget  # prefill chunks sized to end the step in time (None: tokens bound them only)
        self.max_batch_tokens = max_batch_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # sorted by arrival, oldest first
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._arrival: dict[str, int] = {}
        self._next_arrival = 0
        # A request's first sampled token: the arrivals counted by then (later ones arrived behind its stream).
        self._streaming_since: dict[str, int] = {}

    # ---- queries ------------------------------------------------------------------

    @property
    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def unfinished(self) -> list[Request]:
        """Every unfinished request, waiting or running."""
        return list(self._requests.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    @property
    def waiting(self) -> list[Request]:
        return list(self._waiting)

    @property
    def running(self) -> list[Request]:
        return list(self._running)

    @property
    def capacity_tokens(self) -> int | None:
        """The longest sequence the pool can hold (None: any length)."""
        return self.kv_manager.capacity_tokens

    # ---- request lifecycle --------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Validate and queue at the back of the waiting queue."""
        self._validate(request)
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1
        self._waiting.append(request)

    def _validate(self, request: Request) -> None:
        rid, max_tokens = request.request_id, request.max_tokens
        n_prompt = len(request.prompt_token_ids)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use by an unfinished request")
        if request.status is not RequestStatus.WAITING or request.output_token_ids or request.num_computed_tokens:
            raise ValueError(
                f"request {rid!r} must be new (WAITING, no output, nothing computed), got status {request.status.name}"
            )
        if n_prompt == 0:
            raise ValueError(f"request {rid!r} has an empty prompt: the model needs at least 1 token")
        if max_tokens < 1:
            raise ValueError(f"request {rid!r}: max_tokens must be >= 1, got {max_tokens}")
        self.check_fits(n_prompt, max_tokens)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLongError when prompt + max_tokens passes the model context or the whole cache.
        Reads only what is fixed at load, so `Engine.submit` calls it on the caller's thread."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise RequestTooLongError(num_prompt_tokens, max_tokens, self.max_model_len, MODEL_CONTEXT)
        capacity = self.capacity_tokens  # None: any length fits (rings only), so no sequence outgrows the pool
        if capacity is not None and not self.kv_manager.fits_ever(total):  # every block space its blocks
            raise RequestTooLongError(num_prompt_tokens, max_tokens, capacity, CACHE_CAPACITY)

    def finish(self, request_id: str, status: RequestStatus) -> Request:
        """End a waiting or running request and free its blocks at once."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a FINISHED_* status, got {status.name}")
        request = self._requests.pop(request_id, None)
        if request is None:
            raise UnknownRequestError(request_id)
        del self._arrival[request_id]
        self._streaming_since.pop(request_id, None)
        if request.status is RequestStatus.RUNNING:
            self._running.remove(request)
            self.kv_manager.free(request_id)
            self._free_state(request)
        else:
            self._waiting.remove(request)
            self.kv_manager.forget_loading(request_id)
        request.status = status
        return request

    def drop_last_outputs(self, request_id: str, count: int) -> None:
        """Forget a running request's last `count` output tokens (accepted drafts after a stop token),
        before it is finished: their KV is never read."""
        request = self._requests[request_id]
        if not 0 < count <= len(request.output_token_ids):
            raise ValueError(
                f"request {request_id!r}: cannot drop {count} of its {len(request.output_token_ids)} output tokens"
            )
        del request.output_token_ids[-count:]
        self.kv_manager.hashes.trim(request)  # its kept block hashes must not outlive those tokens

    def abort(self, request_id: str) -> Request | None:
        """finish(..., FINISHED_ABORTED); None if the id is unknown or already finished."""
        if request_id not in self._requests:
            return None
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def fork(self, parent_id: str, child: Request, first_token: int) -> list[CopyOnWrite]:
        """Start `child` (n > 1 sampling) as a running copy of a running parent's computed
        tokens: full blocks are shared copy-on-write, and the returned copies (partial blocks,
        sliding-window rings) must be done by the KV layer before the next step. `child` carries
        the parent's prompt; `first_token` is its own first sample (from the parent's logits).
        When the pool (or the state slots) cannot hold the copy, the child waits and recomputes its prompt instead
        (returns no copies)."""
        parent = self._requests.get(parent_id)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            raise ValueError(f"fork needs a running parent, {parent_id!r} is not")
        if child.request_id in self._requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self._requests[child.request_id] = child
        self._arrival[child.request_id] = self._next_arrival
        self._next_arrival += 1
        child.num_cached_tokens = parent.num_cached_tokens
        self._streaming_since[child.request_id] = self._streaming_since.get(parent_id, self._next_arrival)
        copies = self._fork_blocks(parent, child)
        if copies is None:
            copies = []
            child.status = RequestStatus.WAITING
            self._waiting.append(child)
        else:
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            self._running.append(child)  # newest arrival: the order stays sorted
        child.output_token_ids.append(first_token)
        return copies

    def _fork_blocks(self, parent: Request, child: Request) -> list[CopyOnWrite] | None:
        """The child's share of the parent's blocks and state slot, and the copies to do first; None
        when the pool or the state slots cannot hold it."""
        if self.state is not None and self.state.num_free == 0:
            return None
        try:
            copies = self.kv_manager.fork(parent, child)
        except NoFreeBlocksError:
            return None
        if self.state is not None:
            child.state_slot = self.state.fork(_slot(parent))  # shares the parent's state rows
        return copies

    def reserve_next_slot(self, request: Request) -> list[list[int]] | None:
        """The block tables of a running request with room for the token after its last one
        (sampled but not known yet: a pipelined step computes it early), or None when the pool
        has no block for it (the next schedule() preempts as usual)."""
        try:
            return self.kv_manager.allocate_slots(request, request.num_tokens + 1)
        except NoFreeBlocksError:
            return None

    # ---- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks within the token budget."""
        self._check_not_over_length()
        preempted = self._append_pending_slots()
        budget = self.max_batch_tokens
        decodes, prefills = [], []
        for r in self._running:  # one pass: this runs for every request on every step
            left = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if left == 1:
                decodes.append(r)
            elif left > 1:
                prefills.append(r)
        chunks = [self._chunk(request, 1) for request in decodes[:budget]]
        budget -= len(chunks)
        # Asked only when a prefill runs: it matches the waiting head's prefix (O(prompt) lookups).
        cap = self._prefill_cap(preempted) if prefills else self.max_batch_tokens
        time = self.step_budget.plan(decoding=bool(decodes)) if self.step_budget is not None else None
        behind = self._arrived_behind(decodes) if time is not None and (prefills or self._waiting) else _never
        # With a step budget, long prompts' chunks come last, in what their budget leaves after the short prompts and
        # the new arrivals (by arrival within each): an agent's next turn beside someone's pasted file is not held up
        # by it, nor the streams by both at once (bench fleet --long; docs/design/issue38-load.md, session 31).
        shorts, longs = prefills, list[Request]()
        if time is not None:
            shorts = []
            for request in prefills:
                (longs if self._long_prompt(request) else shorts).append(request)
        budget = self._prefill_chunks(shorts, chunks, budget, cap, time, behind)
        fits = None if time is None else lambda request: time.has_time_for(False, behind(request))
        # As in vLLM: a step that had to preempt admits nothing, or it would thrash.
        while not preempted and budget > 0 and (admitted := self._admit_next(fits)) is not None:
            most = budget
            if time is not None:  # priced by the tokens it has, not the step's
                left = min(budget, admitted.num_tokens - admitted.num_computed_tokens)
                long_prompt = self._long_prompt(admitted)
                most = time.take(admitted.num_computed_tokens, left, long_prompt, behind(admitted))
                if most == 0:
                    break  # too little time left for a chunk worth its pass: admitted, it starts next step, first
            chunks.append(self._chunk(admitted, most))
            budget -= len(chunks[-1].token_ids)
        budget = self._prefill_chunks(longs, chunks, budget, cap, time, behind)
        return SchedulerOutput(chunks, preempted, self.max_batch_tokens - budget)

    def _prefill_chunks(
        self,
        requests: list[Request],
        chunks: list[ScheduledChunk],
        budget: int,
        cap: int,
        time: StepPlan | None,
        behind: Callable[[Request], bool],
    ) -> int:
        """Append a chunk of each running prefill in turn while the step has tokens (at most `cap` each) and time
        for it; returns the tokens left."""
        for request in requests:
            long_prompt, behind_streams = time is not None and self._long_prompt(request), behind(request)
            if budget <= 0 or (time is not None and not time.has_time_for(long_prompt, behind_streams)):
                break  # budget < 0: an image prefilled whole
            most = min(budget, cap)
            if time is not None:  # priced by the tokens it has left, not the step's
                left = min(most, request.num_tokens - request.num_computed_tokens)
                most = time.take(request.num_computed_tokens, left, long_prompt, behind_streams)
                if most == 0:
                    break  # too little time left for a chunk worth its pass (step_budget.py MIN_LATER_CHUNK)
            chunks.append(self._chunk(request, most))
            budget -= len(chunks[-1].token_ids)
        return budget

    def update_from_output(
        self,
        output: SchedulerOutput,
        sampled: dict[str, int],
        failed: Collection[str] = (),
        accepted: Mapping[str, list[int]] = {},
    ) -> None:
        """Record the step's KV as computed and append the sampled tokens. Chunks of requests
        finished since schedule(), or whose sampling `failed` (the caller finishes those), are
        skipped; extra keys in `sampled` are ignored. A chunk with drafts keeps the KV of its
        `accepted` drafts (which come before its sampled token) and gives back the slots of the rest."""
        live = [c for c in output.chunks if not c.request.is_finished and c.request.request_id not in failed]
        for chunk in live:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING or chunk.start != request.num_computed_tokens:
                raise RuntimeError(
                    f"stale output for request {request.request_id!r}: chunk starts at "
                    f"{chunk.start}, request has {request.num_computed_tokens} computed "
                    f"tokens and status {request.status.name}"
                )
            if chunk.samples and request.request_id not in sampled:
                raise ValueError(f"no sampled token for request {request.request_id!r}")
        for chunk in live:
            request, drafts = chunk.request, chunk.drafts
            if drafts:
                kept = accepted.get(request.request_id, [])
                if kept != drafts[: len(kept)]:
                    raise ValueError(
                        f"request {request.request_id!r}: accepted {kept} are not a prefix of its drafts {drafts}"
                    )
                request.output_token_ids.extend(kept)  # first: the computed count may not pass the known tokens
                if chunk.state_before is not None and len(kept) < len(drafts):
                    # The state layers consumed the rejected drafts too, and a recurrent state cannot be cut back: the
                    # state returns to where the chunk started, and the next chunk feeds the kept tokens again.
                    self._roll_back_state(request, chunk.state_before)
                else:
                    request.num_computed_tokens += len(chunk.token_ids) - len(drafts) + len(kept)
            else:
                request.num_computed_tokens += len(chunk.token_ids)
            self.kv_manager.cache_blocks(request)  # hashes only blocks of kept tokens
            if self.state is not None:
                # A chunk that does not sample is prefill, even of one token (cut one short of a boundary).
                self._checkpoint(request, publish=not chunk.samples or len(chunk.token_ids) - len(drafts) > 1)
            if chunk.samples:
                request.output_token_ids.append(sampled[request.request_id])
                self._streaming_since.setdefault(request.request_id, self._next_arrival)
            if drafts:  # roll back: blocks past the sequence return to the pool
                self.kv_manager.free_slots_after(request, request.num_tokens)

    # ---- internals ----------------------------------------------------------------

    def _check_not_over_length(self) -> None:
        for request in self._running:
            if len(request.output_token_ids) >= request.max_tokens:
                raise RuntimeError(
                    f"request {request.request_id!r} has {len(request.output_token_ids)} "
                    f"output tokens (max_tokens {request.max_tokens}): finish() it before "
                    f"the next schedule()"
                )

    def _append_pending_slots(self) -> list[Request]:
        """Give each running request a slot for its last sampled token, oldest first,
        preempting the newest running request whenever the pool is dry."""
        preempted: list[Request] = []
        for request in list(self._running):
            while request.status is RequestStatus.RUNNING:
                try:
                    self.kv_manager.ensure_slots(request)
                    break
                except NoFreeBlocksError:
                    victim = self._running[-1]  # newest; may be `request` itself
                    self._preempt(victim)
                    preempted.append(victim)
        return preempted

    def _preempt(self, request: Request) -> None:
        self._running.remove(request)
        self.kv_manager.free(request.request_id)
        self._free_state(request)  # recompute restarts from 0 or from a checkpoint
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        # Newest preempted first, each pushed to the front: the queue stays in arrival order.
        self._waiting.appendleft(request)

    def _arrived_behind(self, decodes: list[Request]) -> Callable[[Request], bool]:
        """Whether a request arrived after one of the streams decoding in this step had begun (its first token): its
        prefill is held to the streams' budget (step_budget.py), those were promised their tokens first. Requests
        already waiting then (a burst, a batch job) were ahead of them."""
        began = [since for r in decodes if (since := self._streaming_since.get(r.request_id)) is not None]
        if not began:
            return _never
        first = min(began)
        return lambda request: self._arrival[request.request_id] >= first

    def _long_prompt(self, request: Request) -> bool:
        """More to prefill than one step's tokens (its tokens less those the prefix cache served): it takes several
        steps whatever their size (step_budget.py), to its last chunk (counted by what is left, a pasted file's last
        `max_batch_tokens` were a short prompt's, in steps of the whole budget beside the streams)."""
        return request.num_tokens - request.num_cached_tokens > self.max_batch_tokens

    def _prefill_cap(self, preempted: list[Request]) -> int:
        """Tokens one running prefill may take this step: a share of the budget while the next waiting request
        could be admitted, else all of it."""
        admitting = (
            self._waiting
            and not preempted
            and len(self._running) < self.max_num_seqs
            and (self.state is None or self.state.num_free > 0)
            and (head := self._next_admissible()) is not None
            and self.kv_manager.can_allocate(head)
        )
        return max(1, self.max_batch_tokens // LONG_PREFILL_SHARE) if admitting else self.max_batch_tokens

    def _next_admissible(self) -> Request | None:
        """The first waiting request that may be admitted now, or None. Those whose blocks are being read from disk
        wait apart, the others passing them meanwhile (as vLLM's requests waiting for KV); one whose next block a
        running prefill is computing waits in its place, the rest behind it (it finds the block cached once it is
        written: `joins_prefill`)."""
        prefilling = [r for r in self._running if r.num_tokens - r.num_computed_tokens > 1]
        for request in self._waiting:
            if self.kv_manager.loading(request):
                continue
            return None if self.kv_manager.joins_prefill(request, prefilling, JOIN_MIN_TOKENS) else request
        return None

    def _admit_next(self, fits: Callable[[Request], bool] | None = None) -> Request | None:
        """Move the next admissible waiting request (`_next_admissible`) to running if it fits the pool (and `fits`,
        the step's time), else None: the first request that does not fit blocks the rest (FIFO, no overtaking)."""
        if (
            not self._waiting
            or len(self._running) >= self.max_num_seqs
            or (self.state is not None and self.state.num_free == 0)
        ):
            return None
        request = self._next_admissible()
        if request is None or (fits is not None and not fits(request)):
            return None
        if not self.kv_manager.can_allocate(request):
            if not self._running:
                raise RuntimeError(
                    f"request {request.request_id!r} ({request.num_tokens} tokens) does not fit an "
                    f"idle pool with {self.kv_manager.num_free_blocks} of {self.kv_manager.num_blocks} "
                    f"blocks free: blocks are held outside the scheduler"
                )
            return None
        try:
            allocation = self.kv_manager.allocate(request)
        except NoFreeBlocksError:  # a resume point counted above failed its checks when read: fewer hits
            return None  # nothing changed; the next step asks again, without that file
        self._waiting.remove(request)
        if request.num_preemptions == 0:
            request.num_cached_tokens = allocation.num_cached_tokens
        request.num_computed_tokens = allocation.num_cached_tokens
        request.num_pool_hit_tokens = allocation.num_cached_tokens - allocation.num_lower_tier_tokens
        if self.state is not None:
            request.state_slot = self.state.allocate()
            if allocation.last_block_hash is not None:  # a hit ends at a checkpoint (the manager's filter)
                self.state.restore(request.state_slot, allocation.last_block_hash)
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, request, key=lambda r: self._arrival[r.request_id])
        return request

    def _chunk(self, request: Request, budget: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        num_tokens = request.num_tokens
        end = min(num_tokens, start + budget)
        if self._checkpoints_on():
            # End a prefill at the prompt's last block boundary, so its state is checkpointed there.
            boundary = (num_tokens - 1) // self.kv_manager.block_size * self.kv_manager.block_size
            end = boundary if start < boundary < end else end
        if request.images and start < len(request.prompt_token_ids) < end:
            # A prompt with images prefills from its merged embeddings, which end with the prompt: the tokens a
            # preempted request had generated go in the next chunk (vision/embedding.py).
            end = len(request.prompt_token_ids)
        end = _spans_whole(request.both_ways, start, end)
        return ScheduledChunk(
            request,
            start,
            request.token_ids_between(start, end),
            self.kv_manager.block_tables(request.request_id),
            samples=end == num_tokens,
            state_slot=request.state_slot,
        )

    # ---- state slots (models with state-space layers) ---------------------------------------

    def _checkpoints_on(self) -> bool:
        return self.state is not None and self.state.checkpoints_enabled and self.kv_manager.enable_prefix_cache

    def _checkpoint(self, request: Request, publish: bool) -> None:
        """At a block boundary, checkpoint the request's state under the hash of the block ending there:
        published at once after a prefill chunk, kept as the newest pending one in decode."""
        computed, bs = request.num_computed_tokens, self.kv_manager.block_size
        if self.state is None or not self._checkpoints_on() or computed % bs:
            return
        block_hash = self.kv_manager.block_hash(request.request_id, computed // bs)
        if block_hash is not None:
            self.state.checkpoint(_slot(request), block_hash, publish)

    def hold_state(self, request: Request) -> object | None:
        """Before a verify pass: the request's state to roll back to (None: the model has no state layers)."""
        return None if self.state is None else self.state.hold(_slot(request))

    def _roll_back_state(self, request: Request, held: object) -> None:
        assert self.state is not None  # only a model with state layers holds state
        self.state.roll_back(_slot(request), held)

    def _free_state(self, request: Request) -> None:
        if self.state is not None and request.state_slot is not None:
            self.state.free(request.state_slot)
            request.state_slot = None


def _never(request: Request) -> bool:
    return False


def _slot(request: Request) -> int:
    """The state slot of a request of a model with state layers (it holds one while it runs)."""
    if request.state_slot is None:
        raise RuntimeError(f"request {request.request_id!r} holds no state slot")
    return request.state_slot


def _spans_whole(spans: Sequence[tuple[int, int]], start: int, end: int) -> int:
    """The end of a chunk [start, end) moved off the inside of a span attended both ways (Request.both_ways): back to
    the span's start when the chunk begins before it, else on to the span's end (past the step's token budget by at
    most the span's tokens)."""
    for first, last in spans:
        if first < end < last:
            end = first if start < first else last
    return end
