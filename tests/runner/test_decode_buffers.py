"""runner/decode_buffers.py: a run's K/V right-aligned in one buffer per layer, checked against a NumPy twin that
places every row's keys by hand; and in the engine (the path a GPU takes), buffered passes of rows of different
lengths, and passes over the memory budget that gather their pages instead, against mlx-lm."""

from __future__ import annotations

import dataclasses

from mlxpaged.runner import decode_buffers, deferred_writes
from mlxpaged.runner.decode_buffers import Alignment
from tests.engine.test_engine import (
    GREEDY,
    reference_tokens,
    tokenizer,  # noqa: F401  (the fixture, shared)
)
from tests.runner.test_gpu_pipeline import gpu_engine  # noqa: F401  (the fixture, shared)
from tests.tiny_models import random_tokens

import mlx.core as mx
import numpy as np

LONG = dataclasses.replace(GREEDY, max_tokens=30)


def test_rows_are_right_aligned_with_their_tail_before_the_newest_column():
    rng = np.random.default_rng(0)
    pages = rng.standard_normal((3, 2, 12, 4)).astype(np.float32)
    tail = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)
    alignment = Alignment.right_aligned([5, 9, 2])  # each row's newest token: positions 5, 9 and 2
    assert (alignment.column, alignment.shifts) == (9, (4, 0, 7))
    buffer = np.array(decode_buffers.from_pages(mx.array(pages), alignment, mx.array(tail), 16))
    assert buffer.shape == (3, 2, 16, 4)
    for row, newest in enumerate([5, 9, 2]):
        shift = alignment.shifts[row]
        for position in range(newest - 2):  # before the tail: from the pages
            np.testing.assert_array_equal(buffer[row, :, position + shift], pages[row, :, position])
        for i in range(2):  # the tail, the two positions before the newest
            np.testing.assert_array_equal(buffer[row, :, newest - 2 + i + shift], tail[row, :, i])
    assert not buffer[:, :, 9:].any()  # the newest column and the room after it
    mask = np.array(alignment.mask())[:, 0, 0, :]
    assert mask.tolist() == [[c >= s for c in range(10)] for s in (4, 0, 7)]


def test_rows_of_one_length_need_no_mask_and_a_selection_trims_unused_columns():
    assert Alignment.right_aligned([7]).mask() is None
    assert Alignment.right_aligned([4, 4]).mask() is None
    alignment = Alignment.right_aligned([5, 9, 2])
    kept, trim = alignment.select([2, 0])  # the longest row left: the columns before both remaining rows go
    assert (kept, trim) == (Alignment(5, (3, 0)), 4)
    assert kept.holds([2, 5]) and kept.next().holds([3, 6])


def _spy_passes(monkeypatch) -> list[tuple[int, bool, bool]]:
    seen: list[tuple[int, bool, bool]] = []
    original = deferred_writes.DeferredPass.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        seen.append((self.batch, self.buffered, self.alignment.padded))

    monkeypatch.setattr(deferred_writes.DeferredPass, "__init__", spy)
    return seen


def test_rows_of_different_lengths_decode_from_padded_buffers_as_mlx_lm(gpu_engine, monkeypatch):
    monkeypatch.setattr(decode_buffers, "BUFFER_STEP", 8)  # buffers grow mid-run
    seen = _spy_passes(monkeypatch)
    prompts = [random_tokens(n, seed=200 + n) for n in (3, 29, 11, 18)]
    params = [dataclasses.replace(LONG, max_tokens=m) for m in (30, 9, 22, 30)]  # rows leave: buffers trimmed
    got = gpu_engine.generate(prompts, params)
    for prompt, p, completion in zip(prompts, params, got, strict=True):
        assert completion.token_ids == reference_tokens(gpu_engine.model, prompt, p.max_tokens)
    assert any(batch > 1 and buffered and padded for batch, buffered, padded in seen), seen


def test_over_the_memory_budget_each_pass_gathers_its_pages(gpu_engine, monkeypatch):
    monkeypatch.setattr(gpu_engine.runner, "buffer_columns", 0)
    seen = _spy_passes(monkeypatch)
    prompts = [random_tokens(n, seed=300 + n) for n in (6, 21)]
    got = gpu_engine.generate(prompts, LONG) + gpu_engine.generate([prompts[0]], LONG)
    for prompt, completion in zip([*prompts, prompts[0]], got, strict=True):
        assert completion.token_ids == reference_tokens(gpu_engine.model, prompt, LONG.max_tokens)
    assert seen and not any(buffered for _, buffered, _ in seen)
