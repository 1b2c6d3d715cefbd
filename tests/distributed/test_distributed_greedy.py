"""The paged engine over 2 and 4 processes (the ring backend on loopback) decodes what it decodes in one,
token for token: prompts alone, batched, a prefix-cache hit, n = 2 (a fork's block copy), and preemption in a
pool too small for all."""

from __future__ import annotations

import json
from pathlib import Path

from mlxpaged.engine.engine import Engine
from tests.distributed.greedy_ranks import completions
from tests.distributed.launch import result_line, run_script
from tests.tiny_models import random_tokens, write_tiny_llama_dir, write_tiny_model_dir

import pytest

SCRIPT = Path(__file__).with_name("greedy_ranks.py")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # 4 KV heads: they split over 2 and over 4 ranks
    return write_tiny_llama_dir(tmp_path_factory.mktemp("dist") / "model", dtype="float32", kv_heads=4)


@pytest.fixture(scope="module")
def one_process(model_dir) -> dict:
    return run(model_dir, 1)


def prompts() -> list[list[int]]:
    # ragged, and the first one spans two full 16-token blocks so running it again hits the prefix cache
    return [
        random_tokens(40, seed=1, vocab=49152),
        random_tokens(7, seed=2, vocab=49152),
        random_tokens(23, seed=3, vocab=49152),
    ]


def run(
    model_dir: Path, processes: int, batch: list[list[int]] | None = None, max_tokens: int = MAX_TOKENS, **settings
) -> dict:
    """greedy_ranks.py's result over `processes` ranks; one process runs in this one (start_engine alone is
    Engine.from_pretrained), which spares an interpreter's start and imports."""
    settings = {"cache_tokens": 2048, "block_size": 16, "max_num_seqs": 4, **settings}
    if processes == 1:
        settings.pop("parallel", None)  # start_engine ignores it alone
        with Engine.from_pretrained(str(model_dir), **settings) as engine:
            return completions(engine, batch or prompts(), max_tokens)
    args = [str(model_dir), json.dumps(batch or prompts()), str(max_tokens), json.dumps(settings)]
    return result_line(run_script(SCRIPT, args, processes))


@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: slow
def test_several_processes_decode_what_one_does(model_dir, one_process, processes):
    assert_same_decoding(one_process, run(model_dir, processes), processes)


@pytest.mark.slow  # two more architectures mlx-lm shards, 2 processes each
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_qwen3_and_its_mixture_of_experts_over_two_processes(tmp_path, model_type):
    model_dir = write_tiny_model_dir(tmp_path / model_type, model_type, dtype="float32", kv_heads=4)
    assert_same_decoding(run(model_dir, 1), run(model_dir, 2), 2)


def assert_same_decoding(one: dict, many: dict, processes: int) -> None:
    assert many["pool_shape"][1] * processes == one["pool_shape"][1]  # each rank holds its share of the KV heads
    assert many["num_blocks"] == one["num_blocks"]
    assert many["alone"] == one["alone"]
    assert many["batched"] == one["batched"] == one["alone"]
    assert many["again"] == one["again"] == one["alone"][0]
    assert many["again_cached"] == one["again_cached"] == 32  # two full blocks of the 40-token prompt
    assert many["forked"] == one["forked"] == [one["alone"][1]] * 2


def test_two_processes_preempt_as_one_does(model_dir):
    # four 10-token prompts are admitted, then each grows to 3 blocks of 16: more than the pool holds
    batch = [random_tokens(10, seed=s, vocab=49152) for s in (4, 5, 6, 7)]
    one, two = (run(model_dir, n, batch, max_tokens=30, cache_tokens=96) for n in (1, 2))
    assert one["num_blocks"] < 4 * 3 and one["preemptions"] > 0
    assert two["preemptions"] == one["preemptions"]
    assert two["batched"] == one["batched"] == one["alone"]
    assert two["alone"] == one["alone"]


@pytest.mark.slow  # 4 launches; quantized pages over 2 processes
@pytest.mark.parametrize("kv_bits", [8, 4])
def test_quantized_pages_over_two_processes(tmp_path, kv_bits):
    """Each rank quantizes its share of the KV heads as written (at 4 bits each calibrates its own heads'
    coordinates: the same prefill on every rank, so the model's all-reduces line up)."""
    model_dir = write_tiny_model_dir(
        tmp_path / "llama64", "llama", dtype="float32", kv_heads=4, head_dim=64, num_attention_heads=4
    )
    one, two = run(model_dir, 1, kv_bits=kv_bits), run(model_dir, 2, kv_bits=kv_bits)
    assert one["pools"] == two["pools"] == 2 * 2 * 3  # 2 layers' K and V, each data, scales and biases
    assert_same_decoding(one, two, 2)
