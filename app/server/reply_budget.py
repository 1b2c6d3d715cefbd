"""One rule, every API: how many tokens a reply may take. A `max_tokens` past what the context has left is
clamped to what fits (the reply then ends with OpenAI's `length`, Anthropic's `max_tokens`, Responses'
`incomplete`); only a prompt that does not fit by itself is refused. Agents size `max_tokens` for the hosted
models (Claude Code 32,000, opencode 1,024 against an 8k context): refusing those would stop them cold, or
send them into a loop of summarising and retrying.

The refusal names the prompt's tokens, the limit as the client sent it, the context, and what to change.
"""

from __future__ import annotations

from mlxpaged_app.server.errors import APIError, invalid_param
from mlxpaged_app.server.param_names import ParamNames
from mlxpaged_app.server.served_model import ServedModel
from mlxpaged_app.server.server_log import log


def reply_budget(
    model: ServedModel,
    prompt_tokens: int,
    requested: int | None,
    names: ParamNames,
    limit: int | None = None,
    to_context_end: bool = False,
) -> int:
    """The reply's max_tokens: `requested` (None: the server's default, or with `to_context_end` all the room
    left) clamped to the room the context leaves. `limit`: the request's own bound on prompt + reply (Ollama's
    num_ctx), which only ever narrows the server's context. A requested value below 1 passes through for
    SamplingParams to refuse, naming the parameter."""
    context = model.context_limit if limit is None else min(limit, model.context_limit)
    room = context - prompt_tokens
    if room < 1:
        if context < model.context_limit:
            raise request_context_too_small(model, prompt_tokens, context, names)
        raise prompt_too_long(model, prompt_tokens, requested, names)
    if requested is not None and requested < 1:
        return requested
    if requested is None and to_context_end:
        return room
    if requested is not None and requested > room:
        log.info(
            "clamped %s %d to %d: the prompt is %d tokens of a %d-token context",
            names.max_tokens,
            requested,
            room,
            prompt_tokens,
            context,
        )
        return room
    return min(model.default_max_tokens if requested is None else requested, room)


def request_context_too_small(model: ServedModel, prompt_tokens: int, limit: int, names: ParamNames) -> APIError:
    """The prompt fits the server's context but not the smaller one the request asked for."""
    error = invalid_param(
        names.prompt,
        f"the prompt is {prompt_tokens} tokens and does not fit in the {limit}-token context this request asked "
        f"for with {names.context} (prompt and reply together): raise {names.context} (this server runs up to "
        f"{model.context_limit} tokens) or shorten the prompt",
        "context_length_exceeded",
    )
    error.prompt_tokens = prompt_tokens
    return error


def prompt_too_long(model: ServedModel, prompt_tokens: int, requested: int | None, names: ParamNames) -> APIError:
    limit = model.context_limit
    sent = f"{names.max_tokens} {requested}" if requested is not None else f"no {names.max_tokens}"
    if model.cache_limits_context:
        what = f"the KV cache capacity of {limit} tokens"
        fix = (
            "give the cache more room (`mlxpaged serve --cache-tokens N` or `--kv-memory SIZE`), or shorten the prompt"
        )
    else:
        what = f"the model context of {limit} tokens this server runs with"
        fix = (
            f"restart the server with a longer context (`mlxpaged serve --max-model-len {_suggested(prompt_tokens)}`"
            "; past the model's trained length quality may drop), use a model with a longer context, or "
            "shorten the prompt"
        )
    error = invalid_param(
        names.prompt,
        f"the prompt is {prompt_tokens} tokens and does not fit in {what} "
        f"(prompt and reply together; {sent} was sent): {fix}",
        "context_length_exceeded",
    )
    error.prompt_tokens = prompt_tokens
    return error


def _suggested(prompt_tokens: int) -> int:
    """The next power of two with room for a reply: the context a user would try next."""
    size = 1024
    while size < prompt_tokens * 5 // 4:
        size *= 2
    return size
