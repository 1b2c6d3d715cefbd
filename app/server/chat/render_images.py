"""A chat request's prompt on a vision-language model: the messages (their images resolved: server/images.py)
through the checkpoint's own template and processor (`Engine.chat_prompt`), tools and reasoning options passed
to the template as render.py passes them to a text model's. Text-only chats to such a model render the same way
(its processor's template is the model's own); a text model refuses images, naming itself.
"""

from __future__ import annotations

from mlxpaged.errors import ImageInputError
from mlxpaged.vision.checkpoint import images_refused
from mlxpaged.vision.images import has_images
from mlxpaged.vision.prompt import ImagePrompt, with_prefix
from mlxpaged_app.server.chat.render import render_prompt, template_inputs
from mlxpaged_app.server.chat.spec import ChatRequestSpec
from mlxpaged_app.server.errors import invalid_param
from mlxpaged_app.server.images import ImagePolicy, resolve_images


def render_chat(engine, spec: ChatRequestSpec, policy: ImagePolicy) -> list[int] | ImagePrompt:
    """What a chat request submits: token ids, or an ImagePrompt when its messages hold images. Runs in a worker
    thread (it may fetch image URLs)."""
    vision = getattr(engine.loaded, "vision", None)  # an engine of a text model may predate vision parts
    if vision is None and has_images(spec.messages):  # refused before any image URL is fetched
        raise invalid_param(spec.names.prompt, images_refused(engine.loaded.name, engine.loaded.config))
    if vision is None or spec.raw_prompt is not None:
        return render_prompt(engine.tokenizer, spec)
    messages, tools = template_inputs(engine.tokenizer, spec)
    options = {**spec.reasoning.kwargs(), **({"tools": tools} if tools else {})}
    try:
        prompt = engine.chat_prompt(resolve_images(messages, policy), policy.limits, **options)
        if isinstance(prompt, ImagePrompt) and spec.prompt_prefix:
            prompt = with_prefix(prompt, spec.prompt_prefix)
    except ImageInputError as exc:  # before ValueError: it is one (a text model's refusal is one too)
        raise invalid_param(spec.names.prompt, str(exc)) from None
    except (ValueError, TypeError, KeyError) as exc:  # a template or processor that refuses the conversation
        raise invalid_param(
            spec.names.prompt, f"the model's chat template cannot render these messages: {type(exc).__name__}: {exc}"
        ) from None
    return prompt if isinstance(prompt, ImagePrompt) else [*spec.prompt_prefix, *prompt]
