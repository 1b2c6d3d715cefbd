"""The model's cache list assembled per leaf path: None entries, CacheLists, unused caches, the state hook,
and, on tiny mlx-lm models of those shapes, the paged engine's tokens against mlx-lm's own."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.layout import CacheListNode, KVLeaf, ModelLayout, StateLeaf, UnusedLeaf
from mlxpaged.runner.cache_tree import UnusedCache, assemble, leaf_caches, model_cache, simple

import pytest
from mlx_lm.models.cache import CacheList


def kv(path, kind="full", span=None) -> KVLeaf:
    return KVLeaf(path, kind, span, 1, 4, 4, "float32")


def layout(leaves, structure, num_layers=None) -> ModelLayout:
    return ModelLayout("tiny", tuple(leaves), tuple(structure), 10, 8, num_layers)


# cache entries != layers: a None entry (a layer reusing K/V), a KV-only CacheList, an unused cache
NESTED = layout(
    [kv((1,)), kv((2, 0)), kv((2, 1)), UnusedLeaf((3,), "KVCache")],
    [None, (1,), CacheListNode(((2, 0), (2, 1))), (3,)],
    num_layers=5,
)


def test_structure_is_rebuilt_with_one_cache_per_leaf_path():
    views = ["v1", "v20", "v21"]
    caches = assemble(NESTED, leaf_caches(NESTED, views))
    assert caches[0] is None and caches[1] == "v1"
    assert isinstance(caches[2], CacheList) and list(caches[2].caches) == ["v20", "v21"]
    assert isinstance(caches[3], UnusedCache)
    assert model_cache(NESTED, views)[1:2] == ["v1"]


def test_an_unused_cache_fails_loudly_naming_where_it_is():
    unused = assemble(NESTED, leaf_caches(NESTED, ["a", "b", "c"]))[3]
    with pytest.raises(RuntimeError, match=r"cache entry 3: .*\.offset"):
        _ = unused.offset
    with pytest.raises(RuntimeError, match="cache entry 3"):
        unused[0]


def test_plain_layouts_use_the_view_list_itself():
    flat = layout([kv((0,)), kv((1,), "window", 8)], [(0,), (1,)], num_layers=2)
    views = ["a", "b"]
    assert simple(flat) and model_cache(flat, views) is views and model_cache(None, views) is views
    assert not simple(NESTED)


def test_state_leaves_come_from_the_hook_or_fail_with_their_place():
    hybrid = layout([StateLeaf((0, 0), (((3, 4), "float32"),)), kv((0, 1))], [CacheListNode(((0, 0), (0, 1)))], 1)
    with pytest.raises(KeyError, match=r"layer 0 cache 0 \(state\) has no cache for this pass: state leaves"):
        assemble(hybrid, leaf_caches(hybrid, ["kv"]))
    caches = model_cache(hybrid, ["kv"], extra={(0, 0): "state view"})
    assert list(caches[0].caches) == ["state view", "kv"]


def test_view_count_must_match_the_kv_leaves():
    with pytest.raises(ValueError, match="2 KV views for the layout's 3 KV leaves"):
        leaf_caches(NESTED, ["a", "b"])


def test_attention_geometries_name_each_class_the_kernel_may_read():
    from mlxpaged.cache.paged_support import attention_geometries

    leaves = [
        KVLeaf((0,), "full", None, 1, 8, 3, "float32", q_heads=4),  # latent
        KVLeaf((1,), "full", None, 1, 8, 3, "float32", q_heads=4),
        KVLeaf((2,), "window", 8, 2, 6, 6, "float32", sinks=True),  # no SDPA call seen: q = kv heads
        KVLeaf((3,), "full", None, 3, 4, 4, "float32", q_heads=4),
    ]  # 4 % 3: never routed to the pools
    flat = layout(leaves, [(0,), (1,), (2,), (3,)])
    assert attention_geometries(flat) == [(2, 2, 6, 6, True), (4, 1, 8, 3, False)]
