"""Building the drafters that read the model's hidden states (engine/build.py calls this): the checkpoint's MTP layers
(`speculative="mtp"`), a DFlash drafter and an EAGLE-3 head (`speculative="dflash"` / `"eagle3"` with
`draft_model=`). Each is read and checked before the memory plan (it counts their weights and pages), and attached
once the model's core exists: the model's runner then keeps the hidden states they read, and they get pools of their
own with the model's block count (one block id stands for a page in each), of their own layers' widths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.specs import KVGeometry
from mlxpaged.config import CacheConfig
from mlxpaged.errors import ConfigError
from mlxpaged.loading.dflash_model import (
    DFlashConfig,
    DFlashModel,
    check_dflash_target,
    dflash_facts,
    load_dflash,
)
from mlxpaged.loading.draft_model import DrafterCheckpoint, check_draft_layout, with_draft
from mlxpaged.loading.eagle3_model import Eagle3Config, Eagle3Head, check_eagle3_target, eagle3_facts, load_eagle3
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.mimo_mtp_head import MimoMtpHead
from mlxpaged.loading.mtp_head import MtpHead, find_mtp, load_mtp_head, mtp_facts
from mlxpaged.loading.nemotron_mtp_head import NemotronMtpHead
from mlxpaged.loading.nextn_head import NextnHead
from mlxpaged.platform import backend
from mlxpaged.platform.model_facts import ModelFacts, model_weight_bytes
from mlxpaged.runner.chained_drafter import ChainedDrafter
from mlxpaged.runner.dflash_drafter import DFlashDrafter
from mlxpaged.runner.model_runner import Runner

import mlx.core as mx

HiddenDrafter = ChainedDrafter | DFlashDrafter
HIDDEN_STATE_METHODS = ("mtp", "dflash", "eagle3")  # the speculative methods whose drafters are built here


@dataclass(frozen=True)
class PreparedDrafter:
    """A drafter read and checked, not attached yet: `facts` is the model's with it, as the plan counts the pair."""

    facts: ModelFacts
    attach: Callable[[Runner, CacheConfig, mx.Dtype, int], HiddenDrafter]  # (model's runner, cache, K/V dtype, vocab)


def prepare(
    method: str, loaded: LoadedModel, layout: ModelLayout, kv_dtype: mx.Dtype, facts: ModelFacts, draft
) -> PreparedDrafter:
    """`method` "mtp" (the checkpoint's MTP layers), "dflash" or "eagle3" (`draft`: a DrafterCheckpoint). ConfigError,
    saying why, for what cannot draft for this model (no MTP layers, a drafter made for another model, layers whose
    rejected drafts cannot be rolled back)."""
    check_draft_layout(layout, "model", loaded.name)  # its pages share the model's block ids, as a draft's do
    if method == "mtp":
        return _prepare_mtp(loaded, kv_dtype, facts)
    if not isinstance(draft, DrafterCheckpoint):
        raise ConfigError(
            f"{{speculative:{method!r}}} needs a drafter checkpoint as its draft model", param="draft_model"
        )
    if method == "eagle3":
        return _prepare_eagle3(loaded, layout, kv_dtype, facts, draft)
    return _prepare_dflash(loaded, layout, kv_dtype, facts, draft)


def _prepare_mtp(loaded: LoadedModel, kv_dtype: mx.Dtype, facts: ModelFacts) -> PreparedDrafter:
    checkpoint = find_mtp(loaded.path, loaded.name)
    head = load_mtp_head(checkpoint, kv_dtype)
    with_head = with_draft(facts, mtp_facts(checkpoint, facts, model_weight_bytes(head)))
    return PreparedDrafter(with_head, lambda *built: mtp_drafter(head, loaded.name, *built))


def _prepare_dflash(
    loaded: LoadedModel, layout: ModelLayout, kv_dtype: mx.Dtype, facts: ModelFacts, draft: DrafterCheckpoint
) -> PreparedDrafter:
    config = DFlashConfig.read(draft.path, draft.name)
    check_dflash_target(config, draft.name, facts.hidden_size, len(loaded.model.layers), layout.vocab_size)
    model = load_dflash(draft.path, draft.name, kv_dtype)
    drafter_facts = dataclasses.replace(
        dflash_facts(config, draft.path, facts, backend.current()), weight_bytes=model_weight_bytes(model)
    )
    return PreparedDrafter(with_draft(facts, drafter_facts), lambda *built: dflash_drafter(model, draft.name, *built))


def _prepare_eagle3(
    loaded: LoadedModel, layout: ModelLayout, kv_dtype: mx.Dtype, facts: ModelFacts, draft: DrafterCheckpoint
) -> PreparedDrafter:
    config = Eagle3Config.read(draft.path, draft.name)
    check_eagle3_target(config, draft.name, facts.hidden_size, len(loaded.model.layers), layout.vocab_size)
    head = load_eagle3(draft.path, draft.name, kv_dtype)
    head_facts = dataclasses.replace(
        eagle3_facts(config, draft.path, facts, backend.current()), weight_bytes=model_weight_bytes(head)
    )
    return PreparedDrafter(with_draft(facts, head_facts), lambda *built: eagle3_drafter(head, draft.name, *built))


def eagle3_drafter(
    head: Eagle3Head, name: str, runner: Runner, config: CacheConfig, dtype: mx.Dtype, vocab_size: int
) -> ChainedDrafter:
    """The EAGLE-3 head's drafter on `runner`'s model (which keeps the outputs of the layers it reads from now on)."""
    kv = _own_pools(runner, head.config, config, dtype)
    _capture(runner, name, head.config.layer_ids)
    return ChainedDrafter(head, kv, runner, name, vocab_size)


def mtp_drafter(
    head: MtpHead | NextnHead | NemotronMtpHead | MimoMtpHead,
    name: str,
    runner: Runner,
    config: CacheConfig,
    dtype: mx.Dtype,
    vocab_size: int,
) -> ChainedDrafter:
    """The MTP layers' drafter on `runner`'s model (which keeps its hidden states from now on), with pools of the
    model's attention width."""
    kv = _pools(runner, head.paged_layers, runner.kv.geometries[-1], config, dtype)
    _capture(runner, name, ())
    return ChainedDrafter(head, kv, runner, name, vocab_size)


def dflash_drafter(
    model: DFlashModel, name: str, runner: Runner, config: CacheConfig, dtype: mx.Dtype, vocab_size: int
) -> DFlashDrafter:
    """The DFlash drafter on `runner`'s model (which keeps the outputs of the layers it reads from now on)."""
    kv = _own_pools(runner, model.config, config, dtype)
    _capture(runner, name, model.config.target_layer_ids)
    return DFlashDrafter(model, kv, runner, name, vocab_size)


def _own_pools(
    runner: Runner, drafter: DFlashConfig | Eagle3Config, config: CacheConfig, dtype: mx.Dtype
) -> PagedKVCache:
    """Pools for a drafter checkpoint's layers, of its own attention's width."""
    geometry = KVGeometry(drafter.num_key_value_heads, drafter.head_dim, drafter.head_dim)
    return _pools(runner, drafter.num_hidden_layers, geometry, config, dtype)


def _pools(runner: Runner, layers: int, geometry: KVGeometry, config: CacheConfig, dtype: mx.Dtype) -> PagedKVCache:
    """Pools for `layers` full-attention layers of `geometry`, with the model's block count."""
    spaces = runner.kv.space_blocks
    if len(spaces) != 1:
        raise ConfigError("a drafter's pages need a model whose pages keep one block space", param="speculative")
    geometries = (geometry,) * layers
    return PagedKVCache(
        layers, spaces, config.block_size, None, None, dtype, geometries=geometries, quantization=config.quantization
    )


def _capture(runner: Runner, name: str, layers: tuple[int, ...]) -> None:
    try:
        runner.capture_hidden(layers)
    except ValueError as exc:
        raise ConfigError(f"drafting from {name!r}'s hidden states cannot run: {exc}", param="speculative") from exc
