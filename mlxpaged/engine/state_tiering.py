"""State checkpoints on disk, beside the KV blocks they belong to.

A model with state-space / linear-attention layers resumes a prefix only where its state was checkpointed (the
state after a block ends, keyed by that block's chained hash: cache/state_cache.py), so KV blocks alone on disk
are of no use to it. Every checkpoint the state cache publishes is offered here; at the end of the step it is
copied out (its arrays were evaluated with the step) and handed to its own writer thread, which writes it as a
`state` record (`<hash>.kvs`, the same format as a block's: version, kind, fingerprint, CRC-32, atomic rename:
cache/disk_tier.py). The arrays are the state leaves' entries in the store's order (entries the model never sets
are left out); a record whose arrays do not match the leaves' shapes and dtypes is skipped like a corrupt one.

Reading. The cache manager's prefix filter (`StateCache.usable_blocks`) counts a checkpoint found here as a
resume point; at allocation `StateCache.prepare` reads it back into the checkpoint table, before any block is
taken, and a file that fails its checks is skipped with a warning: the request resumes at an earlier point.
While a request's KV blocks are read in the background (engine/disk_loads.py), the last checkpoint among them
is read too (`prefetch_last`, a reader thread), so `prepare` mostly finds its arrays in memory and only turns
them into MLX arrays on the engine thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from mlxpaged.cache.disk_tier import DiskTier
from mlxpaged.cache.disk_writer import DiskWriter
from mlxpaged.cache.layout import StateLeaf
from mlxpaged.cache.state_cache import Snapshot

import mlx.core as mx
import numpy as np

CLOSE_TIMEOUT_S = 60.0  # at most this long writing the last checkpoints at close
MAX_PREFETCHED = 2  # checkpoints read ahead and held (one per request loading: disk_loads.MAX_LOADS)


class StateTiering:
    """The disk side of a StateCache (its `lower`): `leaves` in the state store's order."""

    def __init__(self, tier: DiskTier, writer: DiskWriter, leaves: Sequence[StateLeaf]):
        self.tier, self.writer, self.leaves = tier, writer, list(leaves)
        self._dirty: dict[bytes, Snapshot] = {}  # published, not yet handed to the writer
        self.hits = 0  # checkpoints read back and used
        self.read_ahead = 0  # of the reads, those a reader thread did while the request's blocks loaded
        self.read_seconds = 0.0
        self.copy_seconds = 0.0  # steps' time copying checkpoints out
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mlxpaged-state-disk-reader")
        self._prefetched: OrderedDict[bytes, Future] = OrderedDict()  # a checkpoint's arrays being read, or read

    # ---- StateCache's CheckpointTier -----------------------------------------------------------------

    def contains(self, block_hash: Hashable) -> bool:
        return isinstance(block_hash, bytes) and (self.writer.is_pending(block_hash) or self.tier.contains(block_hash))

    def read(self, block_hash: Hashable) -> Snapshot | None:
        if not isinstance(block_hash, bytes):
            return None
        start = time.perf_counter()
        ahead = self._prefetched.pop(block_hash, None)
        arrays = self.writer.pending(block_hash)  # not written yet: the copy itself
        if arrays is None:
            if ahead is not None and not ahead.cancelled():
                arrays = ahead.result()
                self.read_ahead += 1
            else:
                arrays = self.tier.read(block_hash)
        snapshot = None
        if arrays is not None:
            try:
                snapshot = to_snapshot(arrays, self.leaves)
            except ValueError as exc:
                self.tier.reject(block_hash, str(exc))
        self.read_seconds += time.perf_counter() - start
        self.hits += snapshot is not None
        return snapshot

    def prefetch_last(self, block_hashes: Sequence[Hashable]) -> bool:
        """Begin reading the last of these blocks' checkpoints found here (the resume point a request loading
        them will want); whether it is read (True when there is none)."""
        block_hash = next((h for h in reversed(block_hashes) if self.contains(h)), None)
        if not isinstance(block_hash, bytes) or self.writer.is_pending(block_hash):
            return True
        ahead = self._prefetched.get(block_hash)
        if ahead is None:
            self._prefetched[block_hash] = ahead = self._reader.submit(self.tier.read, block_hash)
            while len(self._prefetched) > MAX_PREFETCHED:  # a request gone meanwhile: its read is dropped
                self._prefetched.popitem(last=False)
        return ahead.done()

    def offer(self, block_hash: Hashable, snapshot: Snapshot) -> None:
        if isinstance(block_hash, bytes) and not self.writer.is_pending(block_hash) and block_hash not in self._dirty:
            self._dirty[block_hash] = snapshot

    # ---- writing ---------------------------------------------------------------------------------------

    def persist(self, wait: bool = False) -> None:
        """Copy the published checkpoints out and hand them to the writer (a full queue drops them, counted,
        unless `wait`: at close). A checkpoint already on disk is not written again."""
        if not self._dirty:
            return
        start = time.perf_counter()
        dirty = [(h, s) for h, s in self._dirty.items() if self.tier.needs_write(h)]
        self._dirty.clear()
        for block_hash, snapshot in dirty:
            arrays = to_arrays(snapshot, self.leaves)
            if arrays is None:
                continue  # an entry the leaves say is set was not: nothing to resume from
            accepted = self.writer.submit(block_hash, arrays)
            if not accepted and wait and self.writer.wait_idle(CLOSE_TIMEOUT_S):
                self.writer.submit(block_hash, arrays)
        self.copy_seconds += time.perf_counter() - start

    def close(self) -> None:
        try:
            self.persist(wait=True)
        finally:
            self._prefetched.clear()
            self._reader.shutdown(wait=False, cancel_futures=True)
            self.writer.close(CLOSE_TIMEOUT_S)

    def stats(self) -> dict:
        s = self.tier.stats
        return {
            "disk_state_hits": self.hits,
            "disk_state_read_seconds": self.read_seconds,
            "disk_state_read_ahead": self.read_ahead,
            "disk_state_written": s.written_blocks,
            "disk_state_written_bytes": s.written_bytes,
            "disk_state_skipped_files": s.skipped_files,
            "disk_state_dropped_writes": self.writer.dropped,
        }


# ---- snapshots as host arrays --------------------------------------------------------------------------


def to_arrays(snapshot: Snapshot, leaves: Sequence[StateLeaf]) -> list[np.ndarray] | None:
    """The snapshot's set entries as host arrays, leaf by leaf (bfloat16 as its uint16 bits); None when an entry
    the leaves say is set is not (or one they say is unset is)."""
    rows = []
    for leaf in leaves:
        row = snapshot.get(leaf.path)
        if row is None or len(row) != len(leaf.arrays):
            return None
        for entry, array in zip(leaf.arrays, row, strict=True):
            if (entry is None) != (array is None):
                return None
            if array is not None:
                rows.append(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    mx.eval(rows)
    return [np.array(r, copy=True) for r in rows]  # own copies: the writer thread must not touch MLX arrays


def to_snapshot(arrays: Sequence[np.ndarray], leaves: Sequence[StateLeaf]) -> Snapshot:
    """The snapshot `to_arrays` wrote; ValueError when the arrays do not match the leaves' shapes and dtypes."""
    expected = [(leaf, i, entry) for leaf in leaves for i, entry in enumerate(leaf.arrays) if entry is not None]
    if len(arrays) != len(expected):
        raise ValueError(f"{len(arrays)} state arrays, the state leaves set {len(expected)}")
    snapshot: dict = {leaf.path: [None] * len(leaf.arrays) for leaf in leaves}
    for (leaf, i, (shape, dtype)), host in zip(expected, arrays, strict=True):
        bits = dtype == "bfloat16"
        want = np.dtype(np.uint16) if bits else np.dtype(dtype)
        if tuple(host.shape) != (1, *shape) or host.dtype != want:
            raise ValueError(
                f"state leaf {leaf.path} entry {i}: {host.dtype} {tuple(host.shape)}, expected {dtype} (1, {shape})"
            )
        array = mx.array(host)
        snapshot[leaf.path][i] = array.view(mx.bfloat16) if bits else array
    out = {path: tuple(row) for path, row in snapshot.items()}
    mx.eval([a for row in out.values() for a in row if a is not None])
    return out
