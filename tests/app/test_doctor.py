"""`mlxpaged doctor`: every section reported, no weights loaded, FAIL -> non-zero exit, WARN does not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.platform.memory import DeviceFacts, ModelFacts, model_weight_bytes, plan_memory
from mlxpaged.units import format_size
from mlxpaged_app import doctor
from mlxpaged_app.cli import main
from mlxpaged_app.doctor import FAIL, OK, WARN, Check, ModelOnDisk

import mlx.core as mx
import pytest

SECTIONS = [
    "platform",
    "python",
    "mlx",
    "blas",
    "attention",
    "kernel",
    "memory",
    "wired memory",
    "model store",
    "KV disk tier",
    "default model",
    "sampling defaults",
    "KV plan",
    "distributed",  # one line alone; under mlx.launch one more per rank (test_doctor_distributed.py)
]
SELF_CHECK = "mlxpaged.kernels.self_check"


def doctor_json(capsys, *argv: str) -> tuple[int, dict]:
    code = main(["doctor", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def by_label(report: dict) -> dict[str, dict]:
    return {c["label"]: c for c in report["checks"]}


# ---- fakes of the kernel self-check interface (mlxpaged/kernels/self_check.py) -----------------


@dataclass(frozen=True)
class FakeVariant:
    dtype: str
    head_dim: int
    block_size: int
    gqa: int
    two_pass: bool

    def describe(self) -> str:
        return f"{self.dtype} D={self.head_dim} BS={self.block_size} G={self.gqa}" + (" two-pass" * self.two_pass)


@dataclass(frozen=True)
class FakeCheck:
    variant: FakeVariant
    ok: bool
    reason: str | None
    seconds: float


def fake_self_check(monkeypatch, failing_reason: str | None = None, fake_launcher: bool = True) -> list:
    """Install a self_check module whose two-pass variant fails with `failing_reason` (and, with
    `fake_launcher`, a stand-in for the harness); returns the calls it saw."""
    calls = []

    def variants_for(*, dtype, head_dim, block_size, num_heads, num_kv_heads):
        calls.append(("variants_for", dtype, head_dim, block_size, num_heads, num_kv_heads))
        return [FakeVariant(dtype, head_dim, block_size, num_heads // num_kv_heads, p) for p in (False, True)]

    def check_variant(variant, launcher=None, language="metal"):
        calls.append(("check_variant", variant, launcher))
        bad = variant.two_pass and failing_reason is not None
        return FakeCheck(variant, not bad, failing_reason if bad else None, 0.25)

    module = types.SimpleNamespace(variants_for=variants_for, check_variant=check_variant)
    monkeypatch.setitem(sys.modules, SELF_CHECK, module)
    if fake_launcher:
        monkeypatch.setattr(doctor, "kernel_launcher", lambda: ("LAUNCHER", "CPU harness"))
    return calls


@pytest.fixture
def fast_kernel(monkeypatch):
    """Keep the harness out of tests that are about formatting and exit status."""
    monkeypatch.setattr(doctor, "check_kernel", lambda model: Check(OK, "kernel", "faked"))


# ---- the real command -------------------------------------------------------------------------


def test_the_real_command_reports_every_section_and_exits_0_here():
    done = subprocess.run(
        [sys.executable, "-m", "mlxpaged_app.cli", "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert [c["label"] for c in report["checks"]] == SECTIONS
    assert not [c for c in report["checks"] if c["status"] == FAIL], report
    # That it loads no weights is checked with spies (test_doctor_opens_no_weights and
    # friends), not with a clock: tests never fail on timing.


def test_doctor_opens_no_weights(monkeypatch, capsys):
    opened = spy_on_weight_loading(monkeypatch)
    code, report = doctor_json(capsys)
    assert opened == []
    assert code == 0, report
    on_disk = sum(p.stat().st_size for p in doctor.find_default_model().path.glob("*.safetensors"))
    line = by_label(report)["default model"]
    assert line["status"] == OK and f"weights {format_size(on_disk)} on disk" in line["detail"]


def test_the_weight_spy_catches_a_load(monkeypatch):
    """The control for the test above: `--load` under the same spy is caught."""
    opened = spy_on_weight_loading(monkeypatch)
    check = doctor.guarded("load", doctor.check_load)
    assert opened and check.status == FAIL and "weights loaded" in check.detail


def spy_on_weight_loading(monkeypatch) -> list:
    import mlxpaged.loading.loader

    import mlx_lm.utils

    opened = []

    def refuse(what):
        def call(*args, **kwargs):
            opened.append((what, args))
            raise AssertionError(f"weights loaded through {what}")

        return call

    monkeypatch.setattr(mx, "load", refuse("mx.load"))
    monkeypatch.setattr(mlx_lm.utils, "load", refuse("mlx_lm.utils.load"))
    monkeypatch.setattr(mlxpaged.loading.loader, "mlx_lm_load", refuse("mlx_lm load"))
    monkeypatch.setattr(mlxpaged.loading.loader, "load_model", refuse("load_model"))
    return opened


# ---- exit status and the table ----------------------------------------------------------------


def test_a_failing_check_makes_the_exit_status_non_zero(monkeypatch, capsys, fast_kernel):
    monkeypatch.setattr(doctor, "check_blas", lambda: Check(FAIL, "blas", "injected failure"))
    assert main(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  blas" in out and "injected failure" in out
    assert out.rstrip().splitlines()[-1].endswith("failed: blas")


def test_warnings_alone_exit_0(monkeypatch, capsys, fast_kernel):
    monkeypatch.setattr(doctor, "check_blas", lambda: Check(WARN, "blas", "injected warning"))
    code, report = doctor_json(capsys)
    assert code == 0
    assert by_label(report)["blas"] == {"status": WARN, "label": "blas", "detail": "injected warning"}
    assert report["summary"].endswith(" 0 FAIL")


def test_an_unexpected_exception_is_a_fail_line_not_a_traceback(monkeypatch, capsys, fast_kernel):
    def broken():
        raise OSError("disk on fire")

    monkeypatch.setattr(doctor, "check_memory", broken)
    code, report = doctor_json(capsys)
    assert code == 1
    assert by_label(report)["memory"] == {
        "status": FAIL,
        "label": "memory",
        "detail": "unexpected error: OSError: disk on fire",
    }
    assert [c["label"] for c in report["checks"]] == SECTIONS  # the other lines still ran


def test_the_table_is_aligned():
    checks = [Check(OK, "a", "one"), Check(WARN, "longer label", "two"), Check(FAIL, "b", "three")]
    rows = doctor.format_table(checks).splitlines()[2:5]
    assert len({row.index(detail) for row, detail in zip(rows, ["one", "two", "three"], strict=True)}) == 1
    assert doctor.summary(checks) == "1 OK, 1 WARN, 1 FAIL - failed: b"
    assert doctor.exit_status(checks) == 1 and doctor.exit_status(checks[:2]) == 0


def test_a_check_refuses_an_unknown_status():
    with pytest.raises(ValueError, match="status must be one of"):
        Check("FINE", "x", "y")


# ---- the kernel line --------------------------------------------------------------------------


def test_kernel_line_checks_the_default_models_variants(monkeypatch):
    calls = fake_self_check(monkeypatch)
    model = doctor.find_default_model()
    check = doctor.check_kernel(model)
    config = model.config
    assert calls[0] == (
        "variants_for",
        doctor.kv_dtype(model),
        config["head_dim"],
        doctor.default_cache_config().block_size,
        config["num_attention_heads"],
        config["num_key_value_heads"],
    )
    assert [c[2] for c in calls[1:]] == ["LAUNCHER", "LAUNCHER"]
    assert check.status == OK and check.detail.startswith("CPU harness: 2 variants match the reference")
    assert "two-pass" in check.detail and "0.5 s" in check.detail


def test_kernel_line_fails_with_the_variant_and_reason(monkeypatch):
    fake_self_check(monkeypatch, failing_reason="mismatch: max error 0.31 > tolerance 0.002")
    check = doctor.check_kernel(doctor.find_default_model())
    assert check.status == FAIL
    assert "1 of 2 variants fail" in check.detail and "two-pass: mismatch: max error 0.31" in check.detail


def test_kernel_line_warns_when_the_self_check_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, SELF_CHECK, None)  # makes the import raise ImportError
    check = doctor.check_kernel(doctor.find_default_model())
    assert check.status == WARN and check.detail.startswith("kernel self-check unavailable (")


def test_kernel_line_warns_without_the_harness_or_a_compiler(monkeypatch, tmp_path):
    import mlxpaged.kernels.attention

    fake_self_check(monkeypatch, fake_launcher=False)
    monkeypatch.setattr(mlxpaged.kernels.attention, "metal_available", lambda: False)
    monkeypatch.setattr(mlxpaged.kernels.attention, "gpu_kernel_available", lambda: False)
    monkeypatch.setattr(doctor, "HARNESS", tmp_path / "harness.py")
    check = doctor.check_kernel(doctor.find_default_model())
    assert check.status == WARN and "not checked: " in check.detail and "CPU harness is not at" in check.detail
    monkeypatch.setattr(doctor, "HARNESS", REAL_HARNESS)
    monkeypatch.setattr(doctor.shutil, "which", lambda name: None)
    check = doctor.check_kernel(doctor.find_default_model())
    assert check.status == WARN and "g++ is not installed" in check.detail


REAL_HARNESS = doctor.HARNESS


def test_the_harness_loads_from_the_checkout_without_the_tests_package(monkeypatch):
    monkeypatch.delitem(sys.modules, "tests.msl.harness", raising=False)
    monkeypatch.delitem(sys.modules, "mlxpaged_msl_harness", raising=False)
    module = doctor._load_harness()
    assert Path(module.__file__) == REAL_HARNESS and callable(module.Emulator())


# ---- the model's facts without its weights ----------------------------------------------------


def test_model_facts_from_disk_match_the_loaded_models(tmp_path):
    """The twin: facts from config.json and file sizes vs facts from the loaded model (as Engine reads them)."""
    import dataclasses

    from mlxpaged.loading.probe import probe_layout
    from mlxpaged.platform.model_facts import context_length
    from tests.tiny_models import tiny_llama

    model = tiny_llama()
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(_flat(model)))
    weights = (tmp_path / "model.safetensors").stat().st_size
    on_disk = doctor.model_facts(ModelOnDisk("tiny", "float32", tmp_path, config, weights))
    loaded = ModelFacts.from_layout(probe_layout(model), model_weight_bytes(model), 4, context_length(config))
    assert same_kv(on_disk, loaded)
    assert on_disk.weight_bytes == loaded.weight_bytes  # read from the headers: exact
    device = DeviceFacts("cpu", 16 * 2**30, 8 * 2**30)
    cache = doctor.default_cache_config()
    assert plan_memory(device, on_disk, cache).num_blocks == plan_memory(device, loaded, cache).num_blocks


def same_kv(a: ModelFacts, b: ModelFacts) -> bool:
    """The same KV shape and per-layer windows (None and all-None windows mean the same)."""

    def shape(f: ModelFacts) -> tuple:
        return f.kv.num_layers, f.kv.num_kv_heads, f.kv.head_dim, f.kv.dtype_bytes, f.kv.layer_windows

    return shape(a) == shape(b) and (a.hidden_size, a.vocab_size, a.context_length) == (
        b.hidden_size,
        b.vocab_size,
        b.context_length,
    )


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


@pytest.mark.slow
def test_default_model_plan_from_disk_matches_the_engines(default_loaded):
    from mlxpaged.engine.engine import Engine

    with Engine(default_loaded, doctor.default_cache_config()) as engine:
        loaded = engine.facts
    on_disk = doctor.model_facts(doctor.find_default_model())
    assert same_kv(on_disk, loaded)
    assert on_disk.weight_bytes == loaded.weight_bytes
    device = DeviceFacts("cpu", 16 * 2**30, 8 * 2**30)
    cache = doctor.default_cache_config()
    assert plan_memory(device, on_disk, cache).num_blocks == plan_memory(device, loaded, cache).num_blocks


def test_kv_plan_fails_with_the_numbers_when_memory_is_short(monkeypatch):
    monkeypatch.setattr(DeviceFacts, "detect", classmethod(lambda cls: DeviceFacts("cpu", 2 * 2**30, 2**30)))
    check = doctor.check_kv_plan(doctor.find_default_model())
    assert check.status == FAIL and "GB" in check.detail and "exceed" in check.detail


def test_an_unprovisioned_model_warns_on_every_line_that_needs_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXPAGED_MODELS_DIR", str(tmp_path))
    model = doctor.find_default_model()
    assert model.path is None
    assert doctor.check_default_model(model, None).status == WARN
    assert doctor.check_kv_plan(model).status == WARN
    monkeypatch.setitem(sys.modules, SELF_CHECK, types.SimpleNamespace())
    assert doctor.check_kernel(model).detail.startswith("not checked: the default model is not provisioned")


def test_a_model_without_weight_files_fails(tmp_path):
    model = ModelOnDisk("broken", "float32", tmp_path, {"model_type": "llama"}, 0)
    check = doctor.check_default_model(model, None)
    assert check.status == FAIL and str(tmp_path) in check.detail


def test_store_line_warns_when_the_store_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("MLXPAGED_MODELS_DIR", str(tmp_path / "missing"))
    assert doctor.check_store().status == WARN
    os.makedirs(tmp_path / "missing")
    assert doctor.check_store() == Check(OK, "model store", str(tmp_path / "missing"))


def test_the_kv_disk_tier_line_counts_every_models_blocks(tmp_path, monkeypatch):
    from mlxpaged.cache.disk_tier import DiskTier

    import numpy as np

    monkeypatch.setenv("MLXPAGED_KV_DISK", str(tmp_path / "kv"))
    assert "empty" in doctor.check_kv_disk().detail
    for fingerprint in ("a" * 64, "b" * 64):
        DiskTier(tmp_path / "kv", fingerprint, 10**9).write(fingerprint[:1].encode() * 32, [np.zeros(100, np.float32)])
    check = doctor.check_kv_disk()
    assert check.label == "KV disk tier" and str(tmp_path / "kv") in check.detail and "2 blocks" in check.detail


def test_on_a_cuda_gpu_the_kernel_line_checks_the_cuda_twin_there():
    """MLX's CUDA backend (simulated: MLX computes on the CPU, so building the CUDA kernel fails with MLX's own
    message): the line names the CUDA GPU and the twin, and says what a failure means there."""
    from mlxpaged.kernels import self_check
    from mlxpaged.platform import backend

    self_check.clear_checks()
    model = doctor.find_default_model()  # this machine's (the CUDA store's default is not provisioned here)
    with backend.simulate("cuda"):
        check = doctor.check_kernel(model)
    self_check.clear_checks()
    assert check.status == FAIL and check.detail.startswith(doctor.ON_CUDA), check.detail
    assert "No CUDA back-end" in check.detail and "with MLXPAGED_ATTENTION=kernel the engine uses" in check.detail
