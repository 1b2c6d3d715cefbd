"""The blocking half of loading and unloading a model, run in a worker thread (never on the event loop):
what a model will cost before any weight is read, building its Engine (or its Embedder, for an entry of kind
"embed"), and giving its memory back.

The cost is the memory plan's own (platform/memory.py): weights from the safetensors headers, the KV cache and
state slots as the plan sizes them for this machine, the step's activations. An embedding model's is the
embedding package's own check (embedding/memory.py: weights and one pass's activations; no KV cache is kept). So
a model that cannot fit is refused before loading anything, never loaded into swap.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass

from mlxpaged.config import split_settings
from mlxpaged.loading.generation_defaults import GenerationDefaults
from mlxpaged.platform.malloc import return_freed_memory
from mlxpaged_app.server.model_catalog import CatalogEntry
from mlxpaged_app.server.served_model import ModelCost, embedder_cost, engine_cost


@dataclass(frozen=True)
class EngineSettings:
    """What every model the server loads is built with: the cache / scheduler flags and --generation-config."""

    cache: dict  # CacheConfig and SchedulerConfig fields (flags.cache_settings)
    generation_config: str = "auto"  # "auto": each model's own generation_config.json; "none": API defaults
    warm_up: bool = True
    parallel: str | None = None  # under mlx.launch: "pipeline" (--pipeline) or None (tensor where the model shards)
    rank_timeout_s: float | None = None  # under mlx.launch: rank 0's bound on one step across the ranks


def estimate_cost(entry: CatalogEntry, settings: EngineSettings) -> ModelCost:
    """The memory `entry` will hold once loaded; InsufficientMemoryError if the device cannot hold it at all."""
    from mlxpaged.loading.checkpoint import read_before_load
    from mlxpaged.platform import backend
    from mlxpaged.platform.memory import DeviceFacts, activation_bytes, plan_memory

    if entry.kind == "embed":
        return _embedder_estimate(entry, settings)
    cache, scheduler = split_settings(_engine_settings(entry, settings))
    facts, layout = read_before_load(entry.path, backend.current(), cache.image_memory_pixels)
    if entry.draft is not None:  # the pair is planned as one (loading/draft_model.py, loading/dflash_model.py)
        from mlxpaged.loading.draft_model import pair_facts_before_load

        draft_ref, draft_dir = entry.draft
        facts = pair_facts_before_load(scheduler.speculative, facts, layout, entry.name, draft_dir, draft_ref.name)
    if scheduler.speculative == "mtp":  # the checkpoint's MTP layers' pages (loading/mtp_head.py)
        from mlxpaged.loading.mtp_head import mtp_facts_before_load

        facts = mtp_facts_before_load(facts, entry.path, entry.name)
    if entry.adapters:  # read (and refused, if broken) before the model; they count as weights
        from mlxpaged.adapters.adapter_set import read_adapters

        adapters = read_adapters(dict(entry.adapters))
        facts = dataclasses.replace(facts, weight_bytes=facts.weight_bytes + sum(a.nbytes for a in adapters.values()))
    plan = plan_memory(DeviceFacts.detect(), facts, cache, scheduler)
    activations = activation_bytes(facts, scheduler.max_batch_tokens) + plan.tower_bytes
    return ModelCost(facts.weight_bytes, plan.kv_bytes, plan.state_bytes, activations)


def _with_default_cache(cache: dict) -> dict:
    from mlxpaged.config import DEFAULT_CACHE_TOKENS

    return {"cache_tokens": DEFAULT_CACHE_TOKENS, **cache}  # as Engine.from_pretrained defaults it


def _engine_settings(entry: CatalogEntry, settings: EngineSettings) -> dict:
    """The cache and scheduler settings of `entry`'s engine: a model with a draft model (--draft-model) drafts with it
    (a DFlash drafter with --speculative dflash, an EAGLE-3 head with --speculative eagle3)."""
    cache = _with_default_cache(settings.cache)
    if entry.draft is not None and cache.get("speculative") not in ("dflash", "eagle3"):
        return {**cache, "speculative": "draft"}
    return cache


def _embedder_estimate(entry: CatalogEntry, settings: EngineSettings) -> ModelCost:
    from mlxpaged.embedding.memory import check_fits, embedding_costs
    from mlxpaged.embedding.model_files import embedding_spec
    from mlxpaged.platform import backend
    from mlxpaged.platform.memory import DeviceFacts

    embedding_spec(entry.path, _preset_options(entry))  # a pipeline it cannot run is refused before loading
    check_fits(entry.path, backend.current(), _batch_tokens(settings), DeviceFacts.detect())
    weights, activations = embedding_costs(entry.path, backend.current(), _batch_tokens(settings))
    return ModelCost(weights, 0, 0, activations)


def _batch_tokens(settings: EngineSettings) -> int:
    """--max-batch-tokens bounds an embedder's forward passes too (the KV-cache flags do not apply to it)."""
    from mlxpaged.embedding.embedder import DEFAULT_MAX_BATCH_TOKENS

    return settings.cache.get("max_batch_tokens") or DEFAULT_MAX_BATCH_TOKENS


def _preset_options(entry: CatalogEntry) -> dict | None:
    preset = entry.ref.preset if entry.ref is not None else None
    return preset.options if preset else None


def build_model(entry: CatalogEntry, settings: EngineSettings):
    """Load `entry`: an Engine for a generative model, an Embedder for an embedding one (entry.kind), warmed up.
    Returns (the model, the sampling defaults its requests get, its cost)."""
    if entry.kind == "embed":
        return build_embedder(entry, settings)
    return build_engine(entry, settings)


def build_embedder(entry: CatalogEntry, settings: EngineSettings):
    """The Embedder for `entry`, warmed up by one input (the first pass compiles). Sampling defaults: none."""
    from mlxpaged.embedding.embedder import Embedder

    if entry.ref is None:
        raise ValueError(f"model {entry.name!r} has no reference to load it from")
    embedder = Embedder.from_local(entry.ref, entry.path, _batch_tokens(settings))
    try:
        if settings.warm_up:
            embedder.embed(["Hello"])
    except BaseException:
        holder = [embedder]
        del embedder
        release_engine(holder)
        raise
    return embedder, GenerationDefaults({}, "an embedding model samples nothing"), embedder_cost(embedder)


def build_engine(entry: CatalogEntry, settings: EngineSettings):
    """Load `entry` and build its Engine, warmed up (the first step allocates and compiles). Returns
    (engine, the sampling defaults its requests get, its cost)."""
    from mlxpaged.distributed.ranks import launched
    from mlxpaged.distributed.start import start_engine
    from mlxpaged.engine.engine import Engine
    from mlxpaged.loading.loader import load_local
    from mlxpaged.sampling_params import SamplingParams

    if entry.ref is None:
        raise ValueError(f"model {entry.name!r} has no reference to load it from")
    if launched():  # rank 0 under mlx.launch: every rank loads its shard and the others follow (server/ranks.py)
        timeout = {} if settings.rank_timeout_s is None else {"rank_timeout_s": settings.rank_timeout_s}
        engine = start_engine(
            str(entry.path), parallel=settings.parallel, **timeout, **_with_default_cache(settings.cache)
        )
    else:
        cache, scheduler = split_settings(_engine_settings(entry, settings))
        draft = None
        if entry.draft is not None:  # a drafter checkpoint is read when the engine is built, in the K/V dtype
            from mlxpaged.loading.draft_model import CHECKPOINT_DRAFTERS, DrafterCheckpoint

            ref, where = entry.draft
            checkpoint = scheduler.speculative in CHECKPOINT_DRAFTERS
            draft = DrafterCheckpoint(where, ref.name) if checkpoint else load_local(ref, where)
        engine = Engine(load_local(entry.ref, entry.path), cache, scheduler, adapters=dict(entry.adapters), draft=draft)
    try:
        defaults = sampling_defaults(engine, settings.generation_config)
        if settings.warm_up:
            engine.generate("Hello", SamplingParams(max_tokens=2, temperature=0.0))
    except BaseException:
        holder = [engine]
        del engine
        release_engine(holder)
        raise
    return engine, defaults, engine_cost(engine)


def sampling_defaults(engine, mode: str) -> GenerationDefaults:
    """What requests leaving sampling fields unset get (--generation-config): the model's own, or none."""
    if mode == "auto":
        return engine.generation_defaults
    return GenerationDefaults({}, "--generation-config none")


def release_engine(holder: list) -> None:
    """Stop the engine (or embedder) `holder` holds (its only entry) and give its memory back: the last reference
    goes (the caller's call frames would keep an engine passed directly alive), then Python's cycles, then MLX's
    buffer cache (freed buffers MLX keeps for reuse would otherwise still count against the process), then the C
    heap's free pages."""
    engine = holder.pop()
    engine.close()
    del engine
    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # memory accounting must never fail an unload
        pass
    return_freed_memory()  # the CPU heap keeps freed blocks for reuse (platform/malloc.py): give them back
