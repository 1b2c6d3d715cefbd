"""What makes one process's KV blocks valid in another: the disk tier's model fingerprint. Plain Python.

Blocks are keyed by the chained token hash (block_pool.sha256_block_hash), which says nothing of the model
that computed them. The fingerprint does: the weights (each file's name and size, and samples of its bytes:
the header and 16 slices spread over the file, so a fine-tune of the same shapes differs without reading
gigabytes), the KV dtype and bits, the block size, the layout (every layer's kind and K/V geometry), the pool
shapes and the backend (K/V computed on another backend differ in their last bits). Blocks of another
fingerprint live in another directory and are refused if found in this one.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

SAMPLES_PER_FILE = 16
SAMPLE_BYTES = 64 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
CONFIG_FILES = ("config.json",)


def weights_identity(model_dir: str | os.PathLike) -> str:
    """A hash of the model directory's weight and config files: names, sizes and sampled bytes."""
    root = Path(model_dir)
    h = hashlib.sha256()
    files = sorted(p for p in root.iterdir() if p.is_file() and (p.suffix in WEIGHT_SUFFIXES or p.name in CONFIG_FILES))
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}:{size}|".encode())
        with open(path, "rb") as f:
            for offset in _sample_offsets(size):
                f.seek(offset)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def _sample_offsets(size: int) -> Iterable[int]:
    if size <= SAMPLES_PER_FILE * SAMPLE_BYTES:
        return range(0, size, SAMPLE_BYTES)
    step = (size - SAMPLE_BYTES) // (SAMPLES_PER_FILE - 1)
    return (i * step for i in range(SAMPLES_PER_FILE))


def model_fingerprint(weights: str, **facts: object) -> str:
    """sha256 (hex) of the weights' identity and every fact that shapes a block's bytes (each with a stable
    repr: str, int, None, tuples of them)."""
    h = hashlib.sha256(b"mlxpaged-kv-disk|" + weights.encode())
    for name in sorted(facts):
        h.update(f"|{name}={facts[name]!r}".encode())
    return h.hexdigest()
