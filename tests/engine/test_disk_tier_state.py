"""The disk tier for a model with state layers (tiny Qwen 3.5: gated-delta linear attention + full attention):
state checkpoints go to disk beside the KV blocks (engine/state_tiering.py), so a prompt seen by an earlier
engine, or an earlier process, resumes from disk at its last checkpoint with the tokens a cold run gives; a
corrupt or truncated checkpoint file is skipped with a warning and the request resumes at an earlier one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mlxpaged.cache.disk_tier import list_entries
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_disk_tier_engine import disk_engine
from tests.tiny_models import random_tokens, tiny_qwen3_5

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5()


def chain_hashes(engine, tokens: list[int], n: int) -> list[bytes]:
    manager, hashes = engine.kv_manager, []
    for i in range(n):
        block = tuple(tokens[i * 8 : (i + 1) * 8])
        hashes.append(manager.hash_fn(hashes[-1] if hashes else None, block, manager.extra_key))
    return hashes


def test_a_new_engine_resumes_a_state_model_from_disk_with_the_cold_tokens(model, tokenizer, tmp_path):
    prompt = random_tokens(100, seed=21)
    with disk_engine(model, tokenizer, tmp_path / "m", False) as plain:
        cold = plain.generate(prompt, GREEDY)[0]
        assert plain.stats()["disk_tier"] is False
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as first:
        assert first.generate(prompt, GREEDY)[0].token_ids == cold.token_ids
        assert first.stats()["disk_tier_off"] is None
    stats = first.stats()  # after close: everything written
    assert stats["disk_state_written"] >= 1 and stats["disk_written_blocks"] >= 99 // 8
    states = [e for e in list_entries(tmp_path / "kv") if e.path.suffix == ".kvs"]
    assert len(states) == stats["disk_state_written"]
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv") as second:
        warm = second.generate(prompt, GREEDY)[0]
        stats = second.stats()
    assert warm.token_ids == cold.token_ids
    # The prefill ended at the prompt's last block boundary (96), checkpointed there: it resumes from it.
    assert warm.cached_tokens == 96 and stats["disk_hit_tokens"] == 96 and stats["disk_state_hits"] == 1
    assert stats["disk_state_read_ahead"] == 1  # read by a reader thread while the blocks loaded
    assert stats["disk_skipped_files"] == stats["disk_state_skipped_files"] == 0


def test_a_corrupt_or_truncated_checkpoint_resumes_at_an_earlier_one(model, tokenizer, tmp_path):
    """Chunks of 32 tokens checkpoint after blocks 4, 8 and 12; the last is corrupted, the one before truncated:
    the request resumes after block 4 with a warning for each, and still gives the cold tokens."""
    prompt, chunked = random_tokens(100, seed=22), {"max_batch_tokens": 32, "max_num_seqs": 4}
    with disk_engine(model, tokenizer, tmp_path / "m", False, **chunked) as plain:
        cold = plain.generate(prompt, GREEDY)[0]
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", **chunked) as first:
        assert first.generate(prompt, GREEDY)[0].token_ids == cold.token_ids
        hashes = chain_hashes(first, prompt, 12)
        paths = {n: first.core.tiering.states.tier.path(hashes[n - 1]) for n in (4, 8, 12)}
    assert all(p.is_file() for p in paths.values())
    data = bytearray(paths[12].read_bytes())
    data[-5] ^= 0x5A  # the payload: its checksum no longer matches
    paths[12].write_bytes(bytes(data))
    paths[8].write_bytes(paths[8].read_bytes()[:-100])
    with disk_engine(model, tokenizer, tmp_path / "m", tmp_path / "kv", **chunked) as second:
        with pytest.warns(RuntimeWarning) as caught:
            warm = second.generate(prompt, GREEDY)[0]
        stats = second.stats()
    messages = " ".join(str(w.message) for w in caught)
    assert "checksum" in messages and "truncated" in messages
    assert warm.token_ids == cold.token_ids
    assert warm.cached_tokens == 32 and stats["disk_state_skipped_files"] == 2 and stats["disk_state_hits"] == 1


RESTART_SCRIPT = """
import json, sys
from pathlib import Path
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlxpaged.loading.loader import locate_model
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_disk_tier_engine import disk_engine
from tests.tiny_models import tiny_qwen3_5
model_dir, disk, prompt = Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
tokenizer = load_tokenizer(locate_model(None)[1])
with disk_engine(tiny_qwen3_5(), tokenizer, model_dir, disk) as engine:
    out = engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
stats = engine.stats()  # after close: everything written
print(json.dumps({"tokens": out.token_ids, "cached": out.cached_tokens, "disk_hits": stats["disk_hit_tokens"],
                  "state_hits": stats["disk_state_hits"], "states_written": stats["disk_state_written"]}))
"""


def test_a_state_model_resumes_from_disk_after_a_process_restart(tmp_path):
    prompt = random_tokens(150, seed=23)

    def run() -> dict:
        done = subprocess.run(
            [sys.executable, "-c", RESTART_SCRIPT, str(tmp_path / "m"), str(tmp_path / "kv"), json.dumps(prompt)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["cached"] == 0 and cold["states_written"] >= 1
    assert warm["tokens"] == cold["tokens"]
    assert warm["cached"] == warm["disk_hits"] == 144 and warm["state_hits"] == 1
