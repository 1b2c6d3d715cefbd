"""A Messages request as the chat pipeline's ChatRequestSpec; every 400 names the field at fault.

The conversation becomes the dicts chat templates take: the system prompt first (Claude Code's per-request
`x-anthropic-billing-header:` block dropped: it changes every request and would sit before the whole
conversation, so no prefix would ever be cached), assistant `tool_use` blocks as `tool_calls`, user
`tool_result` blocks as `tool` messages ahead of the user's own text (the images a tool returned after them:
chat/tool_images.py), thinking blocks dropped (templates drop past
reasoning anyway), consecutive turns of one role merged as Anthropic's API does.
"""

from __future__ import annotations

import re

from mlxpaged_app.server.anthropic.protocol import (
    Base64ImageSource,
    CountTokensRequest,
    ImageBlock,
    Message,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from mlxpaged_app.server.chat.spec import (
    ChatRequestSpec,
    JsonSchemaOutput,
    ReasoningSpec,
    SamplingRequest,
    ToolSpec,
)
from mlxpaged_app.server.chat.spec import (
    ToolChoice as SpecToolChoice,
)
from mlxpaged_app.server.chat.tool_images import images_after_tool_turns
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.output_format import check_format_alone
from mlxpaged_app.server.param_names import ANTHROPIC
from mlxpaged_app.server.tool_choice import resolve_tool_choice
from mlxpaged_app.server.tool_list import tool_list

BILLING_HEADER = "x-anthropic-billing-header:"
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # Anthropic's own rule
ERROR_PREFIX = "Error: "  # a tool_result with is_error: the model sees that the call failed


def messages_spec(body: CountTokensRequest) -> ChatRequestSpec:
    """The pipeline's request (count_tokens passes its body too: the prompt is built the same way)."""
    tools = tool_specs(body.tools)
    choice, parallel = tool_choice(body.tool_choice, tools)
    output = None
    if body.output_config is not None and body.output_config.format is not None:
        output = JsonSchemaOutput(body.output_config.format.schema_, strict=True)
    check_format_alone(output, choice, "output_config.format", '{"type": "none"}')
    full = isinstance(body, MessagesRequest)
    sampling = (
        SamplingRequest(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)
        if full
        else SamplingRequest()
    )
    return ChatRequestSpec(
        conversation(body),
        tools,
        choice,
        parallel,
        output,
        sampling,
        body.max_tokens,
        reasoning=reasoning(body),
        stream=bool(full and body.stream),
        api="anthropic",
        names=ANTHROPIC,
    )


def reasoning(body: CountTokensRequest) -> ReasoningSpec:
    thinking = None if body.thinking is None else body.thinking.type != "disabled"
    effort = body.output_config.effort if body.output_config is not None else None
    return ReasoningSpec(enable_thinking=thinking, effort=effort)


def system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))


def conversation(body: CountTokensRequest) -> list[dict]:
    if not body.messages:
        raise invalid_param("messages", "'messages' must hold at least one message")
    if body.messages[-1].role == "assistant":
        raise invalid_param(
            "messages",
            "the last message is from the assistant: this server does not continue "
            "a prefilled assistant turn; end with a user message",
        )
    out: list[dict] = []
    system = system_text(body.system)
    if system:
        out.append({"role": "system", "content": system})
    call_names: dict[str, str] = {}  # tool_use id -> tool name, from the assistant turns so far
    for i, message in enumerate(body.messages):
        for turn in _turns(message, f"messages[{i}]", call_names):
            _append(out, turn)
    return images_after_tool_turns(out)


def _turns(message: Message, where: str, call_names: dict[str, str]) -> list[dict]:
    blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
    texts: list[str | dict] = []  # text, and image parts where the user put them
    calls, results = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ImageBlock):
            texts.append(_image(block, message.role, at))
        elif isinstance(block, ToolUseBlock):
            calls.append(_tool_use(block, message.role, at, call_names))
        elif isinstance(block, ToolResultBlock):
            results.append(_tool_result(block, message.role, at, call_names))
        elif isinstance(block, OtherBlock):
            raise invalid_param(
                f"{at}.type",
                f"{at}: content blocks of type {block.type!r} are not supported; "
                "this server takes text, image, tool_use and tool_result blocks",
            )
        # thinking / redacted_thinking blocks: dropped
    turns = results  # tool results answer the previous assistant turn: they come before the user's text
    if texts or calls or not results:
        turn: dict = {"role": message.role, "content": _content(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns.append(turn)
    return turns


def _image(block: ImageBlock, role: str, at: str) -> dict:
    """An image block as the pipeline's image part (base64 as a data URL; a URL as it is: server/images.py)."""
    if role != "user":
        raise invalid_param(f"{at}.type", f"{at}: image blocks belong to user messages, not {role!r}")
    source = block.source
    if isinstance(source, Base64ImageSource):
        return {"type": "image", "image": f"data:{source.media_type};base64,{source.data}"}
    return {"type": "image", "image": source.url}


def _content(texts: list[str | dict]) -> str | list[dict]:
    """A turn's text, joined; with images, the parts in order (text parts and image parts)."""
    if all(isinstance(t, str) for t in texts):
        return "\n".join(t for t in texts if isinstance(t, str))
    return [{"type": "text", "text": t} if isinstance(t, str) else t for t in texts]


def _tool_use(block: ToolUseBlock, role: str, at: str, call_names: dict[str, str]) -> dict:
    if role != "assistant":
        raise invalid_param(f"{at}.type", f"{at}: tool_use blocks belong to assistant messages, not {role!r}")
    call_names[block.id] = block.name
    return {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}


def _tool_result(block: ToolResultBlock, role: str, at: str, call_names: dict[str, str]) -> dict:
    """The `tool` message of a tool_result block: its text, with its images (a screenshot or an image file an
    agent's tool read) as image parts in order, which chat/tool_images.py moves after the tool turns."""
    if role != "user":
        raise invalid_param(f"{at}.type", f"{at}: tool_result blocks belong to user messages, not {role!r}")
    name = call_names.get(block.tool_use_id)
    if name is None:
        known = ", ".join(call_names) or "none"
        raise invalid_param(
            f"{at}.tool_use_id",
            f"{at}.tool_use_id {block.tool_use_id!r} answers no earlier tool_use block (tool_use ids so far: {known})",
        )
    content = block.content if block.content is not None else ""
    parts: list[dict] = []
    if not isinstance(content, str):
        for k, part in enumerate(content):
            if isinstance(part, OtherBlock):
                raise invalid_param(
                    f"{at}.content[{k}].type",
                    f"{at}.content[{k}]: tool_result content of type {part.type!r} is not supported; "
                    "send text and images",
                )
            if isinstance(part, ImageBlock):
                parts.append(_image(part, role, f"{at}.content[{k}]"))
            elif isinstance(part, TextBlock):
                parts.append({"type": "text", "text": part.text})
        content = "\n".join(p["text"] for p in parts if p["type"] == "text")
    if block.is_error:
        content = ERROR_PREFIX + content
    images = [p for p in parts if p["type"] == "image"]
    message = {"role": "tool", "tool_call_id": block.tool_use_id, "name": name, "content": content}
    return message if not images else {**message, "content": [{"type": "text", "text": content}, *images]}


def _append(out: list[dict], turn: dict) -> None:
    """Consecutive user (or assistant) turns are one turn, as Anthropic's API treats them."""
    last = out[-1] if out else None
    if last is None or turn["role"] == "tool" or last["role"] != turn["role"] or last["role"] == "system":
        out.append(turn)
        return
    if isinstance(last["content"], list) or isinstance(turn["content"], list):  # parts with images: kept in order
        last["content"] = [*_as_parts(last["content"]), *_as_parts(turn["content"])]
    else:
        last["content"] = "\n".join(t for t in (last["content"], turn["content"]) if t)
    if turn.get("tool_calls"):
        last["tool_calls"] = last.get("tool_calls", []) + turn["tool_calls"]


def _as_parts(content: str | list[dict]) -> list[dict]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []


def tool_specs(tools: list | None) -> tuple[ToolSpec, ...]:
    return tool_list(tools, _tool, shape='{"name", "input_schema", "description"}', name_field="name")


def _tool(tool, where: str) -> ToolSpec:
    if tool.type not in (None, "custom"):
        raise invalid_param(
            f"{where}.type",
            f"{where}: tool type {tool.type!r} is one of Anthropic's server "
            "tools, which this server does not run; send custom tools "
            '({"name", "input_schema", "description"})',
        )
    if not TOOL_NAME.match(tool.name):
        raise invalid_param(
            f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {tool.name!r}"
        )
    if tool.input_schema is None:
        raise invalid_param(
            f"{where}.input_schema",
            f"'{where}.input_schema' is required (a JSON schema of type 'object' for the tool's input)",
        )
    if tool.input_schema.get("type") != "object":
        raise invalid_param(
            f"{where}.input_schema.type",
            f"{where}.input_schema must have type 'object', got {tool.input_schema.get('type')!r}",
        )
    return ToolSpec(tool.name, tool.input_schema, tool.description)


def tool_choice(choice: ToolChoice | None, tools: tuple[ToolSpec, ...]) -> tuple[SpecToolChoice, bool]:
    """(the pipeline's choice, whether parallel calls are allowed)."""
    parallel = choice is None or not choice.disable_parallel_tool_use
    return resolve_tool_choice(choice, tools, "anthropic"), parallel
