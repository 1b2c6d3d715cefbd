"""Tool-call text between one pair of markers, read as it streams.

Calls laid out canonically - `{"name": "N", "arguments": {...}}`, json.dumps' layout, alone or in a list, which
is what the grammar makes the model write - are reported as they are generated: the start (with the name) as
soon as the arguments begin, then the arguments' text piece by piece. Anything else (a model writing its calls
its own way, unconstrained) is kept and parsed whole at the end marker with the format's mlx-lm parser.
"""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.tool_formats import ToolFormat
from mlxpaged_app.server.server_log import log

HEAD = '{"name": "'
SEP = '", "arguments": '
_BETWEEN = " \t\r\n[],"  # what may separate calls in a list, or surround one


class CallScanner:
    """Events: ("start", name), ("args", text), ("end", arguments dict), in generation order."""

    def __init__(self, fmt: ToolFormat, tools: list[dict]) -> None:
        self.fmt, self.tools = fmt, tools
        self.raw = ""
        self.completed = 0  # calls ended here
        self.open = False  # a call has started and its arguments have not ended
        self.canonical = True
        self._mode, self._text = "between", ""
        self._depth, self._in_string, self._escape = 0, False, False

    def feed(self, text: str) -> list[tuple]:
        self.raw += text
        out: list[tuple] = []
        for ch in text:
            if not self.canonical:
                break
            getattr(self, f"_{self._mode}")(ch, out)
        return _merge_args(out)

    def _off_canonical(self) -> None:
        self.canonical = False

    def _between(self, ch: str, out: list) -> None:
        if ch == "{":
            self._mode, self._text = "head", "{"
        elif ch not in _BETWEEN:
            self._off_canonical()

    def _reading(self, ch: str, literal: str) -> bool:
        """Whether `ch` falls within the fixed `literal` that opens the text (taken, or canonical layout is off)."""
        if len(self._text) >= len(literal):
            return False
        if ch == literal[len(self._text)]:
            self._text += ch
        else:
            self._off_canonical()
        return True

    def _head(self, ch: str, out: list) -> None:
        """The literal `{"name": "`, then the name up to its closing quote."""
        if self._reading(ch, HEAD):
            return
        if self._escape:
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            self._name, self._mode, self._text = json.loads(self._text[len(HEAD) - 1 :] + '"'), "sep", '"'
            return
        self._text += ch

    def _sep(self, ch: str, out: list) -> None:
        if self._reading(ch, SEP):
            return
        if ch != "{":  # arguments that are not an object: leave them to the parser
            return self._off_canonical()
        self.open, self._mode, self._text, self._depth = True, "args", "{", 1
        out += [("start", self._name), ("args", "{")]

    def _args(self, ch: str, out: list) -> None:
        self._text += ch
        out.append(("args", ch))
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._mode = "close"

    def _close(self, ch: str, out: list) -> None:
        if ch in " \t\r\n":
            return
        try:
            arguments = json.loads(self._text)
        except json.JSONDecodeError:
            arguments = None
        if ch != "}" or not isinstance(arguments, dict):
            return self._off_canonical()
        out.append(("end", arguments))
        self.open, self.completed, self._mode = False, self.completed + 1, "between"

    def close(self) -> tuple[list[tuple], str | None]:
        """At the end marker (or the end of the reply): the calls still to report, and the text to give back
        as plain text when nothing here was a call (never lost)."""
        if self.canonical and self._mode == "between":
            return [], None
        untouched = self.completed == 0 and not self.open
        try:
            calls = _parsed_calls(self.fmt.parse(self.raw.strip(), self.tools))
        except Exception as exc:
            log.warning("tool call text that does not parse (%s: %s): %.200r", type(exc).__name__, exc, self.raw)
            return [], self.raw if untouched else None
        return self._remaining(calls), None

    def _remaining(self, calls: list[dict]) -> list[tuple]:
        out: list[tuple] = []
        for i, call in enumerate(calls[self.completed :]):
            if i == 0 and self.open:
                out.append(("end", call["arguments"]))  # its start and arguments are already out
                continue
            out += [
                ("start", call["name"]),
                ("args", json.dumps(call["arguments"], ensure_ascii=False)),
                ("end", call["arguments"]),
            ]
        self.open, self.completed = False, len(calls)
        return out


def _parsed_calls(parsed) -> list[dict]:
    calls = parsed if isinstance(parsed, list) else [parsed]
    out = []
    for call in calls:
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            raise ValueError(f"not a tool call: {call!r:.100}")
        out.append({"name": call["name"], "arguments": arguments})
    return out


def _merge_args(events: list[tuple]) -> list[tuple]:
    merged: list[tuple] = []
    for event in events:
        if event[0] == "args" and merged and merged[-1][0] == "args":
            merged[-1] = ("args", merged[-1][1] + event[1])
        else:
            merged.append(event)
    return merged
