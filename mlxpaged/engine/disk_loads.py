"""Disk hits read off the engine thread: the files of a waiting request's blocks are read and checked by reader
threads while the engine keeps stepping the other requests; the request is admitted once they are in host
memory, and only the copy into the pools (MLX: the engine thread) is left for its admission.

A load is keyed by its request. `start` begins one (a loader thread fans the files out to READ_THREADS readers:
file reads and CRC-32 release the GIL) and answers whether it is done; `take` hands the pages over, by block
hash, so the cache manager uses whatever part of them still follows its RAM hits then. A run stops at the first
block missing or failing its checks (warned once by the disk tier): the rest is prefilled. Plain Python, numpy.
"""

from __future__ import annotations

import concurrent.futures
import time
import warnings
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor

READ_THREADS = 4  # files read and checked at once by a disk hit
MAX_LOADS = 2  # requests whose pages are read or held at once: bounds the host memory they take

Pages = list  # one block's arrays, one per pool


class DiskLoads:
    """`read_one(hash)`: a block's checked pages or None; `fits(pages)`: they fit the pools."""

    def __init__(self, read_one: Callable[[Hashable], Pages | None], fits: Callable[[Pages], bool]):
        self.read_one, self.fits = read_one, fits
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="mlxpaged-kv-disk-reader")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="mlxpaged-kv-disk-loader")
        self._loads: dict[Hashable, Future] = {}  # by request: a run being read or read
        self.background_loads = 0  # runs read off the engine thread
        self.background_seconds = 0.0  # their reads and checks

    def read_run(self, block_hashes: list[Hashable]) -> list[Pages]:
        """The pages of the leading blocks that read, pass their checks and fit (on the caller's thread)."""
        pages = []
        try:
            for arrays in self._readers.map(self.read_one, block_hashes):
                if arrays is None or not self.fits(arrays):
                    break
                pages.append(arrays)
        except Exception as exc:  # recomputing the blocks is always correct
            warnings.warn(f"KV disk tier: reading blocks back failed ({exc!r}); they are recomputed", RuntimeWarning, 2)
        return pages

    def start(self, key: Hashable, block_hashes: list[Hashable]) -> bool:
        """Begin reading the run for `key` unless it is begun (or MAX_LOADS are: then it waits its turn);
        whether it is read (True: `take` has it)."""
        load = self._loads.get(key)
        if load is None:
            if len(self._loads) >= MAX_LOADS:
                return False
            self._loads[key] = load = self._loader.submit(self._background, block_hashes)
        return load.done()

    def loading(self) -> bool:
        return any(not load.done() for load in self._loads.values())

    def take(self, key: Hashable) -> dict[Hashable, Pages]:
        """The pages read for `key`, by block hash (empty when none are ready); the load is forgotten."""
        load = self._loads.pop(key, None)
        if load is None or not load.done():
            return {}
        return load.result()

    def forget(self, key: Hashable) -> None:
        """The request went away while its blocks loaded: drop them (a read in progress finishes unused)."""
        self._loads.pop(key, None)

    def wait(self, timeout: float) -> None:
        """Block until a load in progress finishes, at most `timeout` s (an engine with nothing else to run)."""
        pending = [load for load in self._loads.values() if not load.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def close(self) -> None:
        self._loads.clear()
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._readers.shutdown(wait=False, cancel_futures=True)

    def _background(self, block_hashes: list[Hashable]) -> dict[Hashable, Pages]:
        start = time.perf_counter()
        pages = self.read_run(block_hashes)
        self.background_loads += 1
        self.background_seconds += time.perf_counter() - start
        return dict(zip(block_hashes, pages, strict=False))
