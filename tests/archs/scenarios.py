"""The paged engine's scenarios for one tiny architecture (design14 E), each against mlx-lm's greedy tokens.

Three engines per architecture: the main one (alone, batched, prefix-cache hit, n = 2), one with a
16-token step budget (chunked prefill) and one whose pool is too small for the three requests at
once (preemption by recompute). After its scenarios every engine must hold no block (and no state
slot, where the engine reports them). A scenario's verdict is "pass" or the reason it failed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

BLOCK_SIZE = 8
NEW_TOKENS = 10
TIE_GAP = 1e-4  # mlx-lm's top-2 log-prob gap under which either token is a fair argmax
EXTRA_TOKENS = 9  # a prefix-hit prompt is a finished prompt + its reply + this many tokens
CHUNK_BUDGET = 16  # max_batch_tokens of the chunked-prefill engine: every prompt takes several steps
SCENARIOS = ("alone", "batched", "chunked", "prefix", "preempt", "n2", "empty")


@dataclass(frozen=True)
class Case:
    """A prompt and mlx-lm's greedy reply to it, with the top-2 log-prob gap of each step."""

    prompt: list[int]
    tokens: list[int]
    gaps: list[float]


def compare(got: list[int], case: Case) -> str | None:
    """None when equal up to the first step that is a near-tie in mlx-lm's own log-probs, else why not."""
    for step, (g, w) in enumerate(zip(got, case.tokens, strict=False)):  # the lengths are compared below
        if g != w:
            gap = case.gaps[step]
            return None if gap < TIE_GAP else f"token {step}: {g} != mlx-lm's {w} (gap {gap:.2g})"
    return None if len(got) == len(case.tokens) else f"{len(got)} tokens, mlx-lm {len(case.tokens)}"


class Scenarios:
    """Runs every scenario on engines over `loaded`; `reference(prompt)` is mlx-lm's Case for a prompt."""

    def __init__(
        self,
        loaded,
        cases: list[Case],
        reference: Callable[[list[int]], Case],
        vocab: int,
        cache_settings: dict | None = None,
    ):
        from mlxpaged.sampling_params import SamplingParams

        self.loaded, self.cases, self.reference, self.vocab = loaded, cases, reference, vocab
        self.cache_settings = cache_settings or {}  # e.g. kv_bits: every engine's pages quantized
        self.params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        self.verdicts: dict[str, str] = {}
        self.facts: dict = {}
        self._empty: list[str] = []
        self._pool_bytes = 0  # the preemption engine's pool, sized from the main engine's blocks

    def run(self) -> dict:
        """Engine facts and a verdict per scenario; raises UnsupportedModelError when the model is refused."""
        from mlxpaged.config import CacheConfig, SchedulerConfig

        cache = CacheConfig(cache_tokens=512, block_size=BLOCK_SIZE, **self.cache_settings)
        with self._engine(cache) as engine:  # a refusal propagates: it is the architecture's verdict
            self._main(engine)
        self._on_engine("chunked", cache, SchedulerConfig(max_batch_tokens=CHUNK_BUDGET), self._chunked)
        self._on_engine("preempt", *self._small_pool(), self._preempt)
        self.verdicts["empty"] = "; ".join(self._empty) or "pass"
        return {"scenarios": {name: self.verdicts[name] for name in SCENARIOS}, **self.facts}

    def _longest(self) -> int:
        return max(len(case.prompt) for case in self.cases) + NEW_TOKENS

    def _small_pool(self) -> tuple:
        """(CacheConfig, SchedulerConfig) of a pool that admits the three prompts at once but cannot hold their
        replies: some must be preempted. Blocks of zero bytes (a model of state layers only: specs.NoKVSpec)
        are bounded by demand, not memory: --cache-tokens for the longest sequence and one sequence per prompt."""
        from mlxpaged.config import CacheConfig, SchedulerConfig

        if self._pool_bytes == 0:
            return (
                CacheConfig(cache_tokens=self._longest(), block_size=BLOCK_SIZE, **self.cache_settings),
                SchedulerConfig(max_num_seqs=len(self.cases)),
            )
        return (
            CacheConfig(
                cache_tokens=self._longest(), kv_memory=self._pool_bytes, block_size=BLOCK_SIZE, **self.cache_settings
            ),
            SchedulerConfig(),
        )

    def _main(self, engine) -> None:
        self._facts(engine)
        blocks = engine.kv_manager.num_blocks_for
        prompts = sum(blocks(len(case.prompt)) for case in self.cases)
        self._pool_bytes = max(prompts, blocks(self._longest())) * engine.kv.bytes_per_block
        replies = self._check("alone", lambda: self._alone(engine))
        self._check("batched", lambda: self._same(engine.generate(self._prompts(), self.params), self.cases))
        self._check("prefix", lambda: self._prefix(engine, replies))
        self._check("n2", lambda: self._n2(engine))
        self._note_empty("main", engine)

    def _chunked(self, engine) -> str | None:
        return self._same(engine.generate(self._prompts(), self.params), self.cases)

    def _on_engine(self, name: str, cache, scheduler, scenario: Callable) -> None:
        """One scenario on an engine of its own; an engine that cannot be built fails the scenario."""
        try:
            engine = self._engine(cache, scheduler)
        except Exception as exc:
            self.verdicts[name] = f"engine not built: {type(exc).__name__}: {str(exc)[:200]}"
            return
        with engine:
            self._check(name, lambda: scenario(engine))
            self._note_empty(name, engine)

    def _engine(self, cache, scheduler=None):
        from mlxpaged.engine.engine import Engine

        return Engine(self.loaded, cache, scheduler)

    def _facts(self, engine) -> None:
        from mlxpaged.runner.routing import is_routed

        self.facts.update(
            prefix_cache=engine.kv_manager.enable_prefix_cache,
            routed=is_routed(engine.model),
            serial=engine.serial_reason,
        )

    def _prompts(self) -> list[list[int]]:
        return [case.prompt for case in self.cases]

    def _check(self, name: str, scenario: Callable):
        """Run a scenario: its verdict is "pass", the mismatch it returned, or the error it raised."""
        try:
            why, value = _split(scenario())
        except Exception as exc:  # a request failed mid-way: the very thing the matrix must catch
            why, value = f"{type(exc).__name__}: {str(exc)[:200]}", None
        self.verdicts[name] = "pass" if why is None else why
        return value

    def _same(self, completions, cases: list[Case]) -> str | None:
        problems = [
            f"prompt of {len(case.prompt)}: {why}"
            for completion, case in zip(completions, cases, strict=True)
            if (why := compare(list(completion.token_ids), case))
        ]
        return "; ".join(problems) or None

    def _alone(self, engine) -> tuple[str | None, list[list[int]]]:
        completions = [engine.generate([case.prompt], self.params)[0] for case in self.cases]
        return self._same(completions, self.cases), [list(c.token_ids) for c in completions]

    def _prefix(self, engine, replies: list[list[int]] | None) -> str | None:
        """Prompt B = a finished prompt A + A's reply + new tokens: mlx-lm's tokens on B cold, and a
        prefix-cache hit where the cache is on."""
        if replies is None:
            return "no reply to extend (the alone scenario raised)"
        first = self.cases[1]
        prompt = first.prompt + replies[1] + [(5 * i + 2) % (self.vocab - 1) + 1 for i in range(EXTRA_TOKENS)]
        completion = engine.generate([prompt], self.params)[0]
        self.facts["prefix_hit_tokens"] = completion.cached_tokens
        why = self._same([completion], [self.reference(prompt)])
        if why is None and self.facts["prefix_cache"] and completion.cached_tokens == 0:
            return f"the prefix cache is on but a {len(prompt)}-token prompt extending a finished one hit nothing"
        return why

    def _n2(self, engine) -> str | None:
        from dataclasses import replace

        completions = engine.generate([self.cases[1].prompt], replace(self.params, n=2))
        if len(completions) != 2:
            return f"{len(completions)} completions for n = 2"
        return self._same(completions, [self.cases[1]] * 2)

    def _preempt(self, engine) -> str | None:
        why = self._same(engine.generate(self._prompts(), self.params), self.cases)
        preemptions = engine.stats()["preemptions"]
        self.facts["preemptions"] = preemptions
        if why is None and preemptions == 0:
            return f"no request was preempted in a pool of {engine.kv_manager.num_blocks} blocks"
        return why

    def _note_empty(self, label: str, engine) -> None:
        """Every block free (cached blocks count as free) and, where reported, every state slot."""
        deadline = time.monotonic() + 2.0  # the engine thread frees a finished request's blocks
        while (held := _held(engine.stats())) and time.monotonic() < deadline:
            time.sleep(0.01)
        if held:
            self._empty.append(f"{label} engine still holds {held} after its requests finished")


def _held(stats: dict) -> str:
    """What a drained engine still holds: blocks in use, and state slots if the engine has them."""
    held = [f"{stats['blocks_used']} blocks"] if stats["blocks_used"] else []
    if stats.get("state_slots_used"):
        held.append(f"{stats['state_slots_used']} state slots")
    return ", ".join(held)


def _split(result) -> tuple[str | None, object]:
    """A scenario returns a reason (or None), or (reason, value) when later scenarios need its output."""
    return result if isinstance(result, tuple) else (result, None)
