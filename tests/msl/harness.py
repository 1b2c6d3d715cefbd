"""Run ``mx.fast.metal_kernel`` kernels on the CPU, from the exact Metal source MLX generates.

1. Capture: on Linux calling a metal_kernel raises "No Metal back-end", but inside
   ``mx.export_function`` tracing the call succeeds and ``verbose=True`` prints the generated
   source (kernel signature included) on fd 1, which we capture.
2. Translate: threadgroup array declarations become checked arrays (metal_shim.h) and a small
   driver maps buffers and thread attributes onto the signature MLX wrote.
3. Compile with g++ against metal_shim.h and the runtime (scheduler.cpp, memory.cpp);
   binaries are cached by source hash.
4. Run as a subprocess: buffers behind guard pages, one fiber per GPU thread, strict checks.
   A failed check raises ``MetalEmulationError`` with the runtime's message.

This cannot catch Metal compile errors or measure speed: that needs a Mac (``pytest -m metal``).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CXX = os.environ.get("CXX", "g++")
CXXFLAGS = ["-std=c++17", "-O1", "-g0", "-w", "-fno-strict-aliasing"]
CACHE_ENV = "MLXPAGED_MSL_CACHE"
RUN_TIMEOUT_S = 600


class MetalEmulationError(AssertionError):
    """A strict-mode check (or a crash) in the emulated kernel."""


@dataclass
class Param:
    type: str
    name: str
    attr: str

    @property
    def buffer_index(self) -> int | None:
        m = re.fullmatch(r"buffer\((\d+)\)", self.attr)
        return int(m.group(1)) if m else None


@dataclass
class KernelSource:
    text: str  # the source as MLX printed it
    function: str
    template_args: str  # "<float, 128>" or ""
    params: list[Param] = field(default_factory=list)


def cache_dir() -> Path:
    path = Path(os.environ.get(CACHE_ENV) or Path(tempfile.gettempdir()) / f"mlxpaged-msl-{os.getuid()}")
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---- 1. capture -------------------------------------------------------------------------


@contextmanager
def _stdout_fd_captured(sink: list[str]):
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            sink.append(tmp.read().decode("utf-8", "replace"))


def _call_kwargs(call: dict) -> dict:
    keys = ("template", "grid", "threadgroup", "output_shapes", "output_dtypes", "init_value")
    return {k: call[k] for k in keys if k in call and call[k] is not None}


_captured: dict[tuple, tuple[object, str]] = {}  # holds the kernel so its id stays unique


def capture_source(kernel, call: dict) -> str:
    """The Metal source MLX generates for ``kernel(**call)`` (memoized per specialization)."""
    inputs = list(call["inputs"])
    key = (
        id(kernel),
        repr(call.get("template")),
        repr(call["output_dtypes"]),
        tuple((a.dtype, a.size < 8, a.ndim) for a in inputs),
    )
    if key in _captured and _captured[key][0] is kernel:
        return _captured[key][1]
    kwargs = _call_kwargs(call)

    def traced(*arrays):
        return kernel(inputs=list(arrays), verbose=True, **kwargs)

    sink: list[str] = []
    with tempfile.TemporaryDirectory() as tmp, _stdout_fd_captured(sink):
        mx.export_function(os.path.join(tmp, "kernel.mlxfn"), traced, *inputs)
    m = re.search(r"Generated source code for `[^`]*`:\n```\n(.*?)\n```", sink[0], re.S)
    if not m:
        raise RuntimeError(f"MLX printed no kernel source while tracing; got: {sink[0][:500]!r}")
    _captured[key] = (kernel, m.group(1))
    return m.group(1)


# ---- 2. translate -------------------------------------------------------------------------

_INSTANTIATION = re.compile(
    r"^template \[\[host_name\(\"\w+\"\)\]\] \[\[kernel\]\] decltype\((\w+)(<.*>)?\) .*;\s*$", re.M
)
_SIGNATURE = re.compile(r"\[\[kernel\]\] void (\w+)\((.*?)\)\s*\{", re.S)
_PARAM = re.compile(r"^(.*?)\s*\b(\w+)\s*\[\[(\w+(?:\(\d+\))?)\]\]$")
_TG_DECL = re.compile(r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:<>, ]*?)\s+((?:\w+\s*(?:\[[^\];]+\])+\s*,?\s*)+);")
_TG_POINTER = re.compile(r"\bthreadgroup\s+((?:const\s+)?[A-Za-z_][\w:]*)\s*\*")


def parse_source(text: str) -> KernelSource:
    inst = _INSTANTIATION.search(text)
    sig = _SIGNATURE.search(text)
    if not sig:
        raise RuntimeError("no [[kernel]] signature in the captured source")
    params = []
    for line in sig.group(2).split(",\n"):
        m = _PARAM.match(line.strip())
        if not m:
            raise RuntimeError(f"cannot parse kernel parameter {line.strip()!r}")
        params.append(Param(*m.groups()))
    template_args = inst.group(2) or "" if inst else ""
    return KernelSource(text, sig.group(1), template_args, params)


def _rewrite_threadgroup(text: str) -> str:
    def declaration(m: re.Match) -> str:
        out = []
        for name, dims in re.findall(r"(\w+)\s*((?:\[[^\]]+\])+)", m.group(2)):
            if dims.count("[") != 1:
                raise RuntimeError(f"multi-dimensional threadgroup array {name}{dims} is not supported by the shim")
            out.append(f"MSL_TG_ARRAY({m.group(1)}, {name}, {dims[1:-1]});")
        return " ".join(out)

    text = _TG_DECL.sub(declaration, text)
    return _TG_POINTER.sub(lambda m: f"mslrt::tg_ptr<{m.group(1)}> ", text)


def translation_unit(src: KernelSource) -> str:
    body = _rewrite_threadgroup(_INSTANTIATION.sub("", src.text))
    args = []
    for p in src.params:
        index = p.buffer_index
        if index is None:
            args.append(f"a.{p.attr}")
        elif p.type.endswith("&"):
            args.append(f"*({p.type[:-1].strip()}*)b[{index}]")
        else:
            args.append(f"({p.type})b[{index}]")
    call = ",\n      ".join(args)
    return (
        f'#include "metal_shim.h"\n#line 1 "kernel.metal"\n{body}\n#line 1 "driver.cpp"\n'
        f'extern "C" void msl_launch(void** b, const mslrt::Attrs& a) {{\n'
        f"  {src.function}{src.template_args}(\n      {call});\n}}\n"
    )


# ---- 3. compile ------------------------------------------------------------------------------


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _run_compiler(args: list[str]) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"g++ failed ({' '.join(args)}):\n{done.stderr[-4000:]}")


RUNTIME_SOURCES = ("scheduler.cpp", "memory.cpp")
RUNTIME_HEADERS = ("metal_shim.h", "runtime.h")


def _runtime_objects() -> list[Path]:
    """The emulator runtime, compiled once per version of its sources."""
    headers = [(HERE / h).read_text() for h in RUNTIME_HEADERS]
    objects = []
    for name in RUNTIME_SOURCES:
        obj = cache_dir() / f"{Path(name).stem}-{_digest((HERE / name).read_text(), *headers, *CXXFLAGS)}.o"
        if not obj.exists():
            tmp = obj.with_suffix(f".{os.getpid()}.tmp.o")
            _run_compiler([CXX, *CXXFLAGS, "-O2", "-I", str(HERE), "-c", str(HERE / name), "-o", str(tmp)])
            os.replace(tmp, obj)
        objects.append(obj)
    return objects


def compile_kernel(src: KernelSource) -> Path:
    """Path of the emulator binary for this source (built once per source hash)."""
    unit = translation_unit(src)
    runtime = _runtime_objects()
    shim = (HERE / "metal_shim.h").read_text()
    binary = cache_dir() / f"kernel-{_digest(unit, shim, *(o.name for o in runtime), *CXXFLAGS)}"
    if binary.exists():
        return binary
    work = Path(tempfile.mkdtemp(prefix="msl-", dir=cache_dir()))
    (work / "kernel.cpp").write_text(unit)
    _run_compiler(
        [CXX, *CXXFLAGS, "-I", str(HERE), str(work / "kernel.cpp"), *map(str, runtime), "-o", str(work / "run")]
    )
    os.replace(work / "run", binary)
    (work / "kernel.cpp").unlink()
    work.rmdir()
    return binary


# ---- 4. run ------------------------------------------------------------------------------------

_SIZE_TYPES = {
    "int": np.int32,
    "int32_t": np.int32,
    "int64_t": np.int64,
    "size_t": np.uint64,
    "uint": np.uint32,
    "uint32_t": np.uint32,
}


def _raw_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a)).tobytes()


def _from_bytes(data: bytes, shape, dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(data, np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dtype = np.array(mx.zeros((1,), dtype)).dtype
    return mx.array(np.frombuffer(data, np_dtype).reshape(shape))


def _shape_param_bytes(p: Param, a: mx.array, kind: str) -> bytes:
    base = re.sub(r"\b(const|constant|device)\b|[*&]", "", p.type).strip()
    np_type = _SIZE_TYPES.get(base, np.int32)
    if kind == "ndim":
        return np.array([a.ndim], np_type).tobytes()
    values = a.shape if kind == "shape" else [int(np.prod(a.shape[i + 1 :])) for i in range(a.ndim)]
    return np.array(values, np_type).tobytes()


def _buffers(src: KernelSource, call: dict) -> list[tuple[str, bytes, int]]:
    """(name, bytes, flags) for every [[buffer(i)]] parameter, in index order."""
    inputs = list(call["inputs"])
    shapes, dtypes = call["output_shapes"], call["output_dtypes"]
    buffer_params = sorted((p for p in src.params if p.buffer_index is not None), key=lambda p: p.buffer_index)
    out, consumed, produced, last = [], 0, 0, None
    for p in buffer_params:
        kind = p.name[len(last.name) + 1 :] if last is not None and p.name.startswith(last.name + "_") else ""
        if last is not None and kind in ("shape", "strides", "ndim"):
            out.append((p.name, _shape_param_bytes(p, inputs[consumed - 1], kind), 2))
        elif consumed < len(inputs):
            out.append((p.name, _raw_bytes(inputs[consumed]), 2))
            consumed, last = consumed + 1, p
        else:
            size = int(np.prod(shapes[produced])) * dtypes[produced].size
            init = call.get("init_value")
            data = b"\xff" * size if init is None else _raw_bytes(mx.full(shapes[produced], init, dtypes[produced]))
            out.append((p.name, data, 1))
            produced += 1
    return out


def _write_input(path: Path, call: dict, buffers, seed: int, strict: bool) -> None:
    grid = list(call["grid"]) + [1] * (3 - len(call["grid"]))
    threadgroup = list(call["threadgroup"]) + [1] * (3 - len(call["threadgroup"]))
    group = [min(t, g) for t, g in zip(threadgroup, grid, strict=True)]  # as MLX dispatches
    with open(path, "wb") as f:
        f.write(b"MSLRUN1\0")
        f.write(np.array(grid + group, np.uint32).tobytes())
        f.write(np.array([seed], np.uint64).tobytes())
        f.write(np.array([int(strict), len(buffers)], np.uint32).tobytes())
        for name, data, flags in buffers:
            f.write(np.array([len(name)], np.uint32).tobytes() + name.encode())
            f.write(np.array([len(data)], np.uint64).tobytes() + np.array([flags], np.uint32).tobytes())
            f.write(data)


def run_kernel(kernel, *, strict: bool = True, seed: int = 0, **call) -> list[mx.array]:
    """Emulate ``kernel(**call)`` (the same keyword arguments as the real call) on the CPU."""
    src = parse_source(capture_source(kernel, call))
    binary = compile_kernel(src)
    return execute(binary, call, _buffers(src, call), seed, strict)


def execute(binary: Path, call: dict, buffers, seed: int, strict: bool) -> list[mx.array]:
    """Run a compiled emulator binary on ``buffers`` (inputs, then poisoned outputs) and read back the outputs
    (``call``: the kernel call's keyword arguments: grid, threadgroup, output shapes and dtypes)."""
    with tempfile.TemporaryDirectory(prefix="msl-run-") as tmp:
        inp, outp = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        _write_input(inp, call, buffers, seed, strict)
        done = subprocess.run([str(binary), str(inp), str(outp)], capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if done.returncode != 0:
            message = next(
                (line[len("MSL-ERROR: ") :] for line in done.stderr.splitlines() if line.startswith("MSL-ERROR: ")),
                None,
            )
            raise MetalEmulationError(message or f"emulator exited with {done.returncode}: {done.stderr[-2000:]}")
        data = outp.read_bytes()
    results, at = [], 0
    for shape, dtype in zip(call["output_shapes"], call["output_dtypes"], strict=True):
        size = int(np.prod(shape)) * dtype.size
        results.append(_from_bytes(data[at : at + size], shape, dtype))
        at += size
    return results


@dataclass
class Emulator:
    """A launcher for kernel wrappers that accept one: ``launcher(kernel, **call) -> outputs``."""

    strict: bool = True
    seed: int = 0
    language = "metal"  # the source the wrapper hands it (the CUDA twin has cuda_harness.CudaEmulator)

    def __call__(self, kernel, **call) -> list[mx.array]:
        return run_kernel(kernel, strict=self.strict, seed=self.seed, **call)
