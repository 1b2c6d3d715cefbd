"""A chat request's prompt: its messages (and tools) through the model's chat template.

A template that knows tools (mlx-lm found a tool parser for it) gets `tools=` and the history as it is. One that
does not (the default SmolLM2's ignores `tools=`) gets the generic fallback, as llama.cpp's generic handler
does: the tools described in the system message, past calls written as the model is asked to write them, tool
results as user turns. Either way the prompt is a function of the messages, tools and template kwargs only -
nothing that changes per request, and tool-call arguments as canonical JSON - so each turn of an agent loop
renders as an extension of the last and hits the prefix cache.
"""

from __future__ import annotations

from mlxpaged_app.server.chat.spec import ChatRequestSpec, ToolSpec, canonical_json
from mlxpaged_app.server.chat.tool_formats import GENERIC_FORMAT
from mlxpaged_app.server.errors import invalid_param

FALLBACK_INSTRUCTIONS = (
    "To call functions, reply only with "
    '<tool_call>[{"name": <function name>, "arguments": {<arguments>}}]</tool_call>.\n'
    "Otherwise answer in plain text."
)


def tools_system_text(tools: tuple[ToolSpec, ...]) -> str:
    lines = "\n".join(canonical_json(t.as_template_tool()) for t in tools)
    return f"You may call functions. Their JSON schemas:\n<tools>\n{lines}\n</tools>\n{FALLBACK_INSTRUCTIONS}"


def _call_block(calls: list[dict]) -> str:
    listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    return GENERIC_FORMAT.start + canonical_json(listed) + GENERIC_FORMAT.end


def _tool_response(message: dict) -> str:
    return (
        f"<tool_response>\n{canonical_json({'name': message.get('name'), 'content': message['content']})}\n"
        "</tool_response>"
    )


def fallback_messages(messages: list[dict], tools: tuple[ToolSpec, ...]) -> list[dict]:
    """The conversation for a template without tool support: plain {role, content} turns only."""
    out: list[dict] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            out.append({"role": "assistant", "content": content + _call_block(message["tool_calls"])})
        elif role == "tool":
            if out and out[-1].get("from_tools"):  # results of parallel calls: one user turn
                out[-1]["content"] += "\n" + _tool_response(message)
            else:
                out.append({"role": "user", "content": _tool_response(message), "from_tools": True})
        else:
            out.append({"role": role, "content": content})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if tools:
        block = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_inputs(tokenizer, spec: ChatRequestSpec) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) for apply_chat_template."""
    if getattr(tokenizer, "has_tool_calling", False):
        return spec.messages, [t.as_template_tool() for t in spec.tools] or None
    return fallback_messages(spec.messages, spec.tools), None


def render_prompt(tokenizer, spec: ChatRequestSpec) -> list[int]:
    """Prompt token ids, ready for the reply: `prompt_prefix`, then the messages through the chat template (or
    the raw prompt, encoded as /v1/completions encodes text). A template that refuses the conversation is the
    client's 400."""
    if spec.raw_prompt is not None:
        return [*spec.prompt_prefix, *tokenizer.encode(spec.raw_prompt, add_special_tokens=False)]
    messages, tools = template_inputs(tokenizer, spec)
    try:
        rendered = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, **spec.reasoning.kwargs()
        )
    except Exception as exc:  # jinja's TemplateError, or a template's raise_exception(...)
        raise invalid_param(
            spec.names.prompt, f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}"
        ) from None
    return [*spec.prompt_prefix, *rendered]


def reasoning_open(tokenizer, prompt: list[int]) -> bool:
    """Whether the prompt leaves a think block open (templates that start the reply thinking)."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    return tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt)
