"""Scheduler over the real KVCacheManager and BlockPool, driven by a fake deterministic model.

The fake model keeps a KV store (slot -> token) written through each chunk's block tables
(a sliding-window group's table as a ring, as specs.LayerGroup maps it) and reads the
sequence back through them before sampling, so a wrong block table, a ring reused too early
or a false prefix hit changes the output, not just a counter. Its next token is a hash of the
whole sequence, so "identical output after preemption" is a strong check: any lost, repeated
or extra token changes everything after it.
"""

import zlib

from mlxpaged.cache.kv_cache_manager import KVCacheManager, UnknownRequestError
from mlxpaged.engine import scheduler
from mlxpaged.engine.scheduler import (
    Request,
    RequestStatus,
    RequestTooLongError,
    Scheduler,
    SchedulerOutput,
)
from mlxpaged.engine.step_budget import Chunk, StepBudget
from tests.cache.kv_sequences import manager_for, slots_for

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

BS = 8
FINISHED_STOPPED, FINISHED_LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH
VOCAB = 50
EOS = 0


def next_token(tokens) -> int:
    return zlib.crc32(",".join(map(str, tokens)).encode()) % VOCAB


def solo_output(prompt, max_tokens, eos=None) -> list[int]:
    """What an uninterrupted run of the fake model produces."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(next_token(seq))
        seq.append(out[-1])
        if out[-1] == eos:
            break
    return out


HYBRID = (3, None, 2)  # window groups whose rings (3 and 2 blocks) hold windows of 16 and 8 tokens


def make(num_blocks=64, *, budget=64, seqs=4, max_len=512, prefix_cache=True, groups=(None,)):
    pool = manager_for(num_blocks, BS, groups, prefix_cache=prefix_cache)
    return pool, Scheduler(pool, max_batch_tokens=budget, max_num_seqs=seqs, max_model_len=max_len)


def slotted(r: Request) -> int:
    """Tokens with slots in a request's tables: the prompt from admission, then each computed token."""
    return max(len(r.prompt_token_ids), r.num_computed_tokens)


def slot(table, cap, pos) -> int:
    """Where the KV layer puts position `pos`: a ring of `cap` blocks wraps (LayerGroup.physical_block)."""
    logical = pos // BS
    return table[logical if cap is None else logical % cap] * BS + pos % BS


def req(rid, prompt, max_tokens=8) -> Request:
    return Request(rid, list(prompt), max_tokens)


class FakeEngine:
    """Runs the fake model over each SchedulerOutput and finishes requests on EOS/length."""

    def __init__(self, scheduler: Scheduler, eos=None):
        self.sched, self.pool, self.eos = scheduler, scheduler.kv_manager, eos
        self.kv: dict[int, int] = {}
        self.finished: dict[str, object] = {}

    def run_chunks(self, out: SchedulerOutput) -> dict[str, int]:
        caps = self.pool.group_max_blocks
        for c in out.chunks:  # every chunk writes its KV before any attends, as in a real step
            for table, cap in zip(c.block_tables, caps, strict=True):
                for pos, tok in enumerate(c.token_ids, c.start):
                    self.kv[slot(table, cap, pos)] = tok
        sampled = {}
        for c in out.chunks:
            end = c.start + len(c.token_ids)
            expected = c.request.all_token_ids[:end]
            for table, cap in zip(c.block_tables, caps, strict=True):
                # The last position attends to everything (full attention) or to its window.
                first = 0 if cap is None else max(0, end - (cap - 1) * BS)
                assert [self.kv[slot(table, cap, p)] for p in range(first, end)] == expected[first:]
            if c.samples:
                sampled[c.request.request_id] = next_token(expected)
        return sampled

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.sched.update_from_output(out, self.run_chunks(out))
        for c in out.chunks:
            if c.samples and not c.request.is_finished:
                self._maybe_finish(c.request)
        return out

    def _maybe_finish(self, r: Request) -> None:
        if r.output_token_ids[-1] == self.eos:
            self.finished[r.request_id] = self.sched.finish(r.request_id, FINISHED_STOPPED)
        elif len(r.output_token_ids) >= r.max_tokens:
            self.finished[r.request_id] = self.sched.finish(r.request_id, FINISHED_LENGTH)

    def run(self, max_steps=10_000) -> int:
        steps = 0
        while self.sched.has_unfinished:
            self.step()
            steps += 1
            assert steps < max_steps, "no progress"
        return steps


def chunk_of(out, rid):
    return next(c for c in out.chunks if c.request.request_id == rid)


# ---- construction and validation ----------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"max_batch_tokens": 0, "max_num_seqs": 1, "max_model_len": 8}, "max_batch_tokens"),
        ({"max_batch_tokens": 4, "max_num_seqs": 0, "max_model_len": 8}, "max_num_seqs"),
        ({"max_batch_tokens": 4, "max_num_seqs": 1, "max_model_len": 0}, "max_model_len"),
        ({"max_batch_tokens": 4, "max_num_seqs": 5, "max_model_len": 8}, "max_batch_tokens \\(4\\)"),
    ],
)
def test_init_rejects_bad_limits(kwargs, word):
    with pytest.raises(ValueError, match=word):
        Scheduler(manager_for(4, BS), **kwargs)


def test_too_long_for_model_context():
    _, s = make(max_len=100)
    msg = r"prompt \(90 tokens\) \+ max_tokens \(20\) = 110 tokens exceeds the model context of 100"
    with pytest.raises(RequestTooLongError, match=msg) as e:
        s.add_request(req("a", range(90), 20))
    assert (e.value.prompt_tokens, e.value.max_tokens, e.value.limit) == (90, 20, 100)
    assert e.value.limit_name == "model context"
    with pytest.raises(RequestTooLongError, match="= 101 tokens"):
        s.add_request(req("a", range(90), 11))
    s.add_request(req("b", range(90), 10))  # exactly the limit is fine
    assert s.num_waiting == 1


def test_too_long_for_cache():
    _, s = make(num_blocks=4, max_len=1000)  # 32 tokens of cache
    msg = r"\(30 tokens\) \+ max_tokens \(3\) = 33 tokens exceeds the KV cache capacity of 32"
    with pytest.raises(RequestTooLongError, match=msg) as e:
        s.add_request(req("a", range(30), 3))
    assert isinstance(e.value, ValueError) and e.value.limit == 32
    s.add_request(req("b", range(30), 2))


def test_rejects_empty_prompt_bad_max_tokens_and_duplicate_ids():
    _, s = make()
    with pytest.raises(ValueError, match="empty prompt"):
        s.add_request(req("a", [], 4))
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        s.add_request(req("a", [1], 0))
    s.add_request(req("a", [1], 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", [2], 4))
    assert s.num_waiting == 1 and not s.schedule().preempted


# ---- admission, budget, limits ------------------------------------------------------


def test_admission_under_small_pool():
    pool, s = make(num_blocks=4)
    for rid in "abc":
        s.add_request(req(rid, range(10), 6))  # 2 blocks each for the prompt
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a", "b"]
    assert s.num_running == 2 and s.num_waiting == 1 and pool.num_free_blocks == 0
    assert s.get("c").status is RequestStatus.WAITING and "c" not in pool
    s.update_from_output(out, {"a": 1, "b": 2})
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["b", "c"]
    assert out.chunks[0].token_ids == [2] and out.chunks[0].start == 10


def test_chunk_fields_and_sampling_flag():
    pool, s = make(budget=6)
    s.add_request(req("a", range(100, 110), 3))
    out = s.schedule()
    (c,) = out.chunks
    assert (c.start, c.token_ids, c.samples) == (0, list(range(100, 106)), False)
    assert c.block_tables == pool.block_tables("a")
    assert out.num_batch_tokens == 6
    s.update_from_output(out, {})  # nothing sampled from a partial prefill
    s2 = s.schedule()
    (c,) = s2.chunks
    assert (c.start, c.token_ids, c.samples) == (6, list(range(106, 110)), True)
    with pytest.raises(ValueError, match="no sampled token for request 'a'"):
        s.update_from_output(s2, {})
    assert s.get("a").num_computed_tokens == 6  # the failed call changed nothing
    s.update_from_output(s2, {"a": 7})
    assert s.get("a").output_token_ids == [7] and s.get("a").num_computed_tokens == 10
    (c,) = s.schedule().chunks
    assert (c.start, c.token_ids, c.samples) == (10, [7], True) and len(slots_for(pool, s.get("a"), 0, 11)) == 11


@pytest.mark.parametrize("both_ways", [True, False], ids=["both-ways", "causal"])
def test_an_image_attended_both_ways_is_prefilled_in_one_chunk(both_ways):
    """Gemma 4's larger models attend both ways within an image (Request.both_ways): a chunk never ends inside one.
    It ends before the image when it starts before it, and runs on to the image's end (past the token budget) when
    it starts in it; the step's other prefills wait. A causal model's images are cut anywhere."""
    from mlxpaged.engine.request import ImageSpan

    _, s = make(budget=6)
    eng = FakeEngine(s)
    image = ImageSpan(start=4, length=9, digest="d")  # positions 4..12
    spans = ((image.start, image.end),) if both_ways else ()
    s.add_request(Request("a", list(range(100, 120)), 3, images=(image,), both_ways=spans))
    s.add_request(req("b", range(300, 310), 3))
    first = eng.step()
    chunks = [(c.request.request_id, c.start, len(c.token_ids)) for c in first.chunks]
    assert chunks == ([("a", 0, 4), ("b", 0, 2)] if both_ways else [("a", 0, 6)])
    second = eng.step()
    if both_ways:  # 9 tokens against a budget of 6: nothing else prefills this step
        assert [(c.request.request_id, c.start, len(c.token_ids)) for c in second.chunks] == [("a", 4, 9)]
        assert second.num_batch_tokens == 9
    eng.run()
    assert eng.finished["a"].output_token_ids == solo_output(range(100, 120), 3)
    assert eng.finished["b"].output_token_ids == solo_output(range(300, 310), 3)


def test_chunked_prefill_does_not_stall_decode():
    _, s = make(budget=8)
    eng = FakeEngine(s)
    s.add_request(req("a", range(3), 40))
    eng.step()  # a's prompt prefilled, first token sampled
    s.add_request(req("b", range(500, 550), 5))
    b_chunks = []
    while not s.get("b").output_token_ids:
        before = len(s.get("a").output_token_ids)
        out = eng.step()
        assert out.chunks[0].request.request_id == "a" and len(out.chunks[0].token_ids) == 1
        assert len(s.get("a").output_token_ids) == before + 1
        b_chunks.append(chunk_of(out, "b"))
        assert out.num_batch_tokens <= 8
    assert [len(c.token_ids) for c in b_chunks] == [7] * 7 + [1]
    assert [c.samples for c in b_chunks] == [False] * 7 + [True]
    eng.run()
    assert eng.finished["a"].output_token_ids == solo_output(range(3), 40)
    assert eng.finished["b"].output_token_ids == solo_output(range(500, 550), 5)


def test_budget_shared_and_never_exceeded():
    _, s = make(budget=10, seqs=4)
    eng = FakeEngine(s)
    prompts = [range(i * 100, i * 100 + 7 + 3 * i) for i in range(6)]
    for i, p in enumerate(prompts):
        s.add_request(req(f"r{i}", p, 6))
    while s.has_unfinished:
        out = eng.step()
        assert out.num_batch_tokens == sum(len(c.token_ids) for c in out.chunks) <= 10
        assert len({id(c.request) for c in out.chunks}) == len(out.chunks)
    for i, p in enumerate(prompts):
        assert eng.finished[f"r{i}"].output_token_ids == solo_output(p, 6)


def test_decode_chunks_come_first_and_a_long_prefill_makes_room_for_a_waiting_request():
    _, s = make(budget=12)
    eng = FakeEngine(s)
    s.add_request(req("long", range(30), 4))
    out = eng.step()  # alone, a long prompt takes the whole budget
    assert [(c.request.request_id, len(c.token_ids)) for c in out.chunks] == [("long", 12)]
    s.add_request(req("short", range(100, 102), 10))
    out = eng.step()  # while short waits, long takes a quarter (LONG_PREFILL_SHARE) and short is admitted
    assert [(c.request.request_id, len(c.token_ids)) for c in out.chunks] == [("long", 3), ("short", 2)]
    assert s.get("short").output_token_ids  # its first token, before long's prompt is done
    out = eng.step()  # decodes first; nobody waits, so long takes the rest of the budget
    assert [(c.request.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 1), ("long", 11)]
    out = eng.step()
    assert [(c.request.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 1), ("long", 4)]
    eng.run()
    assert eng.finished["long"].output_token_ids == solo_output(range(30), 4)
    assert eng.finished["short"].output_token_ids == solo_output(range(100, 102), 10)


def test_a_long_prefill_keeps_the_budget_when_the_waiting_request_cannot_be_admitted():
    _, s = make(budget=12, seqs=1)
    eng = FakeEngine(s)
    s.add_request(req("long", range(30), 4))
    eng.step()
    s.add_request(req("short", range(100, 102), 10))  # max_num_seqs 1: it must wait for long anyway
    out = eng.step()
    assert [(c.request.request_id, len(c.token_ids)) for c in out.chunks] == [("long", 12)]


def test_max_num_seqs_respected():
    _, s = make(budget=32, seqs=2)
    eng = FakeEngine(s)
    for i in range(5):
        s.add_request(req(f"r{i}", range(i, i + 4), 3))
    while s.has_unfinished:
        out = eng.step()
        assert s.num_running <= 2 and len(out.chunks) <= 2
    assert len(eng.finished) == 5


def test_fifo_no_overtaking():
    pool, s = make(num_blocks=6)
    eng = FakeEngine(s)
    s.add_request(req("hog", range(30), 2))  # 4 blocks
    eng.step()
    s.add_request(req("big", range(100, 124), 2))  # 3 blocks: does not fit beside hog
    s.add_request(req("small", range(200, 203), 2))  # 1 block: would fit, must not overtake
    out = eng.step()
    assert [c.request.request_id for c in out.chunks] == ["hog"]
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    out = eng.step()  # hog finished by length last step
    assert [c.request.request_id for c in out.chunks] == ["big", "small"]
    eng.run()
    assert pool.stats().num_owned == 0


# ---- preemption ---------------------------------------------------------------------


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preempts_newest_and_resumes_identically(prefix_cache):
    pool, s = make(num_blocks=3, prefix_cache=prefix_cache)
    eng = FakeEngine(s)
    s.add_request(req("old", range(16), 8))  # 2 full blocks; its first decode needs a third
    s.add_request(req("new", range(100, 104), 8))  # 1 block
    eng.step()
    assert pool.num_free_blocks == 0
    out = eng.step()
    assert [r.request_id for r in out.preempted] == ["new"]
    new = out.preempted[0]
    assert new.status is RequestStatus.WAITING
    assert (new.num_computed_tokens, new.num_preemptions) == (0, 1)
    assert "new" not in pool and s.waiting == [new] and len(new.output_token_ids) == 1
    assert [c.request.request_id for c in out.chunks] == ["old"]
    eng.run()
    assert eng.finished["old"].output_token_ids == solo_output(range(16), 8)
    assert eng.finished["new"].output_token_ids == solo_output(range(100, 104), 8)
    assert eng.finished["new"].num_preemptions >= 1 and pool.stats().num_owned == 0


def test_request_needing_the_slot_preempts_itself_when_newest():
    _pool, s = make(num_blocks=3)
    eng = FakeEngine(s)
    s.add_request(req("old", range(100, 104), 8))
    s.add_request(req("new", range(16), 8))
    eng.step()
    out = eng.step()  # old appends within its block; new needs a block and is the newest
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [c.request.request_id for c in out.chunks] == ["old"]
    eng.run()
    assert eng.finished["new"].output_token_ids == solo_output(range(16), 8)
    assert eng.finished["old"].output_token_ids == solo_output(range(100, 104), 8)


def test_resume_recomputes_prompt_and_output_then_samples_once():
    _pool, s = make(num_blocks=3, budget=8, prefix_cache=False)
    eng = FakeEngine(s)
    s.add_request(req("old", range(100, 104), 14))
    s.add_request(req("new", range(8), 8))
    while not any(r.request_id == "new" for r in eng.step().preempted):
        pass
    new = s.get("new")
    n_out = len(new.output_token_ids)
    seen = []
    while len(new.output_token_ids) == n_out:
        out = eng.step()
        if any(c.request is new for c in out.chunks):
            c = chunk_of(out, "new")
            seen.append((c.start, len(c.token_ids), c.samples))
    assert sum(n for _, n, _ in seen) == 8 + n_out  # prompt + every generated token
    assert [smp for *_, smp in seen] == [False] * (len(seen) - 1) + [True]
    eng.run()
    assert eng.finished["new"].output_token_ids == solo_output(range(8), 8)


# ---- prefix cache -------------------------------------------------------------------


def test_prefix_cache_hit_skips_cached_tokens():
    _pool, s = make()
    eng = FakeEngine(s)
    shared = list(range(1000, 1016))
    s.add_request(req("a", [*shared, 1, 2, 3, 4], 2))
    eng.run()
    s.add_request(req("b", [*shared, 9, 9], 3))
    out = eng.step()
    c = chunk_of(out, "b")
    assert s.get("b").num_cached_tokens == 16 and (c.start, c.token_ids) == (16, [9, 9])
    assert out.num_batch_tokens == 2
    s.add_request(req("c", shared, 3))  # whole prompt cached: the last block is recomputed
    c = chunk_of(eng.step(), "c")
    assert s.get("c").num_cached_tokens == 8 and c.start == 8 and len(c.token_ids) == 8
    eng.run()
    assert eng.finished["b"].output_token_ids == solo_output([*shared, 9, 9], 3)
    assert eng.finished["c"].output_token_ids == solo_output(shared, 3)
    assert eng.finished["b"].num_cached_tokens == 16


def test_prefix_cache_never_serves_uncomputed_kv():
    _pool, s = make(budget=16)
    eng = FakeEngine(s)
    prompt = list(range(700, 740))
    s.add_request(req("a", prompt, 3))
    eng.step()  # 16 of 40 tokens computed: only blocks 0-1 may become hits
    s.abort("a")
    s.add_request(req("b", prompt, 3))
    eng.step()
    assert s.get("b").num_cached_tokens == 16
    eng.run()
    assert eng.finished["b"].output_token_ids == solo_output(prompt, 3)


def test_a_request_waits_while_a_running_prefill_computes_the_prefix_they_share(monkeypatch):
    # Agents sharing a system prompt, arriving together: the second waits (and those behind it: FIFO) while the first
    # computes the shared tokens, then is admitted with them cached instead of computing them again beside it.
    monkeypatch.setattr(scheduler, "JOIN_MIN_TOKENS", 16)
    _pool, s = make(budget=16)
    eng = FakeEngine(s)
    system = list(range(500, 548))  # 6 blocks
    s.add_request(req("a", [*system, 1, 2], 3))
    s.add_request(req("b", [*system, 7, 8, 9], 3))
    s.add_request(req("c", range(900, 904), 3))
    steps = [[c.request.request_id for c in eng.step().chunks] for _ in range(4)]
    assert steps == [["a"], ["a"], ["a"], ["a", "b", "c"]]  # a's prefill at the whole budget, then b and c
    assert s.get("b").num_cached_tokens == 48
    eng.run()
    for rid, prompt in (("a", [*system, 1, 2]), ("b", [*system, 7, 8, 9]), ("c", range(900, 904))):
        assert eng.finished[rid].output_token_ids == solo_output(prompt, 3)
    # Fewer shared tokens than JOIN_MIN_TOKENS (a chat template's first block): not worth a step's wait.
    _pool, s = make(budget=64)
    s.add_request(req("d", [*system[:8], 1, 2, 3, 4, 5, 6, 7, 8, 9], 3))
    s.add_request(req("e", [*system[:8], 9, 8, 7, 6, 5, 4, 3, 2, 1], 3))
    assert [c.request.request_id for c in FakeEngine(s).step().chunks] == ["d", "e"]


def budgeted(budget: StepBudget, blocks: int, max_batch_tokens: int) -> FakeEngine:
    """A fake engine over a scheduler with `budget`, which saw a step decode alone in 0.25 s and one that also
    prefilled 64 tokens at 2**-9 s each."""
    budget.record(0.25, decoding=True, prefills=[])
    budget.record(0.25 + 64 * 2**-9, decoding=True, prefills=[Chunk(0, 64)])
    pool = manager_for(blocks, BS, (None,), prefix_cache=False)
    return FakeEngine(
        Scheduler(pool, max_batch_tokens=max_batch_tokens, max_num_seqs=4, max_model_len=2048, step_budget=budget)
    )


def chunk_sizes(eng: FakeEngine) -> list[tuple[str, int]]:
    """One step of `eng`: (request id, tokens) of each chunk it ran."""
    return [(c.request.request_id, len(c.token_ids)) for c in eng.step().chunks]


def test_with_a_step_budget_a_long_prompts_chunk_waits_for_a_step_without_short_prompts_or_arrivals():
    # A step budget of 1 s (0.75 s planned), 0.5 s beside streams for a long prompt (0.375 planned); a step that only
    # decodes takes 0.25 s and a prefill token TOKEN_S: beside the stream, short prompts may take 0.5 s of prefill, a
    # long one 0.125 s in a step of no other prefill.
    eng = budgeted(StepBudget(1.0, long_prompt_s=0.5), blocks=64, max_batch_tokens=128)
    s = eng.sched
    s.add_request(req("stream", range(4), 20))
    eng.step()
    s.add_request(req("long", range(100, 300), 2))  # more than a step's 128 tokens: a long prompt
    assert [len(c.token_ids) for c in eng.step().chunks] == [1, 64]  # the long budget's 0.125 s
    s.add_request(req("turn", range(400, 456), 2))  # an agent's next turn arrives: 56 tokens, 0.109 s
    out = eng.step()
    # The turn first; the long prompt waits for a step with no other prefill beside the streams.
    assert [(c.request.request_id, len(c.token_ids)) for c in out.chunks] == [("stream", 1), ("turn", 56)]
    assert [(c.request.request_id, len(c.token_ids)) for c in eng.step().chunks] == [
        ("stream", 1),
        ("turn", 1),
        ("long", 64),
    ]
    eng.run()
    assert eng.finished["long"].output_token_ids == solo_output(range(100, 300), 2)


def test_with_a_step_budget_a_prompt_that_arrived_behind_a_stream_keeps_to_the_streams_budget():
    # A step budget of 1 s (0.75 s planned), 0.5 s for prompts that arrived behind a stream (0.375 planned); a step
    # that only decodes takes 0.25 s and a prefill token TOKEN_S: beside the stream a prompt that was already waiting
    # when it began may take 0.5 s of prefill (256 tokens), one that arrived after 0.125 s (64 tokens).
    eng = budgeted(StepBudget(1.0, streams_s=0.5), blocks=160, max_batch_tokens=1024)
    s = eng.sched

    s.add_request(req("stream", range(4), 20))
    s.add_request(req("early", range(100, 700), 2))  # waiting when the stream begins: a burst
    assert chunk_sizes(eng) == [("stream", 4), ("early", 380)]  # no stream yet: the whole budget, 0.75 s
    s.add_request(req("turn", range(1000, 1200), 2))  # arrives once the stream has begun
    assert chunk_sizes(eng) == [("stream", 1), ("early", 220)]  # the whole budget beside it; no time left for the turn
    assert chunk_sizes(eng) == [("stream", 1), ("early", 1), ("turn", 64)]  # first in its step, at the streams' budget
    assert chunk_sizes(eng) == [("stream", 1), ("turn", 64)]
    eng.run()
    assert eng.finished["early"].output_token_ids == solo_output(range(100, 700), 2)
    assert eng.finished["turn"].output_token_ids == solo_output(range(1000, 1200), 2)


def test_with_a_step_budget_a_chunk_takes_its_prompts_last_few_tokens_and_no_piece_too_small_for_a_pass_starts():
    # As above: beside the stream a prompt that was waiting when it began has 256 tokens' time, one that arrived after
    # it 64; with no stream decoding, 384 (0.75 s). A chunk that would leave at most TAIL_TOKENS takes them; a later
    # chunk of a step with under MIN_LATER_CHUNK tokens' time that would not finish its prompt is not started.
    eng = budgeted(StepBudget(1.0, streams_s=0.5), blocks=160, max_batch_tokens=1024)
    s = eng.sched

    s.add_request(req("stream", range(4), 20))
    s.add_request(req("early", range(100, 440), 2))
    s.add_request(req("second", range(500, 800), 2))
    assert chunk_sizes(eng) == [("stream", 4), ("early", 340)]  # 40 tokens' time left: "second" starts next step
    assert s.num_running == 3  # admitted all the same: its blocks (and a cache hit) are held
    s.add_request(req("turn", range(1000, 1070), 2))  # 70 tokens, once the stream has begun
    assert chunk_sizes(eng) == [("stream", 1), ("early", 1), ("second", 256)]  # first, with the whole budget
    assert chunk_sizes(eng) == [("stream", 1), ("second", 44)]  # 20 tokens' time left for the turn: not a pass's worth
    assert chunk_sizes(eng) == [
        ("stream", 1),
        ("second", 1),
        ("turn", 70),
    ]  # 64 tokens' time, and its last 6 with them: its first token
    eng.run()
    for name, prompt in (("early", range(100, 440)), ("second", range(500, 800)), ("turn", range(1000, 1070))):
        assert eng.finished[name].output_token_ids == solo_output(prompt, 2)


# ---- finish / abort -----------------------------------------------------------------


def test_abort_frees_blocks_at_once():
    pool, s = make(num_blocks=8)
    eng = FakeEngine(s)
    s.add_request(req("a", range(20), 10))
    s.add_request(req("b", range(100, 110), 10))
    eng.step()
    s.add_request(req("w", range(200, 210), 10))
    owned = pool.stats().num_owned
    a = s.abort("a")
    assert a.status is RequestStatus.FINISHED_ABORTED and a.is_finished and "a" not in pool
    assert pool.stats().num_owned == owned - 3 and s.num_running == 1
    assert s.abort("a") is None and s.abort("nobody") is None and s.get("a") is None
    w = s.abort("w")  # still waiting: no blocks, just leaves the queue
    assert w.status is RequestStatus.FINISHED_ABORTED and s.num_waiting == 0
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish("b", RequestStatus.RUNNING)
    with pytest.raises(UnknownRequestError):
        s.finish("a", RequestStatus.FINISHED_ERROR)
    s.finish("b", RequestStatus.FINISHED_ERROR)
    assert not s.has_unfinished and pool.stats().num_owned == 0


def test_abort_between_schedule_and_step_done():
    pool, s = make()
    eng = FakeEngine(s)
    s.add_request(req("a", range(5), 4))
    s.add_request(req("b", range(50, 55), 4))
    out = s.schedule()
    sampled = eng.run_chunks(out)
    s.abort("a")
    s.update_from_output(out, sampled)  # a's chunk is skipped, its sampled token ignored
    assert s.get("b").output_token_ids == [sampled["b"]]
    eng.run()
    assert pool.stats().num_owned == 0


def test_stale_output_and_unfinished_length_are_errors():
    _, s = make()
    s.add_request(req("a", range(5), 1))
    out = s.schedule()
    s.update_from_output(out, {"a": 3})
    with pytest.raises(RuntimeError, match="stale output"):
        s.update_from_output(out, {"a": 3})
    with pytest.raises(RuntimeError, match=r"1 output tokens \(max_tokens 1\): finish\(\) it"):
        s.schedule()


# ---- hybrid models: one table per layer group ---------------------------------------


def test_hybrid_rings_stop_growing_and_wrap():
    pool, s = make(groups=HYBRID, prefix_cache=False, budget=16)
    eng = FakeEngine(s)
    s.add_request(req("a", range(30), 30))  # prefilled in chunks, then decoded far past both windows
    lengths = []
    while s.has_unfinished:
        eng.step()
        if "a" in pool:
            lengths.append([len(t) for t in pool.block_tables("a")])
            n = slotted(s.get("a"))
            assert pool.stats().num_owned == -(-n // BS) + min(-(-n // BS), 3) + min(-(-n // BS), 2)
    assert lengths[0] == [3, 4, 2] and lengths[-1] == [3, 8, 2]  # 59 tokens: rings stayed put
    assert eng.finished["a"].output_token_ids == solo_output(range(30), 30)
    assert pool.stats().num_owned == 0


def test_hybrid_preemption_frees_every_table_and_resumes_identically():
    pool, s = make(num_blocks=16, groups=HYBRID, prefix_cache=False, budget=8)
    eng = FakeEngine(s)
    prompts = {"old": range(20), "new": range(100, 120)}  # 3 + 3 + 2 blocks each: the pool is full
    for rid, prompt in prompts.items():
        s.add_request(req(rid, prompt, 20))
    preempted = []
    while s.has_unfinished:
        out = eng.step()
        preempted += [r.request_id for r in out.preempted]
        for r in out.preempted:
            assert r.request_id not in pool
    assert preempted and set(preempted) == {"new"}
    for rid, prompt in prompts.items():
        assert eng.finished[rid].output_token_ids == solo_output(prompt, 20)
    assert pool.stats().num_owned == 0


def test_too_long_for_hybrid_cache():
    pool, s = make(num_blocks=10, groups=HYBRID, prefix_cache=False)
    # n blocks of tokens need n + min(n, 3) + min(n, 2) blocks: 5 fit in 10 (40 tokens), 6 do not.
    assert s.capacity_tokens == 40 and pool.num_blocks_for(40) == 10 and pool.num_blocks_for(41) == 11
    with pytest.raises(RequestTooLongError, match="41 tokens exceeds the KV cache capacity of 40") as e:
        s.add_request(req("a", range(38), 3))
    assert e.value.limit == 40
    s.add_request(req("b", range(38), 2))


@pytest.mark.parametrize("groups", [(None,), HYBRID])
def test_fork_shares_full_blocks_copies_rings_and_matches_solo(groups):
    pool, s = make(groups=groups, prefix_cache=False)
    eng = FakeEngine(s)
    prompt = range(200, 229)  # 29 tokens: 3 full blocks and a partial one; rings of 3 and 2 wrapped
    s.add_request(req("p", prompt, 6))
    eng.step()
    child = req("c", prompt, 6)
    copies = s.fork("p", child, s.get("p").output_token_ids[0])  # its own first sample
    for cow in copies:  # what the engine's KV layer does
        for off in range(cow.num_tokens):
            if cow.src_block * BS + off in eng.kv:
                eng.kv[cow.dst_block * BS + off] = eng.kv[cow.src_block * BS + off]
    assert child.output_token_ids == s.get("p").output_token_ids and child.num_computed_tokens == 29
    parent_tables, child_tables = pool.block_tables("p"), pool.block_tables("c")
    for ptable, ctable, cap in zip(parent_tables, child_tables, groups, strict=True):
        if cap is None:
            assert ctable[:3] == ptable[:3] and ctable[3] != ptable[3]  # full blocks shared
        else:
            assert not set(ctable) & set(ptable)  # a ring is never shared
    assert len(copies) == 1 + sum(cap for cap in groups if cap is not None)
    eng.run()
    assert eng.finished["c"].output_token_ids == eng.finished["p"].output_token_ids == solo_output(prompt, 6)
    assert pool.stats().num_owned == 0


# ---- random workloads ---------------------------------------------------------------

PREFIXES = [list(range(300, 316)), list(range(400, 409)), []]


@st.composite
def workloads(draw):
    num_blocks = draw(st.integers(3, 12))
    seqs = draw(st.integers(1, 4))
    budget = draw(st.integers(seqs, 24))
    reqs = []
    for i in range(draw(st.integers(1, 8))):
        prefix = draw(st.sampled_from(PREFIXES))
        tail = draw(st.lists(st.integers(1, VOCAB - 1), min_size=0 if prefix else 1, max_size=20))
        reqs.append(
            {
                "rid": f"r{i}",
                "prompt": prefix + tail,
                "max_tokens": draw(st.integers(1, 24)),
                "arrive": draw(st.integers(0, 30)),
                "abort": draw(st.one_of(st.none(), st.integers(0, 60))),
            }
        )
    groups = draw(st.sampled_from([(None,), (None,), HYBRID]))
    return {
        "num_blocks": num_blocks + (4 if groups == HYBRID else 0),
        "seqs": seqs,
        "budget": budget,
        "max_len": 48,
        "prefix_cache": groups == (None,) and draw(st.booleans()),
        "groups": groups,
        "eos": draw(st.sampled_from([None, EOS])),
        "reqs": reqs,
    }


def check_step(s: Scheduler, pool: KVCacheManager, out: SchedulerOutput, arrival: dict) -> None:
    assert out.num_batch_tokens == sum(len(c.token_ids) for c in out.chunks) <= s.max_batch_tokens
    assert s.num_running <= s.max_num_seqs
    assert len({id(c.request) for c in out.chunks}) == len(out.chunks)
    running = [arrival[r.request_id] for r in s.running]
    waiting = [arrival[r.request_id] for r in s.waiting]
    assert running + waiting == sorted(running + waiting)  # every waiting one is newer
    for r in out.preempted:
        assert r.status is RequestStatus.WAITING and r.request_id not in pool
        assert all(c.request is not r for c in out.chunks)  # not re-admitted in its step
    tables = [t for r in s.running for t in pool.block_tables(r.request_id)]
    assert pool.stats().num_owned == len({b for t in tables for b in t})
    assert all(r.request_id not in pool for r in s.waiting)


PREEMPT_THEN_FITS = {  # a victim that shares a cached block would fit again at once
    "num_blocks": 4,
    "seqs": 2,
    "budget": 4,
    "max_len": 48,
    "prefix_cache": True,
    "groups": (None,),
    "eos": None,
    "reqs": [
        {"rid": "r0", "prompt": PREFIXES[1] + [1] * 4, "max_tokens": 5, "arrive": 1, "abort": None},
        {"rid": "r1", "prompt": PREFIXES[0], "max_tokens": 1, "arrive": 0, "abort": None},
        {"rid": "r2", "prompt": PREFIXES[1] + [1] * 4, "max_tokens": 6, "arrive": 0, "abort": None},
    ],
}


@example(PREEMPT_THEN_FITS)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads(w):
    pool, s = make(
        w["num_blocks"],
        budget=w["budget"],
        seqs=w["seqs"],
        max_len=w["max_len"],
        prefix_cache=w["prefix_cache"],
        groups=w["groups"],
    )
    eng = FakeEngine(s, eos=w["eos"])
    arrival, admitted, accepted = {}, [], {}
    for step in range(2000):
        for spec in (x for x in w["reqs"] if x["arrive"] == step):
            n = len(spec["prompt"]) + spec["max_tokens"]
            try:
                s.add_request(req(spec["rid"], spec["prompt"], spec["max_tokens"]))
            except RequestTooLongError:
                assert n > w["max_len"] or pool.num_blocks_for(n) > w["num_blocks"]
                continue
            assert n <= w["max_len"] and pool.num_blocks_for(n) <= w["num_blocks"]
            arrival[spec["rid"]], accepted[spec["rid"]] = len(arrival), spec
        for spec in (x for x in accepted.values() if x["abort"] == step):
            if (r := s.abort(spec["rid"])) is not None:
                eng.finished[spec["rid"]] = r
        if step > 30 and not s.has_unfinished:
            break
        out = eng.step()
        admitted += [c.request.request_id for c in out.chunks if c.request.request_id not in admitted]
        check_step(s, pool, out, arrival)
    else:
        pytest.fail("workload did not finish")
    assert [arrival[rid] for rid in admitted] == sorted(arrival[rid] for rid in admitted)
    assert set(eng.finished) == set(accepted) and pool.stats().num_owned == 0
    for rid, spec in accepted.items():
        r, solo = eng.finished[rid], solo_output(spec["prompt"], spec["max_tokens"], w["eos"])
        assert r.num_cached_tokens < len(spec["prompt"])
        if r.status is RequestStatus.FINISHED_ABORTED:
            assert r.output_token_ids == solo[: len(r.output_token_ids)]
        else:
            assert r.output_token_ids == solo
