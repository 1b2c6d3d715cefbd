"""Which cache layouts today's page pools can hold (plain Python; read at load, never mid-request).

The pools (kv_cache.py) keep one K/V geometry for every layer, full or sliding-window tables, one
view per entry of the model's cache list, and attention routed through mlx-lm's SDPA. Everything
else is refused at load with the leaf named; each rule here goes when the pools learn that kind.
"""

from __future__ import annotations

from mlxpaged.cache.layout import CacheListNode, KVLeaf, ModelLayout, StateLeaf, UnusedLeaf

# Consumers (layout.CONSUMERS) the routed decode cannot serve: it reads K and V from the pools and
# drops masks, so another V, a model-built mask, another layer's attention or mx.fast would be wrong.
UNROUTABLE = {
    "sdpa-other-v": "its attention reads another V than the one it caches (latent attention)",
    "sdpa-masked": "its attention uses a mask the model builds itself",
    "sdpa-other-cache": "another layer attends its K/V (shared KV)",
    "fast": "it calls mx.fast.scaled_dot_product_attention directly",
}


def unsupported_reasons(layout: ModelLayout) -> list[str]:
    """Why the pools cannot hold `layout`, one sentence per problem (leaves with the same problem
    named together); [] when they can."""
    per_leaf: dict[tuple[str, str], list[str]] = {}  # (leaf description, why) -> where, in leaf order
    for leaf in layout.leaves:
        for why in _leaf_reasons(leaf):
            per_leaf.setdefault((leaf.describe(), why), []).append(layout.where(leaf.path))
    reasons = _structure_reasons(layout)
    reasons += [f"{', '.join(wheres)} ({kind}): {why}" for (kind, why), wheres in per_leaf.items()]
    reasons += _geometry_reasons(layout)
    if not layout.kv_leaves and not reasons:
        reasons.append("the model keeps no key/value cache")
    return reasons


def _leaf_reasons(leaf) -> list[str]:
    if isinstance(leaf, StateLeaf):
        return ["state-space / linear-attention state needs per-sequence state slots"]
    if isinstance(leaf, UnusedLeaf):
        return ["a cache the model never writes has no paged placeholder yet"]
    return _kv_reasons(leaf) if isinstance(leaf, KVLeaf) else []


def _structure_reasons(layout: ModelLayout) -> list[str]:
    reasons = []
    for i, entry in enumerate(layout.structure):
        if isinstance(entry, CacheListNode):
            reasons.append(f"{layout.where((i,))}: a CacheList ({len(entry.entries)} caches in one layer) "
                           "needs pools per cache")
        elif entry is None:
            reasons.append(f"cache entry {i}: the model's cache list holds None (a layer reusing another's K/V)")
    if layout.num_layers is not None and len(layout.structure) != layout.num_layers:
        reasons.append(f"the model's cache list has {len(layout.structure)} entries for {layout.num_layers} "
                       "layers (shared or looped layers); the pools hold one cache per layer")
    return reasons


def _kv_reasons(leaf: KVLeaf) -> list[str]:
    reasons = []
    if leaf.kind == "chunked":
        reasons.append(f"chunked-local attention (chunks of {leaf.span}) has no paged spec yet")
    if leaf.k_dim != leaf.v_dim:
        reasons.append(f"K width {leaf.k_dim} != V width {leaf.v_dim}; the pools store one width")
    if leaf.sinks:
        reasons.append("its attention uses sinks, which the paged attention does not apply yet")
    reasons += [why for word, why in UNROUTABLE.items() if word in leaf.consumers]
    return reasons


def _geometry_reasons(layout: ModelLayout) -> list[str]:
    """The pools have one (kv_heads, head_dim, dtype) and the kernel one query-head count."""
    leaves = layout.kv_leaves
    if not leaves:
        return []
    first = leaves[0]
    reasons = []
    for leaf in leaves[1:]:
        if leaf.geometry != first.geometry:
            reasons.append(f"{layout.where(leaf.path)} caches {leaf.kv_heads} heads x {leaf.k_dim} "
                           f"({leaf.dtype}) but {layout.where(first.path)} {first.kv_heads} x {first.k_dim} "
                           f"({first.dtype}); the pools hold one geometry")
        elif None not in (leaf.q_heads, first.q_heads) and leaf.q_heads != first.q_heads:
            reasons.append(f"{layout.where(leaf.path)} attends with {leaf.q_heads} query heads but "
                           f"{layout.where(first.path)} with {first.q_heads}; the kernel takes one count")
    return reasons


def query_heads(layout: ModelLayout) -> int:
    """The query heads of a supported layout's attention (its KV heads when no SDPA call showed them)."""
    first = layout.kv_leaves[0]
    known = [leaf.q_heads for leaf in layout.kv_leaves if leaf.q_heads is not None]
    return known[0] if known else first.kv_heads
