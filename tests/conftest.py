"""Shared fixtures. The real default model is loaded once per session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from tests import background_runs
from tests.archs import background

import pytest

# `serve` and `chat` keep the prefix cache on disk by default: in tests (and the servers they start, which
# inherit the environment) that is a directory of this session's, never the user's cache.
if "MLXPAGED_KV_DISK" not in os.environ:
    os.environ["MLXPAGED_KV_DISK"] = tempfile.mkdtemp(prefix="mlxpaged-test-kv-")
    atexit.register(shutil.rmtree, os.environ["MLXPAGED_KV_DISK"], ignore_errors=True)


@pytest.fixture(scope="session")
def default_loaded():
    """The embedded default model (SmolLM2-135M-Instruct) as a LoadedModel, provisioned if needed."""
    from mlxpaged.loading.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def default_model(default_loaded):
    """(model, tokenizer) of the embedded default model."""
    return default_loaded.model, default_loaded.tokenizer


@pytest.fixture(autouse=True)
def speculation_always_drafts(request, monkeypatch):
    """Speculation's gate steps aside by measured step times (engine/speculation_gate.py): in tests every step that
    may draft does, so what a test sees never depends on the machine's speed or load. Tests marked `timed_gate` keep
    the real gate (its own tests)."""
    if request.node.get_closest_marker("timed_gate") is None:
        from mlxpaged.engine.speculation_gate import SpeculationGate

        monkeypatch.setattr(SpeculationGate, "leaning", lambda self, rows: True)
        monkeypatch.setattr(SpeculationGate, "decide", lambda self, rows: True)


def pytest_collection_finish(session):
    """Start the architecture sweep in the background when a selected test needs its verdicts
    (tests/archs/background.py says why), and the whole-process runs selected tests read (background_runs.py)."""
    if session.config.option.collectonly:
        return
    if any("all_verdicts" in getattr(item, "fixturenames", ()) for item in session.items):
        background.start()
    for item in session.items:
        marker = item.get_closest_marker("background_run")
        if marker is not None:
            name = marker.args[0]
            background_runs.start(name, item.module.BACKGROUND_RUNS[name])


def pytest_sessionfinish(session):
    background.stop()
    background_runs.stop_all()
