"""The engine with LoRA / DoRA adapters against mlx-lm's own `generate_step` on the adapted model (load_adapters),
token for token; requests for several adapters and the base model in one batch, each as if alone; a prefix cache
that never serves one adapter's blocks to another; and adapters that do not fit, refused at load."""

from __future__ import annotations

import dataclasses
import functools
import queue
import time
from pathlib import Path

from mlxpaged.config import split_settings
from mlxpaged.engine import engine_thread
from mlxpaged.engine.engine import Engine
from mlxpaged.errors import AdapterError, UnknownAdapterError
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.sampling_params import SamplingParams
from tests.tiny_adapters import adapted_reference, reference_tokens, write_adapter
from tests.tiny_models import tiny_llama, tiny_qwen3, tiny_qwen3_5, write_tiny_model_dir

import mlx.core as mx
import pytest
from mlx_lm import load

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [
    [5, 17, 99, 3, 42, 7, 8, 1, 250, 64, 9, 11, 13, 14, 15, 16, 17, 18, 19],
    [2, 4, 6, 8, 10, 12, 14],
    [200, 100, 50, 25, 12, 6, 3, 1, 0, 1, 3, 6, 12, 25, 50, 100, 200, 100, 50, 25, 12, 6, 3],
]


def adapted_engine(make, tokenizer, adapters: dict, **settings) -> Engine:
    model = make()
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    loaded = LoadedModel(model, tokenizer, ModelRef("tiny", "path"), Path("tiny"), "float32", config)
    cache, scheduler = split_settings({"cache_tokens": 2048, "block_size": 8, **settings})
    return Engine(loaded, cache, scheduler, adapters=adapters)


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request, tokenizer, tmp_path_factory):
    """An engine serving a LoRA and a DoRA adapter of a tiny model, and mlx-lm's adapted twins of it."""
    make = functools.partial(tiny_llama, 3) if request.param == "llama" else tiny_qwen3
    root = tmp_path_factory.mktemp(request.param)
    paths = {
        "lora": write_adapter(make, root / "lora", "lora", seed=1, rank=4, scale=4.0, num_layers=2),
        "dora": write_adapter(make, root / "dora", "dora", seed=2, rank=8, keys=["self_attn.v_proj", "mlp.up_proj"]),
    }
    references = {None: make(), **{name: adapted_reference(make, path) for name, path in paths.items()}}
    with adapted_engine(make, tokenizer, paths) as engine:
        yield engine, references


def test_each_adapter_decodes_as_mlx_lm_does_with_it(setup):
    engine, references = setup
    for name, reference in references.items():
        for prompt in PROMPTS:
            got = engine.generate([prompt], GREEDY, adapter=name)[0].token_ids
            assert got == reference_tokens(reference, prompt, GREEDY.max_tokens), (name, prompt)


def test_batch_one_decode_with_an_adapter_runs_its_compiled_pass(setup):
    """Batch-1 decode with an adapter runs the adapter's compiled pass (runner/decode_pass.py), a batch of several
    adapters the eager one: both give mlx-lm's tokens (the tests beside this one)."""
    engine, _ = setup
    decoder = engine.core.runner.decoder
    assert decoder is not None, "the CPU backend compiles batch-1 decode"
    for name in ("lora", "dora"):
        engine.generate([PROMPTS[1]], dataclasses.replace(GREEDY, max_tokens=3), adapter=name)
        assert engine.adapters.resolve(name).id in decoder.compiled_adapters


def test_speculation_with_an_adapter_gives_its_greedy_tokens(tokenizer, tmp_path):
    """Prompt-lookup drafts verified by the adapted model (compiled verify chunks at batch 1): mlx-lm's tokens."""
    make = functools.partial(tiny_llama, 3)
    lora = write_adapter(make, tmp_path / "lora", seed=4, rank=4, scale=4.0)
    prompt = [11, 12, 13, 14, 15] * 3 + [11, 12]  # its last tokens occurred before: prompt lookup drafts 13, 14, ...
    params = dataclasses.replace(GREEDY, max_tokens=24)
    want = reference_tokens(adapted_reference(make, lora), prompt, params.max_tokens)
    with adapted_engine(make, tokenizer, {"lora": lora}, speculative="ngram", num_speculative_tokens=4) as engine:
        assert engine.generate([prompt], params, adapter="lora")[0].token_ids == want
        assert engine.stats()["spec_draft_tokens_total"] > 0  # verify chunks of drafts ran


def test_requests_for_several_adapters_share_the_batch_each_as_if_alone(setup):
    engine, references = setup
    names = [None, "lora", "dora", "lora", None, "dora"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    engine.pool.reset_prefix_cache()
    together = engine.generate(prompts, GREEDY, adapter=names)
    for prompt, name, got in zip(prompts, names, together, strict=True):
        assert got.token_ids == reference_tokens(references[name], prompt, GREEDY.max_tokens), name
    # the adapters do change what is generated: the test can tell them apart
    assert len({tuple(c.token_ids) for c in together[:3]}) == 3


def test_requests_over_many_lora_adapters_share_a_stacked_batch_each_as_if_alone(tokenizer, tmp_path):
    make = functools.partial(tiny_llama, 3)
    paths = {f"a{i}": write_adapter(make, tmp_path / f"a{i}", seed=10 + i, rank=4 + i) for i in range(4)}
    names = [None, "a0", "a1", "a2", "a3", "a1", None, "a3"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    references = {None: make(), **{n: adapted_reference(make, p) for n, p in paths.items()}}
    with adapted_engine(make, tokenizer, paths) as engine:
        together = engine.generate(prompts, GREEDY, adapter=names)
    for prompt, name, got in zip(prompts, names, together, strict=True):
        assert got.token_ids == reference_tokens(references[name], prompt, GREEDY.max_tokens), name


def tiny_moe(directory: Path):
    """A tiny qwen3_moe model directory, loaded by mlx-lm (the same random weights every time)."""
    if not (directory / "config.json").exists():
        write_tiny_model_dir(directory, "qwen3_moe", dtype="float32", seed=6)
    return load(str(directory))[0]


def test_adapters_on_a_hybrid_model_decode_as_mlx_lm_does(tokenizer, tmp_path):
    """A hybrid (gated-delta state layers beside attention): every linear layer of its last two layers adapted, as
    mlx_lm.lora does by default."""
    make = tiny_qwen3_5
    path = write_adapter(make, tmp_path / "adapter", seed=3)
    references = {None: make(), "a": adapted_reference(make, path)}
    with adapted_engine(make, tokenizer, {"a": path}) as engine:
        names = ["a", None, "a"]
        together = engine.generate(PROMPTS, GREEDY, adapter=names)
    for prompt, name, got in zip(PROMPTS, names, together, strict=True):
        assert got.token_ids == reference_tokens(references[name], prompt, GREEDY.max_tokens), name
    assert together[0].token_ids != reference_tokens(references[None], PROMPTS[0], GREEDY.max_tokens)


def test_adapters_of_moe_switch_layers_decode_as_mlx_lm_does(tokenizer, tmp_path):
    """A mixture-of-experts model adapted as mlx_lm.lora adapts it by default: attention, router and the switch layers
    of the experts (LoRASwitchLinear, an update per expert). Requests for two such adapters and the base model run
    together, each as alone (the step runs a pass per adapter); a 40-token prompt has its tokens sorted by expert."""
    make = functools.partial(tiny_moe, tmp_path / "moe")
    paths = {"a": write_adapter(make, tmp_path / "a", seed=3), "b": write_adapter(make, tmp_path / "b", seed=8)}
    assert any(".switch_mlp." in name for name in mx.load(str(paths["a"] / "adapters.safetensors")))
    references = {None: make(), **{n: adapted_reference(make, p) for n, p in paths.items()}}
    prompts = [*PROMPTS, list(range(3, 43))]
    names = ["a", None, "b", "a"]
    with adapted_engine(make, tokenizer, paths) as engine:
        assert engine.adapters.rows.one_adapter_per_pass
        together = engine.generate(prompts, GREEDY, adapter=names)
        alone = engine.generate([prompts[3]], GREEDY, adapter="b")[0].token_ids  # compiled batch-1 decode
    for prompt, name, got in zip(prompts, names, together, strict=True):
        assert got.token_ids == reference_tokens(references[name], prompt, GREEDY.max_tokens), name
    assert alone == reference_tokens(references["b"], prompts[3], GREEDY.max_tokens)
    assert together[0].token_ids != reference_tokens(references[None], PROMPTS[0], GREEDY.max_tokens)


def test_an_adapter_of_a_switch_layer_with_other_experts_is_refused(tokenizer, tmp_path):
    make = functools.partial(tiny_moe, tmp_path / "moe")
    path = write_adapter(make, tmp_path / "a", seed=3)
    weights = mx.load(str(path / "adapters.safetensors"))
    name = next(n for n in weights if ".switch_mlp." in n and n.endswith("lora_a"))
    weights[name] = weights[name][:-1]
    weights[name.replace("lora_a", "lora_b")] = weights[name.replace("lora_a", "lora_b")][:-1]
    mx.save_safetensors(str(path / "adapters.safetensors"), weights)
    with pytest.raises(AdapterError, match=r"experts of .* the adapter's"):
        adapted_engine(make, tokenizer, {"a": path})


def test_preempted_adapted_requests_resume_as_mlx_lm_decodes_them(tokenizer, tmp_path):
    make = functools.partial(tiny_llama, 3)
    paths = {"a": write_adapter(make, tmp_path / "a", seed=21), "b": write_adapter(make, tmp_path / "b", seed=22)}
    references = {None: make(), **{n: adapted_reference(make, p) for n, p in paths.items()}}
    prompts, names = [list(range(30 + 7 * i, 50 + 7 * i)) for i in range(4)], ["a", None, "b", "a"]
    params = dataclasses.replace(GREEDY, max_tokens=40)
    # 4 x 60 tokens need 32 blocks of 8; this pool has 8 + 4 = 12.
    with adapted_engine(make, tokenizer, paths, cache_tokens=64, max_num_seqs=4) as tight:
        got = tight.generate(prompts, params, adapter=names)
        assert tight.stats()["preemptions"] > 0
    for prompt, name, completion in zip(prompts, names, got, strict=True):
        assert completion.token_ids == reference_tokens(references[name], prompt, params.max_tokens), name


def test_the_prefix_cache_serves_each_adapter_its_own_blocks_only(setup):
    engine, references = setup
    prompt = PROMPTS[2]
    engine.pool.reset_prefix_cache()
    first = engine.generate([prompt], GREEDY, adapter="lora")[0]
    assert first.cached_tokens == 0
    for other in [None, "dora"]:  # the same tokens under another adapter (or none) hit nothing
        cold = engine.generate([prompt], GREEDY, adapter=other)[0]
        assert cold.cached_tokens == 0, other
    again = engine.generate([prompt], GREEDY, adapter="lora")[0]
    assert again.cached_tokens >= 16  # its own blocks: a hit, and the same tokens as cold
    assert again.token_ids == first.token_ids == reference_tokens(references["lora"], prompt, GREEDY.max_tokens)


def test_a_partial_block_is_not_served_across_adapters_either(setup):
    engine, references = setup
    short, params = [2, 4, 6], dataclasses.replace(GREEDY, max_tokens=4)  # 7 tokens: all in one partial block of 8
    engine.pool.reset_prefix_cache()
    engine.generate([short], params)  # the base model leaves a partial block holding its tokens
    for name in ["lora", "dora", None]:
        got = engine.generate([short], params, adapter=name)[0]
        assert got.cached_tokens == (len(short) - 1 if name is None else 0), name
        assert got.token_ids == reference_tokens(references[name], short, params.max_tokens), name
    assert engine.generate([short], params, adapter="lora")[0].cached_tokens == len(short) - 1


def test_n_sequences_of_an_adapted_request_all_use_its_adapter(setup):
    engine, references = setup
    params = dataclasses.replace(GREEDY, n=2)
    got = engine.generate([PROMPTS[1]], params, adapter="dora")
    want = reference_tokens(references["dora"], PROMPTS[1], GREEDY.max_tokens)
    assert [c.token_ids for c in got] == [want, want]


def test_an_unknown_adapter_is_refused_at_submission(setup):
    engine, _ = setup
    with pytest.raises(UnknownAdapterError, match=r"'nope'; this engine serves: '(lora|dora)', '(lora|dora)'"):
        engine.generate([PROMPTS[0]], GREEDY, adapter="nope")
    assert engine.generate([PROMPTS[1]], GREEDY)[0].token_ids  # and the engine goes on


def test_an_engine_without_adapters_refuses_one_by_name(tokenizer):
    with adapted_engine(tiny_qwen3, tokenizer, {}) as engine, pytest.raises(UnknownAdapterError, match="serves: none"):
        engine.generate([PROMPTS[0]], GREEDY, adapter="lora")


def test_adapters_added_and_removed_while_the_engine_serves(tokenizer, tmp_path):
    make = tiny_qwen3
    lora = write_adapter(make, tmp_path / "lora", seed=4)
    misfit = write_adapter(functools.partial(tiny_llama, 3), tmp_path / "misfit", seed=5)
    with adapted_engine(make, tokenizer, {}) as engine:
        base = engine.generate([PROMPTS[0]], GREEDY)[0].token_ids
        assert engine.add_adapter("late", lora)["fine_tune_type"] == "lora"
        want = reference_tokens(adapted_reference(make, lora), PROMPTS[0], GREEDY.max_tokens)
        assert engine.generate([PROMPTS[0]], GREEDY, adapter="late")[0].token_ids == want != base
        decoder, late_id = engine.core.runner.decoder, engine.adapters.resolve("late").id
        assert late_id in decoder.compiled_adapters  # batch-1 decode with it ran compiled
        with pytest.raises(AdapterError, match="does not fit this model"):
            engine.add_adapter("misfit", misfit)
        with pytest.raises(AdapterError, match="served already"):
            engine.add_adapter("late", lora)
        stream = engine.stream(PROMPTS[1], dataclasses.replace(GREEDY, max_tokens=200), adapter="late")
        next(stream)  # a request runs with it: it stays
        with pytest.raises(AdapterError, match="1 unfinished request"):
            engine.remove_adapter("late")
        stream.close()
        deadline = time.monotonic() + 10
        while engine.stats()["requests_running"] + engine.stats()["requests_waiting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.remove_adapter("late")
        assert late_id not in decoder.compiled_adapters  # its graphs (holding its arrays) went with it
        with pytest.raises(UnknownAdapterError):
            engine.generate([PROMPTS[0]], GREEDY, adapter="late")
        assert engine.generate([PROMPTS[0]], GREEDY)[0].token_ids == base  # the base model, unchanged throughout


def test_a_request_for_an_adapter_removed_before_it_started_fails_alone(setup):
    engine, _ = setup
    got: queue.Queue = queue.Queue()
    engine._commands.put(engine_thread.Add("late-req", PROMPTS[0], GREEDY, got.put, adapter="no-such-digest"))
    assert isinstance(got.get(timeout=10), UnknownAdapterError)
    assert engine.generate([PROMPTS[1]], GREEDY, adapter="lora")[0].token_ids  # the others go on


def test_an_adapter_for_another_model_is_refused_at_load_with_its_layers(tokenizer, tmp_path):
    deeper = write_adapter(functools.partial(tiny_llama, 4), tmp_path / "deep", num_layers=1)  # adapts layer 3
    with pytest.raises(AdapterError, match=r"does not fit this model:\n  model\.layers\.3\..*no such layer"):
        adapted_engine(functools.partial(tiny_llama, 3), tokenizer, {"deep": deeper})
    other = write_adapter(tiny_qwen3, tmp_path / "qwen3", num_layers=1, keys=["self_attn.q_proj"])
    with pytest.raises(AdapterError, match=r"q_proj: takes 32 inputs to 64 outputs, the adapter 64 to 64"):
        adapted_engine(functools.partial(tiny_llama, 3, hidden_size=32), tokenizer, {"qwen3": other})
