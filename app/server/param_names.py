"""What each API calls the parameters that code shared by every API checks, so an error names the client's own
parameter from the start: the chat pipeline, the grammar and SamplingParams' checks read them from the request's
ParamNames instead of an API renaming errors afterwards."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParamNames:
    prompt: str = "messages"  # what the prompt is built from: blamed for a template error or a prompt too long
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    top_logprobs: str = "top_logprobs"
    response_format: str = "response_format"  # a structured-output format whose grammar cannot be built
    tools: str = "tools"
    tool_choice: str = "tool_choice"
    context: str = "max_model_len"  # what bounds one request's context (only Ollama's num_ctx can narrow it)
    renamed: Mapping[str, str] = field(default_factory=dict)  # SamplingParams fields the API spells otherwise

    def of(self, name: str | None) -> str | None:
        """The API's name for a SamplingParams field: its own where the API spells it the same."""
        if name in self.renamed:
            return self.renamed[name]
        return getattr(self, name) if name in _SAMPLING_FIELDS else name


_SAMPLING_FIELDS = ("max_tokens", "logprobs", "top_logprobs")

OPENAI_CHAT = ParamNames()
OPENAI_CHAT_MAX_COMPLETION = dataclasses.replace(OPENAI_CHAT, max_tokens="max_completion_tokens")
OPENAI_COMPLETIONS = ParamNames(prompt="prompt", top_logprobs="logprobs")  # legacy `logprobs` is the count
ANTHROPIC = ParamNames(response_format="output_config.format")
RESPONSES = ParamNames(prompt="input", max_tokens="max_output_tokens", response_format="text.format")
# Ollama's sampling settings sit in `options`, under their own names (repeat_penalty is HF's repetition_penalty).
OLLAMA_OPTIONS = {
    name: f"options.{name}"
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "seed", "stop")
}
OLLAMA_CHAT = ParamNames(
    max_tokens="options.num_predict",
    response_format="format",
    tool_choice="tools",  # Ollama has no tool_choice: a model may call any of its tools
    context="options.num_ctx",
    renamed={**OLLAMA_OPTIONS, "repetition_penalty": "options.repeat_penalty"},
)
OLLAMA_GENERATE = dataclasses.replace(OLLAMA_CHAT, prompt="prompt")
