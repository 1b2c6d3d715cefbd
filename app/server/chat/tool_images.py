"""Images a tool returned (a screenshot, an image file an agent's tool read), where a chat template can show them.

Chat templates render a tool turn's content as text, so a tool message's image parts are taken out of it: the
tool message keeps its text, and the images go to the model in a user turn right after the run of tool messages
(at the start of the user's own turn when one follows), in the order the tools returned them. Anthropic's
tool_result blocks, OpenAI's and Ollama's tool messages and Responses' function_call_output items all come through
here.
"""

from __future__ import annotations


def images_after_tool_turns(messages: list[dict]) -> list[dict]:
    """`messages` with each tool message's content as its text, and its images moved after the tool turns."""
    out: list[dict] = []
    shown: list[dict] = []  # the images of the tool messages since the last other turn
    for message in messages:
        if message["role"] == "tool":
            if isinstance(message["content"], list):
                parts = message["content"]
                shown += [p for p in parts if p["type"] == "image"]
                message = {**message, "content": "\n".join(p["text"] for p in parts if p["type"] == "text")}
            out.append(message)
            continue
        if shown and message["role"] == "user":
            message = {**message, "content": [*shown, *_as_parts(message["content"])]}
        elif shown:
            out.append({"role": "user", "content": shown})
        shown = []
        out.append(message)
    if shown:
        out.append({"role": "user", "content": shown})
    return out


def _as_parts(content: str | list[dict]) -> list[dict]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content}] if content else []
