"""Engine: continuous batching over the paged cache. One thread owns MLX.

`build_core` (build.py) sets up what the engine runs on (layout, plan, pools, attention, core); the Engine
keeps the thread, the command queue and the public API. Callers on any thread (or asyncio task) submit
requests; the engine thread (engine_thread.py) applies them and runs the core's steps (core.py: schedule ->
execute -> update -> process), which push events into each request's sink.

Models that mix sliding-window and full attention (gemma3, `layer_types`) run too: each
request holds one block table per layer group, a window group's table being a ring of at
most ceil(window / block_size) + 1 blocks, and their prefix cache is off (kv_cache.py).

Models with state-space / linear-attention layers (mlx-lm ArraysCache: mamba, Qwen 3.5, ...) hold one
state slot per running request next to their KV blocks (cache/state_cache.py); their prefix cache resumes
from state checkpoints at block boundaries.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from mlxpaged.adapters.adapter_set import AdapterSet, AdapterSource, read_adapters
from mlxpaged.config import DEFAULT_CACHE_TOKENS, CacheConfig, SchedulerConfig, split_settings
from mlxpaged.distributed.ranks import Ranks
from mlxpaged.embedding.model_files import refuse_generation
from mlxpaged.engine import engine_thread
from mlxpaged.engine.build import BuiltCore, build_core
from mlxpaged.engine.drafting import SpeculationStats
from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.engine.request import ImageSpan
from mlxpaged.engine.shutdown import STEP_TIMEOUT_S
from mlxpaged.errors import (  # noqa: F401  (re-exported)
    AdapterError,
    ConfigError,
    EngineClosedError,
    ImagesNotSupportedError,
    RequestFailedError,
    UnknownAdapterError,
)
from mlxpaged.loading.checkpoint import read_before_load
from mlxpaged.loading.draft_model import (
    CHECKPOINT_DRAFTERS,
    DrafterCheckpoint,
    check_draft_setting,
    pair_facts_before_load,
)
from mlxpaged.loading.generation_defaults import GenerationDefaults, load_defaults
from mlxpaged.loading.loader import LoadedModel, chat_prompt, load_local, locate_model
from mlxpaged.loading.mtp_head import mtp_facts_before_load
from mlxpaged.loading.progress import Progress
from mlxpaged.outputs import Completion, StreamDelta, collect, drain
from mlxpaged.platform import backend
from mlxpaged.platform.memory import DeviceFacts, plan_memory
from mlxpaged.sampling_params import SamplingParams
from mlxpaged.vision.checkpoint import images_refused
from mlxpaged.vision.embedding import PromptEmbedding
from mlxpaged.vision.encoded_images import EncodedImages
from mlxpaged.vision.prompt import ImagePrompt

Prompt = str | Sequence[int] | ImagePrompt  # what submit, generate and stream take

if TYPE_CHECKING:
    from mlxpaged.constraints import GrammarCompiler
    from mlxpaged.vision.images import ImageLimits
    from mlxpaged.vision.loading import VisionParts


class Engine:
    """Runs a core built by engine/build.py on its own thread (engine_thread.py), fed by a command queue."""

    def __init__(
        self,
        loaded: LoadedModel,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        ranks: Ranks | None = None,
        adapters: Mapping[str, AdapterSource] | None = None,
        draft: LoadedModel | DrafterCheckpoint | None = None,
    ):
        """`ranks`: rank 0 of a group whose other ranks run distributed.follower (distributed/start.py).
        `adapters`: name -> LoRA / DoRA adapter directory (mlx_lm.lora's output), which requests pick by name
        (`adapter=`); each is checked against the model here (AdapterError), never mid-request. `draft`: a smaller
        model of the same tokenizer that drafts tokens the model verifies (scheduler_config.speculative "draft"), or
        a DFlash drafter to read ("dflash")."""
        self.loaded = loaded
        self.ranks = ranks
        self.cache_config = cache_config or CacheConfig(cache_tokens=DEFAULT_CACHE_TOKENS)
        self.scheduler_config = scheduler_config or SchedulerConfig()
        # SimpleQueue (C, reentrant): its put cannot deadlock when a Ctrl-C or a finalizer (engine_thread.py)
        # lands inside another put, as queue.Queue's Python-level lock can.
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._closed = False
        self._stats = StatsCounter()
        # Built on first use (constraints.py): llguidance's tokenizer takes ~0.3 s.
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        commands = self._commands  # the core must not hold the engine: its thread holds it weakly (engine_thread.py)
        self.built: BuiltCore = build_core(
            loaded,
            self.cache_config,
            self.scheduler_config,
            stats=self._stats,
            has_commands=lambda: not commands.empty(),
            ranks=ranks,
            adapters=adapters,
            draft=draft,
        )
        # Images the model encoded, by digest (read and written on the engine thread only: embedding.py).
        keep = int(self.cache_config.image_cache_size)  # bytes: CacheConfig parsed it
        self._encoded_images = EncodedImages(keep) if loaded.vision is not None and keep else None
        self._thread = engine_thread.start(self, commands, self.core, self.plan, self.cache_config.wire)

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        progress: Progress | None = None,
        adapters: Mapping[str, AdapterSource] | None = None,
        draft_model: str | None = None,
        **settings,
    ) -> Engine:
        """A preset name, local path or hub id (None: the embedded default model); settings are CacheConfig
        and SchedulerConfig fields, split by name (kv_memory="2GB", max_num_seqs=4; any other name raises
        ConfigError). A cache that cannot fit raises InsufficientMemoryError before any weight is read
        (once the model's files are local: a hub model is downloaded first); an embedding model raises
        UnsupportedModelError (mlxpaged.Embedder runs it). `adapters`: name -> adapter directory (see __init__);
        their files are read and counted in the memory plan before the model is. `draft_model`: a smaller model of the
        same tokenizer (a name or path, as `model`) drafting tokens this one verifies (speculative "draft", the
        default then; `num_speculative_tokens` drafts at most); both models and both pools are planned before either
        model's weights are read, and a pair that cannot draft (another tokenizer, layers that cannot roll back) is
        refused before the model is built. With speculative "dflash" or "eagle3", `draft_model` is a DFlash drafter
        or an EAGLE-3 head published for this model (loading/dflash_model.py, loading/eagle3_model.py)."""
        settings.setdefault("cache_tokens", DEFAULT_CACHE_TOKENS)
        if draft_model is not None and settings.get("speculative") is None:
            settings["speculative"] = "draft"
        cache, scheduler = split_settings(settings)
        check_draft_setting(scheduler.speculative, draft_model is not None)
        files = read_adapters(adapters or {})  # AdapterError for a missing or corrupt one, before the model
        ref, path = locate_model(model, progress)
        refuse_generation(path, ref.name, ref.preset.options if ref.preset else None)
        # Memory where MLX allocates (DeviceFacts), dtypes as the loader will choose them (backend.current()).
        facts, layout = read_before_load(path, backend.current(), cache.image_memory_pixels)
        facts = dataclasses.replace(facts, weight_bytes=facts.weight_bytes + sum(f.nbytes for f in files.values()))
        draft_ref = None
        checkpoint = scheduler.speculative in CHECKPOINT_DRAFTERS  # a DFlash or EAGLE-3 drafter, not an mlx-lm model
        if draft_model is not None:
            draft_ref, draft_path = locate_model(draft_model, progress)
            facts = pair_facts_before_load(scheduler.speculative, facts, layout, ref.name, draft_path, draft_ref.name)
        if scheduler.speculative == "mtp":  # the checkpoint's MTP layers: refused without them, their pages planned
            facts = mtp_facts_before_load(facts, path, ref.name)
        plan_memory(DeviceFacts.detect(), facts, cache, scheduler)
        draft: LoadedModel | DrafterCheckpoint | None = None
        if draft_ref is not None:  # a drafter checkpoint is read by build.py, in the model's K/V dtype
            draft = DrafterCheckpoint(draft_path, draft_ref.name) if checkpoint else load_local(draft_ref, draft_path)
        return cls(load_local(ref, path), cache, scheduler, adapters=files, draft=draft)

    @property
    def model(self):
        return self.loaded.model

    @functools.cached_property
    def generation_defaults(self) -> GenerationDefaults:
        """The model's recommended sampling (its generation_config.json, gaps filled from its preset), read once."""
        return load_defaults(self.loaded.path, self.loaded.ref.preset)

    def default_sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams with the model's recommended settings, `overrides` winning over them. Plain
        `SamplingParams()` keeps the API's own defaults (temperature 1.0, top_p 1.0) whatever the model."""
        return SamplingParams(**self.generation_defaults.sampling_kwargs(overrides))

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def grammar_compiler(self):
        """The model's GrammarCompiler (grammar text -> Constraint for SamplingParams.constraint), built
        once on first use from any thread; GrammarError if the tokenizer cannot be constrained."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from mlxpaged.constraints import GrammarCompiler  # llguidance loads only when asked for

                config = self.loaded.config
                width = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
                self._grammar_compiler = GrammarCompiler(self.tokenizer, int(width or len(self.tokenizer.vocab)))
            return self._grammar_compiler

    # --- what the core was built on (engine/build.py) ------------------------------------------
    @property
    def layout(self):
        return self.built.layout

    @property
    def facts(self):
        return self.built.facts

    @property
    def plan(self):
        return self.built.plan

    @property
    def kv(self):
        return self.built.kv

    @property
    def max_model_len(self) -> int:
        return self.built.max_model_len

    @property
    def adapters(self) -> AdapterSet | None:
        """The adapters requests may name (None across mlx.launch ranks, which serve none)."""
        return self.built.adapters

    @property
    def serial_reason(self) -> str | None:
        return self.built.serial_reason

    @property
    def core(self):
        return self.built.core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.runner

    @property
    def kv_manager(self):
        return self.scheduler.kv_manager

    @property
    def pool(self):
        """The block pool: stats, block states, prefix-cache reset."""
        return self.kv_manager.pool

    def forget_encoded_images(self) -> None:
        """Drop the images kept encoded by digest (vision/encoded_images.py): the next prompt with an image runs the
        vision tower again, as a cold one does (benchmarks; with `pool.reset_prefix_cache()`, nothing is cached)."""
        if self._encoded_images is not None:
            self._encoded_images.clear()

    # --- public API ----------------------------------------------------------------------------
    def submit(
        self, prompt: Prompt, params: SamplingParams | None, sink: Callable[[object], None], adapter: str | None = None
    ) -> str:
        """Queue a request; events (StreamDelta, or an exception) go to `sink` from the engine thread. A prompt is
        text, token ids, or an ImagePrompt (vision/prompt.py: a vision-language model's prompt with images).
        `adapter`: the name of one of the engine's adapters to run it with (None: the base model)."""
        if self._closed:
            raise EngineClosedError("the engine is closed")
        adapter_id = self._adapter_id(adapter)
        params = params or SamplingParams()
        images: tuple = ()
        multimodal = None
        if isinstance(prompt, ImagePrompt):
            images, multimodal = prompt.images, self._image_inputs(prompt)
            prompt = prompt.token_ids
        tokens = self._tokenize(prompt)
        both_ways = self._both_ways(tokens, images)
        self._check_token_ids("logit_bias", params.logit_bias)
        self._check_fits(len(tokens), params.max_tokens)
        request_id = f"req-{next(self._ids)}"
        self._commands.put(
            engine_thread.Add(request_id, tokens, params, sink, images, multimodal, adapter_id, both_ways)
        )
        return request_id

    def add_adapter(self, name: str, source: AdapterSource, timeout: float | None = STEP_TIMEOUT_S) -> dict:
        """Serve one more adapter (a directory, as `adapters=` takes them) from now on: its files are read here, then
        attached on the engine thread between steps. AdapterError (nothing changed) for one that cannot be served.
        Its memory is not in the plan made at load; the caller counts it (`describe()["bytes"]`)."""
        adapters = self._adapter_set()
        files = read_adapters({name: source})[name]  # read and checked on the caller's thread
        return self._on_engine_thread(lambda: adapters.add(name, files), timeout).describe()

    def check_adapter(self, name: str, source: AdapterSource, timeout: float | None = STEP_TIMEOUT_S):
        """The adapter `add_adapter` would attach (its AdapterFiles), checked against the model without attaching it:
        AdapterError saying why it cannot be served."""
        adapters = self._adapter_set()
        files = read_adapters({name: source})[name]
        return self._on_engine_thread(lambda: adapters.check(name, files), timeout).files

    def remove_adapter(self, name: str, timeout: float | None = STEP_TIMEOUT_S) -> None:
        """Stop serving the adapter `name`: UnknownAdapterError if there is none, AdapterError while unfinished
        requests run with it (nothing changes then)."""
        adapters = self._adapter_set()

        def remove() -> None:
            in_flight = self.core.requests_with_adapter(adapters.resolve(name).id)
            if in_flight:
                raise AdapterError(f"adapter {name!r} has {in_flight} unfinished request(s); remove it once they end")
            removed = adapters.remove(name)
            if self.core.runner.decoder is not None and not adapters.has_id(removed.id):
                self.core.runner.decoder.forget_adapter(removed.id)

        self._on_engine_thread(remove, timeout)

    def _adapter_set(self) -> AdapterSet:
        if self._closed:
            raise EngineClosedError("the engine is closed")
        if self.adapters is None:
            raise ConfigError("adapters across mlx.launch ranks are not supported yet", param="adapters")
        return self.adapters

    def _on_engine_thread(self, fn: Callable[[], object], timeout: float | None):
        """`fn()` run on the engine thread between steps; its result, or its exception raised here."""
        result: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(engine_thread.Call(fn, result))
        return result.result(timeout)

    def _adapter_id(self, name: str | None) -> str | None:
        """The id of the adapter called `name` (None: the base model); UnknownAdapterError for another name."""
        if name is None:
            return None
        if self.adapters is None:
            raise UnknownAdapterError(
                f"unknown adapter {name!r}: adapters across mlx.launch ranks are not supported yet"
            )
        return self.adapters.resolve(name).id

    def _image_inputs(self, prompt: ImagePrompt) -> PromptEmbedding:
        """What the engine thread feeds the prompt's prefill: the model computes it there, on first use."""
        if self.core.runner.mirror is not None:
            raise ConfigError("images across mlx.launch ranks are not supported yet", param="images")
        vision = self._vision()
        return PromptEmbedding(
            vision.model, prompt.token_ids, prompt.arrays, prompt.images, self._encoded_images, vision.both_ways
        )

    def _both_ways(self, tokens: Sequence[int], images: Sequence[ImageSpan]) -> tuple[tuple[int, int], ...]:
        """The prompt's spans attended both ways (engine/request.py Request.both_ways): PaliGemma's whole prompt, each
        of Gemma 4's larger models' images; none for every other model."""
        vision = self.loaded.vision
        if vision is None or not vision.both_ways:
            return ()
        if vision.prompt_both_ways:
            return ((0, len(tokens)),)
        return tuple((image.start, image.end) for image in images)

    def _vision(self) -> VisionParts:
        """The model's vision parts; ImagesNotSupportedError naming the model when it takes no images."""
        if self.loaded.vision is None:
            raise ImagesNotSupportedError(images_refused(self.loaded.name, self.loaded.config), param="images")
        return self.loaded.vision

    def generate(
        self,
        prompts: str | Sequence[int] | list,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        adapter: str | Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Run prompts (text or token-id lists) concurrently; return their completions in order
        (with n > 1, a prompt's n completions follow each other, by index).
        `params` is one SamplingParams for all prompts, or one per prompt; `adapter` one adapter name (None: the
        base model) for all, or one per prompt."""
        if isinstance(prompts, str | ImagePrompt) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        per_prompt = [params] * len(prompts) if params is None or isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        adapters = [adapter] * len(prompts) if adapter is None or isinstance(adapter, str) else list(adapter)
        if len(adapters) != len(prompts):
            raise ValueError(f"{len(adapters)} adapters for {len(prompts)} prompts")
        sinks: list[queue.Queue] = [queue.Queue() for _ in prompts]
        ids = []
        try:
            for prompt, p, sink, name in zip(prompts, per_prompt, sinks, adapters, strict=True):
                ids.append(self.submit(prompt, p, sink.put, adapter=name))
        except Exception:
            for request_id in ids:  # a bad prompt in the list: the ones already queued are withdrawn
                self.abort(request_id)
            raise
        out = []
        for rid, sink, p in zip(ids, sinks, per_prompt, strict=True):
            out += collect(rid, drain(sink, (p or SamplingParams()).n))
        return out

    def chat(
        self, messages: list[dict], params: SamplingParams | None = None, adapter: str | None = None
    ) -> Completion:
        """Reply to `messages` (content a string, or parts: {"type": "text", "text": ...} and, for a
        vision-language model, {"type": "image", "image": <a path, bytes, a data URL or a PIL image>})."""
        return self.generate([self.chat_prompt(messages)], params, adapter)[0]

    def chat_prompt(self, messages: list[dict], limits: ImageLimits | None = None, **template_options) -> Prompt:
        """The prompt `messages` make with the model's chat template: token ids, or an ImagePrompt when they
        hold images (vision/chat.py; `limits` bound them, `template_options` such as tools= go to the
        template). ImagesNotSupportedError for images to a text model, ImageInputError for a bad image."""
        from mlxpaged.vision.images import has_images

        if not has_images(messages) and self.loaded.vision is None:
            return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_options))
        from mlxpaged.vision.chat import chat_image_prompt
        from mlxpaged.vision.images import DEFAULT_LIMITS

        # A vision-language model renders every chat with its processor's template (text-only ones too); an image
        # larger than the memory plan set the vision tower's activations aside for is scaled down to that size.
        vision, planned = self._vision(), self.plan.image_pixels
        prompt = chat_image_prompt(vision, messages, limits or DEFAULT_LIMITS, planned, **template_options)
        return prompt if prompt.images else prompt.token_ids

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        return chat_prompt(self.tokenizer, messages)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None
    ) -> Iterator[StreamDelta]:
        """Yield deltas as tokens arrive. Closing the iterator early aborts the request."""
        sink: queue.Queue = queue.Queue()
        request_id = self.submit(prompt, params, sink.put, adapter=adapter)
        remaining = (params or SamplingParams()).n
        try:
            for delta in drain(sink, remaining):
                remaining -= delta.finish_reason is not None
                yield delta
        finally:
            if remaining:
                self.abort(request_id)

    async def astream(
        self, prompt: Prompt, params: SamplingParams | None = None, adapter: str | None = None
    ) -> AsyncIterator[StreamDelta]:
        """Async version of stream(); cancelling the consuming task aborts the request."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(event: object) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        request_id = self.submit(prompt, params, put, adapter=adapter)
        remaining = (params or SamplingParams()).n
        try:
            while remaining:
                event = await events.get()
                if isinstance(event, BaseException):
                    remaining = 0  # a failed request is already finished in the engine
                    raise event
                remaining -= event.finish_reason is not None
                yield event
        finally:
            if remaining:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request; its blocks are freed at the start of the engine's next step."""
        if not self._closed:
            self._commands.put(engine_thread.Abort(request_id))

    def stats(self) -> dict:
        pool = self.kv_manager.stats()  # block counts of every block space together
        tiers = self._tier_stats(pool.query_tokens, pool.hit_tokens)
        return {
            "blocks_total": pool.num_blocks,
            "blocks_free": pool.num_free + pool.num_cached_free,
            "blocks_used": pool.num_owned,
            "blocks_cached": pool.num_cached_free,
            **tiers,
            "requests_running": self.scheduler.num_running,
            "requests_waiting": self.scheduler.num_waiting,
            **self._stats.snapshot(),
            "memory_plan": self.plan,
            **self._memory_stats(),
            "speculative": self.scheduler_config.speculative,
            "draft_model": self._draft_name(),
            **(self.core.speculator.stats if self.core.speculator else SpeculationStats()).snapshot(),
            "attention": self.built.attention.status(),  # this engine's model: {"path", "reason", "variants"}
            "backend": backend.current(),
            "backend_description": backend.describe(),  # platform/backend.py
            "serial": self.serial_reason,  # why one sequence runs per pass (None: batched)
            "adapters": self.adapters.describe() if self.adapters is not None else {},
            "kv_memory_by_class": {g.describe(): size for g, size in self.kv.bytes_by_class().items()},
        }

    def _draft_name(self) -> str | None:
        """What `draft_model=` named: a draft model, or a DFlash / EAGLE-3 drafter checkpoint (None: neither)."""
        if self.built.draft is not None:
            return self.built.draft.name
        hidden = self.built.hidden_drafter
        if hidden is not None and self.scheduler_config.speculative in CHECKPOINT_DRAFTERS:
            return hidden.name
        return None

    def _tier_stats(self, query_tokens: int, ram_hit_tokens: int) -> dict:
        """Both tiers of the prefix cache: prompt tokens found in RAM (the pool) and on disk (engine/kv_tiering.py);
        `prefix_hit_*` counts both (every prompt token not prefilled)."""
        tiering = self.core.tiering
        disk = tiering.stats(query_tokens - ram_hit_tokens) if tiering is not None else {}
        hits = ram_hit_tokens + disk.get("disk_hit_tokens", 0)
        return {
            "prefix_hit_rate": hits / query_tokens if query_tokens else 0.0,
            "prefix_hit_tokens": hits,
            "ram_hit_tokens": ram_hit_tokens,
            "disk_tier": tiering is not None,
            "disk_tier_off": self.built.disk_tier_off,
            **disk,
        }

    def _memory_stats(self) -> dict:
        """KV memory and state-slot memory, apart: planned bytes, and for state the slots and checkpoints held."""
        out = {"kv_bytes": self.plan.kv_bytes, "state_bytes": self.plan.state_bytes}
        state = self.scheduler.state
        if state is not None:
            out.update(
                state_slots_total=state.store.num_slots,
                state_slots_used=state.store.num_slots - state.num_free,
                state_checkpoints=len(state.checkpoints),
            )
        return out

    def wait_disk_writes(self, timeout: float | None = None) -> bool:
        """Wait until every block in the prefix cache so far is written to the disk tier (True at once without
        one; False on timeout). The engine thread hands the blocks over between steps; its writer writes them."""
        tiering = self.core.tiering
        if tiering is None or self._closed:
            return True
        handed = threading.Event()
        self._commands.put(engine_thread.Flush(handed))
        return handed.wait(timeout) and tiering.wait_idle(timeout)

    def block_states(self) -> list[str]:
        """Per block: "free", "owned", "shared" or "cached" (a snapshot; for the block map); several block
        spaces (specs.block_spaces) one after another."""
        return [state for pool in self.kv_manager.pools for state in pool.block_state()]

    def request_blocks(self, request_id: str) -> list[int]:
        """Block ids a live request holds in all its tables (empty once it finished), as `block_states`
        indexes them (a later space's ids after the earlier spaces' blocks); for the block map."""
        manager = self.kv_manager
        offsets = [sum(p.num_blocks for p in manager.pools[:space]) for space in manager.spaces]
        try:
            tables = manager.block_tables(request_id)
        except KeyError:
            return []
        return [offset + b for table, offset in zip(tables, offsets, strict=True) for b in table]

    def close(self, timeout: float = STEP_TIMEOUT_S) -> None:
        """Stop at the next step boundary and wait (at most `timeout` s) for the engine thread to end:
        unfinished requests fail with EngineClosedError, the thread releases its MLX streams and
        restores the wired limit. Open engines are closed this way at interpreter exit too."""
        self.begin_close()
        if threading.current_thread() is not self._thread:  # e.g. from a sink: cannot wait for itself
            self._thread.join(timeout)

    def begin_close(self) -> None:
        """Ask the engine to stop at its next step boundary, without waiting (close() waits)."""
        if not self._closed:
            self._closed = True
            self._commands.put(engine_thread.Close())

    @property
    def running(self) -> bool:
        """True until the engine thread has ended."""
        return self._thread.is_alive()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- caller-side helpers ---------------------------------------------------------------------
    def _tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        # A list of plain ints (the usual prompt) is copied in C; anything else (NumPy ints) converted one by one.
        tokens = (
            list(prompt) if isinstance(prompt, list) and set(map(type, prompt)) <= {int} else list(map(int, prompt))
        )
        self._check_token_ids("prompt", tokens)
        return tokens

    def _check_token_ids(self, param: str, tokens) -> None:
        vocab = self.facts.vocab_size  # the logits' width
        if not tokens or (min(tokens) >= 0 and not (vocab and max(tokens) >= vocab)):
            return  # min and max in C: an 8k prompt is checked on the caller's thread before it is queued
        bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise ConfigError(f"{param} token ids out of range [0, {vocab}): {bad[:5]}", param=param)

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens == 0:
            raise ValueError("the prompt is empty")
        self.scheduler.check_fits(prompt_tokens, max_tokens)  # the scheduler owns the length limits
