"""Which names a request's `model` may use: what `mlxpaged models` lists and is on disk (a preset already
downloaded or converted, a model directory in the store, a Hugging Face repo id already in the hub cache), the
models named on the command line (--model, --pin: any directory there), and --alias names.

Adapters are named beside models (adapter_catalog.py): a request naming one gets its base model running it.

A request never triggers a download or a conversion, and never loads an arbitrary directory it names: a
client of the server chooses among what the person running it has put on this machine. `mlxpaged pull NAME`
adds a model; the catalog sees it on the next request, without a restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlxpaged.errors import MlxpagedError, UnknownModelError
from mlxpaged.loading.loader import default_dtype
from mlxpaged.loading.model_store import ModelRef, list_models, local_path, models_dir, resolve
from mlxpaged_app.server.adapter_catalog import AdapterCatalog


class ModelNotServable(LookupError):
    """A name the server cannot serve: the message says why (unknown, or known but not on this machine)."""


@dataclass(frozen=True)
class CatalogEntry:
    """One servable model: its canonical name (what replies report as `model`), where it is, and other names."""

    name: str
    ref: ModelRef | None  # None: an engine handed to create_app, not loaded from the store
    path: Path
    aliases: frozenset[str] = field(default_factory=frozenset)
    description: str = ""
    kind: str = "generate"  # what serves it (model_registry.SERVED_KINDS): "generate" (an Engine) or "embed"
    adapters: tuple[tuple[str, str], ...] = ()  # (name, directory) of each adapter its engine serves (--lora)
    draft: tuple[ModelRef, Path] | None = None  # the draft model its engine drafts with (--draft-model), provisioned

    @property
    def names(self) -> frozenset[str]:
        return self.aliases | {self.name}


def canonical_name(ref: ModelRef, path: Path) -> str:
    """What replies and listings call a model: a preset's name, a store directory's base name (what a request
    names it by), else the name it was given (a repo id, a directory's path)."""
    if ref.preset is None and ref.source == "path" and _in_store(path):
        return path.name
    return ref.name


def model_kind(ref: ModelRef | None, path: Path) -> str:
    """ "embed" for an embedding model by the embedding package's rule (sentence-transformers pooling files, or a
    preset saying how it pools: mlxpaged/embedding/model_files.py), else "generate"."""
    from mlxpaged.embedding.model_files import is_embedding_model

    preset = ref.preset if ref is not None else None
    try:
        return "embed" if is_embedding_model(path, preset.options if preset else None) else "generate"
    except OSError:
        return "generate"


def _names_of(name: str, path: Path) -> frozenset[str]:
    """The names a model answers to besides its own: its directory's path and base name."""
    return frozenset({str(path), path.name, name})


class ModelCatalog:
    """Name -> CatalogEntry. `pinned` entries (the command line's models) come first and may be any directory."""

    def __init__(self, aliases: dict[str, str] | None = None, use_store: bool = True) -> None:
        self.dtype = default_dtype()
        self.aliases = dict(aliases or {})  # alias -> a name the catalog knows
        self.use_store = use_store  # False: only the models given (an app built around one engine)
        self._given: dict[str, CatalogEntry] = {}  # by every name: models named on the command line
        self.adapters = AdapterCatalog(self)  # the adapters requests may name, by name (adapter_catalog.py)

    def add_given(
        self, name: str, ref: ModelRef | None, path: Path, description: str = "", kind: str | None = None
    ) -> CatalogEntry:
        """A model named on the command line (already provisioned): servable whatever directory it is in. `kind`:
        None reads it from the model's files (model_kind)."""
        entry = CatalogEntry(name, ref, path, _names_of(name, path), description, kind or model_kind(ref, path))
        for name in entry.names:
            self._given.setdefault(name, entry)
        return entry

    def replace_given(self, entry: CatalogEntry) -> None:
        """A given model's entry changed (adapters.py: the adapters it loads with): every name now means this one."""
        for name in entry.names:
            self._given[name] = entry

    def given(self) -> list[CatalogEntry]:
        """The models named on the command line, each once."""
        return list({entry.name: entry for entry in self._given.values()}.values())

    def find(self, name: str) -> CatalogEntry:
        """The entry `name` means; ModelNotServable saying why when there is none."""
        name = self.aliases.get(name, name)
        if name in self._given:
            return self._given[name]
        if not self.use_store:
            raise ModelNotServable(f"{name!r} is not one of the models this server was started with")
        store_dir = models_dir() / name
        if "/" not in name and (store_dir / "config.json").exists() and not name.startswith("."):
            name = str(store_dir)  # a store directory by its base name, as `mlxpaged models` shows it
        try:
            ref = resolve(name)
        except (UnknownModelError, MlxpagedError) as exc:
            raise ModelNotServable(str(exc)) from None
        if ref.source == "path" and ref.preset is None and not _in_store(ref.path):
            raise ModelNotServable(
                f"{name} is not in the model store ({models_dir()}); the server loads directories named on its "
                "command line (--model, --pin) or in the store only"
            )
        path = local_path(ref, self.dtype)
        if path is None:
            raise ModelNotServable(
                f"model {ref.name!r} is not on this machine yet; run `mlxpaged pull {ref.name}` first "
                "(the server never downloads on a request)"
            )
        description = ref.preset.description if ref.preset else ("local model directory" if ref.path else ref.source)
        name = canonical_name(ref, path)
        return CatalogEntry(name, ref, path, _names_of(name, path) | {ref.name}, description, model_kind(ref, path))

    def servable(self) -> list[CatalogEntry]:
        """Every model a request may name now (what /v1/models lists), the command line's first."""
        entries: dict[str, CatalogEntry] = {}
        for entry in self._given.values():
            entries.setdefault(entry.name, entry)
        if not self.use_store:
            return list(entries.values())
        for row in list_models(self.dtype):
            if row.path is None or row.name in entries:
                continue
            try:
                entry = self.find(row.name)
            except ModelNotServable:
                continue
            entries.setdefault(entry.name, entry)
        return list(entries.values())

    def names_served(self) -> list[str]:
        """For a 404's message: what a request may name (aliases and adapters included)."""
        return [*(e.name for e in self.servable()), *self.aliases, *(a.name for a in self.adapters.listed())]


def _in_store(path: Path | None) -> bool:
    if path is None:
        return False
    try:
        return path.resolve().parent == models_dir().resolve()
    except OSError:
        return False
