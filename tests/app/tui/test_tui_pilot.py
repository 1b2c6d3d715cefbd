"""Pilot tests of the chat app against a scripted fake engine."""

from __future__ import annotations

import io
import json
import threading

from mlxpaged.engine.engine import RequestFailedError
from mlxpaged.engine.scheduler import MODEL_CONTEXT, RequestTooLongError
from mlxpaged.loading.model_store import UnknownModelError
from mlxpaged_app.tui.keys import APP_BINDINGS, key_label
from mlxpaged_app.tui.screens.help import HelpScreen, help_table
from mlxpaged_app.tui.screens.settings import SettingsScreen
from mlxpaged_app.tui.widgets.block_map import BlockMap
from mlxpaged_app.tui.widgets.chat_view import AssistantMessage, UserMessage
from mlxpaged_app.tui.widgets.engine_panel import EnginePanel
from tests.app.tui.tui_support import SIZE, FakeEngine, FakeFactory, make_app, send, send_and_wait, wait_for

import pytest
from rich.console import Console

pytestmark = pytest.mark.asyncio


def views(app, kind):
    return list(app.query(kind))


async def test_send_streams_markdown_reply(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi there")
        [user], [reply] = views(app, UserMessage), views(app, AssistantMessage)
        assert user.text == "hi there"
        assert reply.text == "Hello **world**!"
        assert "world" in reply.markdown.source
        assert engine.submitted[0].prompt == engine.chat_prompt([{"role": "user", "content": "hi there"}])
        assert app.conversation.messages[-1]["content"] == "Hello **world**!"
        assert "3 out" in str(reply.query_one(".reply-stats").render())
        assert app.chat_input.text == ""


async def test_enter_sends_and_ctrl_j_adds_a_line(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("a", "ctrl+j", "b")
        assert app.chat_input.text == "a\nb"
        assert engine.submitted == []
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.reply is None and len(app.conversation.messages) == 2)
        assert app.conversation.messages[0]["content"] == "a\nb"


async def test_escape_stops_and_the_engine_gets_the_abort(tmp_path):
    engine = FakeEngine()
    engine.gate = threading.Event()  # the stream hangs after its first piece until aborted
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "tell me a story")
        await wait_for(pilot, lambda: app.reply_view is not None and app.reply_view.text == "Hello")
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.reply is None)
        assert engine.aborted == ["fake-0"]
        [reply] = views(app, AssistantMessage)
        assert reply.stopped and "stopped" in reply.stats.describe()
        assert app.conversation.messages[-1] == {**app.conversation.messages[-1], "content": "Hello", "stopped": True}
        engine.gate.set()
        await send_and_wait(pilot, "again")  # still usable afterwards
        assert len(engine.submitted) == 2


async def test_new_chat_clears_and_keeps_the_old_one_saved(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "first")
        old_id = app.conversation.id
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert views(app, UserMessage) == [] and views(app, AssistantMessage) == []
        assert app.conversation.messages == [] and app.conversation.id != old_id
        assert [c.id for c in app.store.list()] == [old_id]


async def test_settings_change_what_the_engine_is_asked(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f3")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        await pilot.press("a", "b", "c", "enter")  # typing replaces the selected value
        assert isinstance(app.screen, SettingsScreen)
        assert "temperature must be a number" in str(app.screen.query_one("#settings-error").render())
        await pilot.press("home", "ctrl+k", "0", ".", "2", "tab", "0", ".", "9", "tab", "2", "tab", "4", "2", "enter")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        await send_and_wait(pilot, "hi")
        params = engine.submitted[-1].params
        assert (params.temperature, params.top_p, params.max_tokens, params.seed) == (0.2, 0.9, 2, 42)
        assert app.conversation.messages[-1]["stats"]["finish_reason"] == "length"


async def test_prompt_too_long_is_a_notification_and_the_message_comes_back(tmp_path):
    engine = FakeEngine()
    engine.submit_error = RequestTooLongError(9000, 64, 8192, MODEL_CONTEXT)
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "a very long message")
        await wait_for(pilot, lambda: app.reply is None and app.notes)
        assert "exceeds the model context of 8192 tokens" in app.notes_text()
        assert app.chat_input.text == "a very long message"
        assert app.conversation.messages == [] and views(app, AssistantMessage) == []
        engine.submit_error = None
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2)


async def test_a_failed_stream_is_shown_and_ctrl_r_retries(tmp_path):
    engine = FakeEngine()
    engine.stream_error = RequestFailedError("sampling failed: boom")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await wait_for(pilot, lambda: app.reply is None and app.notes)
        assert "sampling failed: boom" in app.notes_text()
        assert [m["role"] for m in app.conversation.messages] == ["user"]
        engine.stream_error = None
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2)
        assert engine.submitted[0].prompt == engine.submitted[1].prompt


async def test_model_load_failure_keeps_the_app_usable(tmp_path):
    factory = FakeFactory(errors={"broken": UnknownModelError("unknown model 'broken': not a preset")})
    app = make_app(tmp_path, factory=factory, model="broken")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.notes and not app.loading_model)
        assert "unknown model 'broken'" in app.notes_text() and app.engine is None
        assert "No model loaded" in str(app.query_one("#status").render())
        await send(pilot, "hi")
        assert "No model is loaded" in app.notes[-1][0]
        await pilot.press("f4")
        await pilot.pause()
        await pilot.press("down", "enter")  # second choice: other-model
        await wait_for(pilot, lambda: app.engine is not None)
        assert factory.calls == ["broken", "other-model"] and app.sub_title == "other-model"
        await pilot.press("enter")  # "hi" is still in the input
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2)


async def test_switching_model_closes_the_old_engine(tmp_path):
    old = FakeEngine("fake-model")
    factory = FakeFactory()
    app = make_app(tmp_path, old, factory)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("f4")
        await pilot.pause()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.engine is not old and old.closed)
        assert app.model_label == "other-model"
        await send_and_wait(pilot, "and now")
        assert app.conversation.messages[-1]["model"] == "other-model"
        assert len(views(app, AssistantMessage)) == 2  # the conversation carries over


async def test_regenerate_and_edit_last(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: len(engine.submitted) == 2 and app.reply is None)
        await pilot.pause()
        assert len(app.conversation.messages) == 2 and len(views(app, AssistantMessage)) == 1
        await pilot.press("ctrl+l")
        await pilot.pause()
        assert app.chat_input.text == "hi" and app.conversation.messages == []
        assert views(app, UserMessage) == []


async def test_block_map_reflects_the_scripted_pool(tmp_path):
    engine = FakeEngine(num_blocks=12)
    engine.states = ["owned", "owned", "shared", "cached", "cached", "owned"] + ["free"] * 6
    engine.script_blocks = [0, 1, 2]  # the live reply holds 0-1 alone and shares 2; block 5 is someone else's
    engine.gate = threading.Event()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "hi")
        await wait_for(pilot, lambda: app.current_request_id is not None)
        app.refresh_engine_panel()
        block_map = app.query_one(BlockMap)
        assert (
            block_map.classes_by_block == ["current", "current", "shared", "cached", "cached", "other"] + ["free"] * 6
        )
        legend = str(app.query_one("#block-legend").render())
        assert "this reply 2" in legend and "shared 1" in legend and "other 1" in legend and "cached (free) 2" in legend
        engine.gate.set()
        await wait_for(pilot, lambda: app.reply is None)
        app.refresh_engine_panel()
        assert block_map.classes_by_block.count("current") == 0  # finished: nothing is "this reply" any more


async def test_engine_panel_toggles(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        panel = app.query_one(EnginePanel)
        assert panel.display
        await pilot.press("f2")
        assert not panel.display
        await pilot.press("f2")
        assert panel.display
        assert "2 blocks" not in str(app.query_one("#engine-stats").render())


async def test_help_lists_every_binding(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen))
        console = Console(width=100, record=True, file=io.StringIO())
        console.print(help_table())
        text = console.export_text()
        for binding in APP_BINDINGS:
            for key in binding.key.split(","):
                assert key_label(key) in text, key
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


async def test_conversations_persist_and_reopen(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "remember me")
        first_id = app.conversation.id
        saved = json.loads(app.store.path(first_id).read_text())
        assert [m["role"] for m in saved["messages"]] == ["user", "assistant"]
        assert saved["messages"][1]["stats"]["completion_tokens"] == 3
        await pilot.press("ctrl+n")
        await send_and_wait(pilot, "second chat")
        await pilot.press("ctrl+o")
        await pilot.pause()
        await pilot.press("down", "enter")  # most recent first: the first chat is second
        await wait_for(pilot, lambda: app.conversation.id == first_id)
        assert [v.text for v in views(app, UserMessage)] == ["remember me"]
    resumed = make_app(tmp_path, conversation=app.store.latest())
    async with resumed.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert [v.text for v in views(resumed, UserMessage)] == ["second chat"]


async def test_system_prompt_is_sent(tmp_path):
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f5")
        await pilot.pause()
        await pilot.press("b", "e", "space", "b", "r", "i", "e", "f", "ctrl+s")
        await pilot.pause()
        assert app.conversation.system_prompt == "be brief"
        await send_and_wait(pilot, "hi")
        expected = engine.chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
        assert engine.submitted[-1].prompt == expected
