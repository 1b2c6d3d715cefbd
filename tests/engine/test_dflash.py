"""Drafting with a DFlash drafter (runner/dflash_drafter.py, loading/dflash_model.py): a tiny random drafter reading
two layers of a tiny random model (a llama; a Qwen 3.5 hybrid; a Gemma, whose embedding the drafter reads scaled as
the model's first layer does: runner/embedding_scale.py) gives the model's own tokens, alone and batched,
seeded, with a prefix hit, after preemption; and every block it drafts is what mlx-vlm's own DFlash drafter drafts
from the same weights without pages, reading the model's layer outputs of a plain forward pass (the drafter's
context pages must then be right through all of those). Loaded through the public API from a checkpoint directory:
planned before any weight is read, refused with the reason when it was made for another model."""

from __future__ import annotations

import json

from mlxpaged import Engine
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.engine.core import EngineCore
from mlxpaged.engine.hidden_drafters import dflash_drafter
from mlxpaged.errors import ConfigError
from mlxpaged.loading.dflash_model import DFlashConfig, DFlashModel
from mlxpaged.runner.routing import route_paged_attention
from tests.engine import test_engine_state
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_mtp import (
    GREEDY,
    SEEDED,
    batched_equal_plain,
    known_drafts,
    preempted_equal_plain,
    prefix_hit_equals_plain,
    run_plain,
)
from tests.tiny_models import _COMMON, _build, random_tokens, tiny_llama, tiny_qwen3_5, write_tiny_model_dir

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "block_size": 8,
    "dflash_config": {"mask_token_id": 255, "target_layer_ids": [0, 2]},
}


def random_drafter(seed: int = 21, **config) -> DFlashModel:
    mx.random.seed(seed)
    model = DFlashModel(DFlashConfig.from_dict({**CONFIG, **config}, "tiny"))
    model.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, model.parameters()))
    mx.eval(model.parameters())
    return model


def tiny_gemma():
    """A Gemma: mlx-lm scales its token embeddings by sqrt(hidden) in its forward (Hugging Face, in the embedding)."""
    from mlx_lm.models import gemma

    config = {**_COMMON, "model_type": "gemma", "num_hidden_layers": 3, "rope_theta": 10000.0}
    return _build(gemma, config, seed=6)


@pytest.fixture(scope="module", params=["llama", "qwen3_5", "gemma"])
def target(request):
    return {"llama": lambda: tiny_llama(num_layers=3), "qwen3_5": tiny_qwen3_5, "gemma": tiny_gemma}[request.param]()


def input_scale(model) -> float:
    """What the model's first layer sees of a token's embedding, by the model's definition: Gemma's sqrt(hidden)."""
    return model.args.hidden_size**0.5 if model.args.model_type == "gemma" else 1.0


@pytest.fixture(scope="module")
def drafter():
    return random_drafter()


def make_core(model, tokenizer, num_blocks: int = 64, **scheduling) -> EngineCore:
    if model.args.model_type == "qwen3_5":  # state layers: the state slots and layout
        return test_engine_state.make_core(model, tokenizer, num_blocks=num_blocks, **scheduling)
    route_paged_attention()
    args = model.args
    kv = PagedKVCache(args.num_hidden_layers, num_blocks, 8, args.num_key_value_heads, args.head_dim)
    return EngineCore.create(
        model,
        tokenizer,
        kv,
        CacheConfig(block_size=8),
        SchedulerConfig(**{"max_num_seqs": 4, **scheduling}),
        max_model_len=512,
    )


def dflash_core(model, drafter, tokenizer, continuations, k: int = 4, **scheduling) -> EngineCore:
    core = make_core(model, tokenizer, speculative="dflash", num_speculative_tokens=k, **scheduling)
    attached = dflash_drafter(drafter, "tiny", core.runner, CacheConfig(block_size=8), mx.float32, vocab_size=256)
    core.speculator.model = attached
    known_drafts(core, attached, continuations)
    return core


def plain(model, tokenizer, prompts, params, **scheduling) -> dict:
    return run_plain(make_core(model, tokenizer, **scheduling), prompts, params)


def layer_outputs(model, tokens: list[int], layer_ids) -> mx.array:
    """The outputs of `layer_ids` over `tokens`, side by side: the model's layers called one by one, no cache."""
    inner = model.model
    h = inner.embed_tokens(mx.array([tokens])) * input_scale(model)
    outputs = []
    for layer in inner.layers:
        h = layer(h, None if getattr(layer, "is_linear", False) else "causal", None)
        outputs.append(h)
    return mx.concatenate([outputs[i] for i in layer_ids], axis=-1)


class ContextFrom:
    """A cache for mlx-vlm's drafter that holds just the context it is given, whose first position is `offset`."""

    def __init__(self, offset: int):
        self.offset = offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.offset += keys.shape[2]
        return keys, values


def mlx_vlm_reference(model, drafter, config: dict = CONFIG, draft_window: int | None = None):
    """(tokens, k) -> the k drafts mlx-vlm's DFlashDraftModel makes after `tokens` (the last is the row's) from the same
    weights: its cache fed every earlier position's layer outputs at once, or with `draft_window` D only the last D
    of them, at their own positions."""
    from mlx_vlm.speculative.drafters.qwen3_dflash.config import DFlashConfig as TheirConfig
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel

    reference = DFlashDraftModel(TheirConfig.from_dict(config))
    reference.load_weights(list(tree_flatten(drafter.parameters())), strict=True)
    reference.bind(model)
    reference.embed_scale = input_scale(model)  # Hugging Face's Gemma embedding is scaled (mlx-vlm's Gemma 4 says so)

    def drafts(tokens: list[int], k: int) -> list[int]:
        hidden = layer_outputs(model, tokens[:-1], reference.config.target_layer_ids)  # mlx-vlm's reading of them
        cache = reference.make_cache()
        if draft_window is not None and hidden.shape[1] > draft_window:
            skipped = hidden.shape[1] - draft_window
            hidden, cache = hidden[:, skipped:], [ContextFrom(skipped) for _ in cache]
        block = reference.draft_block(tokens[-1], hidden, cache, k + 1, lambda x: mx.argmax(x, -1))
        return block[0].tolist()

    return drafts


def dflash_makers(model, drafter, tokenizer):
    """(make, plain_of) of a DFlash drafter's cores for test_mtp's shared checks."""
    return (
        lambda continuations, **scheduling: dflash_core(model, drafter, tokenizer, continuations, **scheduling),
        lambda prompts, params: plain(model, tokenizer, prompts, params),
    )


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_dflash_drafts_give_the_plain_tokens_and_are_mlx_vlms(target, drafter, tokenizer, params):
    reference = mlx_vlm_reference(target, drafter)
    batched_equal_plain(*dflash_makers(target, drafter, tokenizer), target, None, params, reference)


def test_a_prefix_hit_and_preemption_keep_the_context_pages_right(target, drafter, tokenizer):
    parts = (*dflash_makers(target, drafter, tokenizer), target, None, mlx_vlm_reference(target, drafter))
    prefix_hit_equals_plain(*parts)
    preempted_equal_plain(*parts)


def sliding_config(causal: bool) -> dict:
    """A drafter whose first layer slides over a window of 4 (its last 3 context positions, then the block), with a
    sink logit per head in every layer; both ways within the block, or causally."""
    flash = {**CONFIG["dflash_config"], "attention_sink_bias": True, "causal": causal}
    return {
        **CONFIG,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 4,
        "dflash_config": flash,
    }


@pytest.mark.parametrize("causal", [False, True], ids=["both-ways", "causal"])
def test_sliding_layers_and_sinks_draft_what_mlx_vlm_drafts(tokenizer, causal):
    """mlx-vlm keeps a sliding layer's last W - 1 context positions in a rotating cache; the drafter's pages keep every
    position and mask the others out: alone and batched, with a prefix hit."""
    config = sliding_config(causal)
    drafter = random_drafter(seed=23, **config)
    mx.random.seed(24)
    drafter.update(
        tree_map(lambda w: mx.random.normal(w.shape) if w.ndim == 1 and w.shape == (4,) else w, drafter.parameters())
    )  # random sinks (every 4-wide vector here is one: 4 heads)
    target = tiny_llama(num_layers=3)
    parts = (*dflash_makers(target, drafter, tokenizer), target, None)
    reference = mlx_vlm_reference(target, drafter, config)
    batched_equal_plain(*parts, GREEDY, reference)
    prefix_hit_equals_plain(*parts, reference, length=30)


@pytest.mark.parametrize("causal", [False, True], ids=["both-ways", "causal"])
def test_a_draft_window_bounds_every_layers_context_to_its_last_positions(tokenizer, causal):
    """`draft_window_size` D: every layer of the block sees only the last D context positions (a sliding layer, the
    fewer of its own window's and D), whatever the steps that wrote them: each block equal to mlx-vlm's drafter fed
    just those positions, alone and batched, with a prefix hit and after preemption."""
    config = sliding_config(causal)
    config["dflash_config"] = {**config["dflash_config"], "draft_window_size": 6}
    drafter = random_drafter(seed=25, **config)
    assert drafter.config.draft_window == 6
    assert [drafter.config.mask_bounds(i) for i in range(2)] == (
        [(4, 6), (None, 6)] if causal else [(None, 3), (None, 6)]
    )
    target = tiny_llama(num_layers=3)
    parts = (*dflash_makers(target, drafter, tokenizer), target, None)
    unwindowed = {
        **config,
        "dflash_config": {k: v for k, v in config["dflash_config"].items() if k != "draft_window_size"},
    }
    reference = mlx_vlm_reference(target, drafter, unwindowed, draft_window=6)
    batched_equal_plain(*parts, GREEDY, reference)
    prefix_hit_equals_plain(*parts, reference, length=30)
    preempted_equal_plain(*parts, reference)


def write_drafter_dir(path, model: DFlashModel, **config):
    path.mkdir(parents=True, exist_ok=True)
    weights = {f"model.{name}": w for name, w in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps({**CONFIG, "model_type": "qwen3", **config}))
    return path


@pytest.mark.parametrize("kv_bits, draft_window", [(None, None), (8, None), (None, 6)])
def test_a_dflash_checkpoint_drafts_through_the_public_api(tmp_path, kv_bits, draft_window):
    """Pages of 8-bit K/V too (widths of 32: whole quantization groups); a draft window read from the checkpoint."""
    target = write_tiny_model_dir(tmp_path / "target", "llama", dtype="float32", seed=1, layers=3, head_dim=32)
    flash = {**CONFIG["dflash_config"], **({"draft_window_size": draft_window} if draft_window else {})}
    drafter = write_drafter_dir(tmp_path / "dflash", random_drafter(head_dim=32), head_dim=32, dflash_config=flash)
    prompts = [random_tokens(n, seed=n) for n in (9, 30)]
    settings = {"cache_tokens": 2048, **({"kv_bits": kv_bits} if kv_bits else {})}
    with Engine.from_pretrained(str(target), **settings) as engine:
        expected = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    settings |= {"draft_model": str(drafter), "speculative": "dflash", "num_speculative_tokens": 4}
    with Engine.from_pretrained(str(target), **settings) as engine:
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == expected
        stats = engine.stats()
        assert stats["speculative"] == "dflash" and stats["spec_draft_tokens_total"] > 0
        assert stats["draft_model"] == str(drafter)
        assert engine.built.hidden_drafter.model.config.draft_window == draft_window
        pages = engine.built.hidden_drafter.kv
        assert pages.quantized == (kv_bits is not None)
        assert engine.plan.block_bytes == engine.kv.bytes_per_block + pages.bytes_per_block


def test_a_drafter_for_another_model_or_not_a_drafter_is_refused_before_the_model_is_read(tmp_path):
    target = write_tiny_model_dir(tmp_path / "target", "llama", dtype="float32", seed=1, layers=3)
    settings = {"cache_tokens": 2048, "speculative": "dflash"}
    flash = {"mask_token_id": 255, "target_layer_ids": [0, 5]}
    wide = write_drafter_dir(tmp_path / "wide", random_drafter(), dflash_config=flash)
    with pytest.raises(ConfigError, match="was not made for this model: it reads layers"):
        Engine.from_pretrained(str(target), draft_model=str(wide), **settings)
    with pytest.raises(ConfigError, match="is not a DFlash drafter"):
        Engine.from_pretrained(str(target), draft_model=str(target), **settings)
    with pytest.raises(ConfigError, match="needs a draft model"):
        Engine.from_pretrained(str(target), **settings)


def test_drafter_configs_not_built_here_or_not_valid_are_refused_with_the_reason():
    flash = CONFIG["dflash_config"]
    with pytest.raises(ConfigError, match="has a draft_window_size that is not a count of positions"):
        DFlashConfig.from_dict({**CONFIG, "dflash_config": {**flash, "draft_window_size": -1}}, "rolling")
    assert (
        DFlashConfig.from_dict({**CONFIG, "dflash_config": {**flash, "draft_window_size": 0}}, "whole").draft_window
        is None
    )
    with pytest.raises(ConfigError, match=r"layers of kind \['chunked_attention'\]"):
        DFlashConfig.from_dict({**CONFIG, "layer_types": ["chunked_attention", "full_attention"]}, "chunked")
    with pytest.raises(ConfigError, match="sliding-window layers but no sliding_window above 1"):
        DFlashConfig.from_dict({**CONFIG, "layer_types": ["sliding_attention", "full_attention"]}, "no-window")
    with pytest.raises(ConfigError, match="gives 1 layer_types for 2 layers"):
        DFlashConfig.from_dict({**CONFIG, "layer_types": ["full_attention"]}, "short")
