"""Preset resolution, listing, and the CLI's answers to good and bad model names."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from mlxpaged.loading import model_store as models

import pytest


def test_default_is_the_embedded_model():
    ref = models.resolve(None)
    assert (ref.name, ref.source) == ("smollm2-135m", "pypi-gguf")
    assert ref.preset.options["sha256"].startswith("b179c952")


def test_preset_hub_and_path(tmp_path):
    assert models.resolve("qwen3-0.6b").repo == "mlx-community/Qwen3-0.6B-4bit"
    assert models.resolve("someone/Some-Model-4bit") == models.ModelRef(
        "someone/Some-Model-4bit", "hub", repo="someone/Some-Model-4bit"
    )
    (tmp_path / "config.json").write_text("{}")
    ref = models.resolve(str(tmp_path))
    assert (ref.source, ref.path) == ("path", tmp_path.resolve())


def test_unknown_name_lists_presets():
    with pytest.raises(models.UnknownModelError) as err:
        models.resolve("no-such-model")
    assert "smollm2-135m" in str(err.value) and "qwen3-0.6b" in str(err.value)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(models.UnknownModelError, match=re.escape("no config.json")):
        models.resolve(str(tmp_path))


def test_hub_id_without_network_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(models.ModelUnavailableError, match="no network"):
        models.provision(models.resolve("mlx-community/definitely-not-cached-xyz"), "float32")


def test_presets_file_errors(tmp_path):
    bad = tmp_path / "presets.toml"
    bad.write_text('default = "missing"\n[presets.a]\nsource = "hub"\nrepo = "x/y"\n')
    with pytest.raises(models.ModelError, match="default preset 'missing'"):
        models.load_presets(bad)


def test_listing_shows_the_local_default_model():
    rows = {row.name: row for row in models.list_models("float32")}
    default = rows["smollm2-135m"]
    assert default.is_default and default.path is not None and default.size_bytes > 500_000_000
    assert rows["qwen3-0.6b"].source == "hub"


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MLXPAGED_API_KEY"}
    return subprocess.run(
        [sys.executable, "-m", "mlxpaged_app.cli", *args], capture_output=True, text=True, timeout=300, env=env
    )


def test_cli_models_and_pull():
    listing = cli("models")
    assert listing.returncode == 0 and "smollm2-135m *" in listing.stdout
    pulled = cli("pull")
    assert pulled.returncode == 0 and "smollm2-135m: ready at" in pulled.stdout


def test_cli_errors_are_one_line_not_tracebacks():
    unknown = cli("pull", "no-such-model")
    assert unknown.returncode == 1 and "unknown model 'no-such-model'" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    public = cli("serve", "--host", "0.0.0.0", "--port", "0")  # refused before loading anything
    assert public.returncode == 1 and "--api-key" in public.stderr and "Traceback" not in public.stderr
