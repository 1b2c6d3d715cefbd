"""Pipeline parallel (mlx-lm's pipeline(): each rank keeps a run of whole layers) over 2 and 4 processes
(the ring backend on loopback) decodes what one process does, token for token: prompts alone, batched, a
prefix-cache hit, n = 2, preemption; each rank's pools and memory plan hold its own layers only; and a model that
cannot be split as asked is refused at load on every rank with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.distributed.launch import free_port_run, launcher_path, result_line, run_script
from tests.distributed.test_distributed_greedy import MAX_TOKENS, prompts, run
from tests.tiny_models import random_tokens, write_tiny_llama_dir, write_tiny_model_dir

import pytest

POOLS_SCRIPT = Path(__file__).with_name("pools_ranks.py")
BROKEN_COMPILE_SCRIPT = Path(__file__).with_name("broken_compile_ranks.py")
LAYERS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # qwen2: mlx-lm pipelines it; 4 layers split over 2 and 4 ranks, its 2 KV heads not over 4
    return write_tiny_model_dir(tmp_path_factory.mktemp("pipe") / "qwen2", "qwen2", "float32", layers=LAYERS)


@pytest.fixture(scope="module")
def one_process(model_dir) -> dict:
    return run(model_dir, 1)


def test_pipeline_over_two_processes_decodes_what_one_does(model_dir, one_process):
    two = run(model_dir, 2, parallel="pipeline")  # forced: mlx-lm could shard qwen2's heads over 2
    assert two["parallel"] == "pipeline"
    assert_same_decoding(one_process, two, 2)


@pytest.mark.slow  # 4 ranks on 2 cores
def test_four_processes_fall_back_to_pipeline_and_decode_what_one_does(model_dir, one_process):
    four = run(model_dir, 4)  # 2 KV heads do not split over 4 ranks: pipeline parallel, one layer each
    assert four["parallel"] == "pipeline"
    assert_same_decoding(one_process, four, 4)


@pytest.mark.slow  # another architecture mlx-lm pipelines: a mixture of experts (it also shards: forced)
def test_qwen3_moe_pipelined_over_two_processes_decodes_what_one_does(tmp_path):
    model_dir = write_tiny_model_dir(tmp_path / "qwen3_moe", "qwen3_moe", "float32", layers=LAYERS)
    two = run(model_dir, 2, parallel="pipeline")
    assert two["parallel"] == "pipeline"
    assert_same_decoding(run(model_dir, 1), two, 2)


def assert_same_decoding(one: dict, many: dict, processes: int) -> None:
    assert many["pool_shape"] == one["pool_shape"]  # every KV head of a layer on the rank that holds it
    assert many["pools"] * processes == one["pools"]  # rank 0 holds its share of the layers' pools
    assert many["num_blocks"] == one["num_blocks"]
    assert many["alone"] == one["alone"]
    assert many["batched"] == one["batched"] == one["alone"]
    assert many["again"] == one["again"] == one["alone"][0]
    assert many["again_cached"] == one["again_cached"] >= 32  # at least two full blocks of the 40-token prompt
    assert many["forked"] == one["forked"] == [one["alone"][1]] * 2


@pytest.mark.slow  # two more launches; the pipeline's passes are the same as in the test above
def test_pipeline_preempts_as_one_does(model_dir):
    # four 10-token prompts are admitted, then each grows to 3 blocks of 16: more than the pool holds
    batch = [random_tokens(10, seed=s, vocab=49152) for s in (4, 5, 6, 7)]
    one, two = (run(model_dir, n, batch, max_tokens=30, cache_tokens=96, parallel="pipeline") for n in (1, 2))
    assert one["num_blocks"] < 4 * 3 and one["preemptions"] > 0
    assert two["preemptions"] == one["preemptions"]
    assert two["batched"] == one["batched"] == one["alone"]
    assert two["alone"] == one["alone"]


@pytest.mark.slow  # one more launch, for a failure no model here has any more
def test_a_compiled_pass_failing_on_one_rank_falls_back_on_all(model_dir, one_process):
    settings = {"cache_tokens": 2048, "block_size": 16, "max_num_seqs": 4, "parallel": "pipeline"}
    args = [str(model_dir), json.dumps(prompts()), str(MAX_TOKENS), json.dumps(settings)]
    done = run_script(BROKEN_COMPILE_SCRIPT, args, 2)  # rank 1's trace fails; it hung rank 0's warm-up before
    assert result_line(done)["alone"] == one_process["alone"]
    assert "compiled decode is off for this model (AttributeError(\"this rank's stage" in done.stderr
    assert "compiled decode is off for this model (RuntimeError('the compiled decode pass failed on another" in (
        done.stderr
    )


def test_each_rank_holds_only_its_layers_weights_pools_and_memory(model_dir):
    settings = json.dumps({"kv_memory": "4MB", "block_size": 16})  # sized by memory: the plan shows each rank's
    (one,) = ranks_built(run_script(POOLS_SCRIPT, [str(model_dir), "auto", settings], 1))
    ranks = ranks_built(run_script(POOLS_SCRIPT, [str(model_dir), "pipeline", settings], 2))
    assert one["weight_layers"] == list(range(LAYERS)) and one["kv_layers"] == LAYERS
    # mlx-lm's split: the last rank runs the first layers, rank 0 the last ones (it ends with the logits)
    assert [r["layers"] for r in ranks] == [[2, 4], [0, 2]]
    for rank in ranks:
        assert rank["parallel"] == "pipeline"
        assert rank["weight_layers"] == list(range(*rank["layers"]))  # no other rank's weights were read
        assert rank["kv_layers"] == 2 and rank["pools"] * 2 == one["pools"]  # no pools for the others' layers
        assert rank["pool_shape"][1:] == one["pool_shape"][1:]
        assert rank["bytes_per_block"] * 2 == one["bytes_per_block"]
        # the same KV memory holds twice the blocks of half the layers; both ranks planned the same
        assert rank["num_blocks"] == rank["pool_shape"][0] == 2 * one["num_blocks"]


def ranks_built(done: subprocess.CompletedProcess) -> list[dict]:
    """Every rank's line from pools_ranks.py, by rank."""
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    lines = [json.loads(line.removeprefix("RANK ")) for line in done.stdout.splitlines() if line.startswith("RANK ")]
    return sorted(lines, key=lambda line: line["rank"])


def test_serve_pipeline_on_a_model_mlx_lm_only_shards_is_refused_on_every_rank(tmp_path):
    model_dir = write_tiny_llama_dir(tmp_path / "llama", dtype="float32")  # llama: shard() but no pipeline()
    command = [str(Path(sys.executable).with_name("mlxpaged")), "serve", "--model", str(model_dir), "--port", "0"]
    launcher = [launcher_path(), "--backend", "ring", "-n", "2", "--starting-port", str(free_port_run(2))]
    done = subprocess.run([*launcher, "--", *command, "--pipeline"], capture_output=True, text=True, timeout=120)
    reason = (
        "cannot run this model over 2 processes with pipeline parallelism: mlx-lm has no pipeline parallelism "
        "(a pipeline() method) for model type 'llama'"
    )
    assert f"mlxpaged serve: {reason}" in done.stderr, done.stderr[-3000:]
    assert f"mlxpaged serve (follower rank 1): {reason}" in done.stderr
    assert "ready at" not in done.stdout
