"""An Ollama chat or generate request as the chat pipeline's ChatRequestSpec; every 400 names the field at fault.

Chat messages become the dicts chat templates take: roles lower-cased (as Ollama does), an assistant turn's
`thinking` as `reasoning_content`, its `tool_calls` (arguments objects) with ids (a call sent without one gets
`call_<n>`), a tool turn's result tied to its call by `tool_call_id`, or else by `tool_name` to the latest call of
that name. Tools are OpenAI's function tools (Ollama's own shape); a model may call any of them (Ollama has no
tool_choice). /api/generate is a chat of one user turn (after `system`, if sent), as Ollama renders it, unless
`raw`: then the prompt goes to the model as it is. Its `context` (a previous reply's token ids) comes before the
new prompt. A message's `images` (base64, as Ollama takes them) come before its text, as Ollama puts them (a tool
message's follow the tool turns: chat/tool_images.py); a vision-language model reads them (a text model refuses
them when the prompt is rendered). `suffix` (fill-in-the-middle) and `template` (a Go template replacing the
model's) are refused: this server renders prompts with the model's own chat template.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace

from mlxpaged_app.server.chat.spec import ChatRequestSpec, OutputFormat, ToolSpec
from mlxpaged_app.server.chat.tool_images import images_after_tool_turns
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.ollama import options as opts
from mlxpaged_app.server.ollama.protocol import ChatRequest, GenerateRequest, Message, ToolCall
from mlxpaged_app.server.param_names import OLLAMA_CHAT, OLLAMA_GENERATE, ParamNames
from mlxpaged_app.server.served_model import ServedModel
from mlxpaged_app.server.tool_choice import resolve_tool_choice
from mlxpaged_app.server.tool_list import function_tools

ROLES = ("system", "user", "assistant", "tool")
TOOL_SHAPE = '{"type": "function", "function": {"name", "description", "parameters"}}'


def chat_spec(body: ChatRequest, model: ServedModel) -> ChatRequestSpec:
    tools = function_tools(body.tools, "function", TOOL_SHAPE)
    output = opts.output_format(body.format)
    if output is not None and tools:
        raise invalid_param(
            "format",
            "format with tools is not supported: the format's grammar covers the whole reply, which leaves no room "
            "for tool calls; send format or tools",
        )
    return _spec(body, model, chat_messages(body.messages or []), tools, output, OLLAMA_CHAT)


def generate_spec(body: GenerateRequest, model: ServedModel) -> ChatRequestSpec:
    _check_generate_supported(body)
    system = [{"role": "system", "content": body.system}] if body.system else []
    messages = [*system, {"role": "user", "content": _with_images(body.prompt or "", body.images, "images")}]
    spec = _spec(body, model, messages, (), opts.output_format(body.format), OLLAMA_GENERATE)
    return replace(spec, raw_prompt=body.prompt if body.raw else None, prompt_prefix=tuple(body.context or ()))


def _spec(
    body: ChatRequest | GenerateRequest,
    model: ServedModel,
    messages: list[dict],
    tools: tuple[ToolSpec, ...],
    output: OutputFormat,
    names: ParamNames,
) -> ChatRequestSpec:
    """What chat and generate share: sampling, reply room, thinking, format and logprobs."""
    max_tokens, to_end = opts.reply_length(body.options)
    logprobs, top_logprobs = opts.logprobs(body.logprobs, body.top_logprobs)
    thinks = bool(getattr(model.engine.tokenizer, "has_thinking", False))
    return ChatRequestSpec(
        messages,
        tools,
        resolve_tool_choice(None, tools, "openai"),  # auto with tools, none without
        output=output,
        sampling=opts.sampling_request(body.options),
        max_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        reasoning=opts.reasoning(body.think, body.model, thinks),
        stream=body.stream is not False,  # Ollama streams unless told not to
        api="ollama",
        names=names,
        context_limit=opts.context_limit(body.options, model.context_limit),
        reply_to_context_end=to_end,
    )


def _check_generate_supported(body: GenerateRequest) -> None:
    if body.images and body.raw:
        raise invalid_param("images", "images with raw: true are not supported: the chat template places them")
    if body.suffix:
        raise invalid_param(
            "suffix", "suffix (fill-in-the-middle) is not supported by this server; send the prompt alone"
        )
    if body.template:
        raise invalid_param(
            "template",
            "template is not supported: prompts are rendered with the model's own chat template; to format the "
            "prompt yourself send it with raw: true",
        )
    if body.raw and (body.system or body.context):
        raise invalid_param("raw", "raw mode does not support template, system, or context")  # Ollama's words


def chat_messages(messages: list[Message]) -> list[dict]:
    out: list[dict] = []
    call_ids: dict[str, str] = {}  # tool call id -> function name, from the assistant turns so far
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.role.lower()
        if role not in ROLES:
            raise invalid_param(
                f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got {message.role!r}"
            )
        if message.images and role not in ("user", "tool"):
            raise invalid_param(
                f"{where}.images", f"{where}.images: only user and tool messages carry images, not {role!r}"
            )
        if role == "tool":
            out.append(_tool_result(message, where, call_ids))
            continue
        turn: dict = {"role": role, "content": _with_images(message.content, message.images, f"{where}.images")}
        if message.tool_calls:
            if role != "assistant":
                raise invalid_param(
                    f"{where}.tool_calls", f"{where}.tool_calls: only assistant messages carry tool calls, not {role!r}"
                )
            turn["tool_calls"] = [_call(call, call_ids) for call in message.tool_calls]
        if message.thinking and role == "assistant":
            turn["reasoning_content"] = message.thinking
        out.append(turn)
    return images_after_tool_turns(out)


def _with_images(text: str, images: list | None, where: str) -> str | list[dict]:
    """`text`, or with images the parts: each image (its base64 decoded), then the text."""
    if not images:
        return text
    parts: list[dict] = []
    for k, data in enumerate(images):
        if not isinstance(data, str):
            raise invalid_param(f"{where}[{k}]", f"{where}[{k}] must be a base64 string")
        try:
            parts.append({"type": "image", "image": base64.b64decode(data, validate=True)})
        except (binascii.Error, ValueError) as exc:
            raise invalid_param(f"{where}[{k}]", f"{where}[{k}] is not valid base64 ({exc})") from None
    return [*parts, {"type": "text", "text": text}] if text else parts


def _call(call: ToolCall, call_ids: dict[str, str]) -> dict:
    call_id = call.id or f"call_{len(call_ids)}"
    call_ids[call_id] = call.function.name
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": call.function.arguments},
    }


def _tool_result(message: Message, where: str, call_ids: dict[str, str]) -> dict:
    """Tied to its call: by tool_call_id, else by tool_name to that tool's latest call."""
    call_id = message.tool_call_id
    if call_id is None and message.tool_name is not None:
        call_id = next((i for i, name in reversed(call_ids.items()) if name == message.tool_name), None)
    name = call_ids.get(call_id, message.tool_name) if call_id is not None else message.tool_name
    result: dict = {"role": "tool", "content": _with_images(message.content, message.images, f"{where}.images")}
    if call_id is not None:
        result["tool_call_id"] = call_id
    if name is not None:
        result["name"] = name
    return result
