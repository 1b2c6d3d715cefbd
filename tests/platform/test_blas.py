"""The fast BLAS is what MLX's matmuls actually call after the README setup (Linux)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OpenBLAS preloading is Linux-only")

MATMUL = "import mlx.core as mx; a = mx.ones((64, 64)); mx.eval(a @ a)"


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


@linux_only
def test_openblas_is_installed():
    from mlxpaged.platform.blas import HINT, find_openblas

    assert find_openblas() is not None, f"no system OpenBLAS; the README setup installs it ({HINT})"


@linux_only
def test_mlx_sgemm_binds_to_openblas():
    # The dynamic linker reports which library satisfies libmlx's cblas_sgemm.
    result = run_python(f"import mlxpaged; {MATMUL}", LD_DEBUG="bindings")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [ln for ln in result.stderr.splitlines() if "libmlx" in ln and "`cblas_sgemm'" in ln]
    assert lines, "libmlx never bound cblas_sgemm"
    assert all("libopenblas" in ln for ln in lines), lines


@linux_only
def test_without_preload_mlx_uses_its_bundled_blas():
    # The control: the check above can tell the two apart.
    result = run_python(MATMUL, LD_DEBUG="bindings")
    lines = [ln for ln in result.stderr.splitlines() if "libmlx" in ln and "`cblas_sgemm'" in ln]
    assert lines and not any("libopenblas" in ln for ln in lines), lines


@linux_only
def test_importing_mlx_first_warns_once():
    code = (
        "import warnings, mlx.core\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    import mlxpaged\n"
        "    mlxpaged.load_fast_blas()\n"
        "print(len(w), mlxpaged.blas_status().name)\n"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "mlx-bundled", "(openblas", "loaded", "too", "late)"]


def test_status_is_reported_by_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "mlxpaged_app.cli", "models", "--verbose"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    expected = "accelerate" if sys.platform == "darwin" else "openblas"
    assert f"BLAS:    {expected}" in result.stdout


def run_python_without(name: str, code: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose environment lacks `name` (this sandbox sets some OPENBLAS_*)."""
    env = {k: v for k, v in os.environ.items() if k != name}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


@linux_only
def test_openblas_helpers_sleep_between_calls_unless_the_user_says_otherwise():
    """Spinning helpers would keep a core from the NumPy attention workers (platform/blas.py)."""
    code = "import os, mlxpaged; mlxpaged.load_fast_blas(); print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    result = run_python_without("OPENBLAS_THREAD_TIMEOUT", code)
    assert result.stdout.split() == ["4"], result.stderr
    assert run_python(code, OPENBLAS_THREAD_TIMEOUT="20").stdout.split() == ["20"]


def test_amd_cpus_with_avx512_get_the_skylakex_kernels():
    from mlxpaged.platform.blas import avx512_core

    flags = "fpu sse2 avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16"
    assert avx512_core(f"vendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n") == "SkylakeX"
    assert avx512_core("vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n") is None  # Zen 3: AVX2 only
    assert avx512_core(f"vendor_id\t: GenuineIntel\nflags\t\t: {flags}\n") is None  # OpenBLAS knows Intel's
    assert avx512_core("") is None


@linux_only
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the OpenBLAS core names used here are x86-64's")
@pytest.mark.parametrize("core", ["Haswell", "Sandybridge"])
def test_the_core_reaches_openblas_and_a_users_choice_wins(core):
    """OpenBLAS reads OPENBLAS_CORETYPE once, when it loads: what is set (by the user here, else by
    avx512_core) is what runs, and the status says so."""
    code = (
        "import ctypes, mlxpaged\n"
        "lib = ctypes.CDLL(mlxpaged.blas_status().path); lib.openblas_get_corename.restype = ctypes.c_char_p\n"
        "print(lib.openblas_get_corename().decode(), mlxpaged.blas_status().detail)"
    )
    result = run_python(code, OPENBLAS_CORETYPE=core)
    assert result.stdout.split()[0].lower() == core.lower(), result.stderr
    assert f"OPENBLAS_CORETYPE={core}" in result.stdout


@linux_only
def test_without_a_users_choice_only_amd_avx512_cpus_get_a_core():
    from mlxpaged.platform.blas import _read_cpuinfo, avx512_core

    code = "import os, mlxpaged; mlxpaged.load_fast_blas(); print(os.environ.get('OPENBLAS_CORETYPE'))"
    result = run_python_without("OPENBLAS_CORETYPE", code)
    assert result.stdout.split() == [str(avx512_core(_read_cpuinfo()))], result.stderr
