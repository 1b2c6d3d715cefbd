"""One choice's generated text as chat events: reasoning, plain text and tool calls, as they stream.

mlx-lm's TextStateMachine splits the text at the markers (stripping them, holding back a possible partial
marker) with our own transitions: unlike mlx-lm's `make_text_state_machine` there is no reasoning -> tool
edge, so a tool-call marker inside a think block is reasoning text, never a call.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxpaged.engine.engine import StreamDelta
from mlxpaged_app.server.chat.spec import (
    ChatEvent,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from mlxpaged_app.server.chat.tool_formats import ToolFormat
from mlxpaged_app.server.chat.tool_stream import CallScanner
from mlxpaged_app.server.formatting import delta_logprobs

from mlx_lm.generate import TextStateMachine


def transitions(think: tuple[str, str] | None, tools: ToolFormat | None) -> dict:
    edges: dict[str, list] = {"normal": []}
    if think is not None:
        edges["normal"].append((think[0], "reasoning"))
        edges["reasoning"] = [(think[1], "normal")]
    if tools is not None:
        edges["normal"].append((tools.start, "tool"))
        edges["tool"] = [(tools.end, "normal")] if tools.end else []
    return edges


class OutputParser:
    """Feed it a choice's deltas in order; it returns the events each one completes."""

    def __init__(
        self,
        *,
        think: tuple[str, str] | None,
        tools: ToolFormat | None,
        tool_dicts: list[dict],
        new_call_id: Callable[[], str],
        reasoning_open: bool = False,
        logprobs: bool = False,
    ) -> None:
        self._machine = TextStateMachine(transitions(think, tools))
        self._state = self._machine.make_state("reasoning" if reasoning_open and think else "normal")
        self._format, self._tool_dicts, self._new_call_id = tools, tool_dicts, new_call_id
        self._logprobs = logprobs
        self._scanner: CallScanner | None = None
        self._calls = 0  # tool calls started in this choice
        self._ended = 0

    def feed(self, delta: StreamDelta) -> list[ChatEvent]:
        events: list[ChatEvent] = []
        if self._logprobs and delta.token_id is not None:
            events.append(TokenLogprobs(delta_logprobs(delta)))
        self._state, segments = TextStateMachine.split(self._state, delta.text)
        previous = None
        for state, text in segments:
            events += self._segment(state, text, previous)
            previous = state
        if delta.finish_reason is not None:
            events += self._finish(delta)
        return events

    def _segment(self, state: str | None, text: str, previous: str | None) -> list[ChatEvent]:
        """One piece of text in one state; a change of state from "tool" closes that tool block."""
        events: list[ChatEvent] = []
        if previous == "tool" and state != "tool":
            events += self._close_block(ended=True)
        if state == "tool":
            if self._scanner is None:
                self._scanner = CallScanner(self._format, self._tool_dicts)
            events += self._call_events(self._scanner.feed(text))
        elif text:
            events.append(ReasoningDelta(text) if state == "reasoning" else TextDelta(text))
        return events

    def _call_events(self, scanned: list[tuple]) -> list[ChatEvent]:
        events: list[ChatEvent] = []
        for kind, value in scanned:
            if kind == "start":
                self._calls += 1
                events.append(ToolCallStart(self._calls - 1, self._new_call_id(), value))
            elif kind == "args":
                events.append(ToolCallArgs(self._calls - 1, value))
            else:
                self._ended += 1
                events.append(ToolCallEnd(self._calls - 1, value))
        return events

    def _close_block(self, ended: bool) -> list[ChatEvent]:
        """At the end marker (ended) or at the end of the reply inside a block."""
        scanner, self._scanner = self._scanner, None
        if scanner is None:
            return []
        scanned, unparsed = scanner.close()
        events = self._call_events(scanned)
        if unparsed is not None:  # not a call after all: give the text back, markers included
            events.append(TextDelta(self._format.start + unparsed + (self._format.end if ended else "")))
        return events

    def _finish(self, delta: StreamDelta) -> list[ChatEvent]:
        self._state, rest, state = TextStateMachine.flush(self._state)
        events = self._segment(state, rest, None) if rest else []
        if state == "tool" or self._scanner is not None:
            events += self._close_block(ended=False)
        reason = delta.finish_reason
        if reason == "stop" and self._ended:
            reason = "tool_calls"
        return [*events, Finish(reason, getattr(delta, "stop_sequence", None))]
