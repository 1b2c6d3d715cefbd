"""The disk tier's writer thread: block snapshots (host arrays the engine step already copied out of the
pools) go onto a queue and are written by this thread, so no engine step waits on the disk.

The queue is bounded by the bytes it holds (`max_pending_bytes`): a snapshot that would pass it is dropped
and counted, never waited for (the block stays in RAM; it is offered again when it is evicted or when the
engine closes). Plain Python and numpy.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np


class BlockStore(Protocol):
    """What the writer writes into (disk_tier.DiskTier)."""

    def write(self, block_hash: bytes, arrays: Sequence[np.ndarray]) -> int: ...


_STOP = object()


class DiskWriter:
    def __init__(self, store: BlockStore, max_pending_bytes: int):
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending_bytes = 0
        # Snapshots queued and not yet written, by hash: still readable (a block evicted from RAM before its
        # file exists is found here).
        self._pending: dict[Hashable, list[np.ndarray]] = {}
        self.dropped = 0  # snapshots refused because the queue was full
        self.failed = 0  # writes that raised (disk full, permissions): warned once
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="mlxpaged-kv-disk-writer", daemon=True)
        self._thread.start()

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def is_pending(self, block_hash: Hashable) -> bool:
        return block_hash in self._pending

    def pending(self, block_hash: Hashable) -> list[np.ndarray] | None:
        """The queued snapshot of this block, or None (not queued, or written already)."""
        return self._pending.get(block_hash)

    def submit(self, block_hash: bytes, arrays: list[np.ndarray]) -> bool:
        """Queue a block's snapshot; False (dropped, counted) when the queue holds too many bytes. Never blocks."""
        size = sum(a.nbytes for a in arrays)
        with self._lock:
            if block_hash in self._pending:
                return True
            if self._pending_bytes + size > self.max_pending_bytes:
                self.dropped += 1
                return False
            self._pending_bytes += size
            self._pending[block_hash] = arrays
        self._queue.put((block_hash, arrays, size))
        return True

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written (tests, shutdown); False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Write what is queued (at most `timeout` s), then stop the thread; False when it did not finish."""
        done = self.wait_idle(timeout)
        self._queue.put(_STOP)
        self._thread.join(0 if not done else timeout)
        return done

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            block_hash, arrays, size = item
            try:
                self.store.write(block_hash, arrays)
            except Exception as exc:  # a full or read-only disk must not stop the engine: the block stays in RAM
                self.failed += 1
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"KV disk tier: a block write failed ({exc!r})", RuntimeWarning, stacklevel=1)
            with self._idle:
                self._pending_bytes -= size
                self._pending.pop(block_hash, None)
                self._idle.notify_all()
