"""`POST /v1/completions`: raw prompts (text or token ids, one or a batch), replies as
`text_completion` bodies or events. Choice i * n + j is sample j of prompt i, as in OpenAI."""

from __future__ import annotations

from mlxpaged.engine.engine import StreamDelta
from mlxpaged.sampling_params import SamplingParams
from mlxpaged.loading.generation_defaults import GenerationDefaults
from mlxpaged_app.server.formatting import TokenText, delta_logprobs
from mlxpaged_app.server.openai.shapes import ChoiceText, Envelope, completion_logprobs
from mlxpaged_app.server.params import check_completion_supported, sampling_params
from mlxpaged_app.server.openai.prompts import completion_prompts
from mlxpaged_app.server.openai.protocol import CompletionRequest


class CompletionEndpoint:
    schema = CompletionRequest
    chunk_object = "text_completion"
    prompt_param = "prompt"
    id_prefix = "cmpl-"

    def __init__(self, engine, token_text: TokenText) -> None:
        self.engine, self.token_text = engine, token_text
        self.logprobs = False
        self.n = 1
        self.echo: list[str] | None = None  # per prompt, the text to put before the reply
        self._offsets: dict[int, int] = {}  # per streamed choice, characters sent so far

    def validate(self, body: CompletionRequest) -> list[str | list[int]]:
        check_completion_supported(body)
        self.logprobs = body.logprobs is not None
        self.n = body.n or 1
        self.echo = [] if body.echo else None
        return completion_prompts(body)

    def tokenize(self, sources: list[str | list[int]]) -> list[list[int]]:
        """Runs in a worker thread. Text is encoded as the engine does (no special tokens added);
        token ids pass through (the engine checks their range)."""
        prompts = [self.engine.tokenizer.encode(s, add_special_tokens=False) if isinstance(s, str) else s
                   for s in sources]
        if self.echo is not None:
            self.echo = [s if isinstance(s, str) else self.engine.tokenizer.decode(s) for s in sources]
        return [list(p) for p in prompts]

    @staticmethod
    def requested_max_tokens(body: CompletionRequest) -> int | None:
        return body.max_tokens

    def params(self, body: CompletionRequest, max_tokens: int, defaults: GenerationDefaults) -> SamplingParams:
        params = sampling_params(body, max_tokens=max_tokens, logprobs=self.logprobs,
                                 top_logprobs=body.logprobs or 0, logprobs_name="logprobs", defaults=defaults)
        params.trim_leading_space = False  # a completion continues the prompt's text exactly
        return params

    def _echo(self, choice: int) -> str:
        return self.echo[choice // self.n] if self.echo else ""

    def response(self, envelope: Envelope, choices: list[ChoiceText], usage: dict) -> dict:
        body = []
        for i, choice in enumerate(choices):
            prefix = self._echo(i)
            logprobs = completion_logprobs(self.token_text, choice.logprobs, len(prefix)) if self.logprobs else None
            body.append({"index": i, "text": prefix + choice.text, "logprobs": logprobs,
                         "finish_reason": choice.finish_reason})
        return envelope.body("text_completion", body, usage=usage)

    def stream_start(self, envelope: Envelope, count: int) -> list[dict]:
        if not self.echo:
            return []
        return [self._chunk(envelope, i, self._echo(i), None, None) for i in range(count)]

    def stream_chunk(self, envelope: Envelope, choice: int, delta: StreamDelta) -> dict | None:
        entries = delta_logprobs(delta) if self.logprobs else []
        if not delta.text and delta.finish_reason is None and not entries:
            return None
        offset = self._offsets.get(choice, len(self._echo(choice)))
        logprobs = completion_logprobs(self.token_text, entries, offset) if self.logprobs else None
        self._offsets[choice] = offset + len(delta.text)
        return self._chunk(envelope, choice, delta.text, logprobs, delta.finish_reason)

    @staticmethod
    def _chunk(envelope: Envelope, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return envelope.body("text_completion", [{"index": index, "text": text, "logprobs": logprobs,
                                                  "finish_reason": finish}])
