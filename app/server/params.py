"""From a typed request to what the engine takes: prompts, and SamplingParams (whose ValueError,
naming the field, becomes a 400 naming the API parameter)."""

from __future__ import annotations

import re

from mlxpaged.sampling import SamplingParams
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.protocol import ChatRequest, CompletionRequest

MAX_PROMPTS = 64  # prompts in one /v1/completions batch
_FIELD = re.compile(r"^([a-z_]+)")
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


def check_chat_supported(request: ChatRequest) -> None:
    if request.tools:
        raise invalid_param("tools", "tool calling is not supported by this server; send the request "
                                     "without 'tools'", "unsupported_parameter")
    kind = (request.response_format or {}).get("type", "text")
    if kind != "text":
        raise invalid_param("response_format", f"response_format type {kind!r} is not supported; only 'text'",
                            "unsupported_parameter")
    _check_logit_bias(request.logit_bias)


def check_completion_supported(request: CompletionRequest) -> None:
    if request.suffix:
        raise invalid_param("suffix", "'suffix' (insertion) is not supported by this server", "unsupported_parameter")
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        raise invalid_param("best_of", f"best_of={request.best_of} with n={n}: this server returns every sample, "
                                       "so best_of must equal n or be left out", "unsupported_parameter")
    if request.echo and request.logprobs is not None:
        raise invalid_param("echo", "echo with logprobs (prompt logprobs) is not supported", "unsupported_parameter")
    _check_logit_bias(request.logit_bias)


def _check_logit_bias(bias: dict | None) -> None:
    """OpenAI sends token ids as JSON object keys, i.e. strings of digits."""
    for key in bias or {}:
        if not (isinstance(key, str) and key.isdigit()):
            raise invalid_param("logit_bias", f"logit_bias keys must be token ids (strings of digits), got {key!r}")


def _logit_bias(bias: dict | None) -> dict[int, float]:
    return {int(key): value for key, value in (bias or {}).items()}


def resolve_max_tokens(requested: int | None, prompt_tokens: int, limit: int, default: int) -> int:
    """The request's own value (the engine checks it), or the default clipped to what still fits."""
    if requested is not None:
        return requested
    return max(1, min(default, limit - prompt_tokens))


def _api_names(request, logprobs_name: str) -> dict[str, str]:
    names = {"max_tokens": "max_tokens", "top_logprobs": "top_logprobs", "logprobs": "logprobs"}
    if getattr(request, "max_completion_tokens", None) is not None:
        names["max_tokens"] = "max_completion_tokens"
    if logprobs_name == "logprobs":  # the legacy completions API has only `logprobs` (an int)
        names["top_logprobs"] = "logprobs"
    return names


def sampling_params(request, *, max_tokens: int, logprobs: bool, top_logprobs: int,
                    logprobs_name: str = "top_logprobs") -> SamplingParams:
    """SamplingParams for the request; a range error names the API parameter that caused it."""
    r = request
    fields = dict(max_tokens=max_tokens, logprobs=logprobs, top_logprobs=top_logprobs, n=1 if r.n is None else r.n,
                  temperature=1.0 if r.temperature is None else r.temperature,
                  top_p=1.0 if r.top_p is None else r.top_p,
                  top_k=0 if r.top_k in (None, -1) else r.top_k,  # vLLM spells "off" -1
                  min_p=r.min_p or 0.0, repetition_penalty=1.0 if r.repetition_penalty is None else r.repetition_penalty,
                  presence_penalty=r.presence_penalty or 0.0, frequency_penalty=r.frequency_penalty or 0.0,
                  seed=r.seed, stop=[] if r.stop is None else r.stop, ignore_eos=bool(r.ignore_eos),
                  logit_bias=_logit_bias(r.logit_bias))
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        field = _FIELD.match(str(exc))
        name = field.group(1) if field else None
        api_name = _api_names(r, logprobs_name).get(name, name)
        message = str(exc) if api_name == name else f"{api_name}: {exc}"
        raise invalid_param(api_name, message) from None
