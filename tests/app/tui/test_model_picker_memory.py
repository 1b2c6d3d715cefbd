"""F4 marks the model the chat has loaded with the memory it holds: weights + KV cache + state, as planned."""

from __future__ import annotations

from types import SimpleNamespace

from mlxpaged.units import format_size
from mlxpaged_app.tui.screens.model_picker import ModelPickerScreen, loaded_memory
from tests.app.tui.tui_support import SIZE, FakeEngine, make_app, wait_for

import pytest
from textual.widgets import OptionList


def test_loaded_memory_adds_weights_cache_and_state():
    engine = SimpleNamespace(facts=SimpleNamespace(weight_bytes=500), plan=SimpleNamespace(kv_bytes=30, state_bytes=7))
    assert loaded_memory(engine) == 537 and loaded_memory(None) is None
    assert loaded_memory(SimpleNamespace()) is None  # no plan: nothing to say, no crash


@pytest.mark.asyncio
async def test_f4_shows_the_loaded_model_and_its_memory(tmp_path):
    engine = FakeEngine("fake-model")
    engine.facts = SimpleNamespace(weight_bytes=538_000_000)
    engine.plan.kv_bytes, engine.plan.state_bytes = 12_000_000, 0
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, ModelPickerScreen))
        await pilot.pause()
        options = app.screen.query_one(OptionList)
        loaded, other = (str(options.get_option_at_index(i).prompt) for i in range(2))
    assert f"(loaded, {format_size(550_000_000)} in memory)" in loaded and "loaded" not in other
