"""What quantized KV pages cost and which models they fit: plain Python, no MLX.

A quantized page is laid out as `mx.quantize` lays a matrix out (group-wise affine over the last axis):
per token and head, `dim * bits / 32` packed uint32 words, plus one scale and one bias per `group_size`
elements in the model's KV dtype. A pool of width `dim` is three arrays (kv_cache.py, quantized_pages.py):
data `[blocks, heads, block_size, dim * bits / 32]` uint32, scales and biases `[blocks, heads, block_size,
dim / group_size]`. With a 2-byte dtype that is 9 bits per element for 8-bit pages (groups of 32) and 4.5 for
4-bit ones (groups of 64), against 16: 1.78x or 3.56x the tokens in the same memory.

Why 8-bit pages default to groups of 32 (llama.cpp's q8_0 blocks; mlx's default is 64): with groups of 64 the
embedded model's next-token log-prob margins moved by a median 0.044 nats (p90 0.12) over 180 teacher-forced
positions, as much as a near-tie's whole margin, so which of two close answers won came down to how the CPU's BLAS
rounded (issue 41: "What is the capital of France?" has a 0.10-nat margin, and 8-bit pages in groups of 64 answered
"L'Étoile..." under 5 of 7 OpenBLAS core types). Groups of 32 halve that (median 0.027, p90 0.071; the mean KL to
full precision on held-out text 4.4e-4 -> 2.2e-4) and answered "Paris" under all 7 (docs/design/issue41-cpu-kernels.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.errors import ConfigError

KV_BITS = (8, 4)  # what `kv_bits` takes (None: full precision)
KV_GROUP_SIZES = (64, 32)  # mx.quantize's group sizes that fit common head widths; 64 is mlx's default
DEFAULT_GROUP_SIZES = {8: 32, 4: 64}  # per kv_bits (the module's note says why 8-bit pages take 32)


def default_group_size(bits: int) -> int:
    """The group size `bits`-bit pages take when none is asked for (DEFAULT_GROUP_SIZES; 64 for any other)."""
    return DEFAULT_GROUP_SIZES.get(bits, 64)


@dataclass(frozen=True, init=False)
class KVQuantization:
    """Group-wise affine quantization of every K/V page: `bits` per element, one scale and bias per group of
    `group_size` elements (given as None: `default_group_size(bits)`)."""

    bits: int
    group_size: int

    def __init__(self, bits: int, group_size: int | None = None) -> None:
        object.__setattr__(self, "bits", bits)  # frozen
        object.__setattr__(self, "group_size", default_group_size(bits) if group_size is None else group_size)
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


def kv_quantization(bits: int | None, group_size: int | None = None) -> KVQuantization | None:
    """The quantization `kv_bits` / `kv_group_size` ask for (None: full precision; group size None: the default
    for those bits)."""
    return None if bits is None else KVQuantization(bits, group_size)
