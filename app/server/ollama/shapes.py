"""Ollama's replies to /api/chat and /api/generate, whole or streamed as NDJSON (one JSON object a line,
`application/x-ndjson`), from a chat run's events.

Streamed: one line per engine delta that shows something - `message.content` (chat) or `response` (generate), with
`thinking` and, once a call's arguments are complete, `tool_calls` (arguments as an object) - each with
`"done": false`; then a last line with empty text, `"done": true`, `done_reason` and the timings (and generate's
`context`). Whole: one object with everything. An engine failure after the first line is one `{"error": ...}`
line, as Ollama sends it.

done_reason: "stop" (the model ended, a stop string, or tool calls: Ollama says "stop" for those too), "length"
(num_predict or the context reached); a reply cut by server shutdown has none. Timings, in nanoseconds:
total_duration from the request's arrival; load_duration how long the request waited for its model (its load,
when the request found it unloaded); prompt_eval_count the
prompt's tokens (prefix-cache hits included, as Ollama counts cache_n + prompt_n) and prompt_eval_duration from
submission to the first token; eval_count the reply's tokens and eval_duration from the first token to the last.
"""

from __future__ import annotations

import json
import time

from mlxpaged_app.server.chat.pipeline import ChatRun, ChoiceResult
from mlxpaged_app.server.chat.spec import (
    ChatEvent,
    ReasoningDelta,
    TextDelta,
    TokenLogprobs,
    ToolCallEnd,
    ToolCallStart,
)
from mlxpaged_app.server.formatting import TokenText
from mlxpaged_app.server.ollama.errors import error_body
from mlxpaged_app.server.ollama.model_info import now
from mlxpaged_app.server.openai.shapes import chat_logprobs
from mlxpaged_app.server.serving import ReplyShape

NDJSON = "application/x-ndjson"
DONE_REASONS = {"stop": "stop", "tool_calls": "stop", "length": "length"}


def ndjson_line(payload: dict) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def nanoseconds(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


def done_reply(model: str, reason: str, chat: bool) -> dict:
    """The whole reply to a request that only loads or unloads the model ("load", "unload")."""
    text = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": model, "created_at": now(), **text, "done": True, "done_reason": reason}


def _call(call_id: str, index: int, name: str, arguments: dict) -> dict:
    """A tool call as Ollama writes it: the arguments an object, not OpenAI's JSON text."""
    return {"id": call_id, "function": {"index": index, "name": name, "arguments": arguments}}


class OllamaShape(ReplyShape):
    """What chat and generate replies share: the lines, the calls, the timings. Subclasses say where the text
    goes (`_text_fields`)."""

    frame = staticmethod(ndjson_line)
    media_type = NDJSON

    def __init__(self, model: str, run: ChatRun, token_text: TokenText, load_seconds: float = 0.0) -> None:
        self.model, self.run, self.token_text, self.load_seconds = model, run, token_text, load_seconds
        self.headers: dict[str, str] = {}
        self.submitted = time.perf_counter()  # made right after the run was submitted
        self.result = ChoiceResult()
        self.names: dict[int, tuple[str, str]] = {}  # call index -> (id, name)

    def chunks(self, choice: int, events: list[ChatEvent]) -> list[dict]:
        self.result.extend(events)
        text, thinking, calls, entries = "", "", [], []
        for event in events:
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, ReasoningDelta):
                thinking += event.text
            elif isinstance(event, ToolCallStart):
                self.names[event.index] = (event.id, event.name)
            elif isinstance(event, ToolCallEnd):  # Ollama sends a call whole, once its arguments are complete
                call_id, name = self.names[event.index]
                calls.append(_call(call_id, event.index, name, event.arguments))
            elif isinstance(event, TokenLogprobs):
                entries += event.entries
        if not (text or thinking or calls or entries):
            return []
        line = {"model": self.model, "created_at": now(), **self._text_fields(text, thinking, calls), "done": False}
        if entries:
            line["logprobs"] = chat_logprobs(self.token_text, entries)["content"]
        return [line]

    def closing(self, usage: dict) -> list[dict]:
        return [self._final(self._text_fields("", "", []), usage)]

    def failed(self, message: str) -> list[dict]:
        return [error_body(message)]

    def add(self, choice: int, events: list[ChatEvent]) -> None:
        self.result.extend(events)

    def body(self, usage: dict) -> dict:
        r = self.result
        calls = [
            _call(c.id, i, c.name, c.arguments)
            for i, c in enumerate(r.tool_calls)
            if c.arguments is not None  # a call cut off by the reply's length never ended
        ]
        fields = self._text_fields(r.text, r.reasoning, calls)
        logprobs = chat_logprobs(self.token_text, r.logprobs)["content"] if self.run.spec.logprobs else None
        return {**self._final(fields, usage), **({"logprobs": logprobs} if logprobs is not None else {})}

    def _final(self, fields: dict, usage: dict) -> dict:
        reason = DONE_REASONS.get(self.result.finish.reason) if self.result.finish is not None else None
        return {
            "model": self.model,
            "created_at": now(),
            **fields,
            "done": True,
            **({"done_reason": reason} if reason is not None else {}),
            **self._timings(usage),
        }

    def _timings(self, usage: dict) -> dict:
        end = time.perf_counter()
        first = self.run.generation.first_token_at
        prompt_end = end if first is None else first
        return {
            "total_duration": nanoseconds(end - self.run.generation.arrived),
            "load_duration": nanoseconds(self.load_seconds),
            "prompt_eval_count": usage["prompt_tokens"],
            "prompt_eval_duration": nanoseconds(prompt_end - self.submitted),
            "eval_count": usage["completion_tokens"],
            "eval_duration": nanoseconds(end - prompt_end),
        }

    def _text_fields(self, text: str, thinking: str, calls: list[dict]) -> dict:
        raise NotImplementedError


class ChatShape(OllamaShape):
    def _text_fields(self, text: str, thinking: str, calls: list[dict]) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}


class GenerateShape(OllamaShape):
    """`context`: the prompt's token ids and the reply's, for the next request to continue from (not for a raw
    prompt, as in Ollama)."""

    def _text_fields(self, text: str, thinking: str, calls: list[dict]) -> dict:
        return {"response": text, **({"thinking": thinking} if thinking else {})}

    def _final(self, fields: dict, usage: dict) -> dict:
        final = super()._final(fields, usage)
        if self.run.spec.raw_prompt is None:
            final["context"] = [*self.run.prompt, *self.run.output_ids[0]]
        return final
