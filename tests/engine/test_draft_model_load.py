"""A draft model through the public API (`Engine.from_pretrained(..., draft_model=)`): planned with the target before
either is read, refused at load with the reason (another tokenizer, layers that cannot roll back, a setting that
contradicts it), and exact against plain decoding, with 8-bit pages too, and on the real embedded model."""

from __future__ import annotations

import json
import re

from mlxpaged import Engine, SamplingParams
from mlxpaged.errors import ConfigError, InsufficientMemoryError
from tests.tiny_models import random_tokens, write_tiny_model_dir

import pytest

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft-pairs")
    return {
        "target": write_tiny_model_dir(root / "target", "llama", dtype="float32", seed=1, layers=3, head_dim=32),
        "draft": write_tiny_model_dir(root / "draft", "qwen3", dtype="float32", seed=2, layers=1, head_dim=32),
        "hybrid": write_tiny_model_dir(
            root / "hybrid",
            "llama",
            dtype="float32",
            seed=3,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=8,
        ),
        "other-tokens": _other_tokenizer(write_tiny_model_dir(root / "other", "llama", dtype="float32", seed=4)),
    }


def _other_tokenizer(path):
    """The same model with two tokens' ids swapped: a tokenizer that looks alike and is not."""
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_draft_model_pair_gives_the_targets_plain_tokens(dirs, kv_bits):
    prompts = [random_tokens(n, seed=n, vocab=49152) for n in (9, 30, 17)]
    settings = {"cache_tokens": 2048, **({"kv_bits": kv_bits} if kv_bits else {})}
    with Engine.from_pretrained(str(dirs["target"]), **settings) as engine:
        expected = generate(engine, prompts)
    with Engine.from_pretrained(str(dirs["target"]), draft_model=str(dirs["draft"]), **settings) as engine:
        assert generate(engine, prompts) == expected
        stats = engine.stats()
        assert stats["speculative"] == "draft" and stats["draft_model"] == str(dirs["draft"])
        assert stats["spec_draft_tokens_total"] > 0
        # one block id stands for a page in both models' pools: the plan counted both per block
        draft_kv = engine.built.draft.kv
        assert draft_kv.space_blocks == engine.kv.space_blocks
        assert engine.plan.block_bytes == engine.kv.bytes_per_block + draft_kv.bytes_per_block


def test_the_target_drafting_for_itself_keeps_every_greedy_draft(dirs):
    with Engine.from_pretrained(str(dirs["target"]), draft_model=str(dirs["target"]), cache_tokens=2048) as engine:
        generate(engine, [random_tokens(20, seed=3, vocab=49152)])
        stats = engine.stats()
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] > 0


def test_a_disk_hit_after_a_restart_keeps_the_draft_right(dirs, tmp_path):
    """The disk tier keeps the model's pages only: after a restart the draft computes its own pages for the blocks read
    back (the target drafting for itself keeps every draft only if it does), and the model's are not recomputed."""
    prompt = random_tokens(70, seed=9, vocab=49152)
    settings = {"cache_tokens": 2048, "kv_disk": str(tmp_path / "kv"), "draft_model": str(dirs["target"])}
    with Engine.from_pretrained(str(dirs["target"]), **settings) as engine:
        first = engine.generate([prompt], GREEDY)[0]
    with Engine.from_pretrained(str(dirs["target"]), **settings) as engine:
        again = engine.generate([prompt], GREEDY)[0]
        stats = engine.stats()
    assert again.token_ids == first.token_ids and again.cached_tokens >= 64  # four blocks of 16 from disk
    assert stats["spec_accepted_tokens_total"] == stats["spec_draft_tokens_total"] > 0


def test_another_tokenizer_is_refused_at_load(dirs):
    with pytest.raises(ConfigError, match="another tokenizer") as info:
        Engine.from_pretrained(str(dirs["target"]), draft_model=str(dirs["other-tokens"]), cache_tokens=2048)
    assert info.value.param == "draft_model" and "2 differ" in str(info.value)


def test_layers_that_cannot_roll_back_are_refused_before_anything_is_built(dirs):
    hybrid = re.escape(str(dirs["hybrid"]))
    with pytest.raises(ConfigError, match=f"the draft model '{hybrid}' has sliding-window"):
        Engine.from_pretrained(str(dirs["target"]), draft_model=str(dirs["hybrid"]), cache_tokens=2048)
    with pytest.raises(ConfigError, match=f"the model '{hybrid}' has sliding-window"):
        Engine.from_pretrained(str(dirs["hybrid"]), draft_model=str(dirs["target"]), cache_tokens=2048)


def test_settings_that_contradict_the_draft_model_are_refused(dirs):
    with pytest.raises(ConfigError, match="needs a draft model"):
        Engine.from_pretrained(str(dirs["target"]), speculative="draft", cache_tokens=2048)
    with pytest.raises(ConfigError, match="not speculative='ngram'"):
        Engine.from_pretrained(str(dirs["target"]), draft_model=str(dirs["draft"]), speculative="ngram")


def test_a_pair_that_does_not_fit_is_refused_before_either_is_read(dirs, monkeypatch):
    """The plan counts the draft's pages: a KV budget that holds the target's pages for the context asked, but not
    the target's and the draft's, is refused before any weight is read."""
    from mlxpaged.engine import engine as engine_module

    class Loading(Exception):
        pass

    def load_local(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(engine_module, "load_local", load_local)
    per_token = 3 * 2 * 2 * 32 * 4  # the target's 3 layers: K and V, 2 heads of 32, float32
    settings = {"kv_memory": per_token * 2048, "max_model_len": 2000}
    with pytest.raises(Loading):  # the target alone fits: its load starts
        Engine.from_pretrained(str(dirs["target"]), **settings)
    with pytest.raises(InsufficientMemoryError):
        Engine.from_pretrained(str(dirs["target"]), draft_model=str(dirs["target"]), **settings)


@pytest.mark.slow
def test_the_real_model_with_a_random_draft_of_its_tokenizer_answers_as_it_does_alone(default_loaded, dirs):
    """The embedded model's answer is the same with a draft whose proposals are nearly always wrong."""
    from mlxpaged.config import CacheConfig, SchedulerConfig
    from mlxpaged.engine.engine import Engine as EngineClass
    from mlxpaged.loading.loader import load_local, locate_model

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    short = SamplingParams(temperature=0.0, max_tokens=10)
    with EngineClass(default_loaded, CacheConfig(cache_tokens=2048)) as engine:
        expected = engine.chat(messages, short).token_ids
    ref, path = locate_model(str(dirs["draft"]))

    with EngineClass(
        default_loaded,
        CacheConfig(cache_tokens=2048),
        SchedulerConfig(speculative="draft"),
        draft=load_local(ref, path),
    ) as engine:
        assert engine.chat(messages, short).token_ids == expected
