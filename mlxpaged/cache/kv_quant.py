"""What quantized KV pages cost and which models they fit: plain Python, no MLX.

A quantized page is laid out as `mx.quantize` lays a matrix out (group-wise affine over the last axis):
per token and head, `dim * bits / 32` packed uint32 words, plus one scale and one bias per `group_size`
elements in the model's KV dtype. A pool of width `dim` is three arrays (kv_cache.py, quantized_pages.py):
data `[blocks, heads, block_size, dim * bits / 32]` uint32, scales and biases `[blocks, heads, block_size,
dim / group_size]`. With a 2-byte dtype and groups of 64 that is 8.5 (8-bit) or 4.5 (4-bit) bits per
element against 16: 1.88x or 3.56x the tokens in the same memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.errors import ConfigError

KV_BITS = (8, 4)  # what `kv_bits` takes (None: full precision)
KV_GROUP_SIZES = (64, 32)  # mx.quantize's group sizes that fit common head widths; 64 is mlx's default


@dataclass(frozen=True)
class KVQuantization:
    """Group-wise affine quantization of every K/V page: `bits` per element, one scale and bias per group."""

    bits: int
    group_size: int = 64

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ConfigError(f"{{kv_bits:{self.bits!r}}} must be one of {KV_BITS} (or unset)", param="kv_bits")
        if self.group_size not in KV_GROUP_SIZES:
            raise ConfigError(
                f"{{kv_group_size:{self.group_size!r}}} must be one of {KV_GROUP_SIZES}", param="kv_group_size"
            )

    def packed_width(self, dim: int) -> int:
        """uint32 words of one row of `dim` elements."""
        return dim * self.bits // 32

    def groups(self, dim: int) -> int:
        return dim // self.group_size

    def row_bytes(self, dim: int, dtype_bytes: int) -> int:
        """Bytes of one row of `dim` elements: packed words, scales and biases."""
        return 4 * self.packed_width(dim) + 2 * self.groups(dim) * dtype_bytes

    def check_widths(self, widths: Sequence[int]) -> None:
        """Every K/V width must hold whole groups: ConfigError naming the first that does not."""
        bad = sorted({w for w in widths if w % self.group_size})
        if bad:
            hint = " (try kv_group_size=32)" if self.group_size != 32 and all(w % 32 == 0 for w in bad) else ""
            raise ConfigError(
                f"{{kv_bits:{self.bits}}} quantizes K/V in groups of {{kv_group_size:{self.group_size}}} elements, "
                f"but this model's K/V widths include {bad[0]} (widths: {sorted(set(widths))}), which is not a "
                f"multiple of {self.group_size}{hint}",
                param="kv_bits",
            )

    def describe(self) -> str:
        return f"{self.bits}-bit (groups of {self.group_size})"


def kv_quantization(bits: int | None, group_size: int = 64) -> KVQuantization | None:
    """The quantization `kv_bits` / `kv_group_size` ask for (None: full precision)."""
    return None if bits is None else KVQuantization(bits, group_size)
