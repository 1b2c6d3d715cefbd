"""A state checkpoint as a disk record (engine/state_tiering.py): every leaf's set entries round-trip bit for bit
(bfloat16 as its bits), unset entries stay unset, arrays that do not match the leaves are refused, and a state
record is never read as a KV block (nor a block as a checkpoint)."""

from __future__ import annotations

import hashlib
import shutil

from mlxpaged.cache.disk_tier import DiskTier
from mlxpaged.cache.disk_writer import DiskWriter
from mlxpaged.cache.layout import StateLeaf
from mlxpaged.engine.state_tiering import StateTiering, to_arrays, to_snapshot

import mlx.core as mx
import pytest

LEAVES = [
    StateLeaf((0,), (((2, 24), "float32"), ((4, 8, 8), "bfloat16"))),
    StateLeaf((2,), (None, ((3, 5), "float16"))),  # its first entry the model never sets
]
FP = "ab" * 32


def snapshot(seed: int) -> dict:
    key = mx.random.key(seed)
    out: dict = {}
    for leaf in LEAVES:
        row = []
        for entry in leaf.arrays:
            if entry is None:
                row.append(None)
                continue
            shape, dtype = entry
            key, sub = mx.random.split(key)
            row.append(mx.random.normal((1, *shape), key=sub).astype(getattr(mx, dtype)))
        out[leaf.path] = tuple(row)
    return out


def same(a: dict, b: dict) -> bool:
    """The slow twin: every entry equal bit for bit, with its dtype, None where None."""
    if set(a) != set(b):
        return False
    for path in a:
        for x, y in zip(a[path], b[path], strict=True):
            if (x is None) != (y is None):
                return False
            if x is not None and (x.dtype != y.dtype or not mx.array_equal(x, y).item()):
                return False
    return True


def test_a_checkpoint_round_trips_through_its_disk_record(tmp_path):
    tier = DiskTier(tmp_path, FP, 10**9, kind="state")
    block_hash = hashlib.sha256(b"a").digest()
    want = snapshot(1)
    tier.write(block_hash, to_arrays(want, LEAVES))
    assert tier.path(block_hash).suffix == ".kvs"
    got = to_snapshot(tier.read(block_hash), LEAVES)
    assert same(got, want) and not same(got, snapshot(2))


def test_arrays_that_do_not_match_the_leaves_are_refused():
    arrays = to_arrays(snapshot(3), LEAVES)
    with pytest.raises(ValueError, match="4 state arrays, the state leaves set 3"):
        to_snapshot([*arrays, arrays[-1]], LEAVES)
    with pytest.raises(ValueError, match="entry 1"):
        to_snapshot([arrays[0], arrays[1][:, :2], arrays[2]], LEAVES)
    unset = dict(snapshot(3))
    unset[(0,)] = (unset[(0,)][0], None)  # an entry the leaves say is set is not: nothing to write
    assert to_arrays(unset, LEAVES) is None


def test_a_state_record_is_never_read_as_a_block_nor_the_other_way(tmp_path):
    states, blocks = DiskTier(tmp_path, FP, 10**9, kind="state"), DiskTier(tmp_path, FP, 10**9)
    block_hash = hashlib.sha256(b"b").digest()
    states.write(block_hash, to_arrays(snapshot(4), LEAVES))
    blocks.path(block_hash).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(states.path(block_hash), blocks.path(block_hash))  # the same bytes under a block's name
    with pytest.warns(RuntimeWarning, match="'state' record where a 'kv' one belongs"):
        assert blocks.read(block_hash) is None


def test_a_bad_record_is_skipped_with_a_warning_and_no_longer_offered(tmp_path):
    tier = DiskTier(tmp_path, FP, 10**9, kind="state")
    states = StateTiering(tier, DiskWriter(tier, 10**8), LEAVES)
    block_hash = hashlib.sha256(b"c").digest()
    tier.write(block_hash, to_arrays(snapshot(5), LEAVES)[:2])  # one array short: read well, does not fit
    assert states.contains(block_hash)
    with pytest.warns(RuntimeWarning, match="state arrays"):
        assert states.read(block_hash) is None
    assert not states.contains(block_hash) and tier.stats.skipped_files == 1
    states.offer(block_hash, snapshot(5))  # a good copy replaces it
    states.close()
    assert same(states.read(block_hash), snapshot(5)) and states.hits == 1
