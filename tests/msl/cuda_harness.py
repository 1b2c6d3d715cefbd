"""Run ``mx.fast.cuda_kernel`` kernels on the CPU, from the source MLX would generate for them.

MLX refuses to build a cuda_kernel without a CUDA GPU ("No CUDA back-end"), even inside
``mx.export_function``, so unlike the Metal harness (harness.py) this one cannot capture MLX's text.
It writes it instead, as MLX 0.32.4's ``build_kernel`` (mlx/backend/cuda/custom_kernel.cpp) does:
the header, then in ``namespace mlx::core::cu`` a ``__global__ void custom_kernel_<name><template hash>``
whose parameters are ``const <type>* <input>`` then ``<type>* <output>``, the template arguments as
``constexpr int`` / ``constexpr bool`` / ``using``, then the body. MLX's own device header
(mlx/backend/cuda/device/utils.cuh) is replaced by cuda_shim.h. The kernel then runs on the Metal
harness's runtime (fibers, guard pages, strict warp and barrier checks) with CUDA's launch shape: MLX
launches ceil(grid / block) full blocks.

The kernel takes what ``paged_attention.CudaKernel`` holds (name, inputs, outputs, source, header).
This cannot catch NVRTC compile errors or measure speed: those need an NVIDIA GPU (the GPU kit).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.msl import harness

import mlx.core as mx
import numpy as np

CUDA_TYPES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
TYPE_NAMES = {  # MLX's get_type_string, for the kernel name's template hash
    mx.float16: "float16",
    mx.bfloat16: "bfloat16",
    mx.float32: "float32",
    mx.int32: "int32",
    mx.uint32: "uint32",
}
_SHARED_DECL = re.compile(r"\b__shared__\s+([A-Za-z_][\w:<>]*)\s+(\w+)\s*\[([^\];]+)\]\s*;")


def _template_hash(template) -> str:
    parts = []
    for _, value in template or ():
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append(f"_{TYPE_NAMES[value]}")
    return "".join(parts)


def _template_lines(template) -> str:
    lines = []
    for name, value in template or ():
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {CUDA_TYPES[value]};")
    return "\n".join(lines) + "\n\n" if lines else ""


def _rewrite_shared(body: str) -> str:
    """``__shared__ T name[count];`` -> the runtime's checked threadgroup array (one per block)."""
    rewritten = _SHARED_DECL.sub(lambda m: f"MSL_TG_ARRAY({m.group(1)}, {m.group(2)}, {m.group(3)});", body)
    if "__shared__" in rewritten:
        raise RuntimeError("the CUDA shim takes one-dimensional `__shared__ T name[count];` declarations only")
    return rewritten


def translation_unit(kernel, call: dict) -> tuple[str, str]:
    """(the C++ source, the kernel's function name) for one specialization of ``kernel``."""
    inputs = list(call["inputs"])
    for name in kernel.input_names:
        if any(f"{name}_{kind}" in kernel.source for kind in ("shape", "strides", "ndim")):
            raise NotImplementedError(f"the CUDA harness passes no shape, strides or ndim (input {name!r})")
    template = call.get("template")
    function = f"custom_kernel_{kernel.name}{_template_hash(template)}"
    params = [f"    const {CUDA_TYPES[a.dtype]}* {name}" for name, a in zip(kernel.input_names, inputs, strict=True)]
    params += [
        f"    {CUDA_TYPES[dtype]}* {name}"
        for name, dtype in zip(kernel.output_names, call["output_dtypes"], strict=True)
    ]
    signature = ",\n".join(params)
    args = [f"(const {CUDA_TYPES[a.dtype]}*)b[{i}]" for i, a in enumerate(inputs)]
    args += [f"({CUDA_TYPES[d]}*)b[{len(inputs) + i}]" for i, d in enumerate(call["output_dtypes"])]
    unit = (
        '#include "cuda_shim.h"\n#line 1 "header.cu"\n'
        f"{kernel.header}\n"
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        f"__global__ void {function}(\n{signature}) {{\n"
        f"{_template_lines(template)}"
        f'#line 1 "kernel.cu"\n{_rewrite_shared(kernel.source)}\n}}\n\n}} // namespace mlx::core::cu\n'
        '#line 1 "driver.cpp"\n'
        'extern "C" void msl_launch(void** b, const mslrt::Attrs&) {\n'
        f"  mlx::core::cu::{function}(\n      " + ",\n      ".join(args) + ");\n}\n"
    )
    return unit, function


def compile_kernel(unit: str) -> Path:
    """Path of the emulator binary for this translation unit (built once per source hash)."""
    runtime = harness._runtime_objects()
    shim = (harness.HERE / "cuda_shim.h").read_text()
    binary = harness.cache_dir() / f"cuda-{harness._digest(unit, shim, *(o.name for o in runtime), *harness.CXXFLAGS)}"
    if binary.exists():
        return binary
    work = Path(tempfile.mkdtemp(prefix="cuda-", dir=harness.cache_dir()))
    (work / "kernel.cpp").write_text(unit)
    harness._run_compiler(
        [
            harness.CXX,
            *harness.CXXFLAGS,
            "-I",
            str(harness.HERE),
            str(work / "kernel.cpp"),
            *map(str, runtime),
            "-o",
            str(work / "run"),
        ]
    )
    os.replace(work / "run", binary)
    (work / "kernel.cpp").unlink()
    work.rmdir()
    return binary


def _launch_shape(call: dict) -> dict:
    """CUDA's launch: ceil(grid / block) blocks, every one full (Metal's dispatchThreads trims the last)."""
    grid = list(call["grid"]) + [1] * (3 - len(call["grid"]))
    block = list(call["threadgroup"]) + [1] * (3 - len(call["threadgroup"]))
    block = [min(b, g) for b, g in zip(block, grid, strict=True)]
    full = [-(-g // b) * b for g, b in zip(grid, block, strict=True)]
    return {**call, "grid": tuple(full), "threadgroup": tuple(block)}


def run_kernel(kernel, *, strict: bool = True, seed: int = 0, **call) -> list[mx.array]:
    """Emulate ``kernel(**call)`` (the same keyword arguments as the real call) on the CPU."""
    unit, _ = translation_unit(kernel, call)
    binary = compile_kernel(unit)
    inputs = list(call["inputs"])
    buffers = [(name, harness._raw_bytes(a), 2) for name, a in zip(kernel.input_names, inputs, strict=True)]
    init = call.get("init_value")
    for name, shape, dtype in zip(kernel.output_names, call["output_shapes"], call["output_dtypes"], strict=True):
        size = int(np.prod(shape)) * dtype.size
        data = b"\xff" * size if init is None else harness._raw_bytes(mx.full(shape, init, dtype))
        buffers.append((name, data, 1))
    return harness.execute(binary, _launch_shape(call), buffers, seed, strict)


@dataclass
class CudaEmulator:
    """A launcher for kernel wrappers that accept one: ``launcher(kernel, **call) -> outputs``, running the
    CUDA source (``language`` tells the wrapper which source to hand it)."""

    strict: bool = True
    seed: int = 0
    language = "cuda"

    def __call__(self, kernel, **call) -> list[mx.array]:
        return run_kernel(kernel, strict=self.strict, seed=self.seed, **call)
