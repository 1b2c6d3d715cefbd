"""The prefix cache's disk tier: one file per full KV block, named by its chained block hash, in a directory
that outlives the process; for models with state layers also one file per state checkpoint (the state after the
block of that hash ends: engine/state_tiering.py), a record of another kind beside it. Plain Python and numpy
(no MLX): the pages come in and go out as host arrays (`PagedKVCache.export_blocks` / `import_blocks`);
engine/kv_tiering.py decides when.

Files. `<root>/v<FORMAT_VERSION>/<fingerprint[:16]>/<hash[:2]>/<hash>.kvb` (`.kvs`: a state checkpoint): the
fingerprint names the model (weights, dtype, kv_bits, layout, block size, state layers: disk_fingerprint.py),
so two models never read each other's blocks. A file is: magic, format version, header length, a JSON header
(fingerprint, block hash, record kind, each array's dtype and shape, payload length), the payload's CRC-32,
then the arrays back to back. A file whose magic, version, kind, fingerprint, hash, length or checksum does
not match is skipped with a warning and never used (a later write of that block replaces it). The kind came
after version 1's first files: a header without one is a KV block's (so no version bump; a build that predates
the kind never opens a `.kvs` name, though it does not count those files in its size either).

Two processes on one directory. A file appears only complete: it is written under a temporary name in its
own directory, flushed, fsynced, then renamed over its final name (atomic on POSIX); a reader opens a final
name or misses, and a file unlinked while open stays readable. Blocks are written once: a block whose file
exists is not written again (its content is a pure function of the hash and the fingerprint).

Size. LRU by access time within `max_bytes` over the whole root (every model and version: it is one budget of
disk): a read hit bumps the file's mtime; when this process's running estimate passes the limit, or it has
written 5% of the limit since it last looked, it takes an exclusive `flock` on `<root>/.lock`, lists every
file (other processes' included) and deletes the least recently used until the total is at 90% of the limit.
The lock serializes eviction only; reads and writes never wait on it. Between two looks another process's
writes are not counted, so the directory may pass the limit by what the other processes wrote in that time
(each looks again after writing 5% of it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT_VERSION = 1
MAGIC = b"MLXPKVB\x00"
SUFFIX = ".kvb"
SUFFIXES = {"kv": SUFFIX, "state": ".kvs"}  # by record kind
_PREFIX = struct.Struct("<8sII")  # magic, version, header length
_CRC = struct.Struct("<I")
LOW_WATER = 0.9  # eviction stops at this share of the limit, so each eviction is not followed by another at once
RESCAN_SHARE = 0.05  # look at the directory again after writing this share of the limit
STALE_TEMP_S = 3600.0  # a temporary file this old belongs to a dead writer: deleted when the directory is listed


class BadBlockFile(Exception):
    """A block file that must not be used: what is wrong with it."""


@dataclass(frozen=True)
class DiskEntry:
    path: Path
    size: int
    mtime: float


@dataclass
class DiskTierStats:
    read_hits: int = 0  # blocks read back and verified
    read_bytes: int = 0
    read_seconds: float = 0.0
    misses: int = 0
    skipped_files: int = 0  # corrupt, truncated or foreign: warned about, never used
    written_blocks: int = 0
    written_bytes: int = 0
    write_errors: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0


class DiskTier:
    """Block files of one model (`fingerprint`, hex) under `root`, LRU within `max_bytes`; `kind`: the records this
    instance reads and writes ("kv": KV blocks, "state": state checkpoints; both count in the one size limit)."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, max_bytes: int, kind: str = "kv"):
        if max_bytes < 1:
            raise ValueError(f"the disk tier needs a size limit above 0 bytes, got {max_bytes}")
        if kind not in SUFFIXES:
            raise ValueError(f"record kind must be one of {sorted(SUFFIXES)}, got {kind!r}")
        self.root = Path(root).expanduser()
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.kind = kind
        self.directory = self.root / f"v{FORMAT_VERSION}" / fingerprint[:16]
        self.directory.mkdir(parents=True, exist_ok=True)
        self.stats = DiskTierStats()
        self._lock = threading.Lock()  # the writer thread and the engine thread share the counters
        self._warned: set[Path] = set()
        self._bad: set[bytes] = set()  # hashes whose file failed a read: a write may replace it
        self._approx_bytes = 0
        self._since_scan = 0
        self.enforce_limit()

    # ---- names ----------------------------------------------------------------------------------

    def path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / f"{name}{SUFFIXES[self.kind]}"

    def contains(self, block_hash: bytes) -> bool:
        """A file exists for this block (it may still fail its checks when read)."""
        return block_hash not in self._bad and self.path(block_hash).is_file()

    @property
    def used_bytes(self) -> int:
        """This process's estimate of the whole directory's size (exact after each look)."""
        return self._approx_bytes

    # ---- reading --------------------------------------------------------------------------------

    def read(self, block_hash: bytes) -> list[np.ndarray] | None:
        """The block's arrays, checked; None when there is no file or it fails a check (warned once)."""
        path = self.path(block_hash)
        start = time.perf_counter()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        except OSError as exc:
            self._skip(path, block_hash, f"unreadable: {exc}")
            return None
        try:
            arrays = decode(data, self.fingerprint, block_hash, self.kind)
        except BadBlockFile as exc:
            self._skip(path, block_hash, str(exc))
            return None
        with contextlib.suppress(OSError):  # LRU by access: a read is a use (another process may have evicted it)
            os.utime(path)
        with self._lock:
            self.stats.read_hits += 1
            self.stats.read_bytes += len(data)
            self.stats.read_seconds += time.perf_counter() - start
        return arrays

    def reject(self, block_hash: bytes, why: str) -> None:
        """A file that read well but must not be used (its arrays do not fit what the reader expects)."""
        self._skip(self.path(block_hash), block_hash, why)

    def _skip(self, path: Path, block_hash: bytes, why: str) -> None:
        self._bad.add(block_hash)
        with self._lock:
            self.stats.skipped_files += 1
        if path not in self._warned:
            self._warned.add(path)
            warnings.warn(f"KV disk tier: skipping {path} ({why}); it is not used", RuntimeWarning, stacklevel=3)

    # ---- writing (the writer thread) ------------------------------------------------------------

    def needs_write(self, block_hash: bytes) -> bool:
        return block_hash in self._bad or not self.path(block_hash).is_file()

    def write(self, block_hash: bytes, arrays: Sequence[np.ndarray]) -> int:
        """Write the block's file atomically unless a good one exists; the bytes written (0: already there)."""
        if not self.needs_write(block_hash):
            return 0
        path = self.path(block_hash)
        data = encode(arrays, self.fingerprint, block_hash, self.kind)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            with open(temp, "wb") as f:
                for chunk in data:
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)  # atomic: readers see the old name's file or this one, never a part
        except OSError:
            with contextlib.suppress(OSError):
                temp.unlink()
            with self._lock:
                self.stats.write_errors += 1
            raise
        size = sum(len(c) for c in data)
        self._bad.discard(block_hash)
        with self._lock:
            self.stats.written_blocks += 1
            self.stats.written_bytes += size
            self._approx_bytes += size
            self._since_scan += size
            over = self._approx_bytes > self.max_bytes or self._since_scan > RESCAN_SHARE * self.max_bytes
        if over:
            self.enforce_limit()
        return size

    # ---- size -----------------------------------------------------------------------------------

    def enforce_limit(self) -> None:
        """Under the directory lock: list every block file under root and delete the least recently used
        until the total is within LOW_WATER of the limit (when over the limit)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                entries = list_entries(self.root, remove_stale_temps=True)
                total = sum(e.size for e in entries)
                if total > self.max_bytes:
                    total = self._evict(sorted(entries, key=lambda e: e.mtime), total)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        with self._lock:
            self._approx_bytes, self._since_scan = total, 0

    def _evict(self, oldest_first: list[DiskEntry], total: int) -> int:
        target = LOW_WATER * self.max_bytes
        for entry in oldest_first:
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                entry.path.unlink()
                with self._lock:
                    self.stats.evicted_files += 1
                    self.stats.evicted_bytes += entry.size
            total -= entry.size
        return total


def list_entries(root: Path, remove_stale_temps: bool = False) -> list[DiskEntry]:
    """Every block file under `root` (all versions and models), with size and mtime. `remove_stale_temps`: also
    delete temporary files older than STALE_TEMP_S (a process that died mid-write leaves one)."""
    found = []
    now = time.time()
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            if remove_stale_temps and name.startswith(".") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if now - path.stat().st_mtime > STALE_TEMP_S:
                        path.unlink()
                continue
            if not name.endswith(tuple(SUFFIXES.values())) or name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile by another process
                st = path.stat()
                found.append(DiskEntry(path, st.st_size, st.st_mtime))
    return found


# ---- the file format -----------------------------------------------------------------------------------


def encode(
    arrays: Sequence[np.ndarray], fingerprint: str, block_hash: bytes, kind: str = "kv"
) -> list[bytes | memoryview]:
    """The file's bytes, in pieces (the payload's pieces are views of the arrays: no copy)."""
    payload = [np.ascontiguousarray(a) for a in arrays]
    raw = [a.reshape(-1).view(np.uint8).data for a in payload]  # byte views: no copy
    header = json.dumps(
        {
            "fingerprint": fingerprint,
            "block_hash": block_hash.hex(),
            "kind": kind,
            "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in payload],
            "payload_bytes": sum(a.nbytes for a in payload),
        },
        separators=(",", ":"),
    ).encode()
    crc = 0
    for piece in raw:
        crc = zlib.crc32(piece, crc)
    pieces: list[bytes | memoryview] = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header, _CRC.pack(crc)]
    return pieces + raw


def decode(data: bytes, fingerprint: str, block_hash: bytes, kind: str = "kv") -> list[np.ndarray]:
    """The arrays of a block file, after every check (BadBlockFile naming the first that fails)."""
    if len(data) < _PREFIX.size:
        raise BadBlockFile(f"truncated: {len(data)} bytes, shorter than its prefix")
    magic, version, header_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BadBlockFile("not a KV block file (bad magic)")
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, this build reads {FORMAT_VERSION}")
    body = _PREFIX.size + header_len + _CRC.size
    if len(data) < body:
        raise BadBlockFile(f"truncated: {len(data)} bytes, its header ends at {body}")
    try:
        header = json.loads(data[_PREFIX.size : _PREFIX.size + header_len])
        specs = [(np.dtype(a["dtype"]), tuple(a["shape"])) for a in header["arrays"]]
        payload_bytes = int(header["payload_bytes"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BadBlockFile(f"unreadable header: {exc}") from exc
    if header.get("fingerprint") != fingerprint:
        raise BadBlockFile(f"another model's block (fingerprint {str(header.get('fingerprint'))[:16]}...)")
    if header.get("block_hash") != block_hash.hex():
        raise BadBlockFile("holds another block (hash mismatch)")
    if header.get("kind", "kv") != kind:
        raise BadBlockFile(f"a {header.get('kind')!r} record where a {kind!r} one belongs")
    if len(data) != body + payload_bytes or payload_bytes != sum(d.itemsize * int(np.prod(s)) for d, s in specs):
        raise BadBlockFile(f"truncated or padded: {len(data)} bytes, expected {body + payload_bytes}")
    (crc,) = _CRC.unpack_from(data, _PREFIX.size + header_len)
    view = memoryview(data)[body:]
    if zlib.crc32(view) != crc:
        raise BadBlockFile("checksum mismatch (corrupt)")
    arrays, offset = [], body
    for dtype, shape in specs:
        n = dtype.itemsize * int(np.prod(shape))
        arrays.append(np.frombuffer(data, dtype=dtype, count=n // dtype.itemsize, offset=offset).reshape(shape))
        offset += n
    return arrays
