"""The quantized CPU paths under each OpenBLAS kernel family this machine can run (issue 41).

OpenBLAS picks its kernels by CPU: a CI machine with AVX-512 runs the SkylakeX family, an AMD EPYC without
AVX-512 and most laptops of the last decade the Haswell one, older machines others. Their float rounding differs
(Haswell's sgemm rounds a row by how many rows share the call; SkylakeX's and Sandybridge's do not), and
quantized K/V pages turn rounding into whole levels: a twin test or an answer that held under one family failed
under another, and a green CI on AVX-512 hid it. So the quantized CPU paths' tests run again here, in a fresh
interpreter per family (OpenBLAS reads OPENBLAS_CORETYPE once, when it loads), under every family the CPU can
execute but the one the suite itself runs under (read from the loaded OpenBLAS, whatever chose it: the CPU, or
OPENBLAS_CORETYPE in the environment), whose run would repeat the suite's own; a CPU that executes that family
alone runs it again (the test then checks the forcing itself).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

from mlxpaged.platform.blas import _read_cpuinfo, openblas_core
from tests import background_runs

import pytest

# OpenBLAS's x86-64 kernel families with distinct sgemm kernels, newest first, and the CPU flags each executes.
X86_FAMILIES = (
    ("SkylakeX", {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}),
    ("Haswell", {"avx2", "fma"}),
    ("Sandybridge", {"avx"}),
    ("Nehalem", {"sse4_2"}),
)
ARM64_FAMILIES = ("ARMV8",)  # the generic arm64 kernels, which every arm64 CPU runs
SAME_KERNELS = {"zen": "haswell"}  # OpenBLAS 0.3.21 names AMD's Zen cores apart but runs Haswell's kernels there

# Every test of the quantized pages' CPU paths: writes and reads, the unpacked levels against the quantized
# matmuls, the engine against its twins, the embedded model's answer at 8 and 4 bits, prompt scoring.
QUANTIZED_CPU_TESTS = (
    "tests/cache/test_group_fit.py",
    "tests/cache/test_quantized_pages.py",
    "tests/kernels/test_quantized_unpacked.py",
    "tests/kernels/test_quantized_attention.py",
    "tests/engine/test_engine_quantized.py",
    "tests/engine/test_kv_transform.py",
    "tests/runner/test_prompt_scoring.py",
)


def runnable_families(cpuinfo: str, machine: str) -> list[str]:
    """The OpenBLAS kernel families (OPENBLAS_CORETYPE names) a CPU with this /proc/cpuinfo can execute."""
    if machine in ("aarch64", "arm64"):
        return list(ARM64_FAMILIES)
    if machine != "x86_64":
        return []
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            flags = set(value.split())
            break
    return [family for family, needs in X86_FAMILIES if needs <= flags]


def same_family(core: str, family: str) -> bool:
    core = core.lower()
    return SAME_KERNELS.get(core, core) == family.lower()


def test_families_follow_the_cpu_flags():
    avx512 = "flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl\n"
    assert runnable_families(avx512, "x86_64") == ["SkylakeX", "Haswell", "Sandybridge", "Nehalem"]
    assert runnable_families("flags\t\t: fpu sse4_2 avx avx2 fma\n", "x86_64") == ["Haswell", "Sandybridge", "Nehalem"]
    assert runnable_families("flags\t\t: fpu sse4_2\n", "x86_64") == ["Nehalem"]
    assert runnable_families("", "aarch64") == ["ARMV8"]
    assert same_family("Zen", "Haswell") and same_family("HASWELL", "Haswell") and not same_family("Zen", "SkylakeX")


RUNNABLE_HERE = runnable_families(_read_cpuinfo(), platform.machine()) if sys.platform.startswith("linux") else []
SUITE_FAMILY = openblas_core()  # the suite's own (this process loaded OpenBLAS with mlxpaged)
FAMILIES_HERE = [f for f in RUNNABLE_HERE if SUITE_FAMILY is None or not same_family(SUITE_FAMILY, f)] or RUNNABLE_HERE
# Each family's run is a whole pytest process (~25 s on 2 cores): in the background of the suite
# (tests/background_runs.py). `-p no:cacheprovider`: the runs beside each other and the suite write no cache.
BACKGROUND_RUNS = {
    f"kernel-family-{family}": background_runs.Run(
        (sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *QUANTIZED_CPU_TESTS),
        {"OPENBLAS_CORETYPE": family},
    )
    for family in FAMILIES_HERE
}


@pytest.mark.slow
@pytest.mark.skipif(not RUNNABLE_HERE, reason="OpenBLAS's kernel families are chosen on Linux (macOS: Accelerate)")
@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.background_run(f"kernel-family-{f}")) for f in FAMILIES_HERE] or ["none"],
)
def test_the_quantized_cpu_paths_pass_under_each_openblas_kernel_family(family):
    env = {**os.environ, "OPENBLAS_CORETYPE": family}
    probe = subprocess.run(
        [sys.executable, "-c", "from mlxpaged.platform.blas import openblas_core; print(openblas_core())"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert same_family(probe.stdout.strip(), family), (probe.stdout, probe.stderr[-2000:])
    name = f"kernel-family-{family}"
    run = background_runs.result(name, BACKGROUND_RUNS[name])
    assert run.returncode == 0, f"under OpenBLAS's {family} kernels:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
