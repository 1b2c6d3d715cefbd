"""Both tiers of the prefix cache as the front ends show them, from a real engine's stats: the chat's engine
panel and /metrics (a tiny model, its disk tier in a temporary directory)."""

from __future__ import annotations

from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.server.metrics import ServerMetrics
from mlxpaged_app.tui.widgets.engine_panel import stats_text
from tests.engine.test_disk_tier_engine import disk_engine
from tests.tiny_models import random_tokens, tiny_llama, tiny_qwen3_5

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


def test_the_engine_panel_and_metrics_show_both_tiers(tokenizer, tmp_path):
    model, prompt = tiny_llama(2, seed=7), random_tokens(90, seed=3)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        first.generate(prompt, GREEDY)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as second:
        second.generate(prompt, GREEDY)  # from disk
        second.generate(prompt, GREEDY)  # from RAM
        stats = second.stats()
    panel = stats_text(stats).plain
    assert "  RAM       89 tokens saved" in panel  # full blocks and the partial one: all but the last token
    assert "  disk      88 tokens saved" in panel and "disk tier" in panel
    metrics = ServerMetrics().render(stats, 0, 1)
    assert 'mlxpaged_prefix_cache_tier_hit_tokens_total{tier="ram"} 89' in metrics
    assert 'mlxpaged_prefix_cache_tier_hit_tokens_total{tier="disk"} 88' in metrics
    assert f'mlxpaged_kv_disk_bytes{{kind="limit"}} {stats["disk_limit_bytes"]}' in metrics
    assert 'mlxpaged_kv_disk_problems_total{kind="skipped_file"} 0' in metrics


def test_the_engine_panel_says_why_the_disk_tier_is_off():
    stats = {"blocks_total": 4, "blocks_free": 4, "blocks_cached": 0, "blocks_used": 0, "prefix_hit_rate": 0.0}
    stats |= {"prefix_hit_tokens": 0, "ram_hit_tokens": 0, "requests_running": 0, "requests_waiting": 0}
    stats |= {"generation_tokens_per_s": 0.0, "processed_tokens_per_s": 0.0, "disk_tier": False}
    stats["disk_tier_off"] = "its prefix cache is off"
    assert "disk tier   off: its prefix cache is off" in stats_text(stats).plain


def test_a_state_models_checkpoints_on_disk_show_in_the_panel_and_metrics(tokenizer, tmp_path):
    model, prompt = tiny_qwen3_5(), random_tokens(40, seed=5)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        first.generate(prompt, GREEDY)
    written = first.stats()["disk_state_written"]  # after close: every checkpoint on disk
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as second:
        second.generate(prompt, GREEDY)  # resumed from a checkpoint on disk
        stats = second.stats()
    assert written >= 1 and stats["disk_state_hits"] == 1
    assert "  states    1 resumed · 0 written" in stats_text(stats).plain
    metrics = ServerMetrics().render(stats, 0, 1)
    assert 'mlxpaged_kv_disk_state_checkpoints_total{kind="resumed"} 1' in metrics
    assert 'mlxpaged_kv_disk_state_checkpoints_total{kind="written"} 0' in metrics
