"""The architecture harness itself (tests/archs/scenarios.py) can fail: it passes a healthy model in
every scenario, and names the scenarios an engine gets wrong."""

from __future__ import annotations

import mlxpaged.engine.build as build_module
from tests.archs.harness import run_architecture
from tests.archs.scenarios import SCENARIOS, Case, compare

CASE = Case([1, 2, 3], [5, 6, 7], [0.5, 1e-6, 0.5])  # step 1 is a near-tie in mlx-lm's log-probs


def test_compare_passes_equal_tokens_and_forgives_only_near_ties():
    assert compare([5, 6, 7], CASE) is None
    assert compare([5, 9, 1], CASE) is None  # differs first at the tie: either token is a fair argmax
    assert compare([4, 6, 7], CASE) == "token 0: 4 != mlx-lm's 5 (gap 0.5)"
    assert compare([5, 6], CASE) == "2 tokens, mlx-lm 3"


def test_a_healthy_model_passes_every_scenario_with_a_prefix_hit_and_a_preemption():
    verdict = run_architecture("qwen3")["cpu"]
    assert verdict["status"] == "paged", verdict
    assert verdict["scenarios"] == dict.fromkeys(SCENARIOS, "pass")
    assert verdict["prefix_cache"] and verdict["prefix_hit_tokens"] > 0 and verdict["preemptions"] > 0


def test_batched_failures_are_named_per_scenario(monkeypatch):
    # llama4 batched (no serial passes): every scenario that shares a pass must fail, alone must not.
    monkeypatch.setattr(build_module, "layout_serial_reason", lambda *args: None)
    verdict = run_architecture("llama4")["cpu"]
    scenarios = verdict["scenarios"]
    assert verdict["status"] == "fail" and scenarios["alone"] == "pass" and scenarios["prefix"] == "pass"
    for name in ("batched", "chunked", "preempt", "n2"):
        assert "start_position is one sequence's" in scenarios[name], (name, scenarios[name])
    assert scenarios["empty"] == "pass"  # failed requests free their blocks too
    assert verdict["reason"].startswith("batched: ")


def test_the_chunked_model_passes_every_scenario_one_sequence_per_pass():
    verdict = run_architecture("llama4")["cpu"]
    assert verdict["status"] == "paged" and verdict["serial"], verdict
