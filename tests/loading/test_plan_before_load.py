"""The memory plan is made from a model's files before any weight is read, and it is the plan the
engine makes once the weights are loaded (checkpoint.py, Engine.from_pretrained)."""

from __future__ import annotations

import builtins
import dataclasses
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import split_settings
from mlxpaged.engine.engine import Engine
from mlxpaged.loading.checkpoint import CheckpointError, checkpoint_tensors, facts_before_load, read_safetensors_header
from mlxpaged.loading.loader import activation_dtype, load_local, locate_model
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.loading.probe import probe_layout
from mlxpaged.platform.memory import (
    DeviceFacts,
    InsufficientMemoryError,
    ModelFacts,
    activation_bytes,
    model_weight_bytes,
    plan_memory,
)
from mlxpaged.platform.model_facts import context_length
from mlxpaged.units import parse_size
from tests.tiny_models import tiny_hybrid_llama, tiny_llama

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils
import pytest
from mlx_lm.utils import quantize_model, save_config, save_model

GiB = 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def default_dir() -> Path:
    """The embedded default model's directory (provisioned if needed, not loaded)."""
    return locate_model(None)[1]


def save_tiny(directory: Path, model: nn.Module, tokenizer_dir: Path, dtype=None, bits: int | None = None) -> Path:
    """A tiny model as an MLX model directory, saved by mlx-lm, with the default model's tokenizer."""
    config = {k: v for k, v in dataclasses.asdict(model.args).items() if v is not None}
    if dtype is not None:
        model.set_dtype(dtype)
    if bits is not None:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    save_model(directory, model)
    save_config(config, directory / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


VARIANTS = {
    "float32": lambda: (tiny_llama(), {}),
    "float16": lambda: (tiny_llama(seed=1), {"dtype": mx.float16}),  # the CPU loader casts it to float32
    "bfloat16-4bit": lambda: (tiny_llama(seed=2), {"dtype": mx.bfloat16, "bits": 4}),  # float scales, uint32 weights
    "hybrid": lambda: (tiny_hybrid_llama(), {}),  # sliding windows, read from mlx-lm's caches
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def tiny_dir(request, tmp_path_factory, default_dir) -> Path:
    model, options = VARIANTS[request.param]()
    return save_tiny(tmp_path_factory.mktemp(request.param), model, default_dir, **options)


def loaded_facts(path: Path, backend: str) -> ModelFacts:
    """What the engine reads from the model loaded the way `backend` loads it."""
    loaded = load_local(ModelRef(str(path), "path", path=path), path, backend=backend)
    model = loaded.model
    return ModelFacts.from_layout(
        probe_layout(model), loaded.weight_bytes, activation_dtype(model).size, context_length(loaded.config)
    )


@pytest.mark.parametrize("backend", ["cpu", "metal", "cuda"])
def test_facts_before_load_equal_the_loaded_models(tiny_dir, backend):
    assert facts_before_load(tiny_dir, backend) == loaded_facts(tiny_dir, backend)


@pytest.mark.parametrize("kind", ["smolvlm", "qwen3_5"])
def test_a_vision_checkpoints_facts_before_load_count_its_tower_as_the_loaded_model_does(kind, tmp_path):
    """The plan before load reads every tensor of the checkpoint; the engine's, once loaded, the whole mlx-vlm
    model (the tower and projector beside the language model the engine runs). Both set the encoded images'
    memory aside."""
    from tests.vision.tiny_vlm_dirs import write_tiny_qwen3_5_dir, write_tiny_smolvlm_dir

    path = {"smolvlm": write_tiny_smolvlm_dir, "qwen3_5": write_tiny_qwen3_5_dir}[kind](tmp_path / kind)
    before = facts_before_load(path, "cpu")
    with Engine.from_pretrained(str(path), cache_tokens=256, image_cache_size="1MB") as engine:
        tower = engine.facts.weight_bytes - model_weight_bytes(engine.loaded.model)
        assert engine.facts == before and before.takes_images
        assert ("encoded images (image_cache_size)", 1_000_000) in engine.plan.breakdown
    assert tower > 100_000  # the tower's and projector's weights


def test_dtype_rules_differ_by_backend(tmp_path, default_dir):
    path = save_tiny(tmp_path, tiny_llama(), default_dir, dtype=mx.float16)
    cpu, metal = facts_before_load(path, "cpu"), facts_before_load(path, "metal")
    assert (cpu.kv.dtype_bytes, metal.kv.dtype_bytes) == (4, 2)
    assert cpu.weight_bytes == 2 * metal.weight_bytes
    assert facts_before_load(path, "cuda") == metal  # every GPU keeps the checkpoint's float16


def two_shards(weights: dict, *args) -> list[dict]:
    """mlx-lm's make_shards, splitting a tiny model in two as it splits big ones."""
    items = list(weights.items())
    return [dict(items[: len(items) // 2]), dict(items[len(items) // 2 :])]


def test_sharded_checkpoint_counts_every_shard(tmp_path, default_dir, monkeypatch):
    monkeypatch.setattr(mlx_lm.utils, "make_shards", two_shards)
    path = save_tiny(tmp_path, tiny_llama(), default_dir)
    assert len(list(path.glob("model-0000*-of-00002.safetensors"))) == 2
    assert facts_before_load(path, "cpu") == loaded_facts(path, "cpu")


def test_missing_shard_is_named(tmp_path, default_dir, monkeypatch):
    monkeypatch.setattr(mlx_lm.utils, "make_shards", two_shards)
    path = save_tiny(tmp_path, tiny_llama(), default_dir)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names 2 weight files but 1 are missing .*: model-00002-of-00002"):
        facts_before_load(path, "cpu")


def test_activation_dtype_without_embed_tokens_is_the_weights():
    """The loaded model's rule (model.activation_dtype) for models with no `model.embed_tokens`
    is the files' rule (checkpoint.kv_dtype_bytes): the floating dtype with the most bytes."""
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 32), nn.RMSNorm(32))
    model.set_dtype(mx.bfloat16)
    model.layers[2].update({"weight": mx.ones(32)})  # a float32 norm, as checkpoints keep them
    assert activation_dtype(model) == mx.bfloat16


def test_unreadable_headers_are_refused_with_the_numbers(tmp_path):
    short = tmp_path / "model.safetensors"
    short.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    with pytest.raises(CheckpointError, match="header length 10000 for a 10-byte file"):
        read_safetensors_header(short)
    with pytest.raises(CheckpointError, match=re.escape("no model*.safetensors in")):
        checkpoint_tensors(tmp_path / "nowhere")


# --- the plan before loading is the engine's plan after loading ---------------------------------


def plans_before_and_after(path: Path, monkeypatch, spare: int, **settings):
    """The plan from the files on a device with `spare` bytes for the cache, and the engine's own plan
    after loading on that device (whose available memory then no longer includes the weights)."""
    cache, scheduler = split_settings(settings)
    facts = facts_before_load(path, "cpu")
    fixed = GiB + facts.weight_bytes + activation_bytes(facts, scheduler.max_batch_tokens)  # OS reserve of 8 GiB: 1 GiB
    before = DeviceFacts("cpu", 8 * GiB, fixed + spare)
    after = DeviceFacts("cpu", 8 * GiB, before.available_bytes - facts.weight_bytes)
    devices = iter([before, after])  # from_pretrained detects before loading, the engine after
    monkeypatch.setattr(DeviceFacts, "detect", classmethod(lambda cls, *a, **k: next(devices)))
    with Engine.from_pretrained(str(path), **settings) as engine:
        return plan_memory(before, facts, cache, scheduler), engine.plan


def assert_same_plan(before, after) -> None:
    fields = ("num_blocks", "block_size", "token_capacity", "bytes_per_token", "block_bytes", "kv_bytes")
    assert {f: getattr(before, f) for f in fields} == {f: getattr(after, f) for f in fields}
    assert before.reason == after.reason


def test_tiny_plan_before_load_is_the_engines(tiny_dir, monkeypatch):
    # 4 MB spare, half of it for the cache: fewer blocks than cache_tokens asks, so weights count.
    before, after = plans_before_and_after(tiny_dir, monkeypatch, 4_000_000, cache_tokens=8192)
    assert before.reason.startswith("limited by memory")
    assert_same_plan(before, after)


@pytest.mark.slow
def test_default_model_plan_before_load_is_the_engines(default_dir, monkeypatch):
    before, after = plans_before_and_after(default_dir, monkeypatch, 100_000_000, cache_tokens=1024)
    assert before.reason.startswith("limited by memory")
    assert_same_plan(before, after)


# --- refused before a single weight is read -----------------------------------------------------


@pytest.fixture
def no_weight_reads(monkeypatch):
    """Every way to read weights fails the test; Python reads of .safetensors files stop at the header."""

    def forbidden(*args, **kwargs):
        raise AssertionError("weights were read before the memory plan refused the cache")

    import mlxpaged.loading.loader

    monkeypatch.setattr(mx, "load", forbidden)
    monkeypatch.setattr(mlx_lm.utils, "load_model", forbidden)
    monkeypatch.setattr(mlx_lm.utils, "load", forbidden)
    monkeypatch.setattr(mlxpaged.loading.loader, "mlx_lm_load", forbidden)
    try:
        import safetensors
    except ImportError:  # not installed: then nothing can call it
        pass
    else:
        monkeypatch.setattr(safetensors, "safe_open", forbidden)
    read = {"bytes": 0}
    real_open = builtins.open

    class Counted:
        def __init__(self, file):
            self.file = file

        def read(self, n=-1):
            data = self.file.read(n)
            read["bytes"] += len(data)
            return data

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    def counting_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        return Counted(handle) if str(file).endswith(".safetensors") else handle

    monkeypatch.setattr(builtins, "open", counting_open)
    return read


def header_bytes(path: Path) -> int:
    """Bytes of the safetensors headers in `path`: the length prefixes and the JSON they announce."""
    total = 0
    for file in path.glob("model*.safetensors"):
        with open(file, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


@pytest.mark.parametrize("which", ["tiny", "default"])
def test_refused_before_any_weight_is_read(which, tmp_path, default_dir, request):
    path = save_tiny(tmp_path, tiny_llama(), default_dir) if which == "tiny" else default_dir
    limit = header_bytes(path)
    read = request.getfixturevalue("no_weight_reads")
    with pytest.raises(InsufficientMemoryError) as info:
        Engine.from_pretrained(str(path), kv_memory="1KB")
    assert 0 < read["bytes"] <= limit  # the headers, nothing after them
    message = str(info.value)
    assert "kv_memory=" in message and "--kv-memory" not in message
    assert "only 1.00 KB is available" in message
    assert info.value.param == "kv_memory"
    with pytest.raises(InsufficientMemoryError, match=re.escape("kv_memory=100000.00 GB is more than")):
        Engine.from_pretrained(str(path), kv_memory="100TB")
    with pytest.raises(InsufficientMemoryError, match="a larger kv_memory= or memory_fraction= if") as info:
        Engine.from_pretrained(str(path), memory_fraction=1e-12)
    assert info.value.param == "memory_fraction"


def test_hub_repo_id_is_planned_once_its_files_are_local(tmp_path, default_dir, monkeypatch):
    """A hub id found in the Hugging Face cache (as after a download) is planned from its files."""
    import huggingface_hub.constants

    snapshot = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / "0123abcd"
    save_tiny(snapshot, tiny_llama(), default_dir)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert locate_model("tiny-org/tiny-llama")[1] == snapshot
    with pytest.raises(InsufficientMemoryError, match=re.escape("only 1.00 KB is available")):
        Engine.from_pretrained("tiny-org/tiny-llama", kv_memory="1KB")
    with Engine.from_pretrained("tiny-org/tiny-llama", cache_tokens=256) as engine:
        assert engine.loaded.path == snapshot and engine.facts == facts_before_load(snapshot, "cpu")


def test_cli_refuses_with_one_line_naming_the_flag(tmp_path, default_dir):
    path = save_tiny(tmp_path, tiny_llama(), default_dir)
    mlxpaged_cli = Path(sys.executable).with_name("mlxpaged")
    started = time.monotonic()
    result = subprocess.run(
        [str(mlxpaged_cli), "serve", "--model", str(path), "--port", "0", "--kv-memory", "1KB"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mlxpaged serve: one 512-token sequence needs")
    asked = lines[0].split("use --kv-memory ")[1].split()[0]  # as much as one sequence needs
    assert parse_size(asked) >= facts_before_load(path, "cpu").kv.bytes_per_token * 512
    assert "kv_memory=" not in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert time.monotonic() - started < 60
