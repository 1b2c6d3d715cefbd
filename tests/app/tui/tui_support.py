"""A scripted fake engine and helpers for the chat app's pilot and snapshot tests (no tests here)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from mlxpaged.engine.engine import StreamDelta
from mlxpaged.loading.generation_defaults import NO_DEFAULTS
from mlxpaged_app.tui.app import ChatApp
from mlxpaged_app.tui.memory_use import MemoryUse
from mlxpaged_app.tui.screens.model_picker import ModelChoice
from mlxpaged_app.tui.settings import ChatSettings
from mlxpaged_app.tui.store import ConversationStore

from textual.widgets import TextArea

SIZE = (120, 40)


@dataclass
class FakeLoaded:
    name: str


@dataclass
class FakePlan:
    num_blocks: int = 64
    block_size: int = 16
    kv_bytes: int = 47_185_920

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"KV cache plan (fake)\n  {self.num_blocks:,} blocks x {self.block_size} tokens = "
            f"{self.token_capacity:,} tokens\n  blocks: scripted by the test"
        )


@dataclass
class Submitted:
    request_id: str
    prompt: list[int]
    params: object


class FakeEngine:
    """Streams `reply` pieces from a thread, as the real engine does. Scripting knobs:
    `gate` (an Event the stream waits on after its first piece), `submit_error`,
    `stream_error` (sent after the first piece), `script_blocks` (request_blocks of a live request),
    `states` (block_states), `cached_tokens` (reported on the final delta)."""

    def __init__(self, name: str = "fake-model", reply=("Hello", " **world**", "!"), num_blocks: int = 64):
        self.loaded, self.plan, self.max_model_len = FakeLoaded(name), FakePlan(num_blocks), 2048
        self.generation_defaults = NO_DEFAULTS
        self.reply = list(reply)
        self.states = ["free"] * num_blocks
        self.submitted: list[Submitted] = []
        self.aborted: list[str] = []
        self.closed = False
        self.gate: threading.Event | None = None
        self.submit_error: Exception | None = None
        self.stream_error: Exception | None = None
        self.script_blocks: list[int] | None = None
        self.cached_tokens = 0
        self.images_seen: list[str] = []
        self.first_piece_sent = threading.Event()
        self._live: dict[str, threading.Event] = {}
        self._blocks: dict[str, list[int]] = {}

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """A token per word; image parts are recorded in `images_seen` (the real engine reads them here)."""
        texts = []
        for m in messages:
            parts = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
            self.images_seen += [p["image"] for p in parts if p["type"] == "image"]
            texts.append(" ".join([m["role"], *(p["text"] for p in parts if p["type"] == "text")]))
        return [len(word) for text in texts for word in text.split()]

    def submit(self, prompt, params, sink, adapter=None) -> str:
        if self.submit_error is not None:
            raise self.submit_error
        request_id = f"fake-{len(self.submitted)}"
        self.submitted.append(Submitted(request_id, list(prompt), params))
        self._live[request_id] = threading.Event()
        self._blocks[request_id] = list(self.script_blocks) if self.script_blocks is not None else [0, 1]
        threading.Thread(target=self._emit, args=(request_id, len(prompt), params, sink), daemon=True).start()
        return request_id

    def _emit(self, request_id: str, prompt_tokens: int, params, sink) -> None:
        aborted, sent = self._live[request_id], 0
        for i, piece in enumerate(self.reply[: params.max_tokens]):
            if aborted.is_set():
                break
            if i == 1 and self.stream_error is not None:
                self._blocks.pop(request_id)
                sink(self.stream_error)
                return
            sink(StreamDelta(request_id, piece, token_id=i))
            sent += 1
            if i == 0:
                self.first_piece_sent.set()
                while self.gate is not None and not self.gate.is_set() and not aborted.is_set():
                    time.sleep(0.005)
        reason = "abort" if aborted.is_set() else ("length" if len(self.reply) > params.max_tokens else "stop")
        self._blocks.pop(request_id)
        sink(
            StreamDelta(
                request_id,
                "",
                finish_reason=reason,
                prompt_tokens=prompt_tokens,
                cached_tokens=self.cached_tokens,
                completion_tokens=sent,
            )
        )

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._live[request_id].set()

    def stats(self) -> dict:
        counts = Counter(self.states)
        used = counts["owned"] + counts["shared"]
        return {
            "blocks_total": len(self.states),
            "blocks_free": counts["free"] + counts["cached"],
            "blocks_used": used,
            "blocks_cached": counts["cached"],
            "prefix_hit_rate": 0.5,
            "prefix_hit_tokens": 96,
            "requests_running": 1 if self._blocks else 0,
            "requests_waiting": 0,
            "generation_tokens_per_s": 17.0,
            "processed_tokens_per_s": 250.0,
            "generated_tokens_total": 40,
            "preemptions": 0,
            "last_time_to_first_token": 0.12,
            "memory_plan": self.plan,
        }

    def block_states(self) -> list[str]:
        return list(self.states)

    def request_blocks(self, request_id: str) -> list[int]:
        return list(self._blocks.get(request_id, []))

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeFactory:
    """An EngineFactory that hands out FakeEngines (or raises `errors[name]`) and records calls;
    with a `gate`, each load waits for it after reporting progress (a model still loading)."""

    engines: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)
    calls: list = field(default_factory=list)
    gate: threading.Event | None = None

    def __call__(self, name, progress):
        self.calls.append(name)
        progress(1, 2, "converting")
        if self.gate is not None and not self.gate.wait(timeout=10):
            raise TimeoutError("the test never opened the load gate")
        if name in self.errors:
            raise self.errors[name]
        engine = self.engines.get(name) or FakeEngine(name or "fake-model")
        self.engines[name] = engine
        return engine


class RecordingApp(ChatApp):
    """ChatApp that also keeps every notification, for assertions."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.notes: list[tuple[str, dict]] = []

    def notify(self, message, **kwargs):
        self.notes.append((message, kwargs))
        super().notify(message, **kwargs)

    def on_mount(self) -> None:
        # A blinking cursor is drawn or not depending on timing: snapshots need it steady.
        for area in self.query(TextArea):
            area.cursor_blink = False

    def notes_text(self) -> str:
        return "\n".join(message for message, _ in self.notes)


FIXED_MEMORY = MemoryUse(process_rss=1_234_000_000, host_used=8_100_000_000, host_total=25_300_000_000)
CHOICES = [
    ModelChoice("fake-model", "the scripted default", 541_600_000, True),
    ModelChoice("other-model", "a second scripted model", None),
]


def make_app(tmp_path, engine: FakeEngine | None = None, factory: FakeFactory | None = None, **kwargs) -> RecordingApp:
    engine = engine if engine is not None or factory is not None else FakeEngine()
    kwargs.setdefault("settings", ChatSettings(temperature=0.7, max_tokens=64))
    return RecordingApp(
        factory or FakeFactory(),
        engine=engine,
        store=ConversationStore(tmp_path / "chats"),
        model_lister=lambda: CHOICES,
        memory_probe=lambda _engine: FIXED_MEMORY,
        **kwargs,
    )


async def wait_for(pilot, condition, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition}")
        await pilot.pause(0.02)


async def send(pilot, text: str) -> None:
    await pilot.press(*[("space" if c == " " else c) for c in text], "enter")


async def send_and_wait(pilot, text: str, timeout: float = 15.0) -> None:
    app = pilot.app
    replies = len([m for m in app.conversation.messages if m["role"] == "assistant"])
    await send(pilot, text)
    await wait_for(
        pilot,
        lambda: app.reply is None and len([m for m in app.conversation.messages if m["role"] == "assistant"]) > replies,
        timeout,
    )
    await asyncio.sleep(0)
