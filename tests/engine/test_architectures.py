"""Every text architecture of the installed mlx_lm.models, as a tiny random model: the paged engine
either gives mlx-lm's greedy tokens in every scenario (tests/archs/scenarios.py: alone, batched,
chunked prefill, prefix-cache hit, after preemption, n = 2; pool empty afterwards) or refuses at
Engine construction naming the layer and cache kind - never a mid-request failure or a wrong token.

The sweep runs each architecture in worker processes (tests/archs/sweep.py; a few minutes on 2
cores), once per session; each architecture is then its own test case.
"""

from __future__ import annotations

import subprocess
import sys

from tests.archs import background
from tests.archs.arch_table import ACCEPTANCE, render, section
from tests.archs.configs import MLX_LM_CANNOT_RUN, has_config, text_modules
from tests.archs.scenarios import SCENARIOS
from tests.archs.sweep import ROOT

import pytest

MODULES = text_modules()
# What a refusal must name: where (a layer or cache entry) or, for a model-wide reason, what fails.
NAMES_WHERE = ("layer", "cache entry", "cache list", "forward fails", "keeps no key/value")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def all_verdicts() -> dict[str, dict[str, dict]]:
    """One sweep, every variant of a module in one process (the model and mlx-lm's reference made once): about
    2 minutes on 2 cores, where three sweeps took 3; started in the background of the session (conftest.py,
    tests/archs/background.py)."""
    return background.verdicts()


@pytest.fixture(scope="session")
def verdicts(all_verdicts) -> dict[str, dict]:
    return all_verdicts["cpu"]


@pytest.fixture(scope="session")
def kv_verdicts(all_verdicts) -> dict[str, dict]:
    """The same with quantized pages (kv_bits=8, groups of 32) against mlx-lm over the same quantized K/V
    (tests/archs/quantized_reference.py); measured alone: 90 s wall on the shared 2-core machine (265 s under heavy
    load): 44 run, 76 refused for their widths in about a second each."""
    return all_verdicts["kv8"]


@pytest.fixture(scope="session")
def gpu_verdicts(all_verdicts) -> dict[str, dict]:
    """The same on the path a GPU takes (platform/backend.py simulating CUDA)."""
    return all_verdicts["cuda"]


def test_every_architecture_has_a_config_or_a_reason():
    missing = [m for m in MODULES if not has_config(m) and m not in MLX_LM_CANNOT_RUN]
    assert not missing, f"mlx_lm.models gained modules without a tiny config in tests/archs/configs.json: {missing}"


@pytest.mark.parametrize("module", MODULES)
def test_runs_exactly_or_is_refused_at_load(verdicts, module):
    verdict = verdicts[module]
    status, reason = verdict["status"], verdict.get("reason", "")
    if module in MLX_LM_CANNOT_RUN:
        assert status == "cannot-run", verdict
        return
    assert status in ("paged", "refused"), f"{module}: {status}: {reason}"
    if status == "refused":
        assert "model type " in reason and any(word in reason for word in NAMES_WHERE), reason
        assert verdict["labels"], f"{module} refused by the engine but its layout shows no reason: {reason}"
    else:
        assert not verdict["labels"], f"{module} ran paged although its layout says {verdict['labels']}"
        failed = {name: why for name, why in verdict["scenarios"].items() if why != "pass"}
        assert set(verdict["scenarios"]) == set(SCENARIOS) and not failed, f"{module}: {failed}"


@pytest.mark.parametrize("module", MODULES)
def test_quantized_pages_run_exactly_or_are_refused_at_load(verdicts, kv_verdicts, module):
    """kv_bits=8: every architecture the full-precision sweep runs either passes every scenario against mlx-lm
    over quantized K/V, or is refused when the engine is built because its K/V widths do not split into groups
    of 32 (ConfigError naming kv_bits and the widths); one refused at full precision is refused here too."""
    verdict, full = kv_verdicts[module], verdicts[module]
    status, reason = verdict["status"], verdict.get("reason", "")
    if full["status"] != "paged":
        assert status == full["status"] or (status == "refused" and "kv_group_size" in reason), (full, verdict)
        return
    assert status in ("paged", "refused"), f"{module}: {status}: {reason}"
    if status == "refused":
        assert "kv_bits=8" in reason and "not a multiple of 32" in reason, reason
    else:
        failed = {name: why for name, why in verdict["scenarios"].items() if why != "pass"}
        assert set(verdict["scenarios"]) == set(SCENARIOS) and not failed, f"{module}: {failed}"


def test_quantized_pages_run_a_share_of_the_architectures(kv_verdicts):
    """Not all refused: the widths of 32 and more run (measured: 44 of the runnable ones)."""
    assert sum(v["status"] == "paged" for v in kv_verdicts.values()) >= 35


def test_no_architecture_fails_after_load(verdicts):
    """Refuse at load, never mid-request: every architecture the engine accepted passes every scenario
    (a crash of the paged engine, a failed request or a wrong token all count as failing later)."""
    later = {
        m: f"{v['status']}: {v.get('reason', '')[:160]}"
        for m, v in verdicts.items()
        if v["status"] not in ("paged", "refused", "cannot-run")
    }
    assert not later, f"{len(later)} architectures fail after load: {later}"


def test_sweep_covers_the_acceptance_share(verdicts):
    """At least 95% of the architectures mlx-lm runs here pass; the rest are listed with their reason."""
    runnable = {m: v for m, v in verdicts.items() if m not in MLX_LM_CANNOT_RUN}
    passing = [m for m, v in runnable.items() if v["status"] == "paged"]
    others = {m: v.get("labels") or v.get("reason", "")[:80] for m, v in runnable.items() if v["status"] != "paged"}
    assert len(passing) >= ACCEPTANCE * len(runnable), (
        f"{len(passing)} of {len(runnable)} architectures pass; not yet: {others}"
    )


@pytest.mark.parametrize("module", ["llama", "phi3small"])
def test_plain_mlx_lm_runs_the_tiny_config(module):
    """mlx-lm alone (mlxpaged never imported) runs the tiny model 5 rounds (100 forwards): the config is sound.
    phi3small's first config (vocab 1000) crashed this process in 9 of 9 runs of 20 rounds and 4 of 4 of 5 (SIGSEGV,
    SIGABRT, SIGBUS, at random) and sometimes corrupted a later matmul instead: the model sets the logits of token ids
    100256..100351 to -inf, a scatter out of bounds of a 1000-wide vocab. Its config now has vocab 100352."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.archs.plain_mlx_lm", module, "5"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-500:])


def test_readme_table_is_the_sweeps(verdicts):
    """The README's supported-architectures table is what this sweep renders (regenerate it with
    `python -m tests.archs.arch_table --readme README.md`)."""
    readme = (ROOT / "README.md").read_text()
    assert section(readme) == render(verdicts)


def test_the_gpu_path_gives_the_same_verdicts(verdicts, gpu_verdicts):
    """On a GPU's path (eager decode queued before the last step is read, page writes deferred, MLX's fused
    attention) every architecture the CPU path runs gives mlx-lm's tokens in every scenario too, and the
    ones it refuses are refused the same way."""
    differ = {
        m: f"cpu {verdicts[m]['status']}, gpu {v['status']}: {v.get('reason', '')[:160]}"
        for m, v in gpu_verdicts.items()
        if v["status"] != verdicts[m]["status"]
    }
    assert not differ, f"{len(differ)} architectures differ on the GPU path: {differ}"
    failed = {
        m: {name: why for name, why in v["scenarios"].items() if why != "pass"}
        for m, v in gpu_verdicts.items()
        if v["status"] == "paged"
    }
    assert not any(failed.values()), {m: f for m, f in failed.items() if f}
