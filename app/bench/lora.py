"""`mlxpaged bench lora`: serving adapters. 16 concurrent requests spread over 1, 4 and 16 LoRA adapters against the
same 16 on the base model alone (aggregate tok/s, the ratio is the cost of the adapters), and batch-1 decode with
one adapter against mlx-lm's own `generate_step` on `load(model, adapter_path=...)`, the two alternating run by run
(a pair shares the machine's load: the median of the pairs' ratios is the figure; `--parts decode`: that alone).

The adapters are written for the model here, as `mlx_lm.lora` writes them (adapters.safetensors +
adapter_config.json): rank 8 on every linear layer of the last 16 layers (mlx_lm.lora's defaults), random weights (a
trained adapter costs the same to apply). Every run is warmed up on its exact workload first (timing.py).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from argparse import Namespace
from pathlib import Path

from mlxpaged.errors import ConfigError
from mlxpaged.platform.blas import blas_status
from mlxpaged_app.bench.batch import random_prompts
from mlxpaged_app.bench.timing import after_warm_up

RANK, NUM_LAYERS, SCALE = 8, 16, 20.0  # mlx_lm.lora's defaults
CONCURRENT = 16
SPREADS = (1, 4, 16)  # adapters the 16 requests are spread over


def write_adapter(model, directory: Path, seed: int) -> Path:
    """A random rank-8 LoRA adapter of every linear layer in the model's last NUM_LAYERS layers, in mlx-lm's files."""
    import mlx.core as mx
    import mlx.nn as nn

    directory.mkdir(parents=True, exist_ok=True)
    names = {id(module): name for name, module in model.named_modules()}
    key = mx.random.key(seed)
    weights = {}
    for layer in model.layers[-NUM_LAYERS:]:
        for name, module in layer.named_modules():
            if not isinstance(module, nn.Linear | nn.QuantizedLinear):
                continue
            out, width = module.weight.shape
            width = width * 32 // module.bits if isinstance(module, nn.QuantizedLinear) else width
            key, a, b = mx.random.split(key, 3)
            path = f"{names[id(layer)]}.{name}"
            weights[f"{path}.lora_a"] = mx.random.uniform(-(width**-0.5), width**-0.5, (width, RANK), key=a)
            weights[f"{path}.lora_b"] = mx.random.normal((RANK, out), key=b) * 0.01
    mx.save_safetensors(str(directory / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": NUM_LAYERS,
        "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0},
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def time_batch(engine, prompts: list[list[int]], adapters: list[str | None], tokens: int) -> tuple[float, int]:
    """(wall seconds, tokens generated) of the prompts at once, each with its adapter; prefix cache emptied first."""
    from mlxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    engine.pool.reset_prefix_cache()
    start = time.perf_counter()
    done = engine.generate(prompts, params, adapter=adapters)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in done)


def engine_decode(engine, prompt: list[int], adapter: str, tokens: int) -> float:
    """Batch-1 decode tok/s after the first token, with `adapter`."""
    from mlxpaged.sampling_params import SamplingParams

    engine.pool.reset_prefix_cache()
    first, count = None, 0
    for delta in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), adapter):
        count += delta.token_id is not None
        if first is None:
            first = time.perf_counter()
    return (count - 1) / (time.perf_counter() - first)


def mlx_lm_decode(model, prompt: list[int], tokens: int) -> float:
    """Batch-1 decode tok/s after the first token of mlx-lm's generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    first = None
    for n, _ in enumerate(generate_step(mx.array(prompt), model, max_tokens=tokens)):
        if n == 0:
            first = time.perf_counter()
    return (tokens - 1) / (time.perf_counter() - first)


def bench_lora(args: Namespace) -> int:
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.loader import locate_model
    from mlxpaged.platform import backend

    import mlx.core as mx
    from mlx_lm import load

    runs, tokens = args.runs or 3, args.tokens or 64
    parts = getattr(args, "parts", None) or ("batch", "decode")
    if not set(parts) <= {"batch", "decode"}:
        raise ConfigError("bench lora takes --parts batch, decode or both", param="parts")
    with tempfile.TemporaryDirectory(prefix="mlxpaged-bench-lora-") as tmp:
        _, path = locate_model(args.model)
        shapes, _ = load(str(path), lazy=True)  # the layers' shapes: no weight is read
        paths = {f"lora-{i}": write_adapter(shapes, Path(tmp) / f"lora-{i}", seed=i) for i in range(max(SPREADS))}
        del shapes
        engine = Engine.from_pretrained(args.model, adapters=paths, max_num_seqs=CONCURRENT)
        config = engine.loaded.config
        prompts = random_prompts(CONCURRENT, 256, 512, config["vocab_size"])
        print(f"bench lora: {engine.loaded.name} ({engine.loaded.dtype}), BLAS: {blas_status().name}")
        if "batch" in parts:
            print(
                f"{CONCURRENT} concurrent requests of 256-512 prompt tokens, {tokens} new each; median of {runs} runs"
            )

            def aggregate(adapters: list[str | None]) -> float:
                results = after_warm_up(lambda: time_batch(engine, prompts, adapters, tokens), runs)
                return statistics.median(generated / wall for wall, generated in results)

            base = aggregate([None] * CONCURRENT)
            print(f"  {'base model alone':<28s}{base:8.1f} tok/s")
            for spread in SPREADS:
                names = [f"lora-{i % spread}" for i in range(CONCURRENT)]
                got = aggregate(names)
                label = f"over {spread} adapter{'s' if spread > 1 else ''}"
                print(f"  {label:<28s}{got:8.1f} tok/s  {got / base:5.2f}x base")
        if "decode" in parts:
            reference, _ = load(str(path), adapter_path=str(paths["lora-0"]))
            if not backend.is_gpu():  # the engine runs float32 on MLX's CPU backend (its fast dtype): mlx-lm too here
                reference.set_dtype(mx.float32)
            paired_adapter_decode(engine, reference, prompts[0], tokens, runs)
        engine.close()
    return 0


def paired_adapter_decode(engine, reference, prompt: list[int], tokens: int, runs: int) -> None:
    """Batch-1 decode with one adapter, mlxpaged and mlx-lm alternating after one untimed pair; prints each pair,
    the medians and the median of the pairs' ratios."""
    print(f"batch-1 decode with one adapter, {len(prompt)}-token prompt, {tokens} new, {runs} pairs (+1 warm-up pair)")
    pairs = after_warm_up(
        lambda: (engine_decode(engine, prompt, "lora-0", tokens), mlx_lm_decode(reference, prompt, tokens)), runs
    )
    for run, (ours, theirs) in enumerate(pairs, 1):
        print(f"  run {run}: mlxpaged {ours:6.1f} tok/s   mlx-lm {theirs:6.1f} tok/s", flush=True)
    ours, theirs = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    paired = statistics.median(o / t for o, t in pairs)
    print(
        f"batch-1 decode with one adapter: mlxpaged {ours:.1f} tok/s, mlx-lm generate_step {theirs:.1f} tok/s "
        f"({ours / theirs:.2f}x); median paired ratio {paired:.2f}x"
    )
