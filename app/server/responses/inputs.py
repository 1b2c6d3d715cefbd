"""A Responses `input` (and `instructions`) as the chat pipeline's messages (chat/spec.py).

Items: messages (role user / assistant / system / developer, content a string or input_text / output_text
parts), function_call, function_call_output (text, and input_image parts: chat/tool_images.py) and reasoning. A
function_call joins the assistant turn before it and the reasoning item before a turn becomes its
`reasoning_content`, so a replayed reply renders as the one assistant turn the model generated (and the next
turn's prompt extends the last: prefix cache hits); a call with a `namespace` is named as the model saw it
(tools.flat_name).
"""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.tool_images import images_after_tool_turns
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.responses.tools import flat_name

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = "message, function_call, function_call_output and reasoning"


def input_messages(value: object, instructions: str | None) -> list[dict]:
    """The conversation for the chat template; a 400 names the item (`input[3].call_id`) at fault."""
    conversation = Conversation()
    if instructions:
        conversation.messages.append({"role": "system", "content": instructions})
    if isinstance(value, str) and value:
        conversation.messages.append({"role": "user", "content": value})
    elif isinstance(value, list) and value:
        for i, item in enumerate(value):
            conversation.add(item, f"input[{i}]")
    else:
        got = "nothing" if value is None else f"{json.dumps(value)[:40]}"
        raise invalid_param(
            "input",
            f"'input' must be a non-empty string or a non-empty list of items, got {got}",
            "missing_required_parameter" if value is None else "invalid_value",
        )
    if not any(m["role"] != "system" for m in conversation.messages):
        raise invalid_param("input", "'input' holds no user, assistant or tool turn to reply to")
    return images_after_tool_turns(conversation.messages)


class Conversation:
    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.call_names: dict[str, str] = {}  # call_id -> function name, from the function_call items so far
        self.reasoning: str | None = None  # from a reasoning item, for the assistant turn that follows

    def add(self, item: object, where: str) -> None:
        if not isinstance(item, dict):
            raise invalid_param(where, f"{where} must be an object (an input item), got {json.dumps(item)[:40]}")
        kind = item.get("type", "message" if "role" in item else None)
        handlers = {
            "message": self.message,
            "function_call": self.function_call,
            "function_call_output": self.function_call_output,
            "reasoning": self.reasoning_item,
        }
        if kind not in handlers:
            raise invalid_param(
                f"{where}.type",
                f"{where}: item type {kind!r} is not supported; this server takes {ITEM_TYPES} items",
                "unsupported_value",
            )
        handlers[kind](item, where)

    def message(self, item: dict, where: str) -> None:
        role = item.get("role")
        if role not in ROLES:
            raise invalid_param(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}")
        content = _content(item.get("content"), f"{where}.content", images=ROLES[role] == "user")
        self._append({"role": ROLES[role], "content": content})

    def function_call(self, item: dict, where: str) -> None:
        call_id, name = _string(item, "call_id", where), _string(item, "name", where)
        if item.get("namespace"):  # Codex replays a namespaced call as it got it: back to the name the model wrote
            name = flat_name(_string(item, "namespace", where), name)
        call = {
            "id": call_id,
            "type": "function",
            "function": {"name": name, "arguments": _arguments(item.get("arguments"), f"{where}.arguments")},
        }
        self.call_names[call_id] = name
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant" and self.reasoning is None:
            last.setdefault("tool_calls", []).append(call)  # the same reply: text, then its calls
        else:
            self._append({"role": "assistant", "content": "", "tool_calls": [call]})

    def function_call_output(self, item: dict, where: str) -> None:
        call_id = _string(item, "call_id", where)
        if call_id not in self.call_names:
            known = ", ".join(self.call_names) or "none"
            raise invalid_param(
                f"{where}.call_id",
                f"{where}.call_id {call_id!r} answers no earlier function_call item (call_ids so far: {known})",
            )
        output = _content(item.get("output"), f"{where}.output", images=True)  # a screenshot a tool took
        self._append({"role": "tool", "tool_call_id": call_id, "name": self.call_names[call_id], "content": output})

    def reasoning_item(self, item: dict, where: str) -> None:
        parts = item.get("content") or item.get("summary") or []
        if not isinstance(parts, list):
            raise invalid_param(f"{where}.content", f"{where}.content must be a list of reasoning_text parts")
        texts = [p.get("text") for p in parts if isinstance(p, dict)]
        if not all(isinstance(t, str) for t in texts):
            raise invalid_param(f"{where}.content", f"{where}: every reasoning part needs a string 'text'")
        self.reasoning = "\n".join(texts) or None

    def _append(self, message: dict) -> None:
        if self.reasoning is not None and message["role"] == "assistant":
            message["reasoning_content"] = self.reasoning
        self.reasoning = None  # reasoning belongs to the turn right after it, or to none
        self.messages.append(message)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid_param(
            f"{where}.{key}",
            f"{where}.{key} is required for a {item.get('type')} item: a "
            f"non-empty string, got {json.dumps(value)[:40]}",
        )
    return value


def _content(content: object, where: str, images: bool) -> str | list[dict]:
    """A string, or text parts (input_text / output_text) joined by newlines as the chat API joins them; where a
    user or a tool sends them (`images`), input_image parts too: then the parts in order, as
    {"type": "text", "text": ...} and {"type": "image", "image": <its URL>} (server/images.py reads the URL)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise invalid_param(where, f"{where} must be a string or a non-empty list of input_text parts")
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise invalid_param(
                    f"{where}[{j}].image_url",
                    f"{where}[{j}].image_url must be a data URL or an http(s) URL (file_id is not supported)",
                )
            parts.append({"type": "image", "image": url})
            continue
        if kind not in TEXT_PARTS:
            taken = "text and input_image parts" if images else 'text ({"type": "input_text", "text": ...})'
            raise invalid_param(
                f"{where}[{j}]",
                f"{where}[{j}]: content part type {kind!r} is not supported here; this server takes {taken}",
                "unsupported_value",
            )
        if not isinstance(part.get("text"), str):
            raise invalid_param(f"{where}[{j}].text", f"{where}[{j}].text must be a string")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _arguments(value: object, where: str) -> dict:
    """A function_call's arguments: a JSON string of an object (templates want the object)."""
    if not isinstance(value, str):
        raise invalid_param(where, f"{where} must be a JSON string of an object, got {json.dumps(value)[:40]}")
    try:
        parsed = json.loads(value) if value.strip() else {}
    except json.JSONDecodeError as exc:
        raise invalid_param(
            where, f"{where} is not valid JSON ({exc.msg} at column {exc.colno}): {value[:60]!r}"
        ) from None
    if not isinstance(parsed, dict):
        raise invalid_param(where, f"{where} must encode a JSON object, got {type(parsed).__name__}")
    return parsed
