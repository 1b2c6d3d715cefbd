"""How many prompt tokens one engine step may prefill and still end within its time budget.

A prefill chunk is the engine's unit of latency: every decoding stream waits for the step that carries it, and a
client that hung up is let go only when that step ends. `StepBudget` learns what steps cost as the engine runs, on
this backend with this model: how long a step that only decodes takes, and how long a step takes per prefill token
at each context (a token late in a long prompt attends to more keys; a chunk also pays once for the context it
reads). The scheduler asks it for the chunk that fits the budget, less the decoding streams' part when they
decode beside it. Alone, a long prompt prefills nearly at full speed in such chunks: the embedded model on this
CPU, a 5,000-token prompt, took 30.1-30.9 s in chunks of 2,048 tokens, 29.3 s in 512, 34.6 s in 128 (each chunk
also reads the whole context once), 31.6-34.7 s in steps of 2 s.

Beside decoding streams a prompt that arrived after one of them began (an agent's next turn while the others stream)
may get a tighter budget (`streams_s`): those streams were there first, and their clients read every step's length
as a pause in the text. Prompts that were already waiting when the streams began (a burst of requests, a batch job)
keep the whole budget: they were ahead of them, and are prefilled in few steps, which is what a batch's throughput
needs. A long prompt (more prefill left than one step's tokens, `max_batch_tokens`) may get a tighter budget still
beside decoding streams (`long_prompt_s`): it takes many steps whatever their size, so what its steps cost the
streams is what matters there.

Plain Python, no MLX (the scheduler's rules; tests drive it with made-up times).
"""

from __future__ import annotations

from dataclasses import dataclass

CONTEXT_BUCKET = 1024  # tokens: a cost per prefill token is kept per bucket of the chunk's end position
SMOOTHING = 0.5  # the weight of the newest measurement: costs move with the machine's load
MIN_CHUNK = 16  # a prompt always advances: the first prefill chunk of a step takes at least this many tokens
# Each prefill chunk is a model pass of its own, which costs before its tokens do: the embedded model on this CPU at
# ~2,400 tokens of context, 49 new tokens 0.21 s, 153 0.44 s, 299 0.79 s (~0.1 s a pass, ~2.3 ms a token). So a chunk
# that would leave its prompt at most TAIL_TOKENS short takes them now (an agent's turn whose last 2-16 tokens waited
# for the next step had its first token that step, ~0.7 s, later), and a later chunk of a step that would leave its
# prompt unfinished with fewer than MIN_LATER_CHUNK tokens is not started: the prompt starts next step, first, as
# soon as it would have finished anyway, and this step ends a pass sooner (a cold bench fleet, session 33: pieces of
# 9-33 tokens, each a pass, in 7 of the 25 steps that prefilled a later turn).
TAIL_TOKENS = MIN_CHUNK
MIN_LATER_CHUNK = 64
FIRST_CHUNK = 256  # tokens of a chunk before any prefill was measured
# A plan fills this share of the budget: costs are smoothed averages, and steps scatter around them, so a plan at the
# whole budget runs over it about every other step, and a client that hangs up waits that much longer. The embedded
# model on this CPU, a 6,500-token prompt alone: planned at 2 s, steps of 1.42-2.31 s; at 7/8 of it (1.75 s), 1.62-2.07
# s, and a live server went idle up to 2.45 s after a client hung up (docs/design/issue38-load.md, session 30).
PLAN_SHARE = 0.75


@dataclass(frozen=True)
class Chunk:
    """A prefill chunk as the budget sees it: where it starts in its sequence and how many tokens it feeds."""

    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


class StepBudget:
    """What steps cost here, learnt from the steps run (`record`), and the chunks that fit a step (`plan`)."""

    def __init__(self, budget_s: float, long_prompt_s: float | None = None, streams_s: float | None = None):
        named = (
            ("step budget", budget_s),
            ("long prompts' step budget", long_prompt_s),
            ("streams' budget", streams_s),
        )
        for name, seconds in named:
            if seconds is not None and not seconds > 0:
                raise ValueError(f"the {name} must be > 0 seconds, got {seconds}")
        self.budget_s = budget_s
        # A step that carries a chunk of a prompt that arrived behind a decoding stream: at most this (never above
        # the budget).
        self.streams_s = budget_s if streams_s is None else min(budget_s, streams_s)
        # ... a long prompt's chunk: at most this (never above the streams' budget).
        self.long_prompt_s = self.streams_s if long_prompt_s is None else min(self.streams_s, long_prompt_s)
        self.decode_s: float | None = None  # a step that only decodes (the rows running now)
        self._per_token_s: dict[int, float] = {}  # bucket of a chunk's end -> seconds per prefill token

    def plan(self, decoding: bool) -> StepPlan:
        """The time this step's prefill chunks may take: alone, the budget; beside decoding rows, the budget less the
        rows' part, for a prompt that arrived after one of those streams began the streams' budget less that part,
        for a long prompt's chunk the long prompts' budget less that part."""
        if not decoding:
            alone_s = self.budget_s * PLAN_SHARE
            return StepPlan(self, alone_s, alone_s, alone_s, decoding)
        decode_s = self.decode_s or 0.0
        seconds, streams_s, long_prompt_s = (
            s * PLAN_SHARE - decode_s for s in (self.budget_s, self.streams_s, self.long_prompt_s)
        )
        return StepPlan(self, seconds, streams_s, long_prompt_s, decoding)

    def record(self, seconds: float, decoding: bool, prefills: list[Chunk]) -> None:
        """A step took `seconds`: it decoded (or not) and fed these prefill chunks."""
        if not prefills:
            if decoding:
                self.decode_s = _smooth(self.decode_s, seconds)
            return
        prefill_s = seconds - (self.decode_s or 0.0) if decoding else seconds
        tokens = sum(chunk.num_tokens for chunk in prefills)
        if prefill_s <= 0 or tokens == 0:
            return  # a step faster than its decode part alone: noise, nothing to learn
        for chunk in prefills:
            bucket = chunk.end // CONTEXT_BUCKET
            self._per_token_s[bucket] = _smooth(self._per_token_s.get(bucket), prefill_s / tokens)

    def per_token_s(self, end: int) -> float | None:
        """Seconds per prefill token of a chunk ending at `end`: its bucket's, else the nearest measured bucket's
        before it plus one bucket's rise (as the two measured buckets below it rose, or with one measured, the most a
        token's cost may rise), else the nearest after it, else None (nothing measured yet). A long prompt reaches each
        bucket from the one before, where a token costs a bucket's rise less (a token attends to ~1,024 keys fewer); a
        chunk after a long cached prefix, which costs more than that price, is over budget once, then measured
        (pricing a far bucket by its position would overprice it: in a 5,000-token prompt a token cost 4.4 ms in the
        first bucket and 9.6 ms in the fifth, not 5 x 4.4)."""
        bucket = end // CONTEXT_BUCKET
        if bucket in self._per_token_s:
            return self._per_token_s[bucket]
        below = sorted(b for b in self._per_token_s if b < bucket)
        if below:
            top = self._per_token_s[below[-1]]
            if len(below) < 2:
                # One bucket measured, no rise known: the most it may rise, as if all of a token's cost grew with its
                # context ((b + 1/2) x 1,024 keys in the middle of bucket b). An overprice for a step, until the bucket
                # above is measured; priced at `top`, a fresh server's first bucket crossing was the step a client that
                # hung up waited longest for (1.98 s against issue 38's 2 s; docs/design/issue38-load.md, session 30).
                return top + top / (below[-1] + 0.5)
            rise = (top - self._per_token_s[below[-2]]) / (below[-1] - below[-2])
            return top + max(0.0, rise)
        above = [b for b in self._per_token_s if b > bucket]
        return self._per_token_s[min(above)] if above else None

    def tokens_within(self, seconds: float, start: int, most: int) -> int | None:
        """The most tokens (<= `most`) a chunk starting at `start` may feed in `seconds` (0 when none fit), or None
        before any prefill was measured."""
        per_token = self.per_token_s(start + 1)
        if per_token is None:
            return None
        tokens = min(most, int(seconds / per_token))
        # Priced at its own end (a later bucket costs more): the chunk that fits there, once, but never fewer tokens
        # than its own bucket has left (those are priced right; a chunk cut short of the bucket's end only makes the
        # next step cross it, and with the rise unknown that price is the most it may be).
        later = self.per_token_s(start + tokens) if tokens > 0 else None
        if later is not None and later > per_token:
            bucket_left = ((start + 1) // CONTEXT_BUCKET + 1) * CONTEXT_BUCKET - 1 - start
            tokens = min(tokens, max(int(seconds / later), bucket_left))
        return max(0, tokens)

    def cost_s(self, chunk: Chunk) -> float:
        """The predicted seconds of a chunk (0 before anything was measured)."""
        per_token = self.per_token_s(chunk.end)
        return 0.0 if per_token is None else per_token * chunk.num_tokens


class StepPlan:
    """One step's time for prefill chunks: each chunk `take`s its tokens from it, in the scheduler's order. A chunk
    is of a prompt that came before the streams decoding now (or beside none), of one that arrived behind one of them
    (`behind_streams`: that stream was promised its tokens first), or of a long prompt; each kind has its limit, and
    every chunk's time counts against all three."""

    def __init__(
        self, budget: StepBudget, seconds: float, streams_seconds: float, long_prompt_seconds: float, decoding: bool
    ):
        self.budget = budget
        self.seconds, self.streams_seconds, self.long_prompt_seconds = seconds, streams_seconds, long_prompt_seconds
        self.spent_s = 0.0  # the predicted time of the chunks taken so far
        self.decoding = decoding
        self.num_chunks = 0

    def has_time_for(self, long_prompt: bool, behind_streams: bool = False) -> bool:
        """Whether another chunk of a long prompt, or of a short one (arrived behind a decoding stream or not), may
        start (the first always may). Beside decoding streams a long prompt's chunk goes only in a step of no other
        prefill: beside an agent's next turn such steps took 1.03-1.23 s with seven streams waiting; with this rule
        none of a cold `bench fleet --long`'s steps over 0.85 s carried one (docs/design/issue38-load.md, session
        31)."""
        if long_prompt and self.decoding and self.num_chunks > 0:
            return False
        return self.num_chunks == 0 or self._seconds_left(long_prompt, behind_streams) > 0

    def take(self, start: int, most: int, long_prompt: bool = False, behind_streams: bool = False) -> int:
        """Tokens for a prefill chunk starting at `start` (ask `has_time_for` first), at most `most`, of a long prompt
        or not, behind decoding streams or not: the first chunk of a step at least MIN_CHUNK (or `most`, if smaller);
        `most` when that leaves at most TAIL_TOKENS; a later chunk at least MIN_LATER_CHUNK, else 0 (no chunk: the
        scheduler starts no other this step). Before any prefill was measured, FIRST_CHUNK (the first prompt of an
        engine's life: a step of the most tokens took 5.6 s on this CPU, which a client hanging up would wait for)."""
        seconds = self._seconds_left(long_prompt, behind_streams)
        tokens = self.budget.tokens_within(max(seconds, 0.0), start, most)
        if tokens is None:
            tokens = min(most, FIRST_CHUNK)
        if most - tokens <= TAIL_TOKENS:
            tokens = most
        elif self.num_chunks > 0 and tokens < MIN_LATER_CHUNK:
            return 0
        tokens = max(tokens, min(MIN_CHUNK, most))
        self.num_chunks += 1
        self.spent_s += self.budget.cost_s(Chunk(start, tokens))
        return tokens

    def _seconds_left(self, long_prompt: bool, behind_streams: bool) -> float:
        if long_prompt:
            return self.long_prompt_seconds - self.spent_s
        return (self.streams_seconds if behind_streams else self.seconds) - self.spent_s


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
