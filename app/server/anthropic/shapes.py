"""Anthropic's `message` body from a chat run's results: content blocks, stop_reason and usage.

usage: `input_tokens` counts only the prompt tokens that were computed; `cache_read_input_tokens` those the
prefix cache served (their sum is the prompt, as Anthropic documents it); nothing is billed for writing the
cache here, so `cache_creation_input_tokens` is 0."""

from __future__ import annotations

from mlxpaged_app.server.chat.pipeline import ChoiceResult
from mlxpaged_app.server.chat.spec import Finish
from mlxpaged_app.server.formatting import new_id

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def envelope(model: str) -> dict:
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model}


def stop_reason(finish: Finish | None) -> str | None:
    """None when the run was aborted (server shutdown): it did not end on its own."""
    if finish is None:
        return None
    if finish.reason == "stop" and finish.stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish.reason)


def usage(counts: dict) -> dict:
    """From the pipeline's OpenAI-style usage counts."""
    prompt, cached = counts["prompt_tokens"], counts["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": prompt - cached, "output_tokens": counts["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def content_blocks(choice: ChoiceResult) -> list[dict]:
    """thinking, text, then tool_use blocks; a call cut off by max_tokens (never ended) is left out."""
    blocks: list[dict] = []
    if choice.reasoning:
        blocks.append({"type": "thinking", "thinking": choice.reasoning, "signature": ""})
    if choice.text:
        blocks.append({"type": "text", "text": choice.text})
    blocks += [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}
               for call in choice.tool_calls if call.arguments is not None]
    return blocks


def message_body(env: dict, choice: ChoiceResult, counts: dict) -> dict:
    finish = choice.finish
    return {**env, "content": content_blocks(choice), "stop_reason": stop_reason(finish),
            "stop_sequence": finish.stop_sequence if finish is not None else None, "usage": usage(counts)}
