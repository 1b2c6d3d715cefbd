"""What a draft model (`draft_model=`, `--draft-model`) must be, checked at load, never mid-request: the same token
ids as the target, full attention in its layers and the target's (a rejected draft is rolled back by freeing slots,
which sliding-window rings cannot do; the target's state layers roll back in the scheduler, a draft's would not
yet), text only; and what the pair costs the memory plan: both models' weights, and one block id standing for a
page in each model's pools (runner/model_drafter.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.cache.layout import ModelLayout
from mlxpaged.errors import ConfigError
from mlxpaged.platform.model_facts import KVShape, ModelFacts

import mlx.core as mx

DRAFTING_MODELS = ("draft", "dflash", "eagle3")  # the speculative methods whose drafts come from `draft_model=`
CHECKPOINT_DRAFTERS = ("dflash", "eagle3")  # those whose `draft_model=` is a drafter checkpoint, not an mlx-lm model


@dataclass(frozen=True)
class DrafterCheckpoint:
    """A drafter checkpoint to read beside the model (Engine's `draft=` with speculative "dflash" or "eagle3"): not an
    mlx-lm model; engine/hidden_drafters.py reads it once the model's K/V dtype is known."""

    path: Path
    name: str


def drafter_files(path: Path, what: str) -> list[Path]:
    """A drafter checkpoint's safetensors files (`what`: how errors name it)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors in the {what} {path}", param="draft_model")
    return files


def read_drafter_weights(path: Path, what: str, used: Callable[[str], bool]) -> dict[str, mx.array]:
    """A drafter checkpoint's tensors it `used` (by stored name), named without a leading "model."; lazy."""
    weights: dict[str, mx.array] = {}
    for file in drafter_files(path, what):
        arrays = mx.load(str(file))
        assert isinstance(arrays, dict)  # a .safetensors file
        weights.update({k.removeprefix("model."): v for k, v in arrays.items() if used(k)})
    return weights


def drafter_facts(
    path: Path, what: str, used: Callable[[str], bool], shape: KVShape, target: ModelFacts, backend: str
) -> ModelFacts:
    """What a drafter checkpoint costs the memory plan beside the model (`with_draft` adds it): the weights it uses
    (from the safetensors headers, as loaded on `backend`) and per token the K/V `shape` of its layers."""
    from mlxpaged.loading.checkpoint import as_loaded, read_safetensors_header

    tensors = [t for file in drafter_files(path, what) for t in read_safetensors_header(file) if used(t.name)]
    weights = sum(t.nbytes for t in as_loaded(tensors, backend))
    return dataclasses.replace(target, kv=shape, weight_bytes=weights, state_bytes_per_sequence=0)


def check_draft_setting(speculative: str | None, has_draft: bool) -> None:
    """A draft model and `speculative="draft"` (or "dflash": a DFlash drafter) come together."""
    if not has_draft and speculative in DRAFTING_MODELS:
        raise ConfigError(
            f"{{speculative:{speculative!r}}} needs a draft model (draft_model=, --draft-model)", param="draft_model"
        )
    if has_draft and speculative not in DRAFTING_MODELS:
        raise ConfigError(
            f"a draft model drafts with {{speculative:'draft'}}, not {{speculative:{speculative!r}}}",
            param="speculative",
        )


def check_draft_layout(layout: ModelLayout, role: str, name: str) -> None:
    """Refuse a target or draft (`role`) whose layers a rejected draft could not be rolled back in: sliding-window
    rings in either; state layers in the draft (the model's own roll back: scheduler.update_from_output)."""
    reason = None
    if layout.state_leaves and role != "model":
        reason = "state-space or linear-attention layers (a draft model's state is not rolled back yet)"
    elif any(kind is not None for kind in layout.layer_kinds):
        reason = "sliding-window or chunked attention layers, whose rings reuse their slots"
    elif not layout.kv_leaves:
        reason = "no key/value cache (its pages would share no block ids with the other's)"
    if reason is not None:
        raise ConfigError(
            "a draft model needs full attention in its layers and the model's (the model may also have state "
            f"layers); the {role} {name!r} has {reason}",
            param="draft_model",
        )


def check_draft_tokenizer(target_tokenizer, draft_tokenizer, target: str, draft: str) -> None:
    """The draft must propose the target's token ids: the same vocabulary, token for token."""
    mine, theirs = _vocab(target_tokenizer), _vocab(draft_tokenizer)
    if mine == theirs:
        return
    differ = sum(1 for token, i in theirs.items() if mine.get(token) != i) + sum(1 for t in mine if t not in theirs)
    raise ConfigError(
        f"the draft model {draft!r} has another tokenizer than {target!r} ({len(theirs):,} vs {len(mine):,} tokens, "
        f"{differ:,} differ): a draft model must share the target's token ids (pick one of the same family)",
        param="draft_model",
    )


def _vocab(tokenizer) -> dict[str, int]:
    return dict(tokenizer.get_vocab())  # mlx-lm's TokenizerWrapper passes it to the Hugging Face tokenizer


def draft_facts_before_load(
    facts: ModelFacts, layout: ModelLayout, name: str, draft_dir: Path, draft: str
) -> ModelFacts:
    """The model's `facts` and `layout` (checkpoint.read_before_load) with the draft model in `draft_dir`, as the
    memory plan counts the pair, before either is loaded; ConfigError for a pair that cannot draft by its layers."""
    from mlxpaged.loading.checkpoint import read_before_load
    from mlxpaged.platform import backend

    check_draft_layout(layout, "model", name)
    draft_facts, draft_layout = read_before_load(draft_dir, backend.current())
    check_draft_layout(draft_layout, "draft model", draft)
    return with_draft(facts, draft_facts)


def pair_facts_before_load(
    method: str | None, facts: ModelFacts, layout: ModelLayout, name: str, draft_dir: Path, draft: str
) -> ModelFacts:
    """The model and its `draft_model=` as the memory plan counts the pair before either is read: a draft model, or
    with `method` "dflash" / "eagle3" a drafter checkpoint (loading/dflash_model.py, loading/eagle3_model.py)."""
    if method == "dflash":
        from mlxpaged.loading.dflash_model import dflash_facts_before_load

        return dflash_facts_before_load(facts, layout, name, draft_dir, draft)
    if method == "eagle3":
        from mlxpaged.loading.eagle3_model import eagle3_facts_before_load

        return eagle3_facts_before_load(facts, layout, name, draft_dir, draft)
    return draft_facts_before_load(facts, layout, name, draft_dir, draft)


def with_draft(target: ModelFacts, draft: ModelFacts) -> ModelFacts:
    """The pair as one model to the memory plan: both weights, and per token the K/V of both models' layers (the
    draft's pages are stored in the target's dtype: build.py casts a draft of another dtype)."""
    a, b = target.kv, draft.kv
    if a.sliding_windows is not None or b.sliding_windows is not None:  # check_draft_layout refused these
        raise ValueError("a draft model pair plans full-attention layers only")
    kv = KVShape(
        a.num_layers + b.num_layers,
        a.num_kv_heads,
        a.head_dim,
        a.dtype_bytes,
        geometries=a.layer_geometries + b.layer_geometries,
    )
    return dataclasses.replace(target, kv=kv, weight_bytes=target.weight_bytes + draft.weight_bytes)
