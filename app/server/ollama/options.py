"""Ollama's request settings as this server's: `options` (sampling, reply length, context), `think`, `format` and
`logprobs` (`keep_alive` is every API's: keep_alive.py, serving.request_keep_alive); every 400 names the Ollama
field at fault and says what was expected.

How the reply's room is set:
  num_predict N > 0   the reply takes at most N tokens (clamped to what the context leaves, ending with "length")
  num_predict <= 0    until the context ends (Ollama: -1 "infinite", -2 "fill the context"; 0 reads as no limit)
  num_predict unset   the server's default reply length (`mlxpaged serve --default-max-tokens`), as on every API
  num_ctx N           prompt + reply within N tokens. The engine's context is sized once, when the server starts
                      (`--max-model-len`, the KV cache), and a paged cache holds no per-request window to resize:
                      a smaller num_ctx narrows this request (a longer prompt is refused, naming num_ctx), a larger
                      one runs within the server's context (logged) - refusing it would stop clients that send
                      their own idea of the model's context (Continue, Open WebUI) on every request.
Sampling options left unset take the model's own defaults (its generation_config.json), as on every API here, not
Ollama's built-in ones (temperature 0.8, top_k 40, top_p 0.9).
"""

from __future__ import annotations

import json

from mlxpaged_app.server.chat.spec import (
    JsonObjectOutput,
    JsonSchemaOutput,
    OutputFormat,
    ReasoningSpec,
    SamplingRequest,
)
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.ollama.protocol import THINK_LEVELS, Options
from mlxpaged_app.server.param_names import OLLAMA_CHAT
from mlxpaged_app.server.server_log import log

MAX_TOP_LOGPROBS = 20  # Ollama's bound
_FORMAT_EXPECTED = 'expected "json" or a valid JSON Schema object'
MAPPED = ("num_ctx", "num_predict", *(name.removeprefix("options.") for name in OLLAMA_CHAT.renamed.values()))
_NO_EFFECT = [name for name in Options.model_fields if name not in MAPPED]


def sampling_request(options: Options | None) -> SamplingRequest:
    """The sampling fields the client sent, under this server's names (unsent: the model's defaults apply)."""
    if options is None:
        return SamplingRequest()
    o = options
    fields = {
        "temperature": o.temperature,
        "top_p": o.top_p,
        "top_k": None if o.top_k is None else max(o.top_k, 0),  # Ollama: top_k <= 0 is off, as 0 is here
        "min_p": o.min_p,
        "repetition_penalty": o.repeat_penalty,
        "presence_penalty": o.presence_penalty,
        "frequency_penalty": o.frequency_penalty,
        "seed": None if o.seed == -1 else o.seed,  # Ollama's -1: a random seed
        "stop": o.stop,
    }
    _log_unused(o)
    return SamplingRequest(**{name: value for name, value in fields.items() if value is not None})


def _log_unused(options: Options) -> None:
    unknown = sorted(options.model_extra or {})
    if unknown:  # Ollama warns "invalid option provided" and goes on
        log.info("ollama: ignored unknown options: %s", ", ".join(unknown))
    unused = [name for name in _NO_EFFECT if getattr(options, name) is not None]
    if unused:
        log.debug("ollama: options without effect on this server: %s", ", ".join(unused))


def reply_length(options: Options | None) -> tuple[int | None, bool]:
    """(max_tokens, until the context ends) from num_predict."""
    predict = None if options is None else options.num_predict
    if predict is None:
        return None, False
    return (predict, False) if predict > 0 else (None, True)


def context_limit(options: Options | None, server_context: int) -> int | None:
    """The request's bound on prompt + reply from num_ctx (None: the server's context)."""
    num_ctx = None if options is None else options.num_ctx
    if num_ctx is None:
        return None
    if num_ctx < 1:
        raise invalid_param("options.num_ctx", f"options.num_ctx must be at least 1, got {num_ctx}")
    if num_ctx > server_context:
        log.info(
            "ollama: options.num_ctx %d is past this server's context of %d tokens: the request runs within %d "
            "(`mlxpaged serve --max-model-len` sets it)",
            num_ctx,
            server_context,
            server_context,
        )
        return None
    return num_ctx


def reasoning(think: object, model: str, thinks: bool) -> ReasoningSpec:
    """`think` for the chat template: true / a level asks a model that thinks to (400 for one that cannot, as
    Ollama answers), false asks it not to, unset leaves it to the template. Level "max" is "high" for templates,
    which know low, medium and high (Ollama maps it so for gpt-oss too)."""
    if think is None:
        return ReasoningSpec()
    if not isinstance(think, bool) and think not in THINK_LEVELS:
        levels = ", ".join(f'"{level}"' for level in THINK_LEVELS)
        raise invalid_param("think", f"invalid think value: {json.dumps(think)} (must be {levels}, true, or false)")
    if think is not False and not thinks:
        raise invalid_param("think", f'"{model}" does not support thinking')
    if isinstance(think, bool):
        return ReasoningSpec(enable_thinking=think)
    return ReasoningSpec(enable_thinking=True, effort="high" if think == "max" else think)


def output_format(value: object) -> OutputFormat:
    """`format`: "json" (any JSON object), a JSON schema (enforced leniently: keywords the grammar engine does not
    implement are not enforced, as llama.cpp's schema converter does), or nothing ("" or unset)."""
    if value is None or value == "":
        return None
    if value == "json":
        return JsonObjectOutput()
    if isinstance(value, dict):
        return JsonSchemaOutput(value, strict=False)
    shown = value if isinstance(value, str) else type(value).__name__
    raise invalid_param("format", f"invalid format: {shown!r}; {_FORMAT_EXPECTED}")


def logprobs(wanted: bool | None, top: int | None) -> tuple[bool, int]:
    """(logprobs, top_logprobs): top_logprobs counts only with logprobs, as in Ollama."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise invalid_param("top_logprobs", f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    return (True, top or 0) if wanted else (False, 0)
