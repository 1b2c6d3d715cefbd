"""Which compute backend MLX runs on here, decided in one place: "metal", "cuda" or "cpu".

"Not Metal" is not "CPU": MLX 0.32 also runs on NVIDIA GPUs (`mlx[cuda13]`), where graphs are lazy,
streams asynchronous and memory the device's, as on a Mac. Every choice that differs between a GPU
and MLX's CPU backend reads `current()` (or `is_gpu()`) instead of testing Metal itself:

- the loader's dtype (CPU: float32, its fast dtype; a GPU keeps the checkpoint's bf16 / fp16 / quantized),
- the attention paths (Metal: the paged kernel; CUDA: MLX's fused paths; CPU: kernels/cpu_attention.py
  and NumPy prefill),
- the memory plan (Metal: the recommended working set; CUDA: the device's memory; CPU: host memory),
- the runner's pipelining and the tuned constants (`tuning()`), and every report.

Tests pretend to be another backend with `simulate("cuda")`: the choices then follow that backend while
MLX still computes on the CPU, which is how the GPU's path (its syncs, its dtypes) is tested here.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

BACKENDS = ("cpu", "metal", "cuda")
GPU_BACKENDS = ("metal", "cuda")
ENV_VAR = "MLXPAGED_BACKEND"  # "cpu" makes a GPU machine take the CPU paths (A/B runs); unset: detected

_simulated: str | None = None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


@functools.lru_cache(maxsize=1)
def detected() -> str:
    """What MLX computes on by default in this process: a Metal or CUDA GPU, else the CPU (read once)."""
    import mlx.core as mx

    return detect(mx)


def detect(mx_module) -> str:
    """`detected`'s rule over an mlx.core-like module (tests pass a stand-in)."""
    if mx_module.default_device().type != mx_module.gpu:
        return "cpu"  # a GPU machine whose default device was set to the CPU
    if mx_module.metal.is_available():
        return "metal"
    cuda = getattr(mx_module, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def current() -> str:
    """The backend every choice follows: a test's `simulate`, else MLXPAGED_BACKEND=cpu, else detected."""
    if _simulated is not None:
        return _simulated
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced:
        if forced != "cpu" and forced != detected():
            raise ValueError(f"{ENV_VAR}={forced!r}: MLX computes on {detected()!r} here; only 'cpu' can be forced")
        return _check(forced)
    return detected()


def is_gpu() -> bool:
    return current() in GPU_BACKENDS


def computes_on_gpu() -> bool:
    """True when MLX really runs on a GPU here (not a simulated one): what device-only code asks."""
    return _simulated is None and detected() in GPU_BACKENDS


@contextmanager
def simulate(name: str) -> Iterator[None]:
    """Make every backend choice follow `name` while MLX keeps computing where it does (tests)."""
    global _simulated
    previous, _simulated = _simulated, _check(name)
    try:
        yield
    finally:
        _simulated = previous


@dataclass(frozen=True)
class Tuning:
    """The constants measured per backend. Each field's comment says where its value comes from."""

    # Decode passes of up to this many sequences run as one mx.compile'd graph (runner/decode_pass.py).
    # CPU: B=1 48 vs 51 ms (mlx-lm), B=4 74 vs 83, B=16 120 vs 125 compiled vs eager; retracing per batch
    # size costs 40-150 ms, so only batch 1. GPU: none. Metal's kernel reads host lengths (never compiled);
    # on CUDA an eager pass attends exact keys with no mask (MLX's fused decode kernels; a compiled pass
    # needs a mask over its page bucket) and can be queued before the last one is read (queue_before_read).
    # MLXPAGED_COMPILE_BATCH=N replaces this value (passes of several rows padded to batch buckets, decode_pass.py):
    # the lever the GPU kit measures (docs/design/issue38-load.md).
    compiled_decode_max_batch: int
    # Build the next decode pass on this step's lazy tokens for compiled passes too. CPU: no (2 cores:
    # building during the last pass's tail slowed it, batch 1 19.6 vs 19.0 tok/s, 3 A/B runs).
    pipeline_compiled: bool
    # Queue the next decode pass before this step's tokens are read, as mlx-lm's generate_step does, its
    # K/V kept off the pools meanwhile (runner/deferred_writes.py). A GPU idles for the host part of every
    # step otherwise (H200, commit 50b1a09: 0.5x mlx-lm at batch 1). CPU: the host and the "device" share 2
    # cores, and the look-ahead launched after the read is what was measured there.
    queue_before_read: bool
    # Eager prefill attention and cache hits computed by NumPy on the host (kernels/numpy_attention.py).
    # CPU only: MLX's CPU elementwise ops are scalar code; on a GPU it would sync and copy every layer.
    numpy_attention: bool
    # mlx-lm's SwiGLU through a polynomial exp in the engine's passes (kernels/cpu_activations.py). CPU only: its exp is
    # scalar code (a 153-token turn of the embedded model: 3.35 -> 0.59 ms a layer, 0.10 s of a 0.50 s prefill).
    cpu_swiglu: bool
    # Float32 weights: the CPU backend's fast dtype (half precision matmuls are 3-40x slower there).
    float32_weights: bool
    # Tokens one engine step may take, prefill chunks included (SchedulerConfig's default). CPU: 2048, the value
    # the engine always had (mlx-lm's prefill_step_size; not measured against other sizes there). CUDA: 8192: on an
    # H200 with SmolLM2-1.7B's shape (bf16), cold time to first token of an 8,151-token prompt was 0.135 s in
    # 2048-token chunks against 0.107 s in one (mlx-lm's stream_generate 0.119 and 0.139 s in the same runs).
    # Metal: the CPU's value until it is measured on a Mac (a bigger step also reserves 4x the activation memory,
    # which a 16 GB Mac feels).
    max_batch_tokens: int
    # q/k/v and gate/up projections as one matmul each (loading/fused_projections.py): a GPU step is bounded by
    # launching kernels. H200, SmolLM2-1.7B's shape, bf16 (docs/design/scripts/issue21_step_cost.py): mlx-lm's own
    # decode step at batch 1 / 16 / 64 took 6.06 / 11.30 / 10.90 ms, fused 5.53 / 9.33 / 6.69; the engine's 64
    # requests 2131 -> 2640 tok/s (16: 1720 -> 1683, within noise). Metal: the same choice, unmeasured (fewer
    # dispatches). CPU: no; its step is the matmuls' work, and its benches share the engine's model with the mlx-lm
    # side, which must stay mlx-lm's own.
    fused_projections: bool
    # The time one step may take, prefill chunks included (SchedulerConfig's step_budget_ms default;
    # engine/step_budget.py): the longest a decoding stream waits for a token beside a long prompt, and for a
    # hang-up to be let go. CPU: 2000 ms. The embedded model, three streams beside a 4,000-token prompt: they waited
    # at most 12.7 s for a token in 2,048-token chunks, 2.4 s in 2 s steps, 0.85 s in 750 ms steps; bench batch's
    # 16 requests (prompts 256-512 tokens) lost 7% of their throughput in 2 s steps (29.4 vs 31.6 tok/s, medians of 3
    # interleaved) and 31% in 750 ms steps (21.7 vs 31.6): a step with 16 streams decoding takes ~0.4 s there, and
    # many small prefill passes each read every weight again (docs/design/issue38-load.md). Metal and CUDA: 1000 ms,
    # not measured on a GPU yet: a 2,048-token chunk of a small model fits in it, a 100k-token prompt's late
    # chunks do not.
    step_budget_ms: float
    # A step carrying a chunk of a prompt that arrived after a stream decoding beside it began (SchedulerConfig's
    # streams_step_budget_ms default): what a stream waits for a token while another agent's next turn prefills.
    # CPU: 1000 ms. In the 2 s budget two or three agents' next turns (~156 tokens each at ~2,600 tokens of context)
    # were prefilled in one step, 1.16-1.48 s, and the fleet's inter-token p99 was 1.24-1.43 s with --long, 1.34 s
    # without; at 1000 ms those steps took at most 0.87 s and the p99 was 0.82-0.86 s with --long, 0.78-0.84 s
    # without, at the cost of the agents' time to first token (p50 2.78-4.02 s against 2.15-2.72 s: a turn takes two
    # or three steps instead of one; bench fleet, cold; docs/design/issue38-load.md, session 32). Session 33 made a
    # turn cheaper (cpu_swiglu) and keeps its last few tokens in its step (step_budget.py): most turns take one step,
    # TTFT p50 1.32-1.95 s, the p99 0.71-0.73 s (0.77-0.79 s with --long). Prompts that were waiting when the
    # streams began keep the step budget: bench batch's 16 requests arrive together, and held to 1000 ms beside the
    # first streams they lost ~7% of their throughput (60.8 / 57.9 against 64.8 / 63.2 tok/s, interleaved).
    # Metal and CUDA: the step budget (1000 ms), not measured on a GPU.
    streams_step_budget_ms: float
    # A step carrying a chunk of a long prompt (more prefill left than max_batch_tokens) beside decoding streams
    # (SchedulerConfig's long_prompt_step_budget_ms default): what the streams wait for a token while someone's
    # pasted file prefills. CPU: 750 ms (above: 0.85 s the longest wait at 750 ms; bench fleet --long's other agents'
    # inter-token p99 2.145 s with the 2 s budget, 1.086 s with this one, session 22, when the fleet bench read its
    # earlier runs' prompts from disk). Metal and CUDA: the streams' budget (1000 ms), not measured on a GPU.
    long_prompt_step_budget_ms: float


_GPU = Tuning(
    compiled_decode_max_batch=0,
    pipeline_compiled=True,
    queue_before_read=True,
    numpy_attention=False,
    cpu_swiglu=False,
    float32_weights=False,
    max_batch_tokens=2048,
    fused_projections=True,
    step_budget_ms=1000.0,
    streams_step_budget_ms=1000.0,
    long_prompt_step_budget_ms=1000.0,
)
TUNINGS = {
    "cpu": Tuning(
        compiled_decode_max_batch=1,
        pipeline_compiled=False,
        queue_before_read=False,
        numpy_attention=True,
        cpu_swiglu=True,
        float32_weights=True,
        max_batch_tokens=2048,
        fused_projections=False,
        step_budget_ms=2000.0,
        streams_step_budget_ms=1000.0,
        long_prompt_step_budget_ms=750.0,
    ),
    "metal": _GPU,
    "cuda": dataclasses.replace(_GPU, max_batch_tokens=8192),
}


def tuning(name: str | None = None) -> Tuning:
    return TUNINGS[_check(name) if name is not None else current()]


def describe(name: str | None = None) -> str:
    """One line for reports: which backend and why."""
    name = name or current()
    what = {"metal": "Metal GPU", "cuda": "CUDA GPU (MLX's CUDA backend)", "cpu": "MLX's CPU backend"}[name]
    if _simulated is not None:
        return f"{what} (simulated; MLX computes on {detected()})"
    if os.environ.get(ENV_VAR, "").strip() and detected() != name:
        return f"{what} (forced by {ENV_VAR}; detected {detected()})"
    return what
