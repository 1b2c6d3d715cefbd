"""The lazy probe reads each cache leaf from the model itself (loading/probe.py), for every kind of
cache mlx-lm has, on models with and without weights; what the pools cannot hold is refused at load
naming the layer and its cache kind (cache/paged_support.py, loader.check_paged_support)."""

from __future__ import annotations

import importlib
import math

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.layout import CacheListNode, KVLeaf, StateLeaf, UnusedLeaf
from mlxpaged.cache.paged_support import query_heads, serial_reason, unsupported_reasons
from mlxpaged.errors import UnsupportedModelError
from mlxpaged.loading.loader import check_paged_support
from mlxpaged.loading.probe import MEMORY_GUARD_BYTES, probe_layout
from mlxpaged.platform.model_facts import KVShape, ModelFacts
from tests.archs.configs import MLX_LM_CANNOT_RUN, config_for, has_config, text_modules
from tests.tiny_models import tiny_gemma3, tiny_llama

import mlx.core as mx
import mlx_lm.models.base as base
import pytest
from mlx_lm.models import cache as mlx_cache


def unweighted(module: str):
    """The module's tiny model with lazy random parameters, never evaluated."""
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    return mod.Model(mod.ModelArgs.from_dict(config_for(module)))


def kv(layout) -> list[tuple]:
    return [(leaf.kind, leaf.span, leaf.kv_heads, leaf.k_dim, leaf.v_dim) for leaf in layout.kv_leaves]


def test_llama_full_attention_leaves_are_routed_and_fit_the_pools():
    model = tiny_llama(num_layers=3)
    layout = probe_layout(model)
    args = model.args
    assert kv(layout) == [("full", None, args.num_key_value_heads, args.head_dim, args.head_dim)] * 3
    assert all(leaf.routed and leaf.q_heads == args.num_attention_heads for leaf in layout.kv_leaves)
    assert layout.structure == ((0,), (1,), (2,)) and layout.num_layers == 3
    assert (layout.vocab_size, layout.hidden_size) == (args.vocab_size, args.hidden_size)
    assert unsupported_reasons(layout) == [] and query_heads(layout) == args.num_attention_heads


def test_gemma3_sliding_windows_come_from_its_own_caches():
    model = tiny_gemma3(num_layers=6, window=8, pattern=3)
    layout = probe_layout(model)
    assert [leaf.span for leaf in layout.kv_leaves] == [8, 8, None, 8, 8, None]
    facts = ModelFacts.from_layout(layout, 1, 4)
    assert facts.kv.sliding_windows == (8, 8, None, 8, 8, None)


def test_gpt2_geometry_whatever_the_config_calls_it():
    config = config_for("gpt2")  # n_head / n_embd / n_layer: no num_attention_heads
    layout = probe_layout(unweighted("gpt2"))
    head_dim = config["n_embd"] // config["n_head"]
    assert kv(layout) == [("full", None, config["n_head"], head_dim, head_dim)] * config["n_layer"]
    check_paged_support(layout)
    shape = KVShape.from_layout(layout, 4)
    assert shape.bytes_per_token == sum(leaf.bytes_per_token(4) for leaf in layout.kv_leaves)


def test_deepseek_v3_latent_cache_is_held_in_its_own_widths():
    config = config_for("deepseek_v3")
    layout = probe_layout(unweighted("deepseek_v3"))
    # MLA caches the latent (kv_lora_rank) as K and the rotary part as "V", one head.
    assert kv(layout)[0] == ("full", None, 1, config["kv_lora_rank"], config["qk_rope_head_dim"])
    assert layout.kv_leaves[0].consumers == ("sdpa-other-v",)
    check_paged_support(layout)  # pools per geometry class (kv_cache.py); attention over the gathered K/V
    shape = KVShape.from_layout(layout, 4)
    assert shape.bytes_per_token == len(layout.kv_leaves) * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 4


def test_gpt_oss_sinks_are_seen_and_served():
    """Sinks are applied in every attention path (tests/engine/test_sinks.py), so they refuse nothing."""
    layout = probe_layout(unweighted("gpt_oss"))
    assert all(leaf.sinks for leaf in layout.kv_leaves)
    assert [leaf.kind for leaf in layout.kv_leaves] == ["window", "full", "window", "full"]
    check_paged_support(layout)


def test_mamba2_state_arrays_are_paged_in_state_slots():
    config = config_for("mamba2")
    layout = probe_layout(unweighted("mamba2"))
    assert layout.kv_leaves == () and len(layout.state_leaves) == config["num_hidden_layers"]
    conv, ssm = layout.state_leaves[0].arrays
    assert ssm == ((config["num_heads"], config["head_dim"], config["state_size"]), "float32")
    assert conv[0][0] == config["conv_kernel"] - 1
    check_paged_support(layout)  # state slots hold it (cache/state_cache.py): no refusal
    per_layer = sum(math.prod(shape) * 4 for shape, _ in (conv, ssm))
    assert layout.state_bytes_per_sequence == config["num_hidden_layers"] * per_layer


def test_llama4_chunked_leaves():
    text = config_for("llama4")["text_config"]
    layout = probe_layout(unweighted("llama4"))
    assert [(leaf.kind, leaf.span) for leaf in layout.kv_leaves][:3] == [("chunked", text["attention_chunk_size"])] * 3
    assert unsupported_reasons(layout) == []  # chunked pools, model-built chunk mask: one sequence per pass
    assert serial_reason(layout).startswith("layer 0, layer 1, layer 2 attend with a mask the model builds")


def test_gemma3n_shared_layers_show_in_the_structure():
    text = config_for("gemma3n")["text_config"]
    layout = probe_layout(unweighted("gemma3n"))
    assert layout.num_layers == text["num_hidden_layers"] and len(layout.structure) < layout.num_layers
    assert any("sdpa-other-k" in leaf.consumers for leaf in layout.kv_leaves)  # keys_and_values() readers
    check_paged_support(layout)  # views per leaf path (runner/cache_tree.py): shared layers allocate nothing
    assert KVShape.from_layout(layout, 4).num_layers == len(layout.structure) == 2


def test_cache_lists_unused_leaves_and_own_classes():
    falcon = probe_layout(unweighted("falcon_h1"))
    assert isinstance(falcon.structure[0], CacheListNode) and falcon.structure[0].entries == ((0, 0), (0, 1))
    assert isinstance(falcon.leaf((0, 0)), StateLeaf) and isinstance(falcon.leaf((0, 1)), KVLeaf)
    nas = probe_layout(unweighted("nemotron-nas"))
    assert isinstance(nas.leaves[-1], UnusedLeaf)
    own = probe_layout(unweighted("deepseek_v41"))
    assert own.refuse and "LayerCache" in own.refuse[0]


def test_probe_of_an_unweighted_model_evaluates_nothing_and_matches_the_weighted_one():
    weighted = tiny_llama()
    skeleton = type(weighted)(weighted.args)  # random init, lazy: never evaluated
    before = mx.get_active_memory()
    layout = probe_layout(skeleton)
    assert mx.get_active_memory() - before < 2**20
    assert layout == probe_layout(weighted)


def test_probe_restores_what_it_wraps():
    model = tiny_llama()
    sdpa, fast = base.scaled_dot_product_attention, mx.fast.scaled_dot_product_attention
    probe_layout(model)
    assert base.scaled_dot_product_attention is sdpa and mx.fast.scaled_dot_product_attention is fast


class _Evaluating(type(tiny_llama())):
    """A llama whose forward forces evaluation of a large array it keeps (a .item() on lazy weights)."""

    def __call__(self, inputs, cache=None, **kwargs):
        self.kept = mx.ones((MEMORY_GUARD_BYTES // 4 + 2**20,))
        mx.eval(self.kept)
        return super().__call__(inputs, cache=cache, **kwargs)


def test_memory_guard_refuses_a_forward_that_evaluates():
    model = _Evaluating(tiny_llama().args)
    with pytest.raises(UnsupportedModelError, match=r"'llama'.*evaluated \d+ MB"):
        probe_layout(model)


def test_a_failing_forward_is_a_refusal_naming_the_model_type():
    model = tiny_llama()
    model.model.embed_tokens = None  # the forward raises
    with pytest.raises(UnsupportedModelError, match=r"'llama'.*TypeError"):
        probe_layout(model)


def test_batched_offsets_failure_runs_one_sequence_per_pass():
    layout = probe_layout(unweighted("gpt_bigcode"))  # positions from np.arange(cache.offset, ...)
    assert layout.batch_error is not None
    assert unsupported_reasons(layout) == []
    assert serial_reason(layout).startswith("its forward fails on a batch of sequences at different offsets")
    assert serial_reason(probe_layout(unweighted("llama"))) is None


RUNNABLE = [m for m in text_modules() if has_config(m) and m not in MLX_LM_CANNOT_RUN]


@pytest.mark.parametrize("module", RUNNABLE)
def test_probe_matches_mlx_lm_caches_after_a_real_forward(module):
    """The slow twin: evaluate a real forward through mlx-lm's own caches and read their arrays."""
    model = unweighted(module)
    layout = probe_layout(model)
    caches = mlx_cache.make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=caches))
    for leaf in layout.leaves:
        cache = caches[leaf.path[0]]
        for i in leaf.path[1:]:
            cache = cache.caches[i]
        if isinstance(leaf, KVLeaf):
            assert (cache.keys.shape[1], cache.keys.shape[-1], cache.values.shape[-1]) == (
                leaf.kv_heads,
                leaf.k_dim,
                leaf.v_dim,
            ), leaf
        elif isinstance(leaf, StateLeaf):
            assert [None if a is None else tuple(a.shape[1:]) for a in cache.cache] == [
                None if a is None else a[0] for a in leaf.arrays
            ], leaf
        elif isinstance(leaf, UnusedLeaf):
            assert cache.keys is None
