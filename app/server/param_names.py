"""What each API calls the parameters that code shared by every API checks, so an error names the client's own
parameter from the start: the chat pipeline, the grammar and SamplingParams' checks read them from the request's
ParamNames instead of an API renaming errors afterwards."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ParamNames:
    prompt: str = "messages"  # what the prompt is built from: blamed for a template error or a prompt too long
    max_tokens: str = "max_tokens"
    logprobs: str = "logprobs"
    top_logprobs: str = "top_logprobs"
    response_format: str = "response_format"  # a structured-output format whose grammar cannot be built
    tools: str = "tools"
    tool_choice: str = "tool_choice"

    def of(self, field: str | None) -> str | None:
        """The API's name for a SamplingParams field: its own where the API spells it the same."""
        return getattr(self, field) if field in _SAMPLING_FIELDS else field


_SAMPLING_FIELDS = ("max_tokens", "logprobs", "top_logprobs")

OPENAI_CHAT = ParamNames()
OPENAI_CHAT_MAX_COMPLETION = dataclasses.replace(OPENAI_CHAT, max_tokens="max_completion_tokens")
OPENAI_COMPLETIONS = ParamNames(prompt="prompt", top_logprobs="logprobs")  # legacy `logprobs` is the count
ANTHROPIC = ParamNames(response_format="output_config.format")
RESPONSES = ParamNames(prompt="input", max_tokens="max_output_tokens", response_format="text.format")
