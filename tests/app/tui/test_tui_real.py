"""The chat app on the real default model (SmolLM2-135M): the second turn reuses cached blocks;
keys and a question sent before the engine is ready are kept and answered."""

from __future__ import annotations

import threading

from mlxpaged.config import CacheConfig
from mlxpaged.engine.engine import Engine
from mlxpaged_app.tui.settings import ChatSettings
from tests.app.tui.tui_support import SIZE, make_app, send_and_wait, wait_for

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_second_turn_reports_cached_prompt_tokens(default_loaded, tmp_path):
    engine = Engine(default_loaded, CacheConfig(cache_tokens=2048))
    app = make_app(tmp_path, engine, settings=ChatSettings(temperature=0.0, max_tokens=8))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "what is the capital of france", timeout=120)
            await send_and_wait(pilot, "and of germany", timeout=120)
            first, second = [m["stats"] for m in app.conversation.messages if m["role"] == "assistant"]
            assert first["completion_tokens"] > 0 and "Paris" in app.conversation.messages[1]["content"]
            assert second["prompt_tokens"] > first["prompt_tokens"]
            assert second["cached_tokens"] > 0
            stats_line = str(app.query(".reply-stats").last().render())
            assert f"({second['cached_tokens']} cached)" in stats_line
    finally:
        engine.close()


async def test_typing_at_once_keeps_every_key_and_the_question_is_answered(default_loaded, tmp_path):
    """The engine is built only after the question is sent (a gate holds the load), then warms up its
    compiled decode while the user types on."""
    gate, engines = threading.Event(), []

    def factory(name, progress):
        gate.wait(timeout=60)
        engines.append(Engine(default_loaded, CacheConfig(cache_tokens=2048)))
        return engines[-1]

    app = make_app(tmp_path, factory=factory, settings=ChatSettings(temperature=0.0, max_tokens=8))
    question, more = "what is the capital of france", "and of germany"
    try:
        async with app.run_test(size=SIZE) as pilot:
            await pilot.press(*[("space" if c == " " else c) for c in question])
            assert app.engine is None and app.chat_input.text == question
            await pilot.press("enter")
            gate.set()
            await wait_for(pilot, lambda: app.engine is not None, timeout=120)
            await pilot.press(*[("space" if c == " " else c) for c in more])  # while the engine warms up
            assert app.chat_input.text == more
            await wait_for(pilot, lambda: app.reply is None and len(app.conversation.messages) == 2, timeout=120)
            assert app.conversation.messages[0]["content"] == question
            assert "Paris" in app.conversation.messages[1]["content"]
            assert app.chat_input.text == more
    finally:
        for engine in engines:
            engine.close()
