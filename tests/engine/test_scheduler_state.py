"""The scheduler's state slots (plain Python, no MLX): a fake recurrent model whose slot state is the
exact token sequence it was fed, so every chunk can check that its slot holds precisely the tokens
before it - after admission, a prefix-checkpoint restore, preemption, or an n > 1 fork."""

from __future__ import annotations

import zlib

from mlxpaged.engine.scheduler import Request, RequestStatus, Scheduler
from tests.cache.kv_sequences import manager_for

BS = 8
VOCAB = 50


def next_token(tokens) -> int:
    return zlib.crc32(",".join(map(str, tokens)).encode()) % VOCAB


class FakeState:
    """StateSlots whose state per slot is the tuple of tokens fed; checkpoints by block hash."""

    def __init__(self, num_slots: int, checkpoints: bool = True):
        self._free = list(range(num_slots))
        self.rows: dict[int, tuple] = {}
        self.table: dict = {}
        self.pending: dict = {}
        self.checkpoints_enabled = checkpoints
        self.published: list[tuple] = []  # (tokens, publish) of each checkpoint

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        slot = self._free.pop(0)
        self.rows[slot] = ()
        return slot

    def fork(self, slot: int) -> int:
        child = self.allocate()
        self.rows[child] = self.rows[slot]
        return child

    def free(self, slot: int) -> None:
        if slot in self.pending:
            self.table.__setitem__(*self.pending.pop(slot))
        del self.rows[slot]
        self._free.append(slot)

    def usable_blocks(self, hashes) -> int:
        return max((n for n in range(len(hashes) + 1) if n == 0 or hashes[n - 1] in self.table), default=0)

    def restore(self, slot: int, block_hash) -> None:
        self.rows[slot] = self.table[block_hash]

    def checkpoint(self, slot: int, block_hash, publish: bool) -> None:
        self.published.append((len(self.rows[slot]), publish))
        if publish:
            self.table[block_hash] = self.rows[slot]
        else:
            self.pending[slot] = (block_hash, self.rows[slot])


def make(num_blocks=64, *, budget=64, seqs=4, slots=None, checkpoints=True):
    state = FakeState(seqs if slots is None else slots, checkpoints)
    manager = manager_for(num_blocks, BS, prefix_filter=state.usable_blocks)
    return state, Scheduler(manager, max_batch_tokens=budget, max_num_seqs=seqs, max_model_len=512, state=state)


def run(state: FakeState, sched: Scheduler, max_steps: int = 2000) -> list[list]:
    """Step to the end; each chunk checks its slot holds exactly the tokens before it. Returns each
    step's chunks as (request id, start, length)."""
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return steps
        out = sched.schedule()
        sampled = {}
        for chunk in out.chunks:
            r = chunk.request
            assert state.rows[chunk.state_slot] == tuple(r.all_token_ids[: chunk.start]), r.request_id
            state.rows[chunk.state_slot] += tuple(chunk.token_ids)
            if chunk.samples:
                sampled[r.request_id] = next_token(state.rows[chunk.state_slot])
        sched.update_from_output(out, sampled)
        steps.append([(c.request.request_id, c.start, len(c.token_ids)) for c in out.chunks])
        for chunk in out.chunks:
            r = chunk.request
            if chunk.samples and not r.is_finished and len(r.output_token_ids) >= r.max_tokens:
                sched.finish(r.request_id, RequestStatus.FINISHED_LENGTH)
    raise AssertionError("no progress")


def solo(prompt, max_tokens) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % VOCAB for i in range(n)]


def test_slots_follow_requests_through_preemption_and_end_free():
    state, sched = make(num_blocks=10, budget=16)
    requests = [Request(f"r{i}", prompt_of(n, i), 20) for i, n in enumerate((21, 13, 30))]
    for r in requests:
        sched.add_request(r)
    run(state, sched)
    assert sum(r.num_preemptions for r in requests) > 0
    assert [r.output_token_ids for r in requests] == [solo(r.prompt_token_ids, 20) for r in requests]
    assert state.num_free == 4 and all(r.state_slot is None for r in requests)


def test_a_prefill_is_cut_at_the_prompts_last_boundary_and_checkpointed_there():
    state, sched = make()
    sched.add_request(Request("a", prompt_of(21, 1), 3))
    steps = run(state, sched)
    assert steps[:2] == [[("a", 0, 16)], [("a", 16, 5)]]
    assert state.published[0] == (16, True)  # published at once, after the prefill chunk


def test_the_next_turn_resumes_from_the_last_decode_checkpoint():
    state, sched = make()
    first = Request("t1", prompt_of(21, 2), 12)
    sched.add_request(first)
    run(state, sched)
    assert (24, False) in state.published  # in decode: kept pending, published when the slot was freed
    second = Request("t2", first.all_token_ids + prompt_of(5, 3), 4)
    sched.add_request(second)
    steps = run(state, sched)
    assert steps[0] == [("t2", 32, 6)] and second.num_cached_tokens == 32  # 21 + 12 tokens: boundary 32
    assert second.output_token_ids == solo(second.prompt_token_ids, 4)


def test_without_checkpoints_nothing_is_cut_or_resumed():
    state, sched = make(checkpoints=False)
    sched.add_request(Request("a", prompt_of(21, 4), 3))
    run(state, sched)
    again = Request("b", prompt_of(21, 4), 3)
    sched.add_request(again)
    assert run(state, sched)[0] == [("b", 0, 21)] and state.published == []


def test_a_fork_shares_the_parents_state_or_waits_for_a_slot():
    state, sched = make(seqs=2, slots=2, checkpoints=False)  # the prompt in one chunk, which samples
    parent = Request("p", prompt_of(10, 5), 6)
    sched.add_request(parent)
    out = sched.schedule()  # the parent's prompt
    slot = out.chunks[0].state_slot
    state.rows[slot] += tuple(out.chunks[0].token_ids)
    first = next_token(state.rows[slot])
    sched.update_from_output(out, {"p": first})
    child = Request("c", list(parent.prompt_token_ids), 6)
    sched.fork("p", child, first)  # as the output processor does for n > 1
    assert child.status is RequestStatus.RUNNING and state.rows[child.state_slot] == state.rows[parent.state_slot]
    late = Request("c2", list(parent.prompt_token_ids), 6)
    sched.fork("p", late, first)  # both slots are held: it waits and recomputes
    assert late.status is RequestStatus.WAITING and late.state_slot is None
    run(state, sched)
    assert child.output_token_ids == late.output_token_ids == parent.output_token_ids
    assert state.num_free == 2


def test_admission_waits_for_a_free_slot():
    _state, sched = make(seqs=2, slots=1)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, prompt_of(9, ord(rid)), 3))
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"] and sched.num_waiting == 1


def test_a_one_token_prefill_chunk_ending_at_the_last_boundary_publishes_its_checkpoint():
    """A capped or budget-cut prefill (LONG_PREFILL_SHARE and decodes make chunk ends arbitrary) that leaves
    one token before the prompt's last block boundary still publishes the checkpoint at that boundary."""
    state, sched = make(budget=15)  # chunk 1 ends at 15, one token before the prompt's last boundary (16)
    sched.add_request(Request("a", prompt_of(21, 1), 12))
    steps = run(state, sched)
    assert steps[:2] == [[("a", 0, 15)], [("a", 15, 1)]]  # the scheduler cut at the boundary...
    assert state.published[0] == (16, True)  # ...so the prompt's checkpoint is published there, not pending
    again = Request("b", prompt_of(21, 1), 3)  # the same prompt: resumes at 16 (a decode checkpoint at 24
    sched.add_request(again)  # replaced a pending one, and the prompt does not reach 24)
    run(state, sched)
    assert again.num_cached_tokens == 16
