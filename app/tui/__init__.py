"""The `mlxpaged chat` Textual app (installed as mlxpaged_app.tui)."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

DEFAULT_CACHE_TOKENS = 32768


def run_chat(model: str | None = None, *, max_tokens: int = 512, temperature: float = 0.7,
             top_p: float = 1.0, seed: int | None = None, system: str = "", resume: bool = False,
             cache_tokens: int = DEFAULT_CACHE_TOKENS) -> NoReturn:
    """Run the chat app until the user quits, then exit the process (see _exit_now).
    Raises ValueError for bad sampling settings before the app starts."""
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
    app = ChatApp(real_engine_factory(cache_tokens), model=model, settings=settings, store=store,
                  conversation=conversation, system_prompt=system)
    code = app.run() or 0
    app.close_engine()
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    # MLX 0.32 aborts at interpreter exit ("terminate called without an active exception") once a
    # thread that ran MLX has ended without mx.clear_streams(), which Engine.close() causes today.
    # Until the engine thread calls it, leave without running the interpreter's finalizers.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
