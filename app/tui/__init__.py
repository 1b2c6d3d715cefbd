"""The `mlxpaged chat` Textual app (installed as mlxpaged_app.tui)."""

from __future__ import annotations

import sys

from mlxpaged.config import DEFAULT_CACHE_TOKENS


def run_chat(
    model: str | None = None,
    *,
    max_tokens: int = 512,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    system: str = "",
    resume: bool = False,
    cache_tokens: int = DEFAULT_CACHE_TOKENS,
    speculative: str | None = None,
    kv_disk: dict | None = None,
    kv_bits: int | None = None,
    lora: str | None = None,
    draft: dict | None = None,
) -> int:
    """Run the chat app until the user quits; returns the exit code. temperature / top_p None: the model's.
    `kv_disk`: CacheConfig's kv_disk settings (the prefix cache on disk, which `resume` answers from); `lora`: an
    adapter directory every turn runs with; `draft`: Engine.from_pretrained's draft_model (and draft length).
    Raises ValueError for bad sampling settings before the app starts."""
    from mlxpaged_app.tui.terminal import enter_stays_enter

    with enter_stays_enter():  # before the slow imports: keys typed meanwhile reach the app as typed
        return _run_app(
            model,
            max_tokens,
            temperature,
            top_p,
            seed,
            system,
            resume,
            {
                "cache_tokens": cache_tokens,
                "speculative": speculative,
                "kv_disk": kv_disk,
                "kv_bits": kv_bits,
                "lora": lora,
                "draft": draft,
            },
        )


def _run_app(model, max_tokens, temperature, top_p, seed, system, resume, engine_settings: dict) -> int:
    """`engine_settings`: real_engine_factory's arguments."""
    from mlxpaged_app.tui.app import ChatApp
    from mlxpaged_app.tui.protocol import real_engine_factory
    from mlxpaged_app.tui.settings import ChatSettings
    from mlxpaged_app.tui.store import ConversationStore

    settings = ChatSettings(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed)
    store = ConversationStore.default()
    conversation = store.latest() if resume else None
    if resume and conversation is None:
        print("mlxpaged chat: no saved conversation yet; starting a new one", file=sys.stderr)
    if conversation is not None and model is None:
        model = conversation.model
    app = ChatApp(
        real_engine_factory(**engine_settings),
        model=model,
        settings=settings,
        store=store,
        conversation=conversation,
        system_prompt=system,
    )
    code = app.run() or 0
    app.close_engine()
    return code
