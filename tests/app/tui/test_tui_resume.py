"""`mlxpaged chat --resume`: the reopened conversation's earlier turns come from the prefix cache's disk tier
(a new engine, as after a restart, prefills only what is new), and a question left unanswered is answered."""

from __future__ import annotations

from mlxpaged.config import CacheConfig
from mlxpaged.engine.engine import Engine
from mlxpaged_app.tui.settings import ChatSettings
from mlxpaged_app.tui.store import Conversation
from tests.app.tui.tui_support import SIZE, FakeEngine, make_app, send_and_wait, wait_for

import pytest

pytestmark = pytest.mark.asyncio


async def test_a_resumed_conversation_left_unanswered_is_answered(tmp_path):
    conversation = Conversation.new("fake")
    conversation.add("user", "are you there")
    engine = FakeEngine()
    app = make_app(tmp_path, engine, conversation=conversation)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.reply is None and conversation.messages[-1]["role"] == "assistant")
    assert [m["role"] for m in conversation.messages] == ["user", "assistant"]


@pytest.mark.slow
async def test_a_resumed_conversation_answers_from_the_disk_tier(default_loaded, tmp_path):
    settings = ChatSettings(temperature=0.0, max_tokens=8)
    config = CacheConfig(cache_tokens=2048, kv_disk=str(tmp_path / "kv"))
    first_engine = Engine(default_loaded, config)
    app = make_app(tmp_path, first_engine, settings=settings, system_prompt="You are a helpful geography tutor. " * 8)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "what is the capital of france", timeout=120)
    finally:
        first_engine.close()  # as at exit: what the writer had not written yet is written now
    first = app.conversation.messages[-1]["stats"]
    second_engine = Engine(default_loaded, config)  # a new engine: an empty RAM prefix cache
    resumed = make_app(tmp_path, second_engine, settings=settings, conversation=app.store.latest())
    try:
        async with resumed.run_test(size=SIZE) as pilot:
            await send_and_wait(pilot, "and of germany", timeout=120)
            stats = second_engine.stats()
    finally:
        second_engine.close()
    second = resumed.conversation.messages[-1]["stats"]
    block = config.block_size
    assert stats["ram_hit_tokens"] == 0
    assert second["cached_tokens"] == stats["disk_hit_tokens"] >= (first["prompt_tokens"] - 1) // block * block
