"""The slice of `mlxpaged.Engine` the chat app uses, as a protocol: tests drive the app with a
scripted fake engine, `mlxpaged chat` with the real one."""

from __future__ import annotations

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
    cache_tokens: int, speculative: str | None = None, kv_disk: dict | None = None, kv_bits: int | None = None
) -> EngineFactory:
    """Engines over the real model store, with a KV cache capped at `cache_tokens` tokens (and
    `speculative` decoding, SchedulerConfig's; `kv_disk`: CacheConfig's kv_disk and kv_disk_size; `kv_bits`:
    quantized pages, CacheConfig's)."""

    def build(name: str | None, progress: Progress) -> ChatEngine:
        from mlxpaged.engine.engine import Engine

        engine = Engine.from_pretrained(
            name,
            progress,
            cache_tokens=cache_tokens,  # refuses before loading weights
            speculative=speculative,
            **(kv_disk or {}),
            kv_bits=kv_bits,
        )
        try:
            _ = engine.generation_defaults  # read now: a bad generation_config.json fails the load, not a reply
        except Exception:
            engine.close()
            raise
        return engine

    return build
