"""Which cache layouts the page pools can hold (plain Python; read at load, never mid-request).

The pools (kv_cache.py) keep every KV leaf in its own geometry (heads, K width, V width, K-is-V),
full, sliding-window or chunked-local tables; views are made per leaf path and put back in the model's own nesting
(runner/cache_tree.py: None entries, CacheLists, unused caches, caches != layers); attention gets the
gathered K/V unless reading the pools is provably the same computation (runner/routing.py), so
latent attention, model-built masks, shared K/V and direct mx.fast calls are exact; a model that fails
or is not exact in a ragged batch runs one sequence per pass (runner/batch_check.py). What is left
is refused at load with the leaf named; each rule here goes when the engine learns that kind.
"""

from __future__ import annotations

from typing import NamedTuple

from mlxpaged.cache.layout import KVLeaf, ModelLayout


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
    reasons += [
        Reason(why.label, f"{', '.join(wheres)} ({kind}): {why.text}") for (kind, why), wheres in per_leaf.items()
    ]
    if layout.keeps_no_cache and not reasons:
        reasons.append(Reason("no KV cache", "the model keeps no key/value cache"))
    return reasons


def _leaf_reasons(leaf) -> list[Reason]:
    if isinstance(leaf, KVLeaf) and leaf.kind == "window" and "sdpa-masked" in leaf.consumers:
        return [
            Reason(
                "model-built mask",
                "its attention uses a mask the model builds itself for "
                "mlx-lm's rotating cache, whose key order the pages do not keep",
            )
        ]
    return []


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
    if layout.state_only:
        return 1
    known = [leaf.q_heads for leaf in layout.kv_leaves if leaf.q_heads is not None]
    return known[0] if known else layout.kv_leaves[0].kv_heads


def attention_geometries(layout: ModelLayout) -> list[tuple[int, int, int, int, bool]]:
    """Each distinct (query heads, KV heads, K width, V width, sinks) the decode attention may read
    from the pools, for the kernel's self-check (query heads default to the KV heads). Query heads that
    are no multiple of the KV heads never reach the pools (routing.pool_inputs), so they are left out."""
    seen = {
        (leaf.q_heads or leaf.kv_heads, leaf.kv_heads, leaf.k_dim, leaf.v_dim, leaf.sinks) for leaf in layout.kv_leaves
    }
    return sorted(geometry for geometry in seen if geometry[0] % geometry[1] == 0)
