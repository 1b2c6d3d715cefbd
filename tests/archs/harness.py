"""One tiny architecture on the paged engine against mlx-lm's own generate_step.

    python -m tests.archs.harness MODULE [MODULE ...]   -> one JSON verdict line per module

Verdicts: "paged" (greedy tokens equal mlx-lm's, alone and batched with a prompt of another length),
"refused" (Engine construction raised UnsupportedModelError), "fail" (anything else: a mismatch, a
request that failed, another error at load). A line {"module", "stage": "reference-done"} is printed
once mlx-lm's own run is over, so a process that dies before it shows an upstream crash (sweep.py).
"""

from __future__ import annotations

import importlib
import json
import sys
import time

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
import mlx.core as mx
from mlx.utils import tree_map

from tests.archs.configs import SOFT_CAPPED, config_for

PROMPT_LENGTHS = (11, 23)  # > 2 blocks of 8 and past every window of the tiny configs
NEW_TOKENS = 10
BLOCK_SIZE = 8
TIE_GAP = 1e-4  # mlx-lm's top-2 log-prob gap under which either token is a fair argmax


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


def reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """mlx-lm's greedy tokens and, per step, the gap between its two best log-probs."""
    from mlx_lm.generate import generate_step

    tokens, gaps = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=NEW_TOKENS):
        top2 = mx.sort(logprobs)[-2:].tolist()
        tokens.append(int(token))
        gaps.append(top2[1] - top2[0])
    return tokens, gaps


def compare(got: list[int], want: list[int], gaps: list[float]) -> str | None:
    """None when equal up to the first step that is a near-tie in mlx-lm's own log-probs, else why not."""
    for step, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return None if gaps[step] < TIE_GAP else f"token {step}: {g} != mlx-lm's {w} (gap {gaps[step]:.2g})"
    return None if len(got) == len(want) else f"{len(got)} tokens, mlx-lm {len(want)}"


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


def run_engine(model, module: str, cases: list[tuple[list[int], list[int], list[float]]]) -> dict:
    from mlxpaged.config import CacheConfig
    from mlxpaged.engine.engine import Engine
    from mlxpaged.errors import UnsupportedModelError
    from mlxpaged.loading.loader import LoadedModel, locate_model
    from mlxpaged.loading.model_store import ModelRef
    from mlxpaged.runner.routing import is_routed
    from mlxpaged.runner.sampling import SamplingParams
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(locate_model(None)[1])
    loaded = LoadedModel(model, tokenizer, ModelRef(module, "path"), _path(module), "float32", config_for(module))
    try:
        engine = Engine(loaded, CacheConfig(cache_tokens=512, block_size=BLOCK_SIZE))
    except UnsupportedModelError as exc:
        return {"status": "refused", "reason": str(exc)}
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with engine:
        problems = []
        for label, runs in (("alone", [engine.generate([p], params)[0] for p, _, _ in cases]),
                            ("batched", engine.generate([p for p, _, _ in cases], params))):
            for (prompt, want, gaps), got in zip(cases, runs):
                why = compare(list(got.token_ids), want, gaps)
                if why:
                    problems.append(f"{label}, prompt of {len(prompt)}: {why}")
        return {"status": "fail" if problems else "paged", "reason": "; ".join(problems),
                "prefix_cache": engine.kv_manager.enable_prefix_cache, "routed": is_routed(model)}


def _path(module: str):
    from pathlib import Path

    return Path(f"tiny-{module}")


def run_architecture(module: str) -> dict:
    """Reference first (then the "reference-done" line), then the engine; every error is a verdict."""
    start = time.time()
    out = {"module": module}
    model = build(module)
    out.update(layout_summary(model))
    cases = [(p, *reference(model, p)) for p in prompts(_vocab(model))]
    print(json.dumps({"module": module, "stage": "reference-done"}), flush=True)
    try:
        out.update(run_engine(model, module, cases))
    except Exception as exc:  # a request failing mid-way, or an error at load that is no refusal
        out.update(status="fail", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
    out["seconds"] = round(time.time() - start, 2)
    return out


def _vocab(model) -> int:
    return int(model(mx.array([[1]])).shape[-1])


def main(modules: list[str]) -> None:
    for module in modules:
        print(json.dumps(run_architecture(module)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
