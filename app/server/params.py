"""From a typed request to the engine's SamplingParams: the checks on what this server supports, the
model's sampling defaults, and SamplingParams itself (whose ValueError, naming
the field, becomes a 400 naming the API parameter)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from mlxpaged.loading.generation_defaults import NO_DEFAULTS, GenerationDefaults
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.openai.protocol import ChatRequest, CompletionRequest
from mlxpaged_app.server.param_names import OPENAI_CHAT, ParamNames

from pydantic import BaseModel

_FIELD = re.compile(r"^([a-z_]+)")


def check_chat_supported(request: ChatRequest) -> None:
    """Tools, response_format and reasoning are checked where they are translated (openai/chat_options.py)."""
    _check_logit_bias(request.logit_bias)


def check_completion_supported(request: CompletionRequest) -> None:
    if request.suffix:
        raise invalid_param("suffix", "'suffix' (insertion) is not supported by this server", "unsupported_parameter")
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        raise invalid_param(
            "best_of",
            f"best_of={request.best_of} with n={n}: this server returns every sample, "
            "so best_of must equal n or be left out",
            "unsupported_parameter",
        )
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


MODEL_DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # what the model may default


def sampling_kwargs(defaults: GenerationDefaults, request: object, names: Iterable[str] = MODEL_DEFAULTED) -> dict:
    """The defaults merge every API uses: each of `names` the client actually sent, else the model's default;
    neither: left out, so SamplingParams' own default applies. `request` is a pydantic model (what it was sent
    with: model_fields_set) or any object whose None fields were not sent; null counts as not sent.
    max_tokens is left to the caller (reply_budget.py clamps it to the context)."""
    fields_set = request.model_fields_set if isinstance(request, BaseModel) else None
    sent = {
        name: getattr(request, name)
        for name in names
        if (fields_set is None or name in fields_set) and getattr(request, name, None) is not None
    }
    if sent.get("top_k") == -1:
        sent["top_k"] = 0  # vLLM spells "off" -1
    merged = defaults.sampling_kwargs(sent)
    merged.pop("max_tokens", None)
    return merged


def sampling_params(
    request,
    *,
    max_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    names: ParamNames = OPENAI_CHAT,
    defaults: GenerationDefaults = NO_DEFAULTS,
) -> SamplingParams:
    """SamplingParams for the request, unset fields from the model's `defaults`; a range error names the
    API parameter that caused it (`names`: the request's API's)."""
    r = request
    fields = dict(
        max_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=1 if r.n is None else r.n,
        presence_penalty=r.presence_penalty or 0.0,
        frequency_penalty=r.frequency_penalty or 0.0,
        seed=r.seed,
        stop=[] if r.stop is None else r.stop,
        ignore_eos=bool(r.ignore_eos),
        logit_bias=_logit_bias(r.logit_bias),
        **sampling_kwargs(defaults, r),
    )
    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        field = _FIELD.match(str(exc))
        name = field.group(1) if field else None
        api_name = names.of(name)
        message = str(exc) if api_name == name else f"{api_name}: {exc}"
        raise invalid_param(api_name, message) from None
