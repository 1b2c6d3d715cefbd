"""From a typed request to the engine's prompt sources: chat messages as {role, content} dicts for
the chat template, and completion prompts as text or token-id lists; a 400 names what is unusable."""

from __future__ import annotations

from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.protocol import ChatRequest, CompletionRequest

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
_CHAT_ROLES = {"developer": "system"}  # OpenAI's newer name for the system role; templates know "system"


def _text_parts(content: list, where: str) -> str:
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            shown = f"type '{kind}'" if isinstance(kind, str) else repr(part)[:40]
            raise invalid_param(f"{where}[{j}]", f"{where}[{j}]: content part {shown} is not supported; "
                                                   "this server takes text parts ({\"type\": \"text\", \"text\": ...})")
        if not isinstance(part.get("text"), str):
            raise invalid_param(f"{where}[{j}].text", f"{where}[{j}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _message_text(message, where: str) -> str:
    content = message.content
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        return _text_parts(content, where)
    if content is None and message.role == "assistant":
        return ""  # an assistant turn that only called tools
    raise invalid_param(where, f"{where} must be a string or a non-empty list of text parts"
                               f"{' (it is required for this role)' if content is None else ''}")


def chat_messages(request: ChatRequest) -> list[dict]:
    """Plain {role, content} dicts for the model's chat template."""
    if not request.messages:
        raise invalid_param("messages", "'messages' must hold at least one message")
    return [{"role": _CHAT_ROLES.get(m.role, m.role), "content": _message_text(m, f"messages[{i}].content")}
            for i, m in enumerate(request.messages)]


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def completion_prompts(request: CompletionRequest) -> list[str | list[int]]:
    """A prompt is a string or a token-id list; `prompt` holds one of them or a list of them."""
    prompt = request.prompt
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise invalid_param("prompt", "'prompt' must be a string, a list of strings, a non-empty list of "
                                      "token ids, or a list of token-id lists")
    if len(prompts) > MAX_PROMPTS:
        raise invalid_param("prompt", f"'prompt' holds {len(prompts)} prompts; at most {MAX_PROMPTS} per request")
    for i, p in enumerate(prompts):
        if isinstance(p, str) and not p:
            raise invalid_param("prompt", f"prompt {i} is an empty string")
    return prompts
