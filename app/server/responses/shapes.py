"""A response object built from the chat pipeline's events, and the Responses stream events that build it.

One state machine serves both replies: streamed, every event it returns is sent; not streamed, they are
dropped and `response()` is the body. So the final response of a stream is the non-streamed body, item for
item. Output items: `reasoning` (think text), `message` (one output_text part), `function_call`; a new kind
of text closes the item before it. Every event carries the next `sequence_number`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

from mlxpaged_app.server.chat.spec import (
    ChatEvent,
    Finish,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
)
from mlxpaged_app.server.formatting import new_id
from mlxpaged_app.server.serving import ReplyShape
from mlxpaged_app.server.sse import named_event

ENDED = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "failed"}
TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}
ABORTED = "the server stopped generating this response (it is shutting down)"


def response_head(model: str, echo: dict) -> dict:
    """The fields of a response fixed before generation: identity, and the request settings it echoes."""
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": int(time.time()),
        "model": model,
        "previous_response_id": None,
        "store": False,
        "background": False,
        "truncation": "disabled",
        **echo,
    }


class ResponseBuilder(ReplyShape):
    """The reply shape of /v1/responses: every event named by its type, and no `[DONE]` (OpenAI ends the stream
    with `response.completed`, `.incomplete` or `.failed`)."""

    frame = staticmethod(named_event)

    def __init__(self, head: dict, call_fields: Callable[[str], dict] = lambda name: {"name": name}) -> None:
        self.head = head
        self.call_fields = call_fields  # a called tool's name -> the item's name fields (tools.py: namespaces)
        self.headers = {"x-request-id": head["id"]}
        self.output: list[dict] = []
        self.status, self.error, self.incomplete = "in_progress", None, None
        self.usage: dict | None = None
        self.reasoning_tokens = 0  # engine deltas (tokens) whose text went to reasoning
        self._open: dict | None = None  # the reasoning or message item text is going to
        self._calls: dict[int, dict] = {}  # tool-call index -> its function_call item
        self._positions: dict[str, int] = {}  # item id -> output_index
        self._sequence = 0

    @property
    def id(self) -> str:
        return self.head["id"]

    def response(self) -> dict:
        output = copy.deepcopy(self.output)
        text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
        return {
            **self.head,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "output": output,
            "output_text": text,
            "usage": self.usage,
        }

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def feed(self, events: list[ChatEvent]) -> list[dict]:
        """The stream events for one engine delta's chat events."""
        if any(isinstance(e, ReasoningDelta) for e in events):
            self.reasoning_tokens += 1
        out: list[dict] = []
        for event in events:
            if isinstance(event, (ReasoningDelta, TextDelta)):
                out += self._text(event)
            elif isinstance(event, ToolCallStart):
                out += self._close_open("completed") + self._call_start(event)
            elif isinstance(event, ToolCallArgs):
                out += self._call_args(event)
            elif isinstance(event, ToolCallEnd):
                out += self._call_end(self._calls.pop(event.index), "completed")
            elif isinstance(event, Finish):
                out += self._finish(event)
        return out

    def complete(self, usage: dict) -> list[dict]:
        """The last event, once the run has ended (its usage is known then)."""
        details = usage.get("prompt_tokens_details") or {}
        self.usage = {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": details.get("cached_tokens", 0), "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": usage["total_tokens"],
        }
        return [self._event(TERMINAL[self.status], response=self.response())]

    def fail(self, message: str) -> list[dict]:
        """The engine failed mid-stream: an `error` event, then `response.failed`."""
        self.status, self.error = "failed", {"code": "server_error", "message": message}
        return [
            self._event("error", code="server_error", message=message, param=None),
            self._event("response.failed", response=self.response()),
        ]

    # --- as a serving.ReplyShape: the same state machine, streamed or whole --------------------------------------

    def opening(self) -> list[dict]:
        return self.start()

    def chunks(self, choice: int, events: list[ChatEvent]) -> list[dict]:
        return self.feed(events)

    def closing(self, usage: dict) -> list[dict]:
        return self.complete(usage)

    def failed(self, message: str) -> list[dict]:
        return self.fail(message)

    def add(self, choice: int, events: list[ChatEvent]) -> None:
        self.feed(events)

    def body(self, usage: dict) -> dict:
        self.complete(usage)
        return self.response()

    # --- items -----------------------------------------------------------------------------------------------

    def _text(self, event: ReasoningDelta | TextDelta) -> list[dict]:
        kind = "reasoning" if isinstance(event, ReasoningDelta) else "message"
        out: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            out += self._close_open("completed") + self._open_item(kind)
        item, index = self._open, self._positions[self._open["id"]]
        part = item["content"][0]
        part["text"] += event.text
        fields = {"item_id": item["id"], "output_index": index, "content_index": 0, "delta": event.text}
        if kind == "reasoning":
            return [*out, self._event("response.reasoning_text.delta", **fields)]
        return [*out, self._event("response.output_text.delta", **fields, logprobs=[])]

    def _open_item(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs_"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "type": "message",
                "id": new_id("msg_"),
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        added = self._added(item)
        item["content"].append(part)
        self._open = item
        where = {"item_id": item["id"], "output_index": added["output_index"], "content_index": 0}
        return [added, self._event("response.content_part.added", **where, part=dict(part))]

    def _close_open(self, status: str) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = self._positions[item["id"]], item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            done = self._event("response.output_text.done", **where, text=part["text"], logprobs=[])
        return [done, self._event("response.content_part.done", **where, part=dict(part)), self._item_done(item)]

    def _call_start(self, event: ToolCallStart) -> list[dict]:
        item = {
            "type": "function_call",
            "id": new_id("fc_"),
            "call_id": event.id,
            **self.call_fields(event.name),
            "arguments": "",
            "status": "in_progress",
        }
        self._calls[event.index] = item
        return [self._added(item)]

    def _call_args(self, event: ToolCallArgs) -> list[dict]:
        item = self._calls[event.index]
        item["arguments"] += event.text
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self._positions[item["id"]],
                delta=event.text,
            )
        ]

    def _call_end(self, item: dict, status: str) -> list[dict]:
        item["status"] = status
        done = self._event(
            "response.function_call_arguments.done",
            item_id=item["id"],
            output_index=self._positions[item["id"]],
            name=item["name"],
            arguments=item["arguments"],
        )
        return [done, self._item_done(item)]

    def _finish(self, event: Finish) -> list[dict]:
        self.status = ENDED[event.reason]
        cut = "completed" if self.status == "completed" else "incomplete"
        out = self._close_open(cut)
        for index in sorted(self._calls):  # calls the reply ended inside of (max_output_tokens)
            out += self._call_end(self._calls.pop(index), "incomplete")
        if event.reason == "length":
            self.incomplete = {"reason": "max_output_tokens"}
        elif event.reason == "abort":
            self.error = {"code": "server_error", "message": ABORTED}
        return out

    def _added(self, item: dict) -> dict:
        self._positions[item["id"]] = len(self.output)
        self.output.append(item)
        return self._event("response.output_item.added", output_index=len(self.output) - 1, item=copy.deepcopy(item))

    def _item_done(self, item: dict) -> dict:
        index = self._positions[item["id"]]
        return self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}
