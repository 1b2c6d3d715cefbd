"""Issue 24: 4-bit pages with `mx.quantize`'s min-max groups against groups fitted by least squares
(cache/group_fit.py), by perplexity and mean KL(full || 4-bit) per token on three texts: the Book of Ruth that
ships with the tests, and two read from this machine when present (Esther, KJV, from Debian's bible-kjv-text via
`bible -f "Esther 1:1-10:3"`, verse numbers removed; the GPL-3 text in /usr/share/common-licenses), 4,096 tokens
each. mlx-lm's own model, with caches that round-trip K/V through the engine's calibrated coordinates
(runner/kv_calibration.py) and the given groups, read back rounded within each 2048-token chunk as the pages are.
Three settings: min-max groups and fitted groups in the engine's coordinates, and fitted groups with the centers
the plain means of the calibration's K/V (`quantization=None`: position 0 not put on the grid).

    python docs/design/scripts/issue24_fit_quality.py
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from mlxpaged.cache import group_fit  # noqa: E402  (after the path)
from mlxpaged.cache.kv_quant import KVQuantization  # noqa: E402
from mlxpaged.loading.loader import load_model  # noqa: E402
from mlxpaged.loading.probe import probe_layout  # noqa: E402
from mlxpaged.runner.kv_calibration import calibrate_kv_transform  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

CHUNK, LIMIT = 2048, 4096
QUANTIZATION = KVQuantization(4, 64)


def min_max(x: mx.array) -> mx.array:
    parts = mx.quantize(x, group_size=64, bits=4)
    return mx.dequantize(*parts, group_size=64, bits=4)


def fitted(x: mx.array) -> mx.array:
    return group_fit.round_trip(x, QUANTIZATION)


class RoundedCache(KVCache):
    """mlx-lm's KVCache holding K/V as 4-bit pages give them back (no `bits` attribute: mlx-lm would take it for
    its own quantized cache)."""

    def __init__(self, layer: int, transform, rounding):
        super().__init__()
        self.layer, self.transform, self.rounding = layer, transform, rounding

    def update_and_fetch(self, keys, values):
        t, layer = self.transform, self.layer
        k = t.keys_out(layer, self.rounding(t.keys_in(layer, keys)))
        v = t.values_out(layer, self.rounding(t.values_in(layer, values)))
        return super().update_and_fetch(k, v)


def log_probs(model, tokens: list[int], caches: list):
    """Per chunk: (log-softmax rows float64, the next tokens)."""
    for start in range(0, len(tokens) - 1, CHUNK):
        piece = tokens[start : start + CHUNK]
        n = min(len(piece), len(tokens) - 1 - start)
        logits = model(mx.array([piece]), cache=caches)[0, :n].astype(mx.float32)
        rows = logits - mx.logsumexp(logits, axis=1, keepdims=True)
        yield np.array(rows, dtype=np.float64), np.array(tokens[start + 1 : start + 1 + n])


def texts() -> dict[str, str]:
    out = {"ruth": (ROOT / "tests" / "data" / "ruth_kjv.txt").read_text()}
    if shutil.which("bible"):
        raw = subprocess.run(["bible", "-f", "Esther 1:1-10:3"], capture_output=True, text=True).stdout
        out["esther"] = " ".join(re.sub(r"^Est\d+:\d+ ", "", line) for line in raw.splitlines())
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.exists():
        out["gpl-3"] = gpl.read_text()
    return out


def main() -> None:
    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
    layout = probe_layout(model)
    transform = calibrate_kv_transform(model, layout, tokenizer, mx.float32, 16)
    mean_centers = calibrate_kv_transform(model, layout, tokenizer, mx.float32, 16, quantization=None)
    layers = len(model.layers)
    settings = (
        ("min-max", transform, min_max),
        ("fitted, mean centers", mean_centers, fitted),
        ("fitted", transform, fitted),
    )
    lines: dict[str, list[str]] = {label: [] for label, _, _ in settings}
    for name, text in texts().items():
        tokens = tokenizer.encode(text)[:LIMIT]
        full = list(log_probs(model, tokens, [KVCache() for _ in range(layers)]))
        full_nll = np.concatenate([-rows[np.arange(len(nxt)), nxt] for rows, nxt in full])
        for label, coordinates, rounding in settings:
            caches = [RoundedCache(i, coordinates, rounding) for i in range(layers)]
            nll, kl = [], []
            for (rows, nxt), (full_rows, _) in zip(log_probs(model, tokens, caches), full, strict=True):
                nll.append(-rows[np.arange(len(nxt)), nxt])
                kl.append((np.exp(full_rows) * (full_rows - rows)).sum(axis=1))
            ratio = np.exp(np.concatenate(nll).mean() - full_nll.mean()) - 1
            lines[label].append(
                f"{name} ({len(tokens)} tokens) ppl {ratio * 100:+.2f}% KL {np.concatenate(kl).mean():.4f}"
            )
            print(f"{label}: {lines[label][-1]}", flush=True)
    for label, parts in lines.items():
        print(f"{label:20s} " + " | ".join(parts))


if __name__ == "__main__":
    main()
