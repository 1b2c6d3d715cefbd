"""Block spaces (specs.block_spaces): layer groups whose pages live in disjoint pools draw block ids from a
space each, so an id held by a window group never leaves the full layers' pages unused (gemma4). The cache
manager takes every change from all spaces or none; a random workload keeps each space's accounting."""

from mlxpaged.cache.block_pool import BlockPool, NoFreeBlocksError
from mlxpaged.cache.kv_cache_manager import KVCacheManager
from mlxpaged.cache.specs import (
    FullAttentionSpec,
    KVGeometry,
    SlidingWindowSpec,
    block_spaces,
    group_layers,
    pool_block_bytes,
    sequence_capacity,
    space_block_bytes,
)
from mlxpaged.engine.request import Request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BS = 8
WINDOW, FULL = KVGeometry(1, 32, 32), KVGeometry(1, 64, 64)  # gemma4: window and full layers of other head_dims
KINDS = [16, 16, 16, 16, None] * 2


def test_groups_of_disjoint_pools_get_a_space_each():
    groups = group_layers(KINDS)  # four window groups of two layers, one full group of two
    spaces = block_spaces(groups, [FULL if k is None else WINDOW for k in KINDS])
    assert spaces == ((0, 1, 2, 3), (4,))
    assert block_spaces(groups, [WINDOW] * 10) == ((0, 1, 2, 3, 4),)  # one geometry: one space, as before
    # A pool shared anywhere joins the groups: the window group's first layer has the full layers' geometry.
    mixed = [FULL if k is None else WINDOW for k in KINDS]
    mixed[0] = FULL
    assert block_spaces(groups, mixed) == ((0, 1, 2, 3, 4),)
    assert block_spaces(group_layers([]), []) == ((0,),)  # a layerless model's one group


def test_space_bytes_add_up_to_one_id_in_every_pool():
    geometries = [FULL if k is None else WINDOW for k in KINDS]
    per_space = space_block_bytes(KINDS, geometries, BS, 2)
    assert per_space == (2 * BS * 2 * 32 * 2, 2 * BS * 2 * 64 * 2)  # 2 layers per group, K and V, 2-byte dtype
    assert sum(per_space) == pool_block_bytes(KINDS, geometries, BS, 2)


def two_spaces(window_blocks, full_blocks, rings=1, fulls=1):
    """A manager of `rings` window groups (ring of 3 blocks) in space 0 and `fulls` full groups in space 1."""
    specs = [SlidingWindowSpec(BS, 2 * BS)] * rings + [FullAttentionSpec(BS)] * fulls
    pools = [BlockPool(window_blocks), BlockPool(full_blocks)]
    return KVCacheManager(pools, specs, spaces=[0] * rings + [1] * fulls, enable_prefix_cache=False)


def request(rid, n):
    return Request(rid, list(range(n)), 1 << 30)


def test_tables_draw_from_their_own_space_and_free_back_to_it():
    manager = two_spaces(6, 10)
    ring, full = manager.allocate(request("a", 40)).block_tables  # 5 blocks of 8; a ring of 3
    assert (len(ring), len(full)) == (3, 5)
    assert all(0 <= b < 6 for b in ring) and all(0 <= b < 10 for b in full)
    assert [p.num_free_blocks for p in manager.pools] == [3, 5]
    manager.free("a")
    assert [p.num_free_blocks for p in manager.pools] == [6, 10]


def test_a_short_space_refuses_the_whole_change():
    manager = two_spaces(4, 100)  # one ring of 3 fits, a second does not, whatever the full space holds
    manager.allocate(request("a", 40))
    before = [p.num_free_blocks for p in manager.pools]
    assert not manager.can_allocate(request("b", 20))
    with pytest.raises(NoFreeBlocksError) as error:
        manager.allocate(request("b", 20))
    assert (error.value.needed, error.value.available, error.value.total) == (3, 1, 4)
    assert [p.num_free_blocks for p in manager.pools] == before and "b" not in manager
    with pytest.raises(NoFreeBlocksError):  # a fork copies the ring: no room for it either
        manager.fork(Request("a", list(range(40)), 1 << 30), request("c", 40))
    assert [p.num_free_blocks for p in manager.pools] == before


def test_capacity_is_the_least_any_space_allows():
    manager = two_spaces(3, 10)
    assert manager.capacity_tokens == sequence_capacity(10, BS, [None]) == 80
    assert manager.fits_ever(80) and not manager.fits_ever(81)
    assert two_spaces(2, 10).capacity_tokens == 2 * BS  # the ring space holds two of its three blocks
    assert manager.num_blocks == 13 and manager.stats().num_blocks == 13


def test_spaces_must_cover_the_pools():
    with pytest.raises(ValueError, match="must name one of the 2 block pools"):
        KVCacheManager([BlockPool(4), BlockPool(4)], [FullAttentionSpec(BS)], enable_prefix_cache=False)


OPS = st.lists(
    st.tuples(st.sampled_from(["allocate", "grow", "fork", "free"]), st.integers(0, 5), st.integers(1, 30)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(window_blocks=st.integers(3, 16), full_blocks=st.integers(2, 40), fulls=st.integers(1, 2), ops=OPS)
def test_random_workloads_keep_every_space_consistent(window_blocks, full_blocks, fulls, ops):
    manager = two_spaces(window_blocks, full_blocks, rings=2, fulls=fulls)
    live: dict[int, Request] = {}
    for step, (op, pick, n) in enumerate(ops):
        rid = sorted(live)[pick % len(live)] if live else None
        op = op if live else "allocate"
        before = [p.num_free_blocks for p in manager.pools]
        try:
            if op == "allocate":
                new = step
                manager.allocate(req := request(new, n))
                live[new] = req
            elif op == "grow":
                live[rid].num_computed_tokens = live[rid].num_tokens
                live[rid].output_token_ids.extend(range(n))
                manager.allocate_slots(live[rid])
            elif op == "fork":
                live[rid].num_computed_tokens = live[rid].num_tokens
                child = Request(step, live[rid].all_token_ids, 1 << 30)
                manager.fork(live[rid], child)
                child.num_computed_tokens = live[rid].num_computed_tokens
                live[child.request_id] = child
            else:
                manager.free(rid)
                del live[rid]
        except NoFreeBlocksError:
            if op == "grow":
                del live[rid].output_token_ids[-n:]
            assert [p.num_free_blocks for p in manager.pools] == before  # all spaces or none
        refs = [[0] * p.num_blocks for p in manager.pools]
        for r in live.values():
            tables = manager.block_tables(r.request_id)
            for table, space, spec in zip(tables, manager.spaces, (m.spec for m in manager.managers), strict=True):
                assert len(table) >= spec.blocks_needed(r.num_tokens)
                for b in table:
                    refs[space][b] += 1  # an id out of its space's range raises here
        for space, pool in enumerate(manager.pools):
            assert refs[space] == [pool.ref_count(b) for b in range(pool.num_blocks)]
            assert pool.num_free_blocks == sum(1 for c in refs[space] if c == 0)
    for rid in list(live):
        manager.free(rid)
    assert [p.num_free_blocks for p in manager.pools] == [window_blocks, full_blocks]
