"""The prefix cache's two tiers, RAM (the block pool) and disk (cache/disk_tier.py), joined on the engine thread.

Writing. A block entering the prefix cache (`BlockPool.on_cached`) is remembered as dirty. At the end of a
step whose pools are settled (runner.pools_settled: no pass queued ahead, no K/V held outside the pools) the
dirty blocks' pages are copied out (`PagedKVCache.export_blocks`: one take per pool, evaluated, so no pool is
pinned) and handed to the writer thread (cache/disk_writer.py); the step never waits on the disk. Prefill
steps are settled, so prompt blocks go at once; a block filled while decoding is pipelined waits for the
pipeline to stop. Before a schedule, a dirty block that could be evicted (ref count 0) is written first,
settling the pipeline if it must: under memory pressure, RAM blocks go to disk before the pool reuses them.
At close, every cached block not yet on disk is written (the chat's last reply included).

Reading. A waiting request whose blocks after its RAM hits are on disk is not admitted at once: the cache
manager's `loading` asks `prefetch`, and reader threads (engine/disk_loads.py) read and check the files while
the engine keeps stepping the other requests (which may pass it in the queue meanwhile). Once they are in host
memory, the request is admitted: the manager's `read` takes the pages (reading here only blocks not read yet,
such as one written since) and `write` copies them into the request's first fresh blocks, on the engine thread
that owns MLX, before its prefill is scheduled. A run ends at the first file failing its checks: the rest is
prefilled. State models' checkpoints are read at allocation (engine/state_tiering.py).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Hashable

from mlxpaged.cache.block_pool import BlockPool, KVCacheBlock
from mlxpaged.cache.disk_tier import DiskTier
from mlxpaged.cache.disk_writer import DiskWriter
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.engine.disk_loads import DiskLoads
from mlxpaged.engine.state_tiering import StateTiering

CLOSE_TIMEOUT_S = 60.0  # at most this long writing the last blocks at close
SNAPSHOT_BATCH = 64  # blocks per export (one take per pool): bounds the host copy made at once


class KVTiering:
    """`runner`: the engine's Runner (its `pools_settled` and `drop_look_ahead`)."""

    def __init__(self, tier: DiskTier, writer: DiskWriter, kv: PagedKVCache, pool: BlockPool, runner):
        self.tier, self.writer, self.kv, self.pool, self.runner = tier, writer, kv, pool, runner
        self._dirty: dict[int, bytes] = {}  # block id -> hash: cached in RAM, not yet handed to the writer
        # Block id -> the hash it held when it was written or read back: while it still holds that hash, it is on
        # disk (bounded by the pool, unlike a set of every hash ever written).
        self._on_disk: dict[int, bytes] = {}
        self.hit_blocks = 0
        self.load_seconds = 0.0  # reads, checks and the copy into the pools
        self.snapshot_seconds = 0.0  # time steps spent copying pages out
        self.states: StateTiering | None = None  # a state model's checkpoints on disk (engine/state_tiering.py)
        pool.on_cached = self._on_cached
        self.loads = DiskLoads(self._read, self._fits)  # disk hits read off the engine thread

    # ---- the cache manager's LowerTier -------------------------------------------------------------

    def contains(self, block_hash: Hashable) -> bool:
        """On disk, or queued for it (the writer still holds the snapshot)."""
        return isinstance(block_hash, bytes) and (self.writer.is_pending(block_hash) or self.tier.contains(block_hash))

    def prefetch(self, key: Hashable, block_hashes: list[Hashable]) -> bool:
        """Read the blocks for request `key` in the background (and a state model's last checkpoint among them);
        whether they are read (it may be admitted)."""
        ready = self.loads.start(key, block_hashes)
        return (self.states is None or self.states.prefetch_last(block_hashes)) and ready

    def forget(self, key: Hashable) -> None:
        self.loads.forget(key)

    def read(self, block_hashes: list[Hashable], key: Hashable = None) -> list[list]:
        """The pages of the leading blocks whose files read and pass their checks (and fit the pools): those
        read in the background for `key`, then any not read yet (a block written since), read here."""
        start = time.perf_counter()
        ready = self.loads.take(key)
        pages = []
        for block_hash in block_hashes:
            if block_hash not in ready:
                break
            pages.append(ready[block_hash])
        if len(pages) < len(block_hashes):
            pages += self.loads.read_run(block_hashes[len(pages) :])
        self.load_seconds += time.perf_counter() - start
        return pages

    def write(self, block_ids: list[int], block_hashes: list[Hashable], pages: list[list]) -> None:
        """Copy pages `read` returned into the request's fresh blocks (the engine thread: it owns MLX)."""
        start = time.perf_counter()
        self.runner.drop_look_ahead()  # a pass in flight would make the writes below copy whole pools
        self.kv.import_blocks(block_ids, pages)
        for block_id, block_hash in zip(block_ids, block_hashes, strict=True):
            if isinstance(block_hash, bytes):  # what _read took (other hashes are never read)
                self._on_disk[block_id] = block_hash
        self.hit_blocks += len(block_ids)
        self.load_seconds += time.perf_counter() - start

    def _fits(self, arrays: list) -> bool:
        """The pages fit the pools (a fingerprint covers their shapes: a mismatch is a collision, never used)."""
        pools = self.kv.pools
        ok = len(arrays) == len(pools) and all(
            tuple(a.shape) == tuple(p.shape[1:]) and a.dtype.itemsize == p.dtype.size
            for a, p in zip(arrays, pools, strict=False)
        )
        if not ok:
            warnings.warn("KV disk tier: a block's pages do not fit the pools; not used", RuntimeWarning, 3)
        return ok

    def _read(self, block_hash: Hashable) -> list | None:
        if not isinstance(block_hash, bytes):
            return None
        queued = self.writer.pending(block_hash)  # not written yet: the snapshot itself
        return queued if queued is not None else self.tier.read(block_hash)

    # ---- writing ---------------------------------------------------------------------------------

    def _on_cached(self, block: KVCacheBlock) -> None:
        if isinstance(block.block_hash, bytes) and not self._is_on_disk(block.block_id, block.block_hash):
            self._dirty[block.block_id] = block.block_hash

    def _is_on_disk(self, block_id: int, block_hash: bytes) -> bool:
        return self._on_disk.get(block_id) == block_hash

    def before_schedule(self) -> None:
        """Write dirty blocks the pool could evict this step (settling the pipeline if it must)."""
        if not self._dirty:
            return
        if self.runner.pools_settled:
            self.persist()
        elif any(self.pool.ref_count(b) == 0 for b in self._dirty):
            self.runner.drop_look_ahead()
            self.persist()

    def after_step(self) -> None:
        if self._dirty and self.runner.pools_settled:
            self.persist()
        if self.states is not None:
            self.states.persist()  # checkpoints are not in the pools: no need to settle

    def idle(self) -> None:
        """The engine has nothing to run: settle and write what is dirty."""
        if self._dirty:
            self.runner.drop_look_ahead()
            self.persist()
        if self.states is not None:
            self.states.persist()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until the writers wrote everything handed to them; False on timeout."""
        return self.writer.wait_idle(timeout) and (self.states is None or self.states.writer.wait_idle(timeout))

    def persist(self, wait: bool = False) -> None:
        """Hand every dirty block still holding its hash to the writer (a full queue drops the rest, counted,
        unless `wait`: at close)."""
        start = time.perf_counter()
        live = []
        for block_id, block_hash in self._dirty.items():
            if self.pool.blocks[block_id].block_hash != block_hash or self._is_on_disk(block_id, block_hash):
                continue  # evicted meanwhile (it was written then), or a duplicate
            if not self.writer.is_pending(block_hash) and self.tier.needs_write(block_hash):
                live.append((block_id, block_hash))
            else:  # queued or written from another block, or written by another process
                self._on_disk[block_id] = block_hash
        self._dirty.clear()
        for i in range(0, len(live), SNAPSHOT_BATCH):
            batch = live[i : i + SNAPSHOT_BATCH]
            for (block_id, block_hash), arrays in zip(batch, self.kv.export_blocks([b for b, _ in batch]), strict=True):
                accepted = self.writer.submit(block_hash, arrays)
                if not accepted and wait and self.writer.wait_idle(CLOSE_TIMEOUT_S):
                    accepted = self.writer.submit(block_hash, arrays)
                if accepted:
                    self._on_disk[block_id] = block_hash
        self.snapshot_seconds += time.perf_counter() - start

    def close(self) -> None:
        """Write every cached block not on disk yet, then stop the writer (at most CLOSE_TIMEOUT_S)."""
        try:
            self.runner.drop_look_ahead()
            for block in self.pool.blocks:
                if isinstance(block.block_hash, bytes) and not self._is_on_disk(block.block_id, block.block_hash):
                    self._dirty[block.block_id] = block.block_hash
            self.persist(wait=True)
        except Exception as exc:  # the engine is stopping anyway: lose these blocks, not the clean exit
            warnings.warn(f"KV disk tier: the last blocks were not written ({exc!r})", RuntimeWarning, 2)
        finally:
            self.loads.close()
            self.writer.close(CLOSE_TIMEOUT_S)
            if self.states is not None:
                self.states.close()

    # ---- stats -------------------------------------------------------------------------------------

    def stats(self, ram_missed_tokens: int) -> dict:
        """The disk tier's counters for Engine.stats (`ram_missed_tokens`: prompt tokens looked up so far that the
        RAM tier did not have). Bytes written per prompt token count the tokens computed (found in neither tier)."""
        s = self.tier.stats
        computed = ram_missed_tokens - self.hit_blocks * self.kv.block_size
        return {
            "disk_dir": str(self.tier.directory),
            "disk_limit_bytes": self.tier.max_bytes,
            "disk_used_bytes": self.tier.used_bytes,
            "disk_hit_blocks": self.hit_blocks,
            "disk_hit_tokens": self.hit_blocks * self.kv.block_size,
            "disk_read_bytes": s.read_bytes,
            "disk_read_seconds": self.load_seconds + self.loads.background_seconds,
            "disk_engine_read_seconds": self.load_seconds,  # of it, on the engine thread (others' steps waited)
            "disk_background_loads": self.loads.background_loads,
            "disk_written_blocks": s.written_blocks,
            "disk_written_bytes": s.written_bytes,
            "disk_written_bytes_per_prompt_token": s.written_bytes / computed if computed > 0 else 0.0,
            "disk_pending_bytes": self.writer.pending_bytes,
            "disk_dropped_writes": self.writer.dropped,
            "disk_failed_writes": self.writer.failed,
            "disk_skipped_files": s.skipped_files,
            "disk_evicted_files": s.evicted_files,
            "disk_snapshot_seconds": self.snapshot_seconds,
            **(self.states.stats() if self.states is not None else {}),
        }
