"""Building an engine's core, once, on the caller's thread: the model's cache layout (refused here, never
mid-request), the memory plan, the page pools, attention routing and the kernel's self-check, the ragged-batch
check, and the EngineCore over them. `Engine` (engine.py) runs what this builds: its thread, command queue
and public API.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from mlxpaged.adapters.adapter_set import AdapterSet, AdapterSource
from mlxpaged.cache.disk_fingerprint import model_fingerprint, weights_identity
from mlxpaged.cache.disk_tier import DiskTier
from mlxpaged.cache.disk_writer import DiskWriter
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.layout import ModelLayout
from mlxpaged.cache.paged_support import attention_geometries, serial_reason
from mlxpaged.cache.state_cache import StateCache
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.distributed.leader import PlanSender
from mlxpaged.distributed.memory import agreed_plan, host_share
from mlxpaged.distributed.ranks import Ranks
from mlxpaged.engine import hidden_drafters
from mlxpaged.engine.core import EngineCore
from mlxpaged.engine.hidden_drafters import HIDDEN_STATE_METHODS, HiddenDrafter
from mlxpaged.engine.kv_tiering import KVTiering
from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.engine.state_tiering import StateTiering
from mlxpaged.errors import ConfigError
from mlxpaged.kernels.attention import PreparedAttention, prepare_model_attention
from mlxpaged.loading.draft_model import (
    DrafterCheckpoint,
    check_draft_layout,
    check_draft_setting,
    check_draft_tokenizer,
    with_draft,
)
from mlxpaged.loading.fused_projections import fuse_projections
from mlxpaged.loading.loader import LoadedModel, activation_dtype, check_paged_support
from mlxpaged.loading.probe import probe_layout
from mlxpaged.platform import backend
from mlxpaged.platform.memory import DeviceFacts, MemoryPlan, ModelFacts, plan_memory
from mlxpaged.platform.model_facts import context_length
from mlxpaged.runner.activation_routing import route_for_backend
from mlxpaged.runner.batch_check import batch_mismatch
from mlxpaged.runner.kv_calibration import transform_for
from mlxpaged.runner.model_drafter import ModelDrafter
from mlxpaged.runner.model_runner import Runner
from mlxpaged.runner.routing import route_paged_attention
from mlxpaged.vision.loading import tower_before_load

import mlx.core as mx
import mlx.nn as nn


@dataclass(frozen=True)
class BuiltCore:
    """Everything an engine runs on, built before its thread starts."""

    layout: ModelLayout  # what the model's own caches hold, leaf by leaf
    facts: ModelFacts
    plan: MemoryPlan
    kv: PagedKVCache
    attention: PreparedAttention  # this model's decode attention: its status is the engine's
    max_model_len: int
    serial_reason: str | None  # why one sequence runs per pass (None: ragged batches are exact)
    core: EngineCore
    disk_tier_off: str | None = None  # why the disk tier asked for is off (None: on, or not asked for)
    adapters: AdapterSet | None = None  # the LoRA / DoRA adapters requests may name (adapters/); None across ranks
    draft: ModelDrafter | None = None  # the draft model's runner and pools (`draft_model=`), or None
    # The drafter reading the model's hidden states (speculative "mtp": its MTP layers; "dflash", "eagle3"), or None.
    hidden_drafter: HiddenDrafter | None = None


def build_core(
    loaded: LoadedModel,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    *,
    stats: StatsCounter,
    has_commands: Callable[[], bool],
    ranks: Ranks | None = None,
    adapters: Mapping[str, AdapterSource] | None = None,
    draft: LoadedModel | DrafterCheckpoint | None = None,
) -> BuiltCore:
    """Plan, allocate and check everything for `loaded`; raises (InsufficientMemoryError, an unsupported
    layout) before any request is taken. `has_commands`: whether callers queued anything (the core pipelines
    only when nothing did). `ranks`: the processes this (sharded) model runs over, every one building the same
    core; rank 0's runner sends its passes to the others (distributed/). `adapters`: name -> adapter directory (or
    its files, read already), attached to the model's layers here, before anything else wraps or fuses them. `draft`:
    a draft model for speculative decoding (scheduler_config.speculative "draft"), or a drafter checkpoint to read
    ("dflash", "eagle3"), planned and given pools here."""
    check_draft_setting(scheduler_config.speculative, draft is not None)
    if draft is not None and ranks is not None:
        raise ConfigError("a draft model across mlx.launch ranks is not supported yet", param="draft_model")
    if scheduler_config.speculative in HIDDEN_STATE_METHODS and ranks is not None:
        raise ConfigError(
            "MTP, DFlash or EAGLE-3 drafting across mlx.launch ranks is not supported yet", param="speculative"
        )
    if adapters and ranks is not None:
        raise ConfigError("adapters across mlx.launch ranks are not supported yet", param="adapters")
    # Adapters may be added later too (Engine.add_adapter), not across ranks; AdapterError before anything is planned.
    adapter_set = AdapterSet(loaded.model, adapters, loaded.names, loaded.path) if ranks is None else None
    if backend.tuning().fused_projections:
        fuse_projections(loaded.model)  # before the probe and every pass: the layout is the same either way
    layout = probe_layout(loaded.model)
    check_paged_support(layout)
    if ranks is not None:
        _check_distributed(layout, cache_config)
    route_paged_attention()
    route_for_backend()
    kv_dtype = activation_dtype(loaded.model)  # K/V have the activations' dtype
    weight_bytes = loaded.weight_bytes + (adapter_set.nbytes if adapter_set is not None else 0)
    facts = ModelFacts.from_layout(
        layout, weight_bytes, kv_dtype.size, context_length(loaded.config), loaded.vision is not None
    )
    if loaded.vision is not None and loaded.vision.processor is not None:  # its tower's activations per image size
        pixels = cache_config.image_memory_pixels
        rungs = tower_before_load(loaded.path, kv_dtype.size, backend.current(), pixels)
        facts = dataclasses.replace(facts, tower_rungs=rungs)
    draft_layout = None
    if isinstance(draft, LoadedModel):
        draft_layout = _prepare_draft(loaded, layout, draft, kv_dtype)
        facts = with_draft(facts, ModelFacts.from_layout(draft_layout, draft.weight_bytes, kv_dtype.size))
    reader = None  # a drafter reading the model's hidden states (MTP, DFlash, EAGLE-3), counted in the plan
    if scheduler_config.speculative in HIDDEN_STATE_METHODS:
        reader = hidden_drafters.prepare(scheduler_config.speculative, loaded, layout, kv_dtype, facts, draft)
        facts = reader.facts
    device = DeviceFacts.detect()
    if ranks is not None:  # ranks on one host share its memory
        device = host_share(device, ranks.on_host)
    plan = plan_memory(device, facts, cache_config, scheduler_config, weights_resident=True)
    if ranks is not None:  # each rank planned its own memory; the block ids are shared, so are the pool sizes
        if len(plan.space_blocks) > 1:
            raise ConfigError(
                f"this model's layer kinds keep {len(plan.space_blocks)} block spaces (specs.block_spaces); "
                "across mlx.launch ranks only models with one are built so far"
            )
        plan = agreed_plan(plan, facts, ranks.agree_min(plan.num_blocks), ranks.size)
    # 4-bit pages hold K/V in calibrated coordinates (cache/kv_transform.py): a short prefill, before the pools.
    transform = transform_for(loaded.model, layout, loaded.tokenizer, kv_dtype, cache_config.quantization)
    kv = PagedKVCache.for_layout(  # blocks per block space (specs.block_spaces), as the plan sized them
        layout, plan.space_blocks, cache_config.block_size, kv_dtype, cache_config.quantization, transform
    )
    # Before the first decode: a Metal kernel variant that fails its self-check is replaced by the reference.
    attention = prepare_model_attention(
        kv_dtype, cache_config.block_size, attention_geometries(layout), cache_config.quantization
    )
    max_model_len = scheduler_config.max_model_len or facts.context_length or plan.token_capacity
    if max_model_len is None:  # no stated context, and a cache of rings holds any length
        raise ConfigError(
            "the model states no context length and its cache holds any length: set {max_model_len}",
            param="max_model_len",
        )
    # Not exact in a ragged batch (or cannot take one): one sequence per pass, decided here, not mid-request.
    serial = layout_serial_reason(layout, loaded.model, kv_dtype, cache_config.block_size)
    drafter = None
    if isinstance(draft, LoadedModel) and draft_layout is not None:
        drafter = _build_drafter(draft, draft_layout, plan, cache_config, kv_dtype, layout.vocab_size)
    if loaded.vision is not None and loaded.vision.prompt_both_ways:
        # Every prompt token's keys and values depend on the whole prompt (PaliGemma): a cached prefix of another
        # prompt is not this one's.
        cache_config = dataclasses.replace(cache_config, enable_prefix_cache=False)
    core = EngineCore.create(
        loaded.model,
        loaded.tokenizer,
        kv,
        cache_config,
        scheduler_config,
        max_model_len=max_model_len,
        extra_key=str(loaded.path),
        stats=stats,
        serial=serial is not None,
        layout=layout,
        num_checkpoints=plan.num_checkpoints,
        buffer_budget=plan.spare_bytes,
        has_commands=has_commands,
        model_drafter=drafter,
    )
    hidden_drafter = None
    if reader is not None:
        hidden_drafter = reader.attach(core.runner, cache_config, kv_dtype, layout.vocab_size)
        assert core.speculator is not None  # speculative "mtp", "dflash" or "eagle3" is set
        core.speculator.model = hidden_drafter
    evaluate_model_arrays(loaded.model)  # after every forward on this thread (probe, split_head)
    if loaded.vision is not None:  # the vision tower and projector run on the engine thread too
        evaluate_model_arrays(loaded.vision.model)
    if isinstance(draft, LoadedModel):
        evaluate_model_arrays(draft.model)
    if ranks is not None:
        core.all_ranks_ok = ranks.all_true  # the compiled pass's warm-up: every rank falls back, or none
    if ranks is not None and ranks.leads:
        core.runner.mirror = PlanSender(PlanChannel(ranks))
    if adapter_set is not None:
        core.runner.adapter_rows, core.adapters = adapter_set.rows, adapter_set
    disk_off = attach_disk_tier(core, loaded, layout, cache_config) if cache_config.kv_disk_dir else None
    return BuiltCore(
        layout, facts, plan, kv, attention, max_model_len, serial, core, disk_off, adapter_set, drafter, hidden_drafter
    )


def _prepare_draft(target: LoadedModel, layout: ModelLayout, draft: LoadedModel, kv_dtype: mx.Dtype) -> ModelLayout:
    """Check the pair (loading/draft_model.py) and give the draft the target's K/V dtype; the draft's layout."""
    if target.vision is not None:
        raise ConfigError("a draft model with a vision-language model is not supported yet", param="draft_model")
    check_draft_layout(layout, "model", target.name)
    check_draft_tokenizer(target.tokenizer, draft.tokenizer, target.name, draft.name)
    if backend.tuning().fused_projections:
        fuse_projections(draft.model)
    if activation_dtype(draft.model) != kv_dtype:  # its pages share the plan's per-token bytes (with_draft)
        draft.model.set_dtype(kv_dtype)
    draft_layout = probe_layout(draft.model)
    check_paged_support(draft_layout)
    check_draft_layout(draft_layout, "draft model", draft.name)
    return draft_layout


def _build_drafter(
    draft: LoadedModel,
    layout: ModelLayout,
    plan: MemoryPlan,
    config: CacheConfig,
    kv_dtype: mx.Dtype,
    vocab_size: int,
) -> ModelDrafter:
    """The draft's pools (as many blocks as the target's: one block id, a page in each) and its runner."""
    transform = transform_for(draft.model, layout, draft.tokenizer, kv_dtype, config.quantization)
    kv = PagedKVCache.for_layout(layout, plan.space_blocks, config.block_size, kv_dtype, config.quantization, transform)
    # A draft not exact in a ragged batch only drafts worse; one that fails in one must not fail mid-request.
    serial = layout_serial_reason(layout, draft.model, kv_dtype, config.block_size)
    return ModelDrafter(Runner(draft.model, kv, layout, serial=serial is not None), draft.name, vocab_size)


def _check_distributed(layout: ModelLayout, config: CacheConfig) -> None:
    """Refuse, at load, what the followers cannot mirror yet (rank 0 alone would change its pools)."""
    if layout.state_leaves:
        raise ConfigError(
            "a model with state-space / linear-attention layers cannot run over several processes yet",
            param="model",
        )
    if config.kv_disk_dir:
        raise ConfigError("the KV disk tier cannot be used over several processes yet", param="kv_disk")


def disk_tier_reason(core: EngineCore, layout: ModelLayout) -> str | None:
    """Why this model's prefix cache cannot have a disk tier (None: it can)."""
    manager = core.scheduler.kv_manager
    state = core.scheduler.state
    if layout.state_leaves and (state is None or not state.checkpoints_enabled):
        return "its state-space / linear-attention layers have no state checkpoints to resume from"
    if not manager.enable_prefix_cache:
        return (
            "its prefix cache is off (sliding-window layers, a prompt attended both ways, or enable_prefix_cache=False)"
        )
    return None


def attach_disk_tier(core: EngineCore, loaded: LoadedModel, layout: ModelLayout, config: CacheConfig) -> str | None:
    """Give the core's prefix cache a disk tier (cache/disk_tier.py) keyed by this model's fingerprint; the
    reason it stays off (warned), or None."""
    reason = disk_tier_reason(core, layout)
    if reason is not None:
        warnings.warn(f"the KV disk tier is off for this model: {reason}", RuntimeWarning, stacklevel=3)
        return reason
    kv = core.runner.kv
    fingerprint = model_fingerprint(
        weights_identity(loaded.path),
        kv_dtype=str(kv.dtype),
        kv_bits=getattr(config, "kv_bits", None),
        kv_transform=None if kv.transform is None else kv.transform.digest(),  # what the pages' numbers mean
        block_size=kv.block_size,
        layer_kinds=tuple(repr(k) for k in kv.layer_windows),
        geometries=tuple(repr(g) for g in kv.geometries),
        pools=tuple((tuple(p.shape[1:]), str(p.dtype)) for p in kv.pools),
        model_type=layout.model_type,
        backend=backend.current(),
        # State layers' shapes and dtypes (checkpoints on disk); absent without them, so other models keep theirs.
        **({"state_leaves": tuple(repr(leaf) for leaf in layout.state_leaves)} if layout.state_leaves else {}),
        # Quantized pages' group size (a pool's logical shape is the same for 32 and 64); absent at full precision.
        **({"kv_group_size": kv.quantization.group_size} if kv.quantization is not None else {}),
    )
    directory = config.kv_disk_dir
    assert directory is not None  # the caller checked
    size = config.kv_disk_size
    assert isinstance(size, int)  # parsed when the config was made
    tier = DiskTier(directory, fingerprint, size)
    # Snapshots waiting for the writer: at most a quarter of the KV pool, so a slow disk costs bounded memory.
    writer = DiskWriter(tier, max(kv.bytes_per_block, kv.nbytes // 4))
    tiering = KVTiering(tier, writer, kv, core.scheduler.kv_manager.pool, core.runner)
    if layout.state_leaves:
        tiering.states = attach_state_tier(core, layout, directory, fingerprint, size, kv.nbytes // 4)
    core.attach_disk_tier(tiering)
    return None


def attach_state_tier(
    core: EngineCore, layout: ModelLayout, directory, fingerprint: str, size: int, queue_bytes: int
) -> StateTiering:
    """State checkpoints on disk beside the blocks (engine/state_tiering.py): the state cache offers them and
    reads them back. Its writer's queue holds at least two checkpoints, however small the KV pool."""
    state = core.scheduler.state
    assert isinstance(state, StateCache)  # disk_tier_reason checked it has checkpoints
    one = sum(leaf.bytes_per_sequence() for leaf in layout.state_leaves)
    tier = DiskTier(directory, fingerprint, size, kind="state")
    states = StateTiering(tier, DiskWriter(tier, max(2 * one, queue_bytes)), layout.state_leaves)  # the store's order
    state.lower = states
    return states


def layout_serial_reason(layout: ModelLayout, model, dtype: mx.Dtype, block_size: int) -> str | None:
    """Why the model must run one sequence per pass (warned once), or None when ragged batches are exact."""
    reason = serial_reason(layout)  # what the layout shows: a failing batched forward, a model-built mask
    try:
        # State models never share a prefill pass (runner.state_model_passes), so the check's ragged
        # prefill pass is not theirs; their batched decode is compared with mlx-lm in the tests.
        if reason is None and not layout.state_leaves:
            reason = batch_mismatch(model, layout, dtype, block_size)
    except Exception as exc:  # a ragged batch the probe's batched forward did not catch failing
        reason = f"{type(exc).__name__}: {str(exc)[:200]}"
    if reason is not None:
        warnings.warn(
            f"model type {layout.model_type!r} is not exact in a batch of sequences ({reason}): it runs "
            "one sequence per pass (correct, slower)",
            RuntimeWarning,
            stacklevel=4,
        )
    return reason


def evaluate_model_arrays(model) -> None:
    """Evaluate what this thread left lazy in the model: gemma3n reassigns its altup weights (`weight =
    mx.clip(weight, ...)`) in every forward and keeps `_std_multiplier` outside its parameters; Pixtral's vision
    tower keeps its rotary table in a plain object (`PixtralRotaryEmbedding.inv_freq`), built lazily when the
    model is. First evaluated on the engine thread they fail ("no Stream(cpu, 0) in current thread")."""
    private = [
        value
        for module in model.modules()
        for key, value in module.items()
        if key.startswith("_") and isinstance(value, mx.array)
    ]
    held = [
        value
        for module in model.modules()
        for kept in vars(module).values()
        if not isinstance(kept, nn.Module | mx.array) and hasattr(kept, "__dict__")
        for value in vars(kept).values()
        if isinstance(value, mx.array)
    ]
    mx.eval(model.parameters(), private, held)
