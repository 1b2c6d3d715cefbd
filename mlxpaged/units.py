"""Sizes in bytes, both ways: `parse_size` reads what users type ("2GB", "512MiB"), `format_size`
writes what the library and the front ends print ("2.00 GB"), in the unit the settings read.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from mlxpaged.errors import ConfigError

# Decimal units are powers of 1000 (as disks, macOS and mlx-lm's own --max-kv-size parser count);
# binary units ("GiB", or "Gi") are powers of 1024. A bare number is bytes.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "ki": 2**10,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mi": 2**20,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gi": 2**30,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int, param: str | None = None) -> int:
    """Bytes in a size such as "2GB", "512MiB", "1.5G", "4096" or an int.

    "K/M/G/T" and "KB/MB/GB/TB" are decimal (1 GB = 10**9 bytes, like mlx-lm's size flags);
    "KiB/MiB/GiB/TiB" (or "Ki/Mi/Gi/Ti") are binary (1 GiB = 2**30 bytes). Case does not
    matter. Fractions of a byte are dropped ("1.5KiB" is 1536 bytes). `param` names the setting
    in the error (ConfigError, a ValueError).
    """
    subject = f"{{{param}:{text!r}}}" if param else repr(text)
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ConfigError(f"{subject} is not a size: give a number of bytes or a string like '2GB'", param=param)
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"{subject} is not a size: it must not be negative", param=param)
        return text
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{subject} is not a size: use bytes or a unit, e.g. '2GB', '512MiB', '1.5G'", param=param)
    return int(Decimal(match.group(1)) * _UNITS[unit])  # the regex admits only valid decimals


def format_size(n: int | None) -> str:
    """Bytes as decimal gigabytes, the unit --kv-memory reads (1 GB = 10**9 bytes); below 10 MB in MB
    or KB, so a small size reads as itself rather than 0.00 GB. None (not known) is "-"."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 10**9), ("MB", 10**6)):
        if n >= scale // 100:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.2f} KB"


def size_at_least(n: int) -> str:
    """`n` bytes as a size setting ("0.38GB"), rounded up so that asking for it is enough."""
    unit = format_size(n).split()[1]
    scale = _UNITS[unit.lower()]
    return f"{math.ceil(n * 100 / scale) / 100:.2f}{unit}"
