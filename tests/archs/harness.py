"""One tiny architecture on the paged engine against mlx-lm's own generate_step.

    python -m tests.archs.harness [--variants cpu,cuda,kv8] MODULE [MODULE ...]   -> one JSON verdict per module
                                                                                     and variant

Each variant runs the module's scenarios on engines of its own; the model is built once per module, and mlx-lm's
full-precision reference once for the variants that compare with it (VARIANTS):

- `cpu`: the engine on this machine's backend (MLX's CPU backend);
- `cuda`: the engine on the path a GPU takes (platform/backend.py simulated: eager decode queued before the last
  step is read, deferred page writes flushed every few tokens, MLX's fused attention), MLX still computing on
  the CPU;
- `kv8`: every engine on quantized pages (8 bits, groups of KV_GROUP_SIZE) against mlx-lm's greedy tokens over
  the same quantized K/V (quantized_reference.py: the prompt fed token by token through mlx-lm's own caches, each
  new K/V quantized and dequantized as the pages store it). An architecture whose K/V widths groups cannot split
  is "refused" (the engine raises ConfigError at construction, naming kv_bits and the widths) before any
  reference run, which keeps the variant's added time to the architectures that run.

Verdicts: "paged" (every scenario of scenarios.py passes: greedy tokens equal mlx-lm's alone,
batched, with chunked prefill, on a prefix-cache hit, after preemption and for n = 2, and the pool
empty afterwards), "refused" (Engine construction raised UnsupportedModelError), "fail" (anything
else: a mismatch, a request that failed, another error at load); "scenarios" holds each scenario's
verdict. A line {"module", "variant", "stage": "reference-done"} is printed once mlx-lm's own run for that
variant is over, so a process that dies before it shows an upstream crash (sweep.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import sys
import time
from dataclasses import dataclass

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.kernels import numpy_attention
from tests.archs.configs import SOFT_CAPPED, config_for
from tests.archs.scenarios import NEW_TOKENS, Case, Scenarios

import mlx.core as mx
from mlx.utils import tree_map

PROMPT_LENGTHS = (7, 21, 30)  # within a block, > 2 blocks of 8, and past every window and chunk of the configs
KV_GROUP_SIZE = 32  # the smallest group mx.quantize takes: most tiny configs' heads are 16 or 32 wide
# Quantized K/V computed by a batched prefill and by one token at a time may round to neighbouring levels:
# log-prob gaps below this (8-bit: a level is 1/255 of a group's range) are near-ties either way.
QUANTIZED_TIE_GAP = 1e-2


@dataclass(frozen=True)
class Variant:
    """The backend the engine takes (None: this machine's) and its pages' kv_bits (None: full precision)."""

    backend: str | None = None
    kv_bits: int | None = None


VARIANTS = {"cpu": Variant(), "cuda": Variant(backend="cuda"), "kv8": Variant(kv_bits=8)}


def build(module: str):
    """The module's tiny model, float32, seeded; weights x3 (attention far from uniform) unless soft-capped."""
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(config_for(module)))
    scale = 1.0 if module in SOFT_CAPPED else 3.0
    model.update(tree_map(lambda p: p.astype(mx.float32) * (scale if p.ndim == 2 else 1.0), model.parameters()))
    mx.eval(model.parameters())
    return model


def prompts(vocab: int) -> list[list[int]]:
    return [[(7 * i + 3 * n) % (vocab - 1) + 1 for i in range(n)] for n in PROMPT_LENGTHS]


def reference(model, prompt: list[int], kv_bits: int | None = None) -> Case:
    """mlx-lm's greedy tokens and, per step, the gap between its two best log-probs (over quantized K/V for
    `kv_bits`, with near-ties widened to QUANTIZED_TIE_GAP)."""
    from mlx_lm.generate import generate_step

    if kv_bits is not None:
        from tests.archs.quantized_reference import quantized_greedy

        tokens, gaps = quantized_greedy(model, prompt, NEW_TOKENS, kv_bits, KV_GROUP_SIZE)
        return Case(list(prompt), tokens, [0.0 if g < QUANTIZED_TIE_GAP else g for g in gaps])

    tokens, gaps = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS):
        top2 = mx.sort(logprobs)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(top2[1] - top2[0])
    return Case(list(prompt), tokens, gaps)


def layout_summary(model) -> dict:
    """The probe's view: leaf kinds, whether every KV leaf is routed, and the refusal labels if any."""
    from mlxpaged.cache.paged_support import unsupported_reasons
    from mlxpaged.loading.probe import probe_layout

    try:
        layout = probe_layout(model)
    except Exception as exc:  # the probe refusing is itself a verdict the engine must match
        return {"kinds": [], "labels": ["probe failed"], "probe_error": str(exc)}
    labels = list(dict.fromkeys(reason.label for reason in unsupported_reasons(layout)))
    return {"kinds": layout.kinds(), "all_routed": all(leaf.routed for leaf in layout.kv_leaves), "labels": labels}


def run_engine(model, module: str, cases: list[Case], vocab: int, kv_bits: int | None = None) -> dict:
    """Every scenario's verdict; "paged" when all pass, "refused" when the engine refuses the model."""
    from mlxpaged.errors import UnsupportedModelError
    from mlxpaged.loading.loader import LoadedModel
    from mlxpaged.loading.model_store import ModelRef

    tokenizer = _tokenizer()
    loaded = LoadedModel(model, tokenizer, ModelRef(module, "path"), _path(module), "float32", config_for(module))
    try:
        out = Scenarios(
            loaded, cases, lambda prompt: reference(model, prompt, kv_bits), vocab, _cache_settings(kv_bits)
        ).run()
    except UnsupportedModelError as exc:
        return {"status": "refused", "reason": str(exc)}
    failed = {name: why for name, why in out["scenarios"].items() if why != "pass"}
    return {
        "status": "fail" if failed else "paged",
        "reason": "; ".join(f"{name}: {why}" for name, why in failed.items()),
        **out,
    }


@functools.lru_cache(maxsize=1)
def _tokenizer():
    """The embedded model's tokenizer, loaded once per process: every engine of every variant shares it (loading
    it per engine was 40% of the sweep's time)."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(_tokenizer_dir())


@functools.lru_cache(maxsize=1)
def _tokenizer_dir():
    """The embedded model's directory, for its tokenizer: located once, before a simulated backend would ask
    the store for that backend's dtype (a float16 copy, converted by each worker at once)."""
    from mlxpaged.loading.loader import locate_model

    return locate_model(None)[1]


def _cache_settings(kv_bits: int | None) -> dict:
    return {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": KV_GROUP_SIZE}


def quantized_refusal(model, module: str, kv_bits: int) -> str | None:
    """The engine's ConfigError when it refuses the model's K/V widths for `kv_bits` at construction."""
    from mlxpaged.config import CacheConfig
    from mlxpaged.engine.engine import Engine
    from mlxpaged.errors import ConfigError, UnsupportedModelError
    from mlxpaged.loading.loader import LoadedModel
    from mlxpaged.loading.model_store import ModelRef

    tokenizer = _tokenizer()
    loaded = LoadedModel(model, tokenizer, ModelRef(module, "path"), _path(module), "float32", config_for(module))
    try:
        Engine(loaded, CacheConfig(cache_tokens=512, block_size=8, **_cache_settings(kv_bits))).close()
    except ConfigError as exc:
        return str(exc) if exc.param == "kv_bits" else None
    except UnsupportedModelError:
        return None  # refused for another reason: the scenarios' run says so
    return None


def _path(module: str):
    from pathlib import Path

    return Path(f"tiny-{module}")


def run_architecture(module: str, variants: dict[str, Variant] | None = None) -> dict[str, dict]:
    """Each variant's verdict (default: "cpu" alone), also printed on one line after its "reference-done" line;
    every error is a verdict. The model and mlx-lm's reference are made once for every variant that uses them."""
    variants = variants or {"cpu": VARIANTS["cpu"]}
    verdicts: dict[str, dict] = {}
    start = time.time()
    model = build(module)
    layout = layout_summary(model)
    vocab = _vocab(model)
    references: dict[int | None, list[Case]] = {}
    for name, variant in variants.items():
        out = {"module": module, "variant": name, **layout}
        with _on_path(variant.backend):
            if variant.kv_bits is not None and (why := quantized_refusal(model, module, variant.kv_bits)) is not None:
                _print({"module": module, "variant": name, "stage": "reference-done"})
                verdicts[name] = {**out, "status": "refused", "reason": why, "seconds": round(time.time() - start, 2)}
                _print(verdicts[name])
                start = time.time()
                continue
            if variant.kv_bits not in references:
                references[variant.kv_bits] = [reference(model, p, variant.kv_bits) for p in prompts(vocab)]
            _print({"module": module, "variant": name, "stage": "reference-done"})
            try:
                out.update(run_engine(model, module, references[variant.kv_bits], vocab, variant.kv_bits))
            except Exception as exc:  # a request failing mid-way, or an error at load that is no refusal
                out.update(status="fail", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
        out["seconds"] = round(time.time() - start, 2)
        start = time.time()
        verdicts[name] = out
        _print(out)
    return verdicts


@contextlib.contextmanager
def _on_path(simulated: str | None):
    """The engine on `simulated`'s path (None: this machine's). A GPU's path writes its pending K/V every 3 tokens
    and grows batch-1 buffers every 4, so each scenario crosses several of both."""
    if simulated is None:
        yield
        return
    from mlxpaged.platform import backend
    from mlxpaged.runner import decode_buffers, model_runner

    saved = model_runner.MAX_PENDING, model_runner.MAX_PENDING_BUFFERED, decode_buffers.BUFFER_STEP
    model_runner.MAX_PENDING = model_runner.MAX_PENDING_BUFFERED = 3
    decode_buffers.BUFFER_STEP = 4
    try:
        with backend.simulate(simulated):
            yield
    finally:
        model_runner.MAX_PENDING, model_runner.MAX_PENDING_BUFFERED, decode_buffers.BUFFER_STEP = saved


def _print(record: dict) -> None:
    print(json.dumps(record), flush=True)


def _vocab(model) -> int:
    return int(model(mx.array([[1]])).shape[-1])


def main(argv: list[str]) -> None:
    names = ["cpu"]
    if argv[:1] == ["--variants"]:
        names, argv = argv[1].split(","), argv[2:]
    variants = {name: VARIANTS[name] for name in names}
    # The engine hands NumPy only attention calls above MIN_SCORES, which these tiny prompts never reach:
    # every eager attention call of the sweep goes there, so each architecture checks that path too.
    numpy_attention.MIN_SCORES = 0
    _tokenizer()  # before a simulated backend would ask the store for that backend's dtype
    for module in argv:
        run_architecture(module, variants)


if __name__ == "__main__":
    main(sys.argv[1:])
