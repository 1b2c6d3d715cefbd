"""From a typed request to the engine's prompt sources: chat messages as the dicts chat templates take
(chat/spec.py), and completion prompts as text or token-id lists; a 400 names what is unusable."""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.tool_images import images_after_tool_turns
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.openai.protocol import ChatRequest, CompletionRequest

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
_CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role; templates know "system"


def _content_parts(content: list, where: str, images: bool) -> str | list[dict]:
    """Text parts joined; with image parts (`images`: where the role may send them) the parts in order, as
    {"type": "text", "text": ...} and {"type": "image", "image": <its URL>} (server/images.py reads the URL)."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and images:
            parts.append({"type": "image", "image": _image_url(part.get("image_url"), f"{where}[{j}].image_url")})
            continue
        if kind != "text":
            shown = f"type '{kind}'" if isinstance(kind, str) else repr(part)[:40]
            taken = "text and image_url parts" if images else "text parts"
            raise invalid_param(
                f"{where}[{j}]",
                f"{where}[{j}]: content part {shown} is not supported here; this server takes {taken}",
            )
        if not isinstance(part.get("text"), str):
            raise invalid_param(f"{where}[{j}].text", f"{where}[{j}].text must be a string")
        parts.append({"type": "text", "text": part["text"]})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _image_url(value: object, where: str) -> str:
    """An image_url part's URL: {"url": ...} (OpenAI's), or the URL alone (some clients send it so)."""
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise invalid_param(where, f'{where} must be {{"url": "<a data URL or an http(s) URL>"}}')
    return url


def _message_text(message, where: str) -> str | list[dict]:
    content = message.content
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        return _content_parts(content, where, images=message.role in ("user", "tool"))
    if content is None and message.role == "assistant":
        return ""  # an assistant turn that only called tools
    raise invalid_param(
        where,
        f"{where} must be a string or a non-empty list of content parts"
        f"{' (it is required for this role)' if content is None else ''}",
    )


def chat_messages(request: ChatRequest) -> list[dict]:
    """The conversation for the chat template: {role, content} dicts, assistant `tool_calls` with their
    arguments as dicts, tool results with the name of the call they answer (their images after them:
    chat/tool_images.py)."""
    if not request.messages:
        raise invalid_param("messages", "'messages' must hold at least one message")
    out: list[dict] = []
    call_names: dict[str, str] = {}  # tool_call id -> function name, from the assistant turns so far
    for i, m in enumerate(request.messages):
        where = f"messages[{i}]"
        if m.role == "tool":
            out.append(_tool_result(m, where, call_names))
            continue
        message = {"role": _CHAT_ROLES.get(m.role, m.role), "content": _message_text(m, f"{where}.content")}
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise invalid_param(
                    f"{where}.tool_calls",
                    f"{where}.tool_calls: only assistant messages carry tool calls, this one has role {m.role!r}",
                )
            message["tool_calls"] = _tool_calls(m.tool_calls, f"{where}.tool_calls", call_names)
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning and m.role == "assistant":
            message["reasoning_content"] = reasoning
        out.append(message)
    return images_after_tool_turns(out)


def _tool_result(message, where: str, call_names: dict[str, str]) -> dict:
    if message.tool_call_id is None:
        raise invalid_param(
            f"{where}.tool_call_id",
            f"{where}.tool_call_id is required for role 'tool': it names the tool call this message answers",
        )
    name = call_names.get(message.tool_call_id, message.name)
    if name is None:
        known = ", ".join(call_names) or "none"
        raise invalid_param(
            f"{where}.tool_call_id",
            f"{where}.tool_call_id {message.tool_call_id!r} answers no "
            f"earlier assistant tool call (calls so far: {known})",
        )
    return {
        "role": "tool",
        "tool_call_id": message.tool_call_id,
        "name": name,
        "content": _message_text(message, f"{where}.content"),
    }


def _tool_calls(value: object, where: str, call_names: dict[str, str]) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise invalid_param(where, f"{where} must be a non-empty list of tool calls")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise invalid_param(
                f"{where}[{j}].function",
                f"{where}[{j}] must be "
                '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON>"}}',
            )
        call_id = call.get("id") if isinstance(call.get("id"), str) else f"call_{len(call_names)}"
        call_names[call_id] = function["name"]
        calls.append(
            {
                "id": call_id,
                "type": "function",
                "function": {
                    "name": function["name"],
                    "arguments": _arguments(function.get("arguments"), f"{where}[{j}].function"),
                },
            }
        )
    return calls


def _arguments(value: object, where: str) -> dict:
    """OpenAI sends arguments as a JSON string; templates want the object."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise invalid_param(
                f"{where}.arguments",
                f"{where}.arguments is not valid JSON ({exc.msg} at column {exc.colno}): {value[:60]!r}",
            ) from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid_param(
            f"{where}.arguments", f"{where}.arguments must be a JSON object, got {type(value).__name__}"
        )
    return value


def _is_token_list(value: object) -> bool:
    return (
        isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """A prompt is a string or a token-id list; `prompt` holds one of them or a list of them."""
    prompt = request.prompt
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid_param(
            "prompt",
            "'prompt' must be a string, a list of strings, a non-empty list of token ids, or a list of token-id lists",
        )
    if len(prompts) > MAX_PROMPTS:
        raise invalid_param("prompt", f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise invalid_param("prompt", f"prompt {i} is an empty string")
    return prompts
