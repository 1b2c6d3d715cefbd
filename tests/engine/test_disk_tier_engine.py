"""The prefix cache's disk tier in the engine (engine/kv_tiering.py): a prompt seen by an earlier engine (or an
earlier process) answers from disk with the tokens a cold run gives; blocks the pool evicts go to disk first;
two engines share a directory; no step waits for a write; models whose prefix cache cannot use it say why."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from mlxpaged.cache.disk_tier import DiskTier, list_entries
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.specs import KVGeometry
from mlxpaged.config import split_settings
from mlxpaged.engine.engine import Engine
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.platform import backend
from mlxpaged.sampling_params import SamplingParams
from tests.tiny_models import random_tokens, tiny_hybrid_llama, tiny_llama, write_tiny_llama_dir

import mlx.core as mx
import numpy as np
import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_llama(3, seed=5)


def disk_engine(model, tokenizer, model_dir: Path, disk: Path | bool, **settings) -> Engine:
    """An engine over a tiny model whose 'weights' are `model_dir` (the fingerprint reads its files)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (model_dir / "config.json").write_text(json.dumps(config, default=str))
    loaded = LoadedModel(model, tokenizer, ModelRef("tiny", "path"), model_dir, "float32", config)
    base = {"cache_tokens": 2048, "block_size": 8, "kv_disk": disk if disk is False else str(disk)}
    return Engine(loaded, *split_settings({**base, **settings}))


@pytest.mark.parametrize(
    "dtype, simulated",
    [(mx.float32, None), (mx.float16, None), (mx.bfloat16, None), (mx.float32, "cuda")],
    ids=["float32-host-writes", "float16-host-writes", "bfloat16-scatter", "cuda-scatter"],
)
def test_export_and_import_blocks_round_trip_every_pool(dtype, simulated):
    """Both import paths (pages copied into host-addressable pools, MLX's scatter elsewhere) against the pages
    exported: the slow obviously-right twin is a take of the source block."""
    geometries = (KVGeometry(2, 16, 16), KVGeometry(1, 24, 8), KVGeometry(1, 32, 32, k_is_v=True))
    kv = PagedKVCache(3, 6, 8, None, None, dtype, geometries=geometries)
    for j, pool in enumerate(kv.pools):
        pool[mx.arange(6)] = mx.random.normal(pool.shape, key=mx.random.key(j)).astype(dtype)
    mx.eval(kv.pools)
    before = [mx.array(np.array(p)) if dtype != mx.bfloat16 else p * 1 for p in kv.pools]
    mx.eval(before)
    pages = kv.export_blocks([4, 5])
    assert len(pages) == 2 and len(pages[0]) == len(kv.pools) == 5
    with backend.simulate(simulated) if simulated else contextlib.nullcontext():
        kv.import_blocks([1, 0], pages)
    for pool, old in zip(kv.pools, before, strict=True):
        assert mx.array_equal(pool[1], old[4]).item() and mx.array_equal(pool[0], old[5]).item()
        assert mx.array_equal(pool[2:], old[2:]).item()  # the other blocks untouched
    with pytest.raises(ValueError, match="arrays"):
        kv.import_block(0, pages[:-1])


def test_a_new_engine_answers_from_disk_with_the_cold_tokens(model, tokenizer, tmp_path):
    prompt = random_tokens(100, seed=1)
    with disk_engine(model, tokenizer, tmp_path / "m", False) as plain:
        cold = plain.generate(prompt, GREEDY)[0]
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        assert first.generate(prompt, GREEDY)[0].token_ids == cold.token_ids
    stats = first.stats()
    assert stats["disk_written_blocks"] >= 99 // 8  # the prompt's full blocks, written once
    assert stats["disk_written_bytes"] >= stats["disk_written_blocks"] * first.kv.bytes_per_block  # pages + header
    assert stats["disk_written_bytes_per_prompt_token"] == pytest.approx(stats["disk_written_bytes"] / 100)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as second:
        warm = second.generate(prompt, GREEDY)[0]
        stats = second.stats()
    assert warm.token_ids == cold.token_ids
    assert warm.cached_tokens == 96 and stats["disk_hit_tokens"] == 96 and stats["ram_hit_tokens"] == 0
    assert stats["disk_read_seconds"] > 0 and stats["disk_skipped_files"] == 0
    assert stats["disk_written_blocks"] <= 2  # only the reply's blocks are new


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_pages_answer_from_disk_with_their_cold_tokens(tokenizer, tmp_path, bits):
    """The disk tier stores a quantized block's packed words, scales and biases as they are: a new engine reading
    them gives the tokens the same quantized cache gives cold (not full precision's), and another kv_bits is
    another fingerprint, so it never reads them."""
    model, prompt = tiny_llama(3, seed=5, head_dim=64), random_tokens(100, seed=3)
    with disk_engine(model, tokenizer, tmp_path / "m", False, kv_bits=bits) as plain:
        cold = plain.generate(prompt, GREEDY)[0]
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", kv_bits=bits) as first:
        assert first.generate(prompt, GREEDY)[0].token_ids == cold.token_ids
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", kv_bits=bits) as second:
        warm = second.generate(prompt, GREEDY)[0]
        assert second.stats()["disk_hit_tokens"] == 96
    assert warm.token_ids == cold.token_ids
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", kv_bits=12 - bits) as other:
        other.generate(prompt, GREEDY)
        assert other.stats()["disk_hit_tokens"] == 0
    # Nor does the same kv_bits in other groups: a pool's logical shape is the same for groups of 32 and 64.
    other_groups = 96 - second.kv.quantization.group_size
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", kv_bits=bits, kv_group_size=other_groups) as e:
        e.generate(prompt, GREEDY)
        assert e.stats()["disk_hit_tokens"] == 0


def test_a_corrupt_block_file_ends_the_disk_hit_there_with_a_warning(model, tokenizer, tmp_path):
    prompt = random_tokens(100, seed=12)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        cold = first.generate(prompt, GREEDY)[0]
        chain = [first.kv_manager.hash_fn(None, tuple(prompt[:8]), first.kv_manager.extra_key)]
        for i in range(1, 5):
            chain.append(
                first.kv_manager.hash_fn(chain[-1], tuple(prompt[i * 8 : (i + 1) * 8]), first.kv_manager.extra_key)
            )
        path = first.core.tiering.tier.path(chain[4])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x55  # the fifth block's payload: its checksum no longer matches
    path.write_bytes(bytes(data))
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as second:
        with pytest.warns(RuntimeWarning, match="checksum"):
            warm = second.generate(prompt, GREEDY)[0]
        stats = second.stats()
    assert warm.token_ids == cold.token_ids
    assert warm.cached_tokens == stats["disk_hit_tokens"] == 4 * 8 and stats["disk_skipped_files"] == 1


def test_blocks_the_pool_evicts_go_to_disk_first(model, tokenizer, tmp_path):
    a, b, c = (random_tokens(120, seed=s) for s in (2, 3, 4))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)  # decode blocks too
    with disk_engine(model, tokenizer, tmp_path / "m", False, cache_tokens=256) as plain:
        cold_a = plain.generate(a, params)[0]
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", cache_tokens=256) as eng:
        assert eng.generate(a, params)[0].token_ids == cold_a.token_ids
        eng.generate(b, params)
        eng.generate(c, params)  # 3 x 160 tokens in a pool of fewer: a's blocks are evicted from RAM
        assert eng.pool.stats().evictions > 0
        again = eng.generate(a, params)[0]
        stats = eng.stats()
    assert again.token_ids == cold_a.token_ids
    assert stats["disk_hit_tokens"] > 0 and again.cached_tokens >= stats["disk_hit_tokens"]


def test_two_engines_on_one_directory(model, tokenizer, tmp_path):
    shared = random_tokens(64, seed=4)
    prompts = [shared + random_tokens(30, seed=s) for s in (5, 6, 7, 8)]
    with disk_engine(model, tokenizer, tmp_path / "m", False) as plain:
        cold = [c.token_ids for c in plain.generate(prompts, GREEDY)]
    one = disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv")
    two = disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv")
    try:
        got: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i, e=e: got.update({i: e.generate(prompts[i], GREEDY)[0].token_ids}))
            for i, e in enumerate([one, two, one, two])
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        one.close()
        two.close()
    assert [got[i] for i in range(4)] == cold
    # A third engine finds every prompt's blocks, whichever engine wrote them.
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as third:
        assert [c.token_ids for c in third.generate(prompts, GREEDY)] == cold
        stats = third.stats()
    # The first prompt reads its 11 full blocks from disk; the others find the shared 8 in RAM, then theirs on disk.
    assert stats["prefix_hit_tokens"] == 4 * 88 and stats["disk_hit_tokens"] == 88 + 3 * 24
    assert stats["disk_skipped_files"] == 0


def test_no_step_waits_for_a_disk_write(model, tokenizer, tmp_path, monkeypatch):
    release, entered = threading.Event(), threading.Event()
    real_write = DiskTier.write

    def blocked_write(self, block_hash, arrays):
        entered.set()
        release.wait(60)
        return real_write(self, block_hash, arrays)

    monkeypatch.setattr(DiskTier, "write", blocked_write)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as eng:
        eng.generate(random_tokens(200, seed=9), params)
        assert entered.wait(30)  # the writer is stuck inside its first write from here on
        start = time.perf_counter()
        out = eng.generate(random_tokens(200, seed=10), params)[0]  # every step of it runs while the writer waits
        assert len(out.token_ids) == 30 and time.perf_counter() - start < 30
        assert not release.is_set() and eng.stats()["disk_pending_bytes"] > 0
        release.set()
    assert len(list_entries(tmp_path / "kv")) >= 2 * (199 // 8)  # written once released (close waits for them)


def test_a_model_whose_prefix_cache_is_off_runs_without_the_disk_tier(tokenizer, tmp_path):
    with pytest.warns(RuntimeWarning, match="disk tier is off"):
        eng = disk_engine(tiny_hybrid_llama(), tokenizer, tmp_path / "m", tmp_path / "kv")
    with eng:
        stats = eng.stats()
        assert stats["disk_tier"] is False and "prefix cache is off" in stats["disk_tier_off"]
        assert len(eng.generate(random_tokens(40), GREEDY)[0].token_ids) == 12


RESTART_SCRIPT = """
import json, sys
import mlxpaged
from mlxpaged import Engine, SamplingParams
model_dir, disk, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with Engine.from_pretrained(model_dir, kv_disk=disk, cache_tokens=1024, block_size=16) as engine:
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
stats = engine.stats()  # after close: every block written
print(json.dumps({"tokens": out.token_ids, "cached": out.cached_tokens, "disk_hits": stats["disk_hit_tokens"],
                  "written": stats["disk_written_blocks"]}))
"""


def test_the_disk_tier_survives_a_process_restart(tmp_path):
    model_dir = write_tiny_llama_dir(tmp_path / "model", dtype="float32")
    prompt = random_tokens(150, seed=11, vocab=49152)

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", RESTART_SCRIPT, str(model_dir), str(tmp_path / "kv"), json.dumps(prompt)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["cached"] == 0 and cold["written"] >= 149 // 16
    assert warm["tokens"] == cold["tokens"]
    assert warm["cached"] == warm["disk_hits"] == 144
    assert np.isfinite(warm["cached"])
