"""Issue 24: would a longer calibration text give 4-bit pages better coordinates? The calibration text
(runner/kv_calibration.py, ~250 tokens) extended by the first N tokens of /usr/share/common-licenses/Apache-2.0,
scored as issue24_fit_quality.py scores (fitted groups; Ruth and Esther, the GPL-3 text left out as the same kind
of text as the extension).

    python docs/design/scripts/issue24_calibration_length.py [N,N,...]
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlxpaged.loading.loader import load_model
from mlxpaged.loading.probe import probe_layout
from mlxpaged.runner import kv_calibration

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

fit_quality = importlib.import_module("issue24_fit_quality")  # the script beside this one (not a package)
EXTRA = Path("/usr/share/common-licenses/Apache-2.0")


def main(argv: list[str]) -> None:
    lengths = [int(n) for n in argv[0].split(",")] if argv else [0, 250, 750]
    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
    base, extra = kv_calibration.CALIBRATION_TEXT, tokenizer.encode(EXTRA.read_text())
    layers = len(model.layers)
    texts = {}
    for name, text in fit_quality.texts().items():
        if name != "gpl-3":
            tokens = tokenizer.encode(text)[: fit_quality.LIMIT]
            texts[name] = tokens, list(fit_quality.log_probs(model, tokens, [KVCache() for _ in range(layers)]))
    for n in lengths:
        kv_calibration.CALIBRATION_TEXT = base + ("\n\n" + tokenizer.decode(extra[:n]) if n else "")
        transform = kv_calibration.calibrate_kv_transform(model, probe_layout(model), tokenizer, mx.float32, 16)
        parts = []
        for name, (tokens, full) in texts.items():
            caches = [fit_quality.RoundedCache(i, transform, fit_quality.fitted) for i in range(layers)]
            nll, kl = [], []
            for (rows, nxt), (full_rows, _) in zip(fit_quality.log_probs(model, tokens, caches), full, strict=True):
                nll.append(-rows[np.arange(len(nxt)), nxt])
                kl.append((np.exp(full_rows) * (full_rows - rows)).sum(axis=1))
            full_nll = np.concatenate([-rows[np.arange(len(nxt)), nxt] for rows, nxt in full])
            ratio = np.exp(np.concatenate(nll).mean() - full_nll.mean()) - 1
            parts.append(f"{name} ppl {ratio * 100:+.2f}% KL {np.concatenate(kl).mean():.4f}")
        print(f"calibration + {n} tokens: " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
