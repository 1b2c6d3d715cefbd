"""While a model loads, the message box keeps every key and a question sent meanwhile is answered
once the engine is ready (issue 12, part 7). Loads are held open with FakeFactory's gate."""

from __future__ import annotations

import threading

from mlxpaged.loading.model_store import UnknownModelError
from mlxpaged_app.tui.widgets.chat_view import AssistantMessage, UserMessage
from tests.app.tui.tui_support import SIZE, FakeEngine, FakeFactory, RecordingApp, make_app, send, wait_for

import pytest
from textual import events
from textual.widgets import ProgressBar, Static

pytestmark = pytest.mark.asyncio

EARLY_KEYS = "x1x2x3"


class EarlyTypingApp(RecordingApp):
    """Keys that reach the app before it is mounted, as a terminal delivers keys typed at launch."""

    def on_load(self) -> None:
        for character in EARLY_KEYS:
            self.post_message(events.Key(character, character))


def gated_factory() -> FakeFactory:
    return FakeFactory(gate=threading.Event())


def keys(text: str) -> list[str]:
    return [("space" if c == " " else c) for c in text]


def user_texts(app) -> list[str]:
    return [view.text for view in app.query(UserMessage)]


async def test_keys_typed_before_the_app_is_mounted_reach_the_message_box(tmp_path):
    factory = gated_factory()
    app = EarlyTypingApp(factory, store=make_app(tmp_path).store)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert app.loading_model and app.engine is None
        assert app.chat_input.text == EARLY_KEYS
        await pilot.press("x", "4")
        assert app.chat_input.text == EARLY_KEYS + "x4"
        factory.gate.set()
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.press("x", "5")
        assert app.chat_input.text == EARLY_KEYS + "x4x5"


async def test_typing_while_the_model_loads_is_kept_and_the_question_answered(tmp_path):
    factory = gated_factory()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*keys("hi there"))
        assert app.loading_model and app.chat_input.text == "hi there"
        await pilot.press("enter")
        await pilot.pause()
        assert user_texts(app) == ["hi there"] and app.chat_input.text == ""
        assert "sent once the model is ready" in str(app.query_one("#status").render())
        await pilot.press(*keys("next"))  # the box stays usable while the question waits
        factory.gate.set()
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2 and app.reply is None)
        engine = factory.engines[None]
        assert engine.submitted[0].prompt == engine.chat_prompt([{"role": "user", "content": "hi there"}])
        assert [v.text for v in app.query(AssistantMessage)] == ["Hello **world**!"]
        assert app.chat_input.text == "next"


async def test_one_question_waits_a_second_enter_keeps_its_text(tmp_path):
    factory = gated_factory()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        await send(pilot, "second")
        assert user_texts(app) == ["first"] and app.chat_input.text == "second"
        assert "waits for the model" in app.notes_text()
        factory.gate.set()
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2 and app.reply is None)
        assert len(factory.engines[None].submitted) == 1 and app.chat_input.text == "second"


async def test_a_question_sent_while_switching_goes_to_the_new_model(tmp_path):
    old, factory = FakeEngine("fake-model"), gated_factory()
    app = make_app(tmp_path, old, factory)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.loading_model)
        await send(pilot, "to the new one")
        assert user_texts(app) == ["to the new one"] and old.submitted == []
        factory.gate.set()
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2 and app.reply is None)
        assert old.submitted == [] and len(factory.engines["other-model"].submitted) == 1
        assert app.conversation.messages[-1]["model"] == "other-model"


async def test_a_failed_load_keeps_the_question_until_a_model_loads(tmp_path):
    factory = FakeFactory(
        errors={"broken": UnknownModelError("unknown model 'broken': not a preset")}, gate=threading.Event()
    )
    app = make_app(tmp_path, factory=factory, model="broken")
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "still there?")
        factory.gate.set()
        await wait_for(pilot, lambda: app.notes and not app.loading_model)
        assert "unknown model 'broken'" in app.notes_text() and "Your message waits" in app.notes_text()
        assert app.conversation.messages == [{"role": "user", "content": "still there?"}]
        assert app.store.latest().messages == app.conversation.messages  # saved: nothing is lost on quit
        await pilot.press("f4")
        await pilot.pause()
        await pilot.press("down", "enter")  # other-model
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2 and app.reply is None)
        assert app.conversation.messages[-1]["model"] == "other-model"


async def test_a_new_chat_drops_the_waiting_question_from_the_queue(tmp_path):
    factory = gated_factory()
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "never mind")
        waiting = app.conversation
        await pilot.press("ctrl+n")
        factory.gate.set()
        await wait_for(pilot, lambda: app.engine is not None)
        await pilot.pause()
        assert factory.engines[None].submitted == [] and app.conversation.messages == []
        assert app.store.load(waiting.id).messages == [{"role": "user", "content": "never mind"}]


async def test_a_failed_switch_answers_the_waiting_question_with_the_old_model(tmp_path):
    old = FakeEngine("fake-model")
    factory = FakeFactory(
        errors={"other-model": UnknownModelError("unknown model 'other-model'")}, gate=threading.Event()
    )
    app = make_app(tmp_path, old, factory)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await pilot.pause()
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: app.loading_model)
        await send(pilot, "anyone?")
        factory.gate.set()
        await wait_for(pilot, lambda: len(app.conversation.messages) == 2 and app.reply is None)
        assert "Still chatting with fake-model" in app.notes_text() and len(old.submitted) == 1
        assert app.conversation.messages[-1]["model"] == "fake-model"


async def test_edit_last_keeps_the_draft_being_typed(tmp_path):
    app = make_app(tmp_path)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, "first")
        await wait_for(pilot, lambda: app.reply is None and len(app.conversation.messages) == 2)
        await pilot.press(*keys("draft"), "ctrl+l")
        await pilot.pause()
        assert app.chat_input.text == "first\ndraft" and app.conversation.messages == []


async def test_the_loaders_progress_reaches_the_loading_panel(tmp_path):
    factory = gated_factory()  # reports (1, 2, "converting"), then waits for the gate
    app = make_app(tmp_path, factory=factory)
    async with app.run_test(size=SIZE) as pilot:
        bar = app.loading_panel.query_one(ProgressBar)
        await wait_for(pilot, lambda: bar.total == 2)
        stage = app.loading_panel.query_one("#loading-stage", Static)
        assert bar.progress == 1 and str(stage.render()) == "converting" and app.loading_panel.display
        factory.gate.set()
        await wait_for(pilot, lambda: app.engine is not None)
        assert not app.loading_panel.display and app.sub_title == "fake-model"
