"""State slots (cache/state_cache.py): rows per slot, views of a pass, forks, snapshots, checkpoints."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.cache.layout import StateLeaf
from mlxpaged.cache.state_cache import CheckpointTable, NoFreeSlotsError, StateCache, StatePass, StateStore, StateView

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache

LEAVES = (StateLeaf((0,), (((2, 3), "float32"), ((4,), "float32"))), StateLeaf((2,), (((5,), "float32"),)))


def write(store: StateStore, slots: list[int], base: float) -> StatePass:
    """A pass over `slots` that sets every entry of every leaf to base + row, and commits it."""
    state = StatePass(store, slots, [1] * len(slots))
    for leaf in LEAVES:
        for i, (shape, _) in enumerate(leaf.arrays):
            rows = mx.arange(len(slots), dtype=mx.float32).reshape(-1, *([1] * len(shape))) + base
            state.views[leaf.path][i] = mx.broadcast_to(rows, (len(slots), *shape))
    state.commit()
    return state


def test_slots_allocate_and_free_and_say_when_none_is_left():
    store = StateStore(LEAVES, 2)
    a, b = store.allocate(), store.allocate()
    assert (a, b, store.num_free) == (0, 1, 0)
    with pytest.raises(NoFreeSlotsError, match="all 2 state slots"):
        store.allocate()
    store.free(a)
    assert store.num_free == 1 and store.allocate() == a
    with pytest.raises(KeyError, match="state slot 7 is not allocated"):
        store.free(7)


def test_fresh_slots_read_none_and_a_view_is_an_arrays_cache():
    store = StateStore(LEAVES, 2)
    state = StatePass(store, [store.allocate(), store.allocate()], [1, 1])
    view = state.views[(0,)]
    assert isinstance(view, ArraysCache) and view[0] is None and view.empty()
    assert view.make_mask(1) is None


def test_a_pass_reads_its_slots_rows_in_order_and_commits_one_row_each():
    store = StateStore(LEAVES, 3)
    s0, s1, s2 = store.allocate(), store.allocate(), store.allocate()
    write(store, [s2, s0], base=10.0)  # s2 gets row 0 (10), s0 row 1 (11)
    assert store.row(s2, (2,))[0].tolist() == [[10.0] * 5] and store.row(s0, (2,))[0].tolist() == [[11.0] * 5]
    view = StatePass(store, [s0, s2], [1, 1]).views[(2,)]
    assert view[0][:, 0].tolist() == [11.0, 10.0]
    mixed = StatePass(store, [s1, s0], [1, 1]).views[(2,)][0]  # fresh s1 reads zeros next to s0's row
    assert mixed[:, 0].tolist() == [0.0, 11.0]


def test_writes_stay_in_the_pass_until_committed_and_commit_can_take_some_rows():
    store = StateStore(LEAVES, 2)
    s0, s1 = store.allocate(), store.allocate()
    state = StatePass(store, [s0, s1], [1, 1])
    state.views[(2,)][0] = mx.array([[1.0] * 5, [2.0] * 5])
    assert state.views[(2,)][0][:, 0].tolist() == [1.0, 2.0]  # the model reads back what it wrote
    assert store.row(s0, (2,))[0] is None  # not stored before commit
    assert len(state.new_arrays()) == 1
    state.commit([1])
    assert store.row(s0, (2,))[0] is None and store.row(s1, (2,))[0].tolist() == [[2.0] * 5]


def test_a_ragged_pass_masks_each_row_by_its_length():
    store = StateStore(LEAVES, 2)
    view = StatePass(store, [store.allocate(), store.allocate()], [3, 1]).views[(0,)]
    assert view.make_mask(3).tolist() == [[True, True, True], [True, False, False]]


def test_a_pass_needs_distinct_slots():
    store = StateStore(LEAVES, 2)
    slot = store.allocate()
    with pytest.raises(ValueError, match="distinct slots"):
        StatePass(store, [slot, slot], [1, 1])


def test_fork_shares_the_rows_and_then_they_go_their_own_ways():
    store = StateStore(LEAVES, 2)
    parent = store.allocate()
    write(store, [parent], base=1.0)
    child = store.fork(parent)
    assert store.row(child, (0,))[1] is store.row(parent, (0,))[1]  # shared, not copied
    write(store, [child], base=5.0)
    assert store.row(parent, (0,))[1].tolist() == [[1.0] * 4] and store.row(child, (0,))[1].tolist() == [[5.0] * 4]


def test_snapshot_restores_later_and_is_not_changed_by_later_passes():
    store = StateStore(LEAVES, 2)
    slot = store.allocate()
    write(store, [slot], base=3.0)
    snap = store.snapshot(slot)
    write(store, [slot], base=4.0)
    other = store.allocate()
    store.restore(other, snap)
    assert store.row(other, (0,))[0].tolist() == [[[3.0] * 3] * 2] and store.row(slot, (0,))[0][0, 0, 0].item() == 4.0
    with pytest.raises(ValueError, match="snapshot leaves"):
        store.restore(other, {(0,): (None, None)})


def test_checkpoint_table_finds_the_longest_prefix_and_evicts_least_recently_used():
    table = CheckpointTable(2)
    table.put("h1", {})
    table.put("h2", {})
    assert table.longest(["h1", "h2", "h3"]) == 2 and table.longest(["x", "y"]) == 0 and table.longest(["x", "h1"]) == 2
    table.get("h1")  # now the newest
    table.put("h3", {})
    assert "h2" not in table and "h1" in table and len(table) == 2
    off = CheckpointTable(0)
    off.put("h", {})
    assert len(off) == 0


def test_state_cache_publishes_a_decode_checkpoint_when_its_slot_is_freed():
    cache = StateCache(StateStore(LEAVES, 2), CheckpointTable(4))
    slot = cache.allocate()
    write(cache.store, [slot], base=2.0)
    cache.checkpoint(slot, "prompt", publish=True)
    cache.checkpoint(slot, "reply-1", publish=False)
    cache.checkpoint(slot, "reply-2", publish=False)  # replaces reply-1
    assert cache.usable_blocks(["prompt", "reply-1", "reply-2"]) == 1
    cache.free(slot)
    assert cache.usable_blocks(["prompt", "reply-1", "reply-2"]) == 3 and "reply-1" not in cache.checkpoints
    again = cache.allocate()
    cache.restore(again, "reply-2")
    assert cache.store.row(again, (2,))[0].tolist() == [[2.0] * 5]


def test_view_state_lists_this_passes_arrays():
    store = StateStore(LEAVES, 1)
    view = StateView(store, (0,), [store.allocate()], None)
    view[1] = mx.ones((1, 4))
    assert len(view.state) == 1 and view.nbytes == 16 and view.cache[0] is None
