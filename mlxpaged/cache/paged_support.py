"""Which cache layouts the page pools can hold (plain Python; read at load, never mid-request).

The pools (kv_cache.py) keep every KV leaf in its own geometry (heads, K width, V width, K-is-V),
full or sliding-window tables; views are made per leaf path and put back in the model's own nesting
(runner/cache_tree.py: None entries, CacheLists, unused caches, caches != layers); attention gets the
gathered K/V unless reading the pools is provably the same computation (runner/routing.py), so
latent attention, model-built masks, shared K/V and direct mx.fast calls are exact; a model that fails
or is not exact in a ragged batch runs one sequence per pass (runner/batch_check.py). What is left
is refused at load with the leaf named; each rule here goes when the engine learns that kind.
"""

from __future__ import annotations

from typing import NamedTuple

from mlxpaged.cache.layout import KVLeaf, ModelLayout, StateLeaf


class Reason(NamedTuple):
    """One reason to refuse: `label` in a few words (the README table), `text` a sentence naming the leaves."""

    label: str
    text: str


def unsupported_reasons(layout: ModelLayout) -> list[Reason]:
    """Why the pools cannot hold `layout`, one Reason per problem (leaves with the same problem named
    together); [] when they can."""
    per_leaf: dict[tuple[str, Reason], list[str]] = {}  # (leaf description, why) -> where, in leaf order
    for leaf in layout.leaves:
        for why in _leaf_reasons(leaf):
            per_leaf.setdefault((leaf.describe(), why), []).append(layout.where(leaf.path))
    reasons = [Reason("own cache class", text) for text in layout.refuse]
    reasons += [Reason(why.label, f"{', '.join(wheres)} ({kind}): {why.text}")
                for (kind, why), wheres in per_leaf.items()]
    if not layout.kv_leaves and not reasons:
        reasons.append(Reason("no KV cache", "the model keeps no key/value cache"))
    return reasons


def _leaf_reasons(leaf) -> list[Reason]:
    if isinstance(leaf, StateLeaf):
        return [Reason("state", "state-space / linear-attention state needs per-sequence state slots")]
    if isinstance(leaf, KVLeaf) and leaf.kind == "chunked":
        return [Reason("chunked", f"chunked-local attention (chunks of {leaf.span}) has no paged spec yet")]
    return []


def query_heads(layout: ModelLayout) -> int:
    """The query heads of a supported layout's first attention (its KV heads when no SDPA call showed them)."""
    known = [leaf.q_heads for leaf in layout.kv_leaves if leaf.q_heads is not None]
    return known[0] if known else layout.kv_leaves[0].kv_heads


def attention_geometries(layout: ModelLayout) -> list[tuple[int, int, int, int, bool]]:
    """Each distinct (query heads, KV heads, K width, V width, sinks) the decode attention may read
    from the pools, for the kernel's self-check (query heads default to the KV heads). Query heads that
    are no multiple of the KV heads never reach the pools (routing.pool_inputs), so they are left out."""
    seen = {(leaf.q_heads or leaf.kv_heads, leaf.kv_heads, leaf.k_dim, leaf.v_dim, leaf.sinks)
            for leaf in layout.kv_leaves}
    return sorted(geometry for geometry in seen if geometry[0] % geometry[1] == 0)
