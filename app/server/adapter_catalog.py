"""Which adapters a request's `model` may name, and the model each runs on.

Two kinds: adapters named on the command line (`--lora NAME=PATH`, on --model: its engine is built with them and
keeps them), and adapter directories in the model store (mlx_lm.lora's files, named by their directory), served on
the model their config names (`model`, what mlx_lm.lora was given) and attached to its engine on first use
(served_model.py `ServedModel.use_adapter`, bounded by --max-loras). A request names an adapter as `NAME`, or
Ollama-style as `BASE:NAME`. A store adapter whose config names no model this server can serve is not listed.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mlxpaged.loading.model_store import list_adapters, models_dir
from mlxpaged_app.server.server_log import log

if TYPE_CHECKING:
    from mlxpaged_app.server.model_catalog import CatalogEntry, ModelCatalog

CONFIG = "adapter_config.json"  # what marks an adapter directory (mlx_lm.lora writes it)


@dataclass(frozen=True)
class AdapterTarget:
    """An adapter a request may name: what it is called, the model it runs on, its directory, and whether it was
    given on the command line (loaded with the model, never unloaded) or found in the store (loaded on demand)."""

    name: str
    base: CatalogEntry
    path: str
    given: bool
    trained_on: str | None = None  # a store adapter's config's `model`, which the catalog matched to `base`


class AdapterCatalog:
    def __init__(self, models: ModelCatalog) -> None:
        self.models = models
        self._given: dict[str, AdapterTarget] = {}

    def add_given(self, base: CatalogEntry, adapters: dict[str, str]) -> CatalogEntry:
        """Serve `adapters` (name -> directory, from --lora) on the given model `base`; its entry, now naming them
        (its engine is built with them). ValueError for a name a model, an alias or another adapter has."""
        taken = [n for n in adapters if n in self._given or n in self.models.aliases or self._is_model(n)]
        if taken:
            raise ValueError(f"--lora: {', '.join(map(repr, taken))} already names a model or an adapter")
        entry = replace(base, adapters=base.adapters + tuple(adapters.items()))
        self.models.replace_given(entry)
        for name, path in entry.adapters:
            self._given[name] = AdapterTarget(name, entry, path, given=True)
        return entry

    def listed(self) -> list[AdapterTarget]:
        """Every adapter a request may name now: the command line's, then the store's."""
        return [*self._given.values(), *self._store().values()]

    def target(self, name: str | None) -> AdapterTarget | None:
        """The adapter `name` means (`NAME` or `BASE:NAME`), or None when it names none."""
        if not name:
            return None
        base, _, adapter = name.rpartition(":")
        for candidate, base_name in ((name, None), (adapter, base)):
            if not candidate or base_name == "":
                continue
            found = self._given.get(candidate) or self._in_store(candidate)
            if found is not None and (base_name is None or self._same_model(base_name, found.base)):
                return found
        return None

    def _in_store(self, name: str) -> AdapterTarget | None:
        """The store's adapter `name`; the directory is looked at first, so naming a model reads no config."""
        if not self.models.use_store or self._is_model(name) or not (models_dir() / name / CONFIG).is_file():
            return None
        return self._store().get(name)

    def _store(self) -> dict[str, AdapterTarget]:
        """The store's adapters whose config names a model this server serves (read anew: `mlxpaged pull` and a
        copied directory show up without a restart)."""
        if not self.models.use_store:
            return {}
        found = {}
        for row in list_adapters():
            base = self._base_entry(row.base) if row.base else None
            if base is None:
                log.info("adapter %s in the model store is not served: no model here is %r", row.name, row.base)
            elif row.name not in self._given:
                found[row.name] = AdapterTarget(row.name, base, str(row.path), given=False, trained_on=row.base)
        return found

    def _base_entry(self, named: str) -> CatalogEntry | None:
        """The catalog entry of the model an adapter's config names: by its name, else by its directory's name (a
        path that mlx_lm.lora was given, maybe relative to where it ran); the command line's entry for the same
        directory wins, so the adapter runs on the engine that model already has."""
        from mlxpaged_app.server.model_catalog import ModelNotServable

        entry = None
        for name in dict.fromkeys([named, Path(named).name]):
            try:
                entry = self.models.find(name)
                break
            except ModelNotServable:
                continue
        if entry is None:
            return None
        same = [e for e in self.models.given() if _same_path(e.path, entry.path)]
        return same[0] if same else entry

    def _same_model(self, name: str, entry: CatalogEntry) -> bool:
        name = self.models.aliases.get(name, name)
        if name in entry.names or name.removesuffix(":latest") in entry.names:
            return True
        base = self._base_entry(name)
        return base is not None and base.name == entry.name

    def _is_model(self, name: str) -> bool:
        return any(name in entry.names for entry in self.models.given())


def _same_path(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False
