"""Per-request text output: streaming detokenization and stop conditions.

`TextStream.push(token)` turns one sampled token into a `Delta` of new text. Text comes from
mlx-lm's streaming detokenizer (whole characters even when a character's bytes span tokens).
Stop strings may span token boundaries, so the stream holds back any trailing text that could
still begin a stop string; when one completes, only the text before it is emitted. Order of
checks for a token: EOS / stop_token_ids ("stop", the token's text is not emitted), then stop
strings ("stop"), then max_tokens ("length"). Nothing is emitted after a finished delta.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlxpaged.sampling_params import SamplingParams


@dataclass(frozen=True)
class Delta:
    """New text from one token. `finish_reason` is "stop", "length" or None (not finished, or
    ended by `finish()`); `stop_matched` is the stop string that ended the text, if one did."""

    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_matched: str | None = None


def _earliest_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(position, stop) of the stop string that starts first in `text`; ties go to list order."""
    found = None
    for stop in stops:
        position = text.find(stop)
        if position >= 0 and (found is None or position < found[0]):
            found = (position, stop)
    return found


def _held_back_length(text: str, stops: list[str], longest: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for size in range(min(len(text), longest - 1), 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) for stop in stops):
            return size
    return 0


def _keep_leading_space(detokenizer) -> None:
    """Turn off the first-word space trimming of mlx-lm's BPE and SentencePiece detokenizers."""
    if hasattr(detokenizer, "trim_space"):  # SPMStreamingDetokenizer
        detokenizer.trim_space = False
    elif hasattr(detokenizer, "_maybe_trim_space"):  # BPEStreamingDetokenizer
        detokenizer._maybe_trim_space = lambda text: text


class TextStream:
    """Text of one sequence, token by token. Build one per sequence (each gets its own detokenizer)."""

    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: Iterable[int]) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not hasattr(tokenizer, "detokenizer"):
            raise ValueError("tokenizer must be an mlx-lm TokenizerWrapper (it has no .detokenizer)")
        # TokenizerWrapper.detokenizer returns a fresh, reset copy on every access.
        self._detokenizer = tokenizer.detokenizer
        if not params.trim_leading_space:
            _keep_leading_space(self._detokenizer)
        self._stops = list(params.stop)
        self._longest_stop = max((len(stop) for stop in self._stops), default=0)
        eos = set() if params.ignore_eos else {int(token) for token in eos_token_ids}
        self._stop_token_ids = eos | set(params.stop_token_ids)
        self._max_tokens = params.max_tokens
        self._num_tokens = 0
        self._held = ""
        self._emitted: list[str] = []
        self._last: Delta | None = None  # the finished delta, once there is one

    @property
    def finished(self) -> bool:
        return self._last is not None

    @property
    def finish_reason(self) -> str | None:
        return self._last.finish_reason if self._last is not None else None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    @property
    def num_tokens(self) -> int:
        """Tokens pushed so far, including a final EOS or stop token."""
        return self._num_tokens

    def push(self, token_id: int) -> Delta:
        """Consume one sampled token; returns the text it releases and whether the sequence ended."""
        if self._last is not None:
            raise RuntimeError(f"push({token_id}) after the stream finished ({self._last.finish_reason})")
        self._num_tokens += 1
        if token_id in self._stop_token_ids:
            self._flush_detokenizer()
            return self._end("stop")
        self._detokenizer.add_token(token_id)
        self._held += self._detokenizer.last_segment
        if self._num_tokens >= self._max_tokens:
            self._flush_detokenizer()
            return self._end("length")
        return self._release()

    def finish(self) -> Delta:
        """End the stream for another reason (abort): flush everything held back."""
        if self._last is not None:
            return Delta("", True, self._last.finish_reason, self._last.stop_matched)
        self._flush_detokenizer()
        return self._end(None)

    def _flush_detokenizer(self) -> None:
        self._detokenizer.finalize()
        self._held += self._detokenizer.last_segment

    def _release(self) -> Delta:
        if not self._stops:  # nothing to hold back: what `_release_stops` does with no stop strings
            text, self._held = self._held, ""
            self._emitted.append(text)
            return Delta(text)
        return self._release_stops()

    def _release_stops(self) -> Delta:
        if _earliest_stop(self._held, self._stops) is not None:
            return self._end("stop")
        keep = _held_back_length(self._held, self._stops, self._longest_stop)
        text, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self._emitted.append(text)
        return Delta(text)

    def _end(self, reason: str | None) -> Delta:
        """Emit the held text, cut before a stop string if one is in it, and finish."""
        text, matched = self._held, None
        match = _earliest_stop(text, self._stops)
        if match is not None:
            text, matched, reason = text[: match[0]], match[1], "stop"
        self._held = ""
        self._emitted.append(text)
        self._last = Delta(text, True, reason, matched)
        return self._last
