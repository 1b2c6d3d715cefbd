"""Chunked-local attention (llama4) in the engine: a tiny llama4 with chunks of 8 tokens, prompts and
replies crossing many chunk boundaries, against mlx-lm's own generate_step. llama4 builds its chunk
mask from one sequence's positions, so the engine runs it one sequence per pass."""

from __future__ import annotations

import dataclasses

import mlxpaged.runner.model_runner as model_runner
from tests.archs.harness import build
from tests.engine.test_engine import GREEDY, assert_pool_empty, reference_tokens, tiny_engine
from tests.tiny_models import random_tokens

import pytest

LONG = dataclasses.replace(GREEDY, max_tokens=30)
PROMPTS = [random_tokens(n, seed=n) for n in (5, 19, 40)]


@pytest.fixture(scope="module")
def llama4():
    return build("llama4")


@pytest.fixture(scope="module")
def expected(llama4):
    return [reference_tokens(llama4, p, LONG.max_tokens) for p in PROMPTS]


@pytest.fixture
def pass_sizes(monkeypatch):
    """The batch size of every pass the runner builds views for."""
    sizes: list[int] = []
    views = model_runner.paged_views

    def spy(kv, tables, *args, **kwargs):
        sizes.append(len(tables))
        return views(kv, tables, *args, **kwargs)

    monkeypatch.setattr(model_runner, "paged_views", spy)
    return sizes


def test_llama4_batched_and_chunked_requests_equal_mlx_lm(llama4, expected, pass_sizes, default_loaded):
    with tiny_engine(llama4, default_loaded.tokenizer, max_batch_tokens=16) as engine:
        assert engine.serial_reason and [g.chunk for g in engine.kv.groups] == [8, 8, 8, None]
        assert [c.token_ids for c in engine.generate(PROMPTS, LONG)] == expected
        assert_pool_empty(engine)
    assert pass_sizes and set(pass_sizes) == {1}  # three requests at once, one sequence per pass


def test_llama4_batched_passes_would_fail_which_is_why_it_runs_serially(llama4, default_loaded):
    with tiny_engine(llama4, default_loaded.tokenizer) as engine:
        engine.runner.serial = False
        with pytest.raises(Exception, match="start_position is one sequence's"):
            engine.generate(PROMPTS[:2], LONG)
        assert_pool_empty(engine)


def test_llama4_rings_stay_bounded_while_decoding_across_chunks(llama4, default_loaded):
    with tiny_engine(llama4, default_loaded.tokenizer) as engine:
        stream = engine.stream(PROMPTS[2], LONG)
        rid = next(stream).request_id
        tables = engine.kv_manager.block_tables(rid)
        ring = engine.kv_manager.managers[0].spec.max_blocks
        assert [len(t) for t in tables[:3]] == [ring] * 3  # chunked groups: ceil(9 / 8) + 1 blocks
        list(stream)
        assert_pool_empty(engine)
