"""The slice of `mlxpaged.Engine` the chat app uses, as a protocol: tests drive the app with a
scripted fake engine, `mlxpaged chat` with the real one."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol

Progress = Callable[[int, int, str], None]  # (done, total, what), as load_model reports it


class ChatEngine(Protocol):
    loaded: Any  # .name: the model's display name
    plan: Any  # MemoryPlan: .describe(), .num_blocks, .block_size, .kv_bytes, .token_capacity
    max_model_len: int
    generation_defaults: Any  # GenerationDefaults: the model's sampling defaults (.values, .source)

    def chat_prompt(self, messages: list[dict]) -> Any: ...  # token ids, or an ImagePrompt (images attached)

    def submit(self, prompt: Sequence[int], params: Any, sink: Callable[[object], None]) -> str: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict: ...

    def block_states(self) -> list[str]: ...

    def request_blocks(self, request_id: str) -> list[int]: ...

    def close(self) -> None: ...


EngineFactory = Callable[[str | None, Progress], ChatEngine]
"""Builds an engine for a model name (None: the default model), reporting download progress."""


def real_engine_factory(
    cache_tokens: int,
    speculative: str | None = None,
    kv_disk: dict | None = None,
    kv_bits: int | None = None,
    lora: str | None = None,
    draft: dict | None = None,
) -> EngineFactory:
    """Engines over the real model store, with a KV cache capped at `cache_tokens` tokens (and
    `speculative` decoding, SchedulerConfig's; `kv_disk`: CacheConfig's kv_disk and kv_disk_size; `kv_bits`:
    quantized pages, CacheConfig's; `lora`: an adapter directory every turn runs with; `draft`: a draft model,
    Engine.from_pretrained's draft_model and num_speculative_tokens)."""

    def build(name: str | None, progress: Progress) -> ChatEngine:
        from mlxpaged.engine.engine import Engine

        adapters = {adapter_name(lora): lora} if lora else None
        engine = Engine.from_pretrained(
            name,
            progress,
            adapters,
            cache_tokens=cache_tokens,  # refuses before loading weights
            speculative=speculative,
            **(kv_disk or {}),
            kv_bits=kv_bits,
            **(draft or {}),
        )
        try:
            _ = engine.generation_defaults  # read now: a bad generation_config.json fails the load, not a reply
        except Exception:
            engine.close()
            raise
        return AdaptedChatEngine(engine, adapter_name(lora)) if lora else engine

    return build


def adapter_name(path: str) -> str:
    """What `chat --lora PATH` calls its adapter: the directory's name."""
    return os.path.basename(os.path.normpath(path)) or path


class AdaptedChatEngine:
    """An engine whose every turn runs with one of its adapters (`chat --lora`); the rest is the engine's own."""

    def __init__(self, engine, adapter: str) -> None:
        self.engine, self.adapter = engine, adapter

    def submit(self, prompt, params, sink: Callable[[object], None]) -> str:
        return self.engine.submit(prompt, params, sink, adapter=self.adapter)

    def __getattr__(self, name: str):
        return getattr(self.engine, name)
