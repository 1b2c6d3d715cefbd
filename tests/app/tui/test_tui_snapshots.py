"""Snapshot tests (pytest-textual-snapshot) of the chat app: main screen, engine panel with the
live block map, help screen, loading panel with text typed meanwhile. Update with
`pytest tests/app/tui/test_tui_snapshots.py --snapshot-update` and look at the SVGs in
tests/__snapshots__/test_tui_snapshots/ before committing them."""

from __future__ import annotations

import threading

from mlxpaged_app.tui.generation import ReplyStats
from mlxpaged_app.tui.store import Conversation, ConversationStore
from tests.app.tui.tui_support import (
    FIXED_MEMORY,
    SIZE,
    FakeEngine,
    FakeFactory,
    RecordingApp,
    make_app,
    send,
    wait_for,
)

ANSWER = """Paris is the capital of **France**. A few facts:

- about 2.1 million people live in the city proper
- the Seine runs through it

```python
capitals = {"France": "Paris"}
```"""


def two_turn_conversation() -> Conversation:
    conversation = Conversation("snapshot", model="fake-model", system_prompt="You are a concise assistant.")
    conversation.add("user", "What is the capital of France?")
    conversation.add("assistant", ANSWER, model="fake-model", stats=ReplyStats(41, 0, 52, 0.31, 17.2, "stop").to_dict())
    conversation.add("user", "And of Germany?")
    conversation.add(
        "assistant",
        "Berlin is the capital of **Germany**.",
        model="fake-model",
        stats=ReplyStats(112, 96, 9, 0.08, 17.4, "stop").to_dict(),
    )
    return conversation


def busy_pool_engine() -> FakeEngine:
    """A default-sized pool (2,064 blocks, grouped 3 to a cell) in the middle of a reply."""
    engine = FakeEngine(num_blocks=2064)
    engine.states = ["shared"] * 6 + ["owned"] * 4 + ["cached"] * 150 + ["owned"] * 30 + ["free"] * 1874
    engine.script_blocks = list(range(10))  # this reply: 6 shared prefix blocks + 4 of its own
    engine.gate = threading.Event()
    return engine


def test_main_screen(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeEngine(), conversation=two_turn_conversation(), show_engine_panel=False)
    assert snap_compare(app, terminal_size=SIZE)


def test_engine_panel_with_block_map(snap_compare, tmp_path):
    app = make_app(tmp_path, busy_pool_engine(), conversation=two_turn_conversation())

    async def mid_reply(pilot):
        await send(pilot, "and Italy")
        await wait_for(pilot, lambda: app.reply_view is not None and app.reply_view.text == "Hello")
        app.refresh_engine_panel()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=mid_reply)


def test_help_screen(snap_compare, tmp_path):
    app = make_app(tmp_path, FakeEngine())
    assert snap_compare(app, terminal_size=SIZE, press=["f1"])


class GatedLoadApp(RecordingApp):
    """Holds the model load open for the snapshot; opening the gate on exit lets the load thread end."""

    def exit(self, *args, **kwargs) -> None:
        self.engine_factory.gate.set()
        super().exit(*args, **kwargs)


def test_loading_panel_leaves_the_message_box_usable(snap_compare, tmp_path):
    factory = FakeFactory(gate=threading.Event())
    app = GatedLoadApp(factory, store=ConversationStore(tmp_path / "chats"), memory_probe=lambda _engine: FIXED_MEMORY)

    async def type_while_loading(pilot):
        await wait_for(pilot, lambda: "converting" in str(app.query_one("#loading-stage").render()))
        await pilot.press(*"hello")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=type_while_loading)
