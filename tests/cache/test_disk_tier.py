"""The disk tier's files (cache/disk_tier.py) and writer (cache/disk_writer.py), without a model: round trips,
files that must never be used (corrupt, truncated, another model's, another version's), the size limit, two
tiers on one directory, and a writer that never makes its caller wait."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
import time

from mlxpaged.cache import disk_tier
from mlxpaged.cache.disk_tier import DiskTier, list_entries
from mlxpaged.cache.disk_writer import DiskWriter

import numpy as np
import pytest

FP = "a" * 64
OTHER_FP = "b" * 64


def block(seed: int, shape=(2, 3, 8, 4)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32), rng.integers(0, 2**16, shape, dtype=np.uint16)]


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def test_a_written_block_reads_back_equal(tmp_path):
    tier = DiskTier(tmp_path, FP, 10**9)
    arrays = block(0)
    assert not tier.contains(h(0))
    assert tier.write(h(0), arrays) > 0
    assert tier.contains(h(0))
    got = tier.read(h(0))
    assert got is not None and len(got) == 2
    for g, a in zip(got, arrays, strict=True):
        assert g.dtype == a.dtype and np.array_equal(g, a)
    assert tier.write(h(0), arrays) == 0  # written once, never again
    assert tier.read(h(1)) is None
    assert not list(tmp_path.rglob("*.tmp"))  # the temporary name is gone after the rename


@pytest.mark.parametrize(
    "damage",
    ["flip_payload_byte", "truncate_payload", "truncate_header", "empty", "other_fingerprint", "other_version"],
)
def test_a_bad_file_is_skipped_with_a_warning_and_never_used(tmp_path, damage):
    tier = DiskTier(tmp_path, FP, 10**9)
    tier.write(h(0), block(0))
    path = tier.path(h(0))
    data = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        data[-5] ^= 0xFF
    elif damage == "truncate_payload":
        data = data[:-7]
    elif damage == "truncate_header":
        data = data[:20]
    elif damage == "empty":
        data = bytearray()
    elif damage == "other_fingerprint":  # another model's file at this name (its own file, intact)
        data = bytearray(b"".join(bytes(p) for p in disk_tier.encode(block(0), OTHER_FP, h(0))))
    elif damage == "other_version":
        data[8:12] = struct.pack("<I", disk_tier.FORMAT_VERSION + 1)
    path.write_bytes(bytes(data))
    fresh = DiskTier(tmp_path, FP, 10**9)  # another process: nothing remembered
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert fresh.read(h(0)) is None
    assert fresh.stats.skipped_files == 1
    assert not fresh.contains(h(0))  # never offered again in this process
    assert fresh.write(h(0), block(0)) > 0  # and a good copy replaces it
    assert all(np.array_equal(a, b) for a, b in zip(fresh.read(h(0)), block(0), strict=True))


def test_a_file_of_another_block_under_this_name_is_refused(tmp_path):
    tier = DiskTier(tmp_path, FP, 10**9)
    tier.write(h(1), block(1))
    tier.path(h(0)).parent.mkdir(parents=True, exist_ok=True)
    tier.path(h(0)).write_bytes(tier.path(h(1)).read_bytes())
    with pytest.warns(RuntimeWarning, match="skipping"):
        assert tier.read(h(0)) is None


def test_models_of_other_fingerprints_live_apart(tmp_path):
    a, b = DiskTier(tmp_path, FP, 10**9), DiskTier(tmp_path, OTHER_FP, 10**9)
    a.write(h(0), block(0))
    assert not b.contains(h(0)) and b.read(h(0)) is None


def test_the_size_limit_holds_and_evicts_least_recently_used(tmp_path):
    one = len(b"".join(bytes(p) for p in disk_tier.encode(block(0), FP, h(0))))
    tier = DiskTier(tmp_path, FP, 10 * one)
    for i in range(5):
        tier.write(h(i), block(i))
    past = time.time() - 1000
    for i in range(5):  # oldest first: 0 .. 4, then block 0 is read (a use)
        os.utime(tier.path(h(i)), (past + i, past + i))
    assert tier.read(h(0)) is not None
    for i in range(5, 30):
        tier.write(h(i), block(i))
        assert sum(e.size for e in list_entries(tmp_path)) <= 10 * one
    assert tier.stats.evicted_files >= 20
    assert not tier.contains(h(1))  # least recently used: gone
    assert tier.contains(h(29))
    assert tier.used_bytes == sum(e.size for e in list_entries(tmp_path))


def test_a_smaller_limit_is_enforced_when_the_tier_opens(tmp_path):
    big = DiskTier(tmp_path, FP, 10**9)
    for i in range(10):
        big.write(h(i), block(i))
    one = big.path(h(0)).stat().st_size
    small = DiskTier(tmp_path, OTHER_FP, 3 * one)  # the limit covers every model's files
    assert sum(e.size for e in list_entries(tmp_path)) <= 3 * one
    assert small.used_bytes <= 3 * one


def test_two_tiers_on_one_directory_share_blocks_and_the_limit(tmp_path):
    one = len(b"".join(bytes(p) for p in disk_tier.encode(block(0), FP, h(0))))
    limit = 40 * one
    a, b = DiskTier(tmp_path, FP, limit), DiskTier(tmp_path, FP, limit)
    errors: list[BaseException] = []

    def run(tier, start):
        try:
            for i in range(start, start + 60):
                tier.write(h(i % 70), block(i % 70))  # overlapping hashes: both may write the same block
                got = tier.read(h((i * 7) % 70))
                if got is not None:  # a block is whole or absent, never half-written
                    want = block((i * 7) % 70)
                    assert all(np.array_equal(x, y) for x, y in zip(got, want, strict=True))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(a, 0)), threading.Thread(target=run, args=(b, 30))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert a.stats.skipped_files == b.stats.skipped_files == 0
    a.enforce_limit()
    assert sum(e.size for e in list_entries(tmp_path)) <= limit
    assert not list(tmp_path.rglob("*.tmp"))


class BlockedStore:
    """A store whose writes wait for an event: the disk at its slowest."""

    def __init__(self):
        self.release = threading.Event()
        self.written: list[bytes] = []

    def write(self, block_hash, arrays):
        self.release.wait(10)
        self.written.append(block_hash)
        return sum(a.nbytes for a in arrays)


def test_the_writer_never_blocks_its_caller_and_drops_past_its_budget():
    store = BlockedStore()
    arrays = block(0)
    size = sum(a.nbytes for a in arrays)
    writer = DiskWriter(store, max_pending_bytes=3 * size)
    start = time.perf_counter()
    accepted = [writer.submit(h(i), block(i)) for i in range(10)]
    assert time.perf_counter() - start < 1.0  # the store is blocked: nothing waited for it
    assert accepted[:3] == [True] * 3 and not any(accepted[3:])
    assert writer.dropped == 7 and writer.pending_bytes == 3 * size
    assert not writer.wait_idle(0.05)
    store.release.set()
    assert writer.close(5.0)
    assert store.written == [h(0), h(1), h(2)]
    assert writer.pending_bytes == 0


def test_a_temporary_file_left_by_a_dead_writer_is_removed_once_stale(tmp_path):
    tier = DiskTier(tmp_path, FP, 10**9)
    tier.write(h(0), block(0))
    stale, fresh = tier.path(h(0)).parent / ".x.kvb.1.aa.tmp", tier.path(h(0)).parent / ".y.kvb.2.bb.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    old = time.time() - 2 * disk_tier.STALE_TEMP_S
    os.utime(stale, (old, old))
    tier.enforce_limit()
    assert not stale.exists() and fresh.exists() and tier.read(h(0)) is not None
