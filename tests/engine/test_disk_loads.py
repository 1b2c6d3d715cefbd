"""Disk hits read off the engine thread (engine/disk_loads.py): while one request's blocks are read, the engine
keeps stepping the others; the loaded request gives the tokens of a cold run; a file that fails its checks during
the background read ends the hit there and the rest is prefilled."""

from __future__ import annotations

import threading
import time

from mlxpaged.cache.disk_tier import DiskTier
from mlxpaged.engine.disk_loads import DiskLoads
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_disk_tier_engine import disk_engine
from tests.tiny_models import random_tokens, tiny_llama

import numpy as np
import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, seed=5)


def test_a_background_load_hands_over_what_a_plain_read_gives():
    """DiskLoads against its slow twin, the same run read on the caller's thread: the pages by hash, the run
    ending at the first block that fails; a forgotten load hands nothing over."""
    blocks = {bytes([i]): [np.full((2, 3), i, np.float32)] for i in range(6)}
    blocks[bytes([4])] = None  # fails its checks
    loads = DiskLoads(blocks.get, lambda pages: True)
    hashes = [bytes([i]) for i in range(6)]
    try:
        while not loads.start("a", hashes):
            loads.wait(1.0)
        plain = loads.read_run(hashes)
        got = loads.take("a")
        assert len(plain) == 4 and list(got) == hashes[:4]
        assert all(np.array_equal(got[h][0], p[0]) for h, p in zip(hashes, plain, strict=False))
        assert loads.take("a") == {} and loads.background_loads == 1
        loads.start("b", hashes)
        loads.forget("b")
        assert loads.take("b") == {}
    finally:
        loads.close()


def test_other_requests_keep_running_while_a_disk_hit_is_read(model, tokenizer, tmp_path, monkeypatch):
    prompt, other = random_tokens(100, seed=31), random_tokens(40, seed=32)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with disk_engine(model, tokenizer, tmp_path / "m", False) as plain:
        cold, cold_other = plain.generate(prompt, GREEDY)[0], plain.generate(other, long)[0]
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        first.generate(prompt, GREEDY)
    # The test's hook: every block file read waits until the test releases it (a very slow disk).
    release, entered, real_read = threading.Event(), threading.Event(), DiskTier.read

    def slow_disk_read(self, block_hash):
        entered.set()
        release.wait(60)
        return real_read(self, block_hash)

    monkeypatch.setattr(DiskTier, "read", slow_disk_read)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as eng:
        loaded: list = []
        waiter = threading.Thread(target=lambda: loaded.extend(eng.generate(prompt, GREEDY)))
        waiter.start()
        try:
            assert entered.wait(30)  # the disk hit is being read from here on
            start = time.perf_counter()
            running = eng.generate(other, long)[0]  # every step of it runs while the read waits
            assert time.perf_counter() - start < 30 and not release.is_set()
            assert running.token_ids == cold_other.token_ids and waiter.is_alive() and not loaded
        finally:
            release.set()
            waiter.join(60)
        stats = eng.stats()
    assert loaded[0].token_ids == cold.token_ids and loaded[0].cached_tokens == 96
    assert stats["disk_hit_tokens"] == 96 and stats["disk_background_loads"] == 1


def test_a_corrupt_file_found_by_the_background_read_is_prefilled(model, tokenizer, tmp_path):
    prompt = random_tokens(100, seed=33)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        cold = first.generate(prompt, GREEDY)[0]
        manager, chain = first.kv_manager, [None]
        for i in range(7):
            chain.append(manager.hash_fn(chain[-1], tuple(prompt[i * 8 : (i + 1) * 8]), manager.extra_key))
        path = first.core.tiering.tier.path(chain[7])
    path.write_bytes(path.read_bytes()[:-10])  # the seventh block: truncated
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as second:
        with pytest.warns(RuntimeWarning, match="truncated"):
            warm = second.generate(prompt, GREEDY)[0]
        stats = second.stats()
    assert warm.token_ids == cold.token_ids
    assert warm.cached_tokens == stats["disk_hit_tokens"] == 6 * 8
    assert stats["disk_background_loads"] == 1 and stats["disk_skipped_files"] == 1
