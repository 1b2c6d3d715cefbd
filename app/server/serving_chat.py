"""`POST /v1/chat/completions`: messages through the model's chat template, replies as
`chat.completion` bodies or `chat.completion.chunk` events."""

from __future__ import annotations

from mlxpaged.engine import StreamDelta
from mlxpaged.generation_defaults import GenerationDefaults
from mlxpaged.sampling import SamplingParams
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.formatting import ChoiceText, Envelope, TokenText, chat_logprobs, delta_logprobs
from mlxpaged_app.server.params import check_chat_supported, sampling_params
from mlxpaged_app.server.prompts import chat_messages
from mlxpaged_app.server.protocol import ChatRequest


class ChatEndpoint:
    schema = ChatRequest
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"
    id_prefix = "chatcmpl-"

    def __init__(self, engine, token_text: TokenText) -> None:
        self.engine, self.token_text = engine, token_text
        self.logprobs = False

    def validate(self, body: ChatRequest) -> list[list[dict]]:
        """One prompt: the conversation, as {role, content} dicts."""
        check_chat_supported(body)
        self.logprobs = bool(body.logprobs)
        return [chat_messages(body)]

    def tokenize(self, sources: list[list[dict]]) -> list[list[int]]:
        """Runs in a worker thread. A template that refuses the conversation is the client's 400."""
        try:
            return [self.engine.chat_tokens(messages) for messages in sources]
        except Exception as exc:  # jinja's TemplateError, or a template's raise_exception(...)
            raise invalid_param("messages", f"the model's chat template cannot render these messages: "
                                            f"{type(exc).__name__}: {exc}") from None

    @staticmethod
    def requested_max_tokens(body: ChatRequest) -> int | None:
        return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens

    def params(self, body: ChatRequest, max_tokens: int, defaults: GenerationDefaults) -> SamplingParams:
        return sampling_params(body, max_tokens=max_tokens, logprobs=bool(body.logprobs),
                               top_logprobs=0 if body.top_logprobs is None else body.top_logprobs, defaults=defaults)

    def response(self, envelope: Envelope, choices: list[ChoiceText], usage: dict) -> dict:
        return envelope.body("chat.completion", [self._choice(i, c) for i, c in enumerate(choices)], usage=usage)

    def _choice(self, index: int, choice: ChoiceText) -> dict:
        logprobs = chat_logprobs(self.token_text, choice.logprobs) if self.logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": logprobs, "finish_reason": choice.finish_reason}

    def stream_start(self, envelope: Envelope, count: int) -> list[dict]:
        """OpenAI opens each choice with a chunk that carries only the role."""
        return [self._chunk(envelope, i, {"role": "assistant", "content": ""}, None, None) for i in range(count)]

    def stream_chunk(self, envelope: Envelope, choice: int, delta: StreamDelta) -> dict | None:
        logprobs = chat_logprobs(self.token_text, delta_logprobs(delta)) if self.logprobs else None
        if not delta.text and delta.finish_reason is None and not (logprobs and logprobs["content"]):
            return None  # text held back (a possible stop string, or half a UTF-8 character)
        content = {"content": delta.text} if delta.text else {}
        return self._chunk(envelope, choice, content, logprobs, delta.finish_reason)

    @staticmethod
    def _chunk(envelope: Envelope, index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return envelope.body("chat.completion.chunk", [choice])
