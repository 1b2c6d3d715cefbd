"""Issue 24: would a full-precision attention sink bring 4-bit pages within 3%? Perplexity on the Book of Ruth
with mlx-lm's own model and caches that round-trip K/V through groups of 64 in the engine's calibrated coordinates
(runner/kv_calibration.py), read back rounded within each 2048-token chunk as the pages are, except the first KEEP
tokens, kept exact (a sink page). ALPHA < 1 clips each group's range to ALPHA of its half-width around its middle
before quantizing.

    python docs/design/scripts/issue24_sink_perplexity.py [BITS] [KEEP,KEEP,...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from mlxpaged.loading.loader import load_model  # noqa: E402  (after the path)
from mlxpaged.loading.probe import probe_layout  # noqa: E402
from mlxpaged.runner.kv_calibration import calibrate_kv_transform  # noqa: E402
from mlxpaged.runner.prompt_scoring import perplexity  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

GROUP = 64
CHUNK = 2048
ALPHA = float(os.environ.get("ALPHA", "1"))


def round_trip(x: mx.array, bits: int) -> mx.array:
    """`x` quantized and dequantized as the pages store it (its groups clipped first when ALPHA < 1)."""
    if ALPHA < 1:
        shape = x.shape
        groups = x.reshape(*shape[:-1], shape[-1] // GROUP, GROUP)
        hi, lo = groups.max(axis=-1, keepdims=True), groups.min(axis=-1, keepdims=True)
        middle, half = (hi + lo) / 2, (hi - lo) / 2 * ALPHA
        x = mx.clip(groups, middle - half, middle + half).reshape(shape)
    return mx.dequantize(*mx.quantize(x, group_size=GROUP, bits=bits), group_size=GROUP, bits=bits)


class RoundedCache(KVCache):
    """mlx-lm's KVCache holding K/V as the pages would give them back: rounded, except the first `keep` tokens."""

    def __init__(self, layer: int, keep: int, bits: int, transform):
        super().__init__()  # no `bits` attribute: mlx-lm would take it for its own quantized cache
        self.layer, self.keep, self.kv_bits, self.transform = layer, keep, bits, transform

    def update_and_fetch(self, keys, values):
        t, layer = self.transform, self.layer
        if t is not None:
            k = t.keys_out(layer, round_trip(t.keys_in(layer, keys), self.kv_bits))
            v = t.values_out(layer, round_trip(t.values_in(layer, values), self.kv_bits))
        else:
            k, v = round_trip(keys, self.kv_bits), round_trip(values, self.kv_bits)
        exact = max(0, min(self.keep - self.offset, keys.shape[2]))
        if exact:
            k = mx.concatenate([keys[:, :, :exact], k[:, :, exact:]], axis=2)
            v = mx.concatenate([values[:, :, :exact], v[:, :, exact:]], axis=2)
        return super().update_and_fetch(k, v)


def score(model, tokens: list[int], caches: list) -> float:
    out = []
    for start in range(0, len(tokens) - 1, CHUNK):
        piece = tokens[start : start + CHUNK]
        logits = model(mx.array([piece]), cache=caches)[0].astype(mx.float32)
        targets = mx.array(tokens[start + 1 : start + len(piece) + 1])
        rows = logits[: targets.size]
        picked = mx.take_along_axis(rows, targets[:, None], axis=1)[:, 0] - mx.logsumexp(rows, axis=1)
        mx.eval(picked)
        out.append(np.array(picked, dtype=np.float64))
    return perplexity(np.concatenate(out))


def main(argv: list[str]) -> None:
    bits = int(argv[0]) if argv else 4
    keeps = [int(x) for x in argv[1].split(",")] if len(argv) > 1 else [0, 1, 4, 16, 32]
    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
    transform = calibrate_kv_transform(model, probe_layout(model), tokenizer, mx.float32, 16)
    tokens = tokenizer.encode((ROOT / "tests" / "data" / "ruth_kjv.txt").read_text())
    layers = len(model.layers)
    full = score(model, tokens, [KVCache() for _ in range(layers)])
    print(f"{len(tokens)} tokens, full precision {full:.4f}", flush=True)
    for keep in keeps:
        p = score(model, tokens, [RoundedCache(i, keep, bits, transform) for i in range(layers)])
        print(f"{bits}-bit, calibrated, first {keep} exact: {p:.4f} ({(p / full - 1) * 100:+.2f}%)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
