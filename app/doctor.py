"""`mlxpaged doctor`: the facts a bug report needs, one line each, marked OK / WARN / FAIL.

Nothing here loads weights: the default model's facts come from its config.json and the sizes of
its weight files. `--load` also loads it, builds an Engine and times one short greedy generation.
The library provides the facts; this module only asks and formats.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import mlxpaged
from mlxpaged.config import DEFAULT_CACHE_TOKENS, CacheConfig
from mlxpaged.platform import backend
from mlxpaged.platform.blas import blas_status, openblas_core
from mlxpaged.units import format_size

OK, WARN, FAIL = "OK", "WARN", "FAIL"
STATUSES = (OK, WARN, FAIL)
HARNESS = Path(mlxpaged.__file__).resolve().parent.parent / "tests" / "msl" / "harness.py"
LOAD_PROMPT = "What is the capital of France?"
LOAD_TOKENS = 24
ON_GPU, ON_HARNESS = "Metal GPU", "CPU harness"
ON_CUDA = "CUDA GPU (the kernel's CUDA twin, which MLXPAGED_ATTENTION=kernel takes there)"
# What each attention path (kernels.attention.attention_status()["path"]) is; a path not named here is shown bare.
ATTENTION_PATHS = {
    "kernel": "the paged-attention kernel (Metal's, or its CUDA twin)",
    "fused": "MLX's fused attention (gathered pages, mx.fast.scaled_dot_product_attention)",
    "cpu": "the CPU path (pages read in place, kernels/cpu_attention.py)",
    "reference": "the pure-MLX reference (gathered pages, mx.fast.scaled_dot_product_attention)",
}


@dataclass(frozen=True)
class Check:
    status: str  # OK, WARN or FAIL
    label: str
    detail: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass(frozen=True)
class ModelOnDisk:
    """The default model as the store holds it, read without opening a weight file."""

    name: str
    dtype: str  # the store's dtype: float32 on MLX's CPU backend, float16 on a GPU (loader.default_dtype)
    path: Path | None  # None: not provisioned yet
    config: dict | None
    weight_bytes: int


def default_cache_config() -> CacheConfig:
    """What `mlxpaged chat` uses when given no cache settings (the prefix cache on disk as well)."""
    return CacheConfig(cache_tokens=DEFAULT_CACHE_TOKENS, kv_disk=True)


# ---- the checks: each returns one Check ------------------------------------------------------


def check_platform() -> Check:
    mac = platform.mac_ver()[0]
    system = f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"
    return Check(OK, "platform", f"{system} {platform.machine()}")


def check_python() -> Check:
    return Check(OK, "python", f"{platform.python_version()} ({sys.executable})")


def check_mlx() -> Check:
    import mlx.core as mx

    detail = f"mlx {mx.__version__}, device {mx.default_device()}"
    name = mx.device_info().get("device_name")
    detail += (f" ({name})" if name else "") + f", backend: {backend.describe()}"
    if sys.platform == "darwin" and backend.detected() == "cpu":
        return Check(WARN, "mlx", detail + "; Metal is not available, so MLX runs on the CPU (slow)")
    return Check(OK, "mlx", detail)


def check_blas() -> Check:
    status = blas_status()
    where = f" ({status.path})" if status.path else ""
    core = openblas_core()
    kernels = f", {core} kernels" if core else ""  # their float rounding differs (issue 41)
    return Check(OK if status.fast else WARN, "blas", f"{status.name}{where}: {status.detail}{kernels}")


def check_attention() -> Check:
    """The path the engine takes now and why (attention_status, once the self-check is merged)."""
    from mlxpaged.kernels import attention

    try:
        resolved = attention.resolved_backend()
    except RuntimeError as exc:  # the kernel forced on a machine without Metal
        return Check(FAIL, "attention", str(exc))
    path, reason = attention_path(resolved)
    what = ATTENTION_PATHS.get(path)
    return Check(
        WARN if "fallback" in path else OK, "attention", f"{path}" + (f" ({what})" if what else "") + f": {reason}"
    )


def attention_path(resolved: str) -> tuple[str, str]:
    """(path, why): attention_status() once the kernel self-check is merged, else the resolved path's name."""
    from mlxpaged.kernels import attention

    status_of = getattr(attention, "attention_status", None)
    if status_of is None:
        return resolved, f"{attention.ENV_VAR}={os.environ.get(attention.ENV_VAR, 'auto')}"
    status = status_of()
    return status["path"], status["reason"]


def check_kernel(model: ModelOnDisk | None) -> Check:
    """The paged kernel checked against the reference for the default model's variants: on the GPU on a Mac (and its
    CUDA twin on an NVIDIA GPU), the Metal source on the CPU harness elsewhere."""
    try:  # through sys.modules, so tests can stand in for it
        self_check = importlib.import_module("mlxpaged.kernels.self_check")
    except ImportError as exc:
        return Check(WARN, "kernel", f"kernel self-check unavailable ({exc})")
    if model is None or model.config is None:
        return Check(WARN, "kernel", "not checked: the default model is not provisioned (its shapes pick the variants)")
    try:
        launcher, where = kernel_launcher()
    except KernelNotCheckable as exc:
        return Check(WARN, "kernel", f"not checked: {exc}")
    from mlxpaged.cache.paged_support import query_heads
    from mlxpaged.loading.checkpoint import read_before_load

    facts, layout = read_before_load(model.path, backend.current())
    heads = query_heads(layout)  # read from the model's attention, not a config key
    variants = self_check.variants_for(
        dtype=kv_dtype(model),
        head_dim=facts.kv.head_dim,
        block_size=default_cache_config().block_size,
        num_heads=heads,
        num_kv_heads=facts.kv.num_kv_heads,
    )
    language = "cuda" if where == ON_CUDA else "metal"
    return summarize_kernel([self_check.check_variant(v, launcher, language) for v in variants], where)


def summarize_kernel(results: list, where: str) -> Check:
    """One line for a list of VariantCheck: OK when every variant matches the reference."""
    if not results:
        return Check(WARN, "kernel", f"{where}: no kernel variant applies to the default model")
    seconds = sum(r.seconds for r in results)
    failed = [r for r in results if not r.ok]
    if not failed:
        names = ", ".join(r.variant.describe() for r in results)
        return Check(OK, "kernel", f"{where}: {len(results)} variants match the reference ({names}; {seconds:.1f} s)")
    reasons = "; ".join(f"{r.variant.describe()}: {r.reason}" for r in failed)
    effect = {ON_GPU: "the engine uses", ON_CUDA: "with MLXPAGED_ATTENTION=kernel the engine uses"}.get(
        where, "on a Mac the engine would use"
    )
    return Check(
        FAIL,
        "kernel",
        f"{where}: {len(failed)} of {len(results)} variants fail ({reasons}); {effect} the reference path for them",
    )


class KernelNotCheckable(Exception):
    """The kernel cannot be run here; the message says what is missing."""


_emulator = None  # one launcher per process: check_variant caches by launcher identity


def kernel_launcher():
    """(launcher, where): None on a Metal GPU or a CUDA one (the CUDA twin), else the source checkout's CPU harness."""
    global _emulator
    from mlxpaged.kernels.attention import gpu_kernel_available, metal_available

    if metal_available():
        return None, ON_GPU
    if gpu_kernel_available():
        return None, ON_CUDA
    if not HARNESS.exists():
        raise KernelNotCheckable(
            f"no Metal GPU, and the CPU harness is not at {HARNESS} (it ships with the source checkout only)"
        )
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise KernelNotCheckable(
            f"no Metal GPU, and {compiler} is not installed (the CPU harness compiles "
            "the kernel with it: apt-get install g++)"
        )
    if _emulator is None:
        _emulator = _load_harness().Emulator()
    return _emulator, ON_HARNESS


def _load_harness():
    """tests/msl/harness.py as a module, whether or not the checkout's tests/ is importable."""
    if "tests.msl.harness" in sys.modules:
        return sys.modules["tests.msl.harness"]
    name = "mlxpaged_msl_harness"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HARNESS)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules[name]


def check_memory() -> Check:
    from mlxpaged.platform.memory import DeviceFacts, os_reserve_bytes

    device = DeviceFacts.detect()
    if device.backend != "cuda":
        return Check(
            OK,
            "memory",
            f"RAM {format_size(device.total_bytes)}, available "
            f"{format_size(device.available_bytes)} ({device.backend} backend)",
        )
    detail = (
        f"CUDA device memory {format_size(device.total_bytes)}, free {format_size(device.available_bytes)} "
        "(cuda backend; the KV plan starts from the total)"
    )
    # The plan leaves only its reserve to others: a GPU other processes already fill needs a smaller cache.
    if device.total_bytes - device.available_bytes > os_reserve_bytes(device.total_bytes):
        return Check(
            WARN,
            "memory",
            detail + "; other processes hold more than the plan's reserve: set --kv-memory or --memory-fraction",
        )
    return Check(OK, "memory", detail)


def check_wired() -> Check:
    """The recommended working set and the wired limit MLX holds now (set_wired_limit returns it)."""
    import mlx.core as mx

    working_set = mx.device_info().get("max_recommended_working_set_size")
    if backend.detected() == "cuda":
        return Check(OK, "wired memory", "not applicable on CUDA (mx.set_wired_limit is Metal's)")
    current = mx.set_wired_limit(0)
    mx.set_wired_limit(current)
    if working_set is None:
        return Check(OK, "wired memory", f"no recommended working set (CPU backend); MLX wired limit {current}")
    detail = f"recommended working set {format_size(working_set)}, MLX wired limit {format_size(current)}"
    sysctl = _iogpu_wired_limit_mb()
    return Check(OK, "wired memory", detail + (f", sysctl iogpu.wired_limit_mb={sysctl}" if sysctl else ""))


def _iogpu_wired_limit_mb() -> str | None:
    """macOS's system-wide GPU wiring limit (0: the default); users raise it with sudo sysctl."""
    import subprocess

    try:
        done = subprocess.run(["sysctl", "-n", "iogpu.wired_limit_mb"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def check_store() -> Check:
    from mlxpaged.loading.model_store import models_dir

    store = models_dir()
    if not store.exists():
        return Check(WARN, "model store", f"{store} does not exist yet (`mlxpaged pull` creates it)")
    if not os.access(store, os.W_OK):
        return Check(WARN, "model store", f"{store} is not writable: models cannot be pulled or converted")
    return Check(OK, "model store", str(store))


def check_kv_disk() -> Check:
    """The prefix cache's disk tier as `chat` and `serve` use it by default: where, how full, room left."""
    from mlxpaged.cache.disk_tier import list_entries
    from mlxpaged.config import DEFAULT_KV_DISK_SIZE, default_kv_disk_dir
    from mlxpaged.units import parse_size

    root, limit = default_kv_disk_dir(), parse_size(DEFAULT_KV_DISK_SIZE)
    label = "KV disk tier"
    if not root.exists():
        return Check(OK, label, f"{root}: empty (created on first use; --no-kv-disk keeps the prefix cache in RAM)")
    if not os.access(root, os.W_OK):
        return Check(WARN, label, f"{root} is not writable: chat and serve cannot keep prefixes across restarts")
    entries = list_entries(root)
    used = sum(e.size for e in entries)
    free = shutil.disk_usage(root).free
    detail = (
        f"{root}: {len(entries):,} blocks, {format_size(used)} of the default {format_size(limit)} limit "
        f"(all models); {format_size(free)} free on its disk"
    )
    if free < limit - used:
        return Check(WARN, label, detail + f": the disk fills before the limit (--kv-disk-size {format_size(free)})")
    return Check(OK, label, detail)


def check_default_model(model: ModelOnDisk | None, error: str | None) -> Check:
    if model is None:
        return Check(FAIL, "default model", error or "unknown error")
    if model.path is None:
        return Check(
            WARN,
            "default model",
            f"{model.name} ({model.dtype}) is not provisioned yet: "
            "`mlxpaged pull` fetches it (the first chat would too)",
        )
    if model.weight_bytes == 0:
        return Check(FAIL, "default model", f"{model.name}: no *.safetensors weight files in {model.path}")
    arch = model.config.get("model_type", "?")
    return Check(
        OK,
        "default model",
        f"{model.name} at {model.path}: {arch}, {model.dtype}, weights {format_size(model.weight_bytes)} on disk",
    )


def check_sampling_defaults(model: ModelOnDisk | None) -> Check:
    """What chat and serve sample with when temperature / top_p are left unset
    (mlxpaged.loading.generation_defaults)."""
    from mlxpaged.loading.generation_defaults import GenerationConfigError, load_defaults
    from mlxpaged.loading.model_store import resolve

    if model is None:
        return Check(WARN, "sampling defaults", "not read: the default model could not be resolved")
    try:
        defaults = load_defaults(model.path, resolve(model.name).preset)
    except GenerationConfigError as exc:
        return Check(FAIL, "sampling defaults", str(exc))
    return Check(OK, "sampling defaults", defaults.describe())


def check_kv_plan(model: ModelOnDisk | None) -> Check:
    """The plan the default settings would make, from the model's facts without its weights."""
    from mlxpaged.platform.memory import DeviceFacts, InsufficientMemoryError, plan_memory

    if model is None or model.config is None:
        return Check(WARN, "KV plan", "not planned: the default model is not provisioned")
    cache = default_cache_config()
    try:
        plan = plan_memory(DeviceFacts.detect(), model_facts(model), cache)
    except InsufficientMemoryError as exc:
        return Check(FAIL, "KV plan", str(exc))
    capacity = "any length" if plan.token_capacity is None else f"{plan.token_capacity:,} tokens"
    return Check(
        OK,
        "KV plan",
        f"{plan.num_blocks:,} blocks x {plan.block_size} tokens = {format_size(plan.kv_bytes)} "
        f"({plan.backend}), one sequence up to {capacity}; {plan.reason}",
    )


def check_load() -> Check:
    """Load the default model, build an Engine, time one short greedy chat reply (batch 1)."""
    from mlxpaged.engine.engine import Engine
    from mlxpaged.kernels.attention import resolved_backend
    from mlxpaged.loading.loader import load_model
    from mlxpaged.loading.model_store import ModelError
    from mlxpaged.platform.memory import InsufficientMemoryError
    from mlxpaged.sampling_params import SamplingParams

    start = time.perf_counter()
    try:
        loaded = load_model()
        engine = Engine(loaded, default_cache_config())
    except (ModelError, InsufficientMemoryError) as exc:  # the user's to fix: the message says how
        return Check(FAIL, "load", str(exc))
    with engine:
        ready = time.perf_counter()
        prompt = engine.chat_tokens([{"role": "user", "content": LOAD_PROMPT}])
        arrivals, text = [], ""
        for delta in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=LOAD_TOKENS)):
            arrivals += [time.perf_counter()] if delta.token_id is not None else []
            text += delta.text
        engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))  # the prefix cache's turn
        tiers = prefix_tiers(engine.stats())
    if not arrivals:
        return Check(FAIL, "load", f"{loaded.name} loaded, but generated no token for {LOAD_PROMPT!r}")
    path, _ = attention_path(resolved_backend())
    first, last = arrivals[0] - ready, arrivals[-1] - arrivals[0]
    decode = f"{(len(arrivals) - 1) / last:.1f} tok/s" if last > 0 else "n/a"
    return Check(
        OK,
        "load",
        f"{loaded.name} loaded and engine built in {ready - start:.1f} s; {len(prompt)}-token "
        f"prompt, first token in {first:.2f} s, decode {decode} over {len(arrivals)} tokens "
        f"(greedy, attention {path}): {text.strip()!r}; asked again, {tiers}",
    )


def prefix_tiers(stats: dict) -> str:
    """What each tier of the prefix cache saved so far (an earlier `doctor --load` or chat leaves blocks on disk)."""
    ram = f"{stats['ram_hit_tokens']} prompt tokens came from RAM"
    if not stats.get("disk_tier"):
        return f"{ram} (disk tier off: {stats.get('disk_tier_off') or 'not asked for'})"
    return (
        f"{ram}, {stats['disk_hit_tokens']} from disk ({stats['disk_dir']}, {format_size(stats['disk_used_bytes'])} "
        f"used, {format_size(stats['disk_written_bytes'])} written now)"
    )


# ---- the default model's facts, without its weights --------------------------------------------


def find_default_model() -> ModelOnDisk:
    """Resolve the default preset and read its config.json and weight file sizes, if it is local."""
    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import local_path, resolve

    ref, dtype = resolve(None), default_dtype()
    path = local_path(ref, dtype)
    if path is None:
        return ModelOnDisk(ref.name, dtype, None, None, 0)
    config = json.loads((path / "config.json").read_text())
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return ModelOnDisk(ref.name, dtype, path, config, weights)


def kv_dtype(model: ModelOnDisk) -> str:
    """The dtype K/V will have, read from the weight headers as the engine reads it before loading."""
    from mlxpaged.loading.checkpoint import kv_dtype_before_load

    return kv_dtype_before_load(model.path, backend.current())


def model_facts(model: ModelOnDisk):
    """The facts the engine plans with before loading (mlxpaged.loading.checkpoint): one reading, not two."""
    from mlxpaged.loading.checkpoint import facts_before_load

    return facts_before_load(model.path, backend.current())


# ---- running and reporting ----------------------------------------------------------------------


def guarded(label: str, check: Callable[[], Check]) -> Check:
    """Run one check; an unexpected exception is that line's FAIL, never a traceback."""
    try:
        return check()
    except Exception as exc:  # a bug report tool must always print its report
        return Check(FAIL, label, f"unexpected error: {type(exc).__name__}: {exc}")


def run_checks(load: bool = False) -> list[Check]:
    model, error = None, None
    try:
        model = find_default_model()
    except Exception as exc:  # bad presets file, unreadable config.json: reported on the model's line
        error = f"{type(exc).__name__}: {exc}"
    checks = [
        ("platform", check_platform),
        ("python", check_python),
        ("mlx", check_mlx),
        ("blas", check_blas),
        ("attention", check_attention),
        ("kernel", lambda: check_kernel(model)),
        ("memory", check_memory),
        ("wired memory", check_wired),
        ("model store", check_store),
        ("KV disk tier", check_kv_disk),
        ("default model", lambda: check_default_model(model, error)),
        ("sampling defaults", lambda: check_sampling_defaults(model)),
        ("KV plan", lambda: check_kv_plan(model)),
    ]
    if load:
        checks.append(("load", check_load))
    return [guarded(label, check) for label, check in checks] + distributed_lines()


def distributed_lines() -> list[Check]:
    """The distributed setup under mlx.launch (doctor_distributed.py; rank 0's lines), one line alone."""
    from mlxpaged_app.doctor_distributed import distributed_checks

    try:
        return distributed_checks()
    except Exception as exc:  # a group that cannot be joined is this line's FAIL, never a traceback
        return [Check(FAIL, "distributed", f"unexpected error: {type(exc).__name__}: {exc}")]


def summary(checks: list[Check]) -> str:
    counts = {status: sum(c.status == status for c in checks) for status in STATUSES}
    line = ", ".join(f"{counts[s]} {s}" for s in STATUSES)
    failed = [c.label for c in checks if c.status == FAIL]
    return line + (f" - failed: {', '.join(failed)}" if failed else "")


def format_table(checks: list[Check]) -> str:
    width = max(len(c.label) for c in checks)
    rows = [f"{c.status:<4}  {c.label:<{width}}  {c.detail}" for c in checks]
    return "\n".join([f"mlxpaged {mlxpaged.__version__} doctor", "", *rows, "", summary(checks)])


def to_json(checks: list[Check]) -> str:
    return json.dumps(
        {"mlxpaged": mlxpaged.__version__, "checks": [asdict(c) for c in checks], "summary": summary(checks)}, indent=2
    )


def exit_status(checks: list[Check]) -> int:
    """1 when any line FAILs; warnings alone exit 0."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from mlxpaged.distributed.ranks import follows

    if follows():  # under mlx.launch, a rank other than 0 sends rank 0 its facts and prints nothing
        from mlxpaged_app.doctor_distributed import follower_doctor

        return follower_doctor()
    checks = run_checks(load=args.load)
    print(to_json(checks) if args.json else format_table(checks))
    return exit_status(checks)
