"""`POST /v1/completions`: raw prompts (text or token ids, one or a batch), replies as `text_completion` bodies
or events. Choice i * n + j is sample j of prompt i, as in OpenAI."""

from __future__ import annotations

from mlxpaged.engine.engine import StreamDelta
from mlxpaged.loading.generation_defaults import GenerationDefaults
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.server.engine_client import Generation
from mlxpaged_app.server.formatting import TokenText, delta_logprobs, new_id
from mlxpaged_app.server.openai.prompts import completion_prompts
from mlxpaged_app.server.openai.protocol import CompletionRequest
from mlxpaged_app.server.openai.shapes import ChoiceText, Envelope, OpenAIShape, completion_logprobs
from mlxpaged_app.server.param_names import OPENAI_COMPLETIONS
from mlxpaged_app.server.params import check_completion_supported, sampling_params
from mlxpaged_app.server.reply_budget import reply_budget
from mlxpaged_app.server.serving import accept, launch, model_for, respond, sane_n
from mlxpaged_app.server.state import ServerState

import anyio
from starlette.requests import Request
from starlette.responses import Response

OBJECT = "text_completion"  # the `object` of bodies and chunks alike


async def serve_completion(request: Request, state: ServerState) -> Response:
    body, arrived = await accept(request, state, CompletionRequest)
    check_completion_supported(body)
    model = await model_for(state, body)
    sources = completion_prompts(body)
    count = len(sources) * sane_n(body.n)
    usage = bool(body.stream_options and body.stream_options.include_usage)
    shape = CompletionShape(
        Envelope(new_id("cmpl-"), model.model_id),
        model.token_text,
        body.logprobs is not None,
        body.n or 1,
        usage,
        count,
    )

    async def start() -> Generation:
        prompts, shape.echo = await anyio.to_thread.run_sync(tokenize, model.engine.tokenizer, sources, bool(body.echo))
        max_tokens = reply_budget(model, max(len(p) for p in prompts), body.max_tokens, OPENAI_COMPLETIONS)
        params = _params(body, max_tokens, shape.logprobs, model.config.sampling_defaults)
        generation = Generation(model.engine, model.metrics, params.n, arrived, model.adapter)
        generation.submit(prompts, params, OPENAI_COMPLETIONS.prompt)
        return generation

    generation, cleanup = await launch(model, count, start, request.url.path)
    return await respond(request, shape, bool(body.stream), generation.deltas(), generation.usage, cleanup)


def tokenize(tokenizer, sources: list[str | list[int]], echo: bool) -> tuple[list[list[int]], list[str] | None]:
    """Runs in a worker thread. Text is encoded as the engine does (no special tokens added); token ids pass
    through (the engine checks their range). Returns (prompts, per prompt the text echo puts before the reply)."""
    prompts = [tokenizer.encode(s, add_special_tokens=False) if isinstance(s, str) else s for s in sources]
    echoed = [s if isinstance(s, str) else tokenizer.decode(s) for s in sources] if echo else None
    return [list(p) for p in prompts], echoed


def _params(body: CompletionRequest, max_tokens: int, logprobs: bool, defaults: GenerationDefaults) -> SamplingParams:
    params = sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        top_logprobs=body.logprobs or 0,
        names=OPENAI_COMPLETIONS,
        defaults=defaults,
    )
    params.trim_leading_space = False  # a completion continues the prompt's text exactly
    return params


class CompletionShape(OpenAIShape):
    chunk_object = OBJECT

    def __init__(
        self, envelope: Envelope, token_text: TokenText, logprobs: bool, n: int, include_usage: bool, count: int
    ) -> None:
        super().__init__(envelope, include_usage)
        self.token_text, self.logprobs, self.n = token_text, logprobs, n
        self.echo: list[str] | None = None  # per prompt, the text to put before the reply
        self.choices = [ChoiceText() for _ in range(count)]
        self._offsets: dict[int, int] = {}  # per streamed choice, characters sent so far

    def _echo(self, choice: int) -> str:
        return self.echo[choice // self.n] if self.echo else ""

    def add(self, choice: int, delta: StreamDelta) -> None:
        self.choices[choice].add(delta)

    def body(self, usage: dict) -> dict:
        body = []
        for i, choice in enumerate(self.choices):
            prefix = self._echo(i)
            logprobs = completion_logprobs(self.token_text, choice.logprobs, len(prefix)) if self.logprobs else None
            body.append(
                {"index": i, "text": prefix + choice.text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
            )
        return self.envelope.body(OBJECT, body, usage=usage)

    def opening(self) -> list[dict]:
        if not self.echo:
            return []
        return [self._chunk(i, self._echo(i), None, None) for i in range(len(self.choices))]

    def chunks(self, choice: int, delta: StreamDelta) -> list[dict]:
        entries = delta_logprobs(delta) if self.logprobs else []
        if not delta.text and delta.finish_reason is None and not entries:
            return []  # nothing to send for this delta yet
        offset = self._offsets.get(choice, len(self._echo(choice)))
        logprobs = completion_logprobs(self.token_text, entries, offset) if self.logprobs else None
        self._offsets[choice] = offset + len(delta.text)
        return [self._chunk(choice, delta.text, logprobs, delta.finish_reason)]

    def _chunk(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return self.envelope.body(
            OBJECT, [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]
        )
