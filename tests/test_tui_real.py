"""The chat app on the real default model (SmolLM2-135M): the second turn reuses cached blocks."""

from __future__ import annotations

import pytest

from mlxpaged.config import CacheConfig
from mlxpaged.engine import Engine
from mlxpaged_app.tui.settings import ChatSettings
from tests.test_tui_support import SIZE, make_app, send_and_wait

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


async def test_second_turn_reports_cached_prompt_tokens(default_loaded, tmp_path):
    engine = Engine(default_loaded, CacheConfig(max_tokens=2048))
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
