"""Which cache layouts today's page pools can hold (plain Python; read at load, never mid-request).

The pools (kv_cache.py) keep one K/V geometry for every layer, full, sliding-window or chunked-local
tables, one view per entry of the model's cache list, and attention routed through mlx-lm's SDPA. Everything
else is refused at load with the leaf named; each rule here goes when the pools learn that kind.
"""

from __future__ import annotations

from typing import NamedTuple

from mlxpaged.cache.layout import CacheListNode, KVLeaf, ModelLayout, UnusedLeaf


class Reason(NamedTuple):
    """One reason to refuse: `label` in a few words (the README table), `text` a sentence naming the leaves."""

    label: str
    text: str


# Consumers (layout.CONSUMERS) the routed decode cannot serve: it reads K and V from the pools and
# drops masks, so another V, another layer's attention or mx.fast would be wrong. (A model-built mask
# only makes the engine run one sequence per pass: serial_reason.)
UNROUTABLE = {
    "sdpa-other-v": ("latent attention", "its attention reads another V than the one it caches (latent attention)"),
    "sdpa-other-cache": ("shared KV", "another layer attends its K/V (shared KV)"),
    "fast": ("mx.fast attention", "it calls mx.fast.scaled_dot_product_attention directly"),
}


def unsupported_reasons(layout: ModelLayout) -> list[Reason]:
    """Why the pools cannot hold `layout`, one Reason per problem (leaves with the same problem named
    together); [] when they can."""
    per_leaf: dict[tuple[str, Reason], list[str]] = {}  # (leaf description, why) -> where, in leaf order
    for leaf in layout.leaves:
        for why in _leaf_reasons(leaf):
            per_leaf.setdefault((leaf.describe(), why), []).append(layout.where(leaf.path))
    reasons = [Reason("own cache class", text) for text in layout.refuse] + _structure_reasons(layout)
    reasons += [Reason(why.label, f"{', '.join(wheres)} ({kind}): {why.text}")
                for (kind, why), wheres in per_leaf.items()]
    reasons += _geometry_reasons(layout)
    if not layout.kv_leaves and not layout.state_leaves and not reasons:
        reasons.append(Reason("no KV cache", "the model keeps no key/value cache"))
    return reasons


def _leaf_reasons(leaf) -> list[Reason]:
    if isinstance(leaf, UnusedLeaf):
        return [Reason("unused cache", "a cache the model never writes has no paged placeholder yet")]
    return _kv_reasons(leaf) if isinstance(leaf, KVLeaf) else []


def _structure_reasons(layout: ModelLayout) -> list[Reason]:
    reasons = []
    for i, entry in enumerate(layout.structure):
        if isinstance(entry, CacheListNode):
            reasons.append(Reason("CacheList", f"{layout.where((i,))}: a CacheList ({len(entry.entries)} caches in "
                                               "one layer) needs pools per cache"))
        elif entry is None:
            reasons.append(Reason("shared KV", f"cache entry {i}: the model's cache list holds None "
                                               "(a layer reusing another's K/V)"))
    if layout.num_layers is not None and len(layout.structure) != layout.num_layers:
        reasons.append(Reason("caches != layers", f"the model's cache list has {len(layout.structure)} entries for "
                                                  f"{layout.num_layers} layers (shared or looped layers); the pools "
                                                  "hold one cache per layer"))
    return reasons


def _kv_reasons(leaf: KVLeaf) -> list[Reason]:
    reasons = []
    if leaf.kind == "window" and "sdpa-masked" in leaf.consumers:
        reasons.append(Reason("model-built mask", "its attention uses a mask the model builds itself for "
                                                  "mlx-lm's rotating cache, whose key order the pages do not keep"))
    if leaf.k_dim != leaf.v_dim:
        reasons.append(Reason("K width != V width", f"K width {leaf.k_dim} != V width {leaf.v_dim}; "
                                                    "the pools store one width"))
    reasons += [Reason(*UNROUTABLE[word]) for word in leaf.consumers if word in UNROUTABLE]
    return reasons


def _geometry_reasons(layout: ModelLayout) -> list[Reason]:
    """The pools have one (kv_heads, head_dim, dtype) and the kernel one query-head count."""
    leaves = layout.kv_leaves
    if not leaves:
        return []
    first = leaves[0]
    reasons = []
    for leaf in leaves[1:]:
        if leaf.geometry != first.geometry:
            reasons.append(Reason("several geometries", f"{layout.where(leaf.path)} caches {leaf.kv_heads} heads x "
                                  f"{leaf.k_dim} ({leaf.dtype}) but {layout.where(first.path)} {first.kv_heads} x "
                                  f"{first.k_dim} ({first.dtype}); the pools hold one geometry"))
        elif None not in (leaf.q_heads, first.q_heads) and leaf.q_heads != first.q_heads:
            reasons.append(Reason("per-layer query heads", f"{layout.where(leaf.path)} attends with {leaf.q_heads} "
                                  f"query heads but {layout.where(first.path)} with {first.q_heads}; the kernel "
                                  "takes one count"))
    return reasons


def serial_reason(layout: ModelLayout) -> str | None:
    """Why the engine must run this model one sequence per pass, or None when ragged batches are exact.
    A batch-1 pass hands the model exactly the keys mlx-lm's own KVCache / ChunkedKVCache would, so
    masks it builds from one sequence's positions (llama4's chunk mask) stay right; batched they would not."""
    if layout.batch_error is not None:
        return f"its forward fails on a batch of sequences at different offsets ({layout.batch_error})"
    masked = [layout.where(leaf.path) for leaf in layout.kv_leaves if "sdpa-masked" in leaf.consumers]
    if masked:
        return f"{', '.join(masked)} attend with a mask the model builds from one sequence's positions"
    return None


def query_heads(layout: ModelLayout) -> int:
    """The query heads of a supported layout's attention (its KV heads when no SDPA call showed them;
    1 for a model of state layers only, which attends nothing)."""
    known = [leaf.q_heads for leaf in layout.kv_leaves if leaf.q_heads is not None]
    return known[0] if known else layout.kv_leaves[0].kv_heads if layout.kv_leaves else 1
