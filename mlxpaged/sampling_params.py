"""What a caller asks of sampling: `SamplingParams`, checked when built (each bad field raises a
ValueError naming it). How rows are sampled is mlxpaged.runner.sampling; the definitions of logprobs,
penalties and seeded randomness are in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlxpaged.validation import require_bool, require_number

import mlx.core as mx

if TYPE_CHECKING:
    from mlxpaged.constraints import Constraint

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# Temperatures below this sample greedily, as vLLM does: 1/T would overflow float32 logits.
GREEDY_TEMPERATURE = 1e-5
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
MAX_N = 128
MAX_LOGIT_BIAS = 100.0  # OpenAI's range


def _stop_list(value: object) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {value!r}")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise ValueError(f"stop entries must be non-empty strings, got {stop!r}")
    return list(stops)


def token_id_list(name: str, value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    # Plain non-negative ints pass in C loops: the engine thread checks each prompt (an 8k one took 5.7 ms
    # entry by entry, ahead of its first token); anything else gets the entry-by-entry check that names it.
    if set(map(type, value)) <= {int} and (not value or min(value) >= 0):
        return list(value)
    for token in value:
        require_number(f"{name} entries", token, 0, math.inf, integer=True)
    return list(value)


def _logit_bias(value: object) -> dict[int, float]:
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {value!r}")
    for token, bias in value.items():
        require_number("logit_bias token ids", token, 0, math.inf, integer=True)
        require_number(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    return {int(token): float(bias) for token, bias in value.items()}


@dataclass
class SamplingParams:
    """How one request samples and when it stops. Checked on construction (ValueError)."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 is off; k >= vocabulary size is off too
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the logits before sampling
    # Detokenizing: mlx-lm drops the space before the first generated word (chat replies); raw
    # completions keep it, as OpenAI's and vLLM's do ("The capital of France is" -> " Paris").
    trim_leading_space: bool = True
    constraint: Constraint | None = None  # a compiled grammar (constraints.py); each sequence gets its own matcher

    def __post_init__(self) -> None:
        require_number("max_tokens", self.max_tokens, 1, math.inf, integer=True)
        require_number("temperature", self.temperature, 0.0, math.inf)
        require_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        require_number("top_k", self.top_k, 0, math.inf, integer=True)
        require_number("min_p", self.min_p, 0.0, 1.0)
        require_number("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        require_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        require_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.stop = _stop_list(self.stop)
        self.stop_token_ids = token_id_list("stop_token_ids", self.stop_token_ids)
        require_bool("ignore_eos", self.ignore_eos)
        require_bool("trim_leading_space", self.trim_leading_space)
        require_bool("logprobs", self.logprobs)
        require_number("top_logprobs", self.top_logprobs, 0, MAX_TOP_LOGPROBS, integer=True)
        if self.top_logprobs and not self.logprobs:
            raise ValueError(f"top_logprobs={self.top_logprobs} needs logprobs=True (as in OpenAI's API)")
        require_number("n", self.n, 1, MAX_N, integer=True)
        self.logit_bias = _logit_bias(self.logit_bias)
        self._check_processors()
        self._check_constraint()

    def _check_constraint(self) -> None:
        if self.constraint is None:
            return
        from mlxpaged.constraints import Constraint  # llguidance loads only for constrained requests

        if not isinstance(self.constraint, Constraint):
            raise ValueError(f"constraint must be a Constraint from GrammarCompiler.compile, got {self.constraint!r}")
        if self.ignore_eos:
            raise ValueError(
                "ignore_eos=True cannot be combined with a constraint: the grammar decides where the output may end"
            )

    def _check_processors(self) -> None:
        if not isinstance(self.logits_processors, (list, tuple)):
            raise ValueError(f"logits_processors must be a list of callables, got {self.logits_processors!r}")
        for processor in self.logits_processors:
            if not callable(processor):
                raise ValueError(f"logits_processors entries must be callable, got {processor!r}")
        self.logits_processors = list(self.logits_processors)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
