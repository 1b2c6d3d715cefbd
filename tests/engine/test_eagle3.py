"""Drafting with an EAGLE-3 head (runner/chained_drafter.py, loading/eagle3_model.py): a tiny random head reading
three layers of a tiny random model (a llama; a Qwen 3.5 hybrid), with a draft vocabulary of half the model's and its
map back, gives the model's own tokens, alone and batched, seeded, with a prefix hit, after preemption; and every run of
drafts is what mlx-vlm's own EAGLE-3 drafter drafts from the same weights without pages, fed the model's layer outputs
of a plain forward pass. Through the public API from a checkpoint directory, and refused with the reason when it was
made for another model or is not an EAGLE-3 head."""

from __future__ import annotations

import dataclasses
import json

from mlxpaged import Engine
from mlxpaged.config import CacheConfig
from mlxpaged.engine.hidden_drafters import eagle3_drafter
from mlxpaged.errors import ConfigError
from mlxpaged.loading.eagle3_model import Eagle3Config, Eagle3Head
from tests.engine.test_dflash import layer_outputs, make_core, plain, target  # noqa: F401  (fixture, shared)
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_mtp import GREEDY, PROMPTS, SEEDED, check, full, known_drafts, run
from tests.tiny_models import random_tokens, write_tiny_model_dir

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

LAYER = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
}
CONFIG = {
    "speculators_model_type": "eagle3",
    "transformer_layer_config": LAYER,
    "draft_vocab_size": 128,
    "eagle_aux_hidden_state_layer_ids": [1, 2, 3],  # the outputs of layers 0, 1 and 2
}


def random_head(config: dict = CONFIG, seed: int = 31) -> Eagle3Head:
    mx.random.seed(seed)
    head = Eagle3Head(Eagle3Config.from_dict(config, "tiny"))
    head.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, head.parameters()))
    draft = config["draft_vocab_size"]
    head.d2t = mx.array([2 * d + d % 2 - d for d in range(draft)], dtype=mx.int32)  # draft id d -> 2d + d % 2
    mx.eval(head.parameters())
    return head


def eagle3_core(model, head, tokenizer, continuations, k: int = 3, **scheduling):
    head.embed_tokens = model.model.embed_tokens  # a head without an embedding of its own uses the model's
    core = make_core(model, tokenizer, speculative="eagle3", num_speculative_tokens=k, **scheduling)
    attached = eagle3_drafter(head, "tiny", core.runner, CacheConfig(block_size=8), mx.float32, vocab_size=256)
    core.speculator.model = attached
    known_drafts(core, attached, continuations)
    return core


def mlx_vlm_reference(model, head):
    """(tokens, k) -> the k drafts mlx-vlm's Eagle3DraftModel makes after `tokens` (the last is the row's): prefilled
    from every earlier position's layer outputs and the token after it, then drafting a block."""
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config as TheirConfig
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel

    reference = Eagle3DraftModel(TheirConfig.from_dict(CONFIG))
    weights = [(name, w) for name, w in tree_flatten(head.parameters()) if not name.startswith("embed_tokens.")]
    reference.load_weights([*weights, ("embed_tokens.weight", model.model.embed_tokens.weight)], strict=True)
    reference.d2t = head.d2t

    def drafts(tokens: list[int], k: int) -> list[int]:
        reference.reset(model)
        hidden = layer_outputs(model, tokens[:-1], reference.config.capture_layer_ids)  # mlx-vlm's reading of them
        reference.prefill_from_target_hidden(mx.array([tokens[:-1]]), hidden, tokens[-1], None, greedy=True)
        return reference.draft_block(tokens[-1], hidden, None, k + 1, None, greedy=True)[0].tolist()

    return drafts


@pytest.fixture(scope="module")
def head():
    return random_head()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_eagle3_drafts_give_the_plain_tokens_and_are_mlx_vlms(target, head, tokenizer, params):
    expected = plain(target, tokenizer, PROMPTS, params)
    core = eagle3_core(target, head, tokenizer, full(PROMPTS, expected))
    check(core, target, None, run(core, PROMPTS, params), expected, mlx_vlm_reference(target, head))


def test_a_prefix_hit_and_preemption_keep_the_heads_pages_right(target, head, tokenizer):
    prompt = random_tokens(40, seed=5)
    expected = plain(target, tokenizer, {"p": prompt}, GREEDY)["p"]
    core = eagle3_core(target, head, tokenizer, [prompt + expected])
    run(core, {"first": prompt}, GREEDY)
    reference = mlx_vlm_reference(target, head)
    check(core, target, None, run(core, {"second": prompt}, GREEDY), {"second": expected}, reference)
    params = dataclasses.replace(GREEDY, max_tokens=40)
    expected = plain(target, tokenizer, PROMPTS, params)
    core = eagle3_core(target, head, tokenizer, full(PROMPTS, expected), num_blocks=14, max_num_seqs=3)
    check(core, target, None, run(core, PROMPTS, params), expected, reference)
    assert core.stats.preemptions > 0


def write_head_dir(path, head: Eagle3Head, config: dict = CONFIG):
    path.mkdir(parents=True, exist_ok=True)
    weights = {name: w for name, w in tree_flatten(head.parameters()) if not name.startswith("embed_tokens.")}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_an_eagle3_checkpoint_drafts_through_the_public_api_and_one_for_another_model_is_refused(tmp_path):
    target_dir = write_tiny_model_dir(tmp_path / "target", "llama", dtype="float32", seed=1, layers=3)
    config = {**CONFIG, "transformer_layer_config": {**LAYER, "vocab_size": 49152}}
    head_dir = write_head_dir(tmp_path / "eagle3", random_head(config), config)
    prompts = [random_tokens(n, seed=n) for n in (9, 30)]
    with Engine.from_pretrained(str(target_dir), cache_tokens=2048) as engine:
        expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    settings = {"cache_tokens": 2048, "speculative": "eagle3", "num_speculative_tokens": 3}
    with Engine.from_pretrained(str(target_dir), draft_model=str(head_dir), **settings) as engine:
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
        stats = engine.stats()
        assert stats["speculative"] == "eagle3" and stats["spec_draft_tokens_total"] > 0
        drafter = engine.built.hidden_drafter
        assert drafter.embed is engine.model.model.embed_tokens  # no embedding of its own: the model's, shared
        assert engine.plan.block_bytes == engine.kv.bytes_per_block + drafter.kv.bytes_per_block
    deep = {**config, "eagle_aux_hidden_state_layer_ids": [1, 2, 9]}
    with pytest.raises(ConfigError, match="was not made for this model: it reads layers"):
        Engine.from_pretrained(
            str(target_dir), draft_model=str(write_head_dir(tmp_path / "deep", random_head(deep), deep)), **settings
        )
    with pytest.raises(ConfigError, match="is not an EAGLE-3 head"):
        Engine.from_pretrained(str(target_dir), draft_model=str(target_dir), **settings)
