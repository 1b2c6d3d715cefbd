"""The cache list a model gets for one pass, assembled per cache leaf path from its layout.

`make_prompt_cache(model)` need not hold one cache per layer: gemma4 pads it with None for layers
that reuse an earlier layer's K/V, gemma3n / afm7 / looped models have fewer or more entries than
layers, DSA and longcat_flash put several caches in one `CacheList`, nemotron-nas creates caches a
layer never touches. So caches are made per leaf path (cache/layout.py) and put back in the model's
own nesting; a layer that reuses K/V gets nothing of its own, so no pages are allocated for it twice.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlxpaged.cache.layout import CacheListNode, Entry, ModelLayout, Path, StateLeaf

from mlx_lm.models.cache import CacheList


class UnusedCache:
    """The placeholder for a cache the model creates but never writes (a layer replaced by a linear
    map): the probe saw no use, so any use now means the probe was wrong - fail loudly, never guess."""

    def __init__(self, where: str):
        self._where = where

    def __getattr__(self, name: str):
        raise RuntimeError(
            f"{self._where}: the model used the cache it never used when its layout was read "
            f"(.{name}); no pages back it. Please report this model."
        )

    def __getitem__(self, index):
        raise RuntimeError(f"{self._where}: the model indexed the cache it never used when its layout was read")


def simple(layout: ModelLayout) -> bool:
    """One KV cache per entry, no None, CacheList or other kinds: the plain list of views is the cache."""
    kv = layout.kv_leaves
    return len(kv) == len(layout.leaves) and [leaf.path for leaf in kv] == list(layout.structure) == [
        (i,) for i in range(len(layout.structure))
    ]


def leaf_caches(layout: ModelLayout, kv_views: Sequence, extra: Mapping[Path, object] | None = None) -> dict:
    """Path -> cache object: the KV views (one per KV leaf, in layout order, as `paged_views` makes them),
    placeholders for unused leaves, and `extra` (the state views of StateLeaf paths, filled by the state
    slots when they exist)."""
    kv = layout.kv_leaves
    if len(kv_views) != len(kv):
        raise ValueError(f"{len(kv_views)} KV views for the layout's {len(kv)} KV leaves")
    caches: dict[Path, object] = {leaf.path: view for leaf, view in zip(kv, kv_views, strict=True)}
    caches.update((leaf.path, UnusedCache(layout.where(leaf.path))) for leaf in layout.unused_leaves)
    caches.update(extra or {})
    return caches


def assemble(layout: ModelLayout, caches: Mapping[Path, object]) -> list:
    """The model's cache list: `layout.structure` with each leaf path replaced by its cache."""
    return [_entry(layout, entry, caches) for entry in layout.structure]


def _entry(layout: ModelLayout, entry: Entry, caches: Mapping[Path, object]):
    if entry is None:
        return None
    if isinstance(entry, CacheListNode):
        return CacheList(*(_entry(layout, child, caches) for child in entry.entries))
    if entry not in caches:
        leaf = layout.leaf(entry)
        kind = "state" if isinstance(leaf, StateLeaf) else leaf.describe()
        raise KeyError(
            f"{layout.where(entry)} ({kind}) has no cache for this pass"
            + (": state leaves need state slots" if isinstance(leaf, StateLeaf) else "")
        )
    return caches[entry]


def model_cache(layout: ModelLayout | None, kv_views: list, extra: Mapping[Path, object] | None = None) -> list:
    """What `model(tokens, cache=...)` takes: the views themselves for a plain layout (or none given),
    else the assembled list."""
    if layout is None or (simple(layout) and not extra):
        return kv_views
    return assemble(layout, leaf_caches(layout, kv_views, extra))
