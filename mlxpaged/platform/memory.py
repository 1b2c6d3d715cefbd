"""Device memory facts, the KV cache sizing plan, and the Metal wired-limit context manager.

How the plan is sized (all in bytes):

    device limit   Metal: max_recommended_working_set_size (the GPU's ceiling; Apple already
                   keeps 25-33% of RAM outside it). CUDA: the device's total memory
                   (mx.device_info()'s total_memory). CPU: psutil's available memory (and the
                   cgroup's, in a container).
  - OS reserve     max(1 GiB, 10% of RAM; on CUDA of device memory). vLLM and mistral.rs default
                   to 90% utilization, leaving 10% of the device; on unified memory that 10% is
                   the OS's and other apps', and wired pages cannot be paged out for them; on a
                   CUDA device it is the CUDA context's, cuBLAS/cuDNN workspaces' and JIT kernels'.
  - weights        the loaded model. On CPU, skipped when `weights_resident` (psutil's
                   "available" was read after loading, so it no longer includes them); on a
                   GPU always counted (the limit is a fixed ceiling the weights live under).
  - activations    max_batch_tokens x (hidden + vocab) x 4 B (float32 logits) x 2: the peak
                   per-token activation of transformers' PagedAttentionMemoryHandler, doubled
                   as its safety factor does (sampling makes a second vocab-sized array).
  - encoded images a vision-language model's images as it encoded them, kept so an image sent again is not
                   encoded again (CacheConfig.image_cache_size, --image-cache-size; vision/encoded_images.py)
  - vision tower   its activations for the largest image it is planned for, as the model's processor resizes
                   it (vision/tower_memory.py): CacheConfig.image_memory_pixels (--image-memory-pixels) when set,
                   else the largest of 50 MP, 25 MP, ... 0.4 MP whose activations take at most half of what the
                   other costs leave (TOWER_SHARE; the smallest when none does). Larger images are scaled down to
                   it before the processor (MemoryPlan.image_pixels).
  = left for KV    then: --kv-memory (must fit), --memory-fraction x left, or a default
                   fraction of it (Metal and CUDA 0.9, the slack MLX's buffer cache needs; CPU
                   0.5, because the pool is touched up front and a host with no swap OOM-kills).

A block id stands for one page per layer of a layer group (specs.py): every layer for a
full-attention model, a group of them when sliding-window and full attention mix. Pages are
counted in each layer's real K and V widths (latent MLA, V narrower than K, per-layer heads; a
layer reusing another's K/V has none), one page in every pool (kv_cache.py `assign_pools`). A sequence
of T tokens holds ceil(T / block_size) blocks per full-attention group and at most
ceil(window / block_size) + 1 (its ring) per window group, as the block pool allocates them. A model whose
groups have disjoint pools (gemma4) has several block spaces, each sized on its own (space_plan.py); the rules
below are those of the one space most models have.

The block count is then capped by demand on every backend (mistral.rs's Metal rule: memory
the cache can never use still competes with the OS): --cache-tokens needs
ceil(cache_tokens / block_size) + max_num_seqs blocks per group (one partial block per
sequence; a window group never more than max_num_seqs rings); without it, max_num_seqs
sequences of the model context. It must hold one sequence of the longest length asked for
(min of --cache-tokens and the model context), or the plan raises InsufficientMemoryError
with the numbers. Blocks of zero bytes (a model with no KV layers: specs.NoKVSpec) are bounded by
demand alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.cache.specs import sequence_capacity, spaces_capacity, table_lengths
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.errors import InsufficientMemoryError
from mlxpaged.platform.backend import detect as detect_backend
from mlxpaged.platform.model_facts import (  # noqa: F401  (re-exported)
    KVShape,
    ModelFacts,
    TowerRung,
    model_weight_bytes,
)
from mlxpaged.platform.space_plan import SpaceNeeds, fitting_tokens, size_spaces
from mlxpaged.units import format_size, size_at_least
from mlxpaged.validation import require_int

OS_RESERVE_FLOOR = 2**30
OS_RESERVE_FRACTION = 0.10
ACTIVATION_DTYPE_BYTES = 4
ACTIVATION_SAFETY_FACTOR = 2
# CUDA as Metal (vLLM's 0.9 utilization too): the reserve covers the CUDA context and workspaces, so only the
# slack MLX's buffer cache keeps for freed temporaries is left; the CPU's 0.5 guards a host against OOM kills.
DEFAULT_KV_FRACTION = {"metal": 0.9, "cuda": 0.9, "cpu": 0.5}
# Prefix checkpoints of state-space state per sequence slot (design 14, D3): one pending (the newest
# block boundary of a running reply) and two in the table (a prompt's last boundary and a finished
# conversation's), so a chat's next turn resumes.
CHECKPOINTS_PER_SEQUENCE = 3
BACKENDS = ("metal", "cuda", "cpu")  # platform/backend.py's names


@dataclass(frozen=True)
class DeviceFacts:
    """What the device offers. Build it with detect(), or by hand in tests and planners."""

    backend: str  # "metal", "cuda" or "cpu": where the memory is (platform.backend.detect)
    total_bytes: int  # RAM on Metal and CPU; the device's memory on CUDA
    available_bytes: int  # psutil's (cgroup's) on Metal and CPU; the device's free memory on CUDA
    max_recommended_working_set_size: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        require_int("total_bytes", self.total_bytes, low=1)
        require_int("available_bytes", self.available_bytes)
        if self.backend == "metal":
            require_int("max_recommended_working_set_size", self.max_recommended_working_set_size, low=1)

    @property
    def limit_bytes(self) -> int:
        """The ceiling the plan starts from: the working set on Metal, the device's total memory on CUDA,
        available memory on CPU."""
        if self.backend == "metal":
            return self.working_set_bytes
        return self.total_bytes if self.backend == "cuda" else self.available_bytes

    @property
    def working_set_bytes(self) -> int:
        """Metal's recommended working set (__post_init__ requires it there)."""
        if self.max_recommended_working_set_size is None:
            raise ValueError(f"no recommended working set on {self.backend}")
        return self.max_recommended_working_set_size

    @property
    def limit_label(self) -> str:
        return {"metal": "Metal recommended working set", "cuda": "CUDA device memory", "cpu": "available host memory"}[
            self.backend
        ]

    @property
    def reserve_label(self) -> tuple[str, str]:
        """(what the reserve is, what it is a share of), for the plan's breakdown."""
        return ("device reserve", "device memory") if self.backend == "cuda" else ("OS reserve", "RAM")

    @classmethod
    def detect(cls, mx_module=None, psutil_module=None, cgroup_dir: str = "/sys/fs/cgroup") -> DeviceFacts:
        """Read this machine: mx.device_info() on a GPU, psutil (and cgroup v2 limits) on CPU; the
        backend is platform.backend.detect(mx_module), where MLX computes (a test's simulate() aside).
        On Metal, available_bytes (psutil) is informational: the plan starts from the working set."""
        if mx_module is None:
            import mlx.core as mx_module
        backend = detect_backend(mx_module)
        info = mx_module.device_info()
        name = str(info.get("device_name", ""))
        if backend == "cuda":
            # total_memory is the limit: a fixed ceiling, the same before and after the weights load (free_memory
            # then excludes them), as Metal's working set is; free_memory (NVML's, device-wide) is informational.
            return cls("cuda", int(info["total_memory"]), int(info["free_memory"]), None, name)
        if psutil_module is None:
            import psutil as psutil_module
        vm = psutil_module.virtual_memory()
        if backend == "metal":
            total = int(info.get("memory_size", vm.total))
            return cls("metal", total, int(vm.available), int(info["max_recommended_working_set_size"]), name)
        available = int(vm.available)
        cgroup_free = _cgroup_available(Path(cgroup_dir))
        if cgroup_free is not None:
            available = min(available, cgroup_free)
        return cls("cpu", int(vm.total), available, None, name)


def _cgroup_available(root: Path) -> int | None:
    """Bytes left under a cgroup v2 memory limit, or None when there is no limit."""
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(int(limit) - int((root / "memory.current").read_text().strip()), 0)
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class MemoryPlan:
    """The sized cache: `num_blocks` block ids of `block_bytes` each (one page per layer of a
    layer group). `token_capacity` is the longest sequence it holds (None: any length, when
    every layer slides); `bytes_per_token` what a token costs while all its layers hold it."""

    backend: str
    num_blocks: int
    block_size: int
    token_capacity: int | None
    bytes_per_token: int
    block_bytes: int
    kv_bytes: int
    breakdown: tuple[tuple[str, int], ...]  # device limit first; the rest add up to it
    reason: str
    wired_limit_bytes: int | None
    wired_status: str
    state_bytes: int = 0  # state slots and checkpoints of state-space layers (none: 0)
    num_state_slots: int = 0
    num_checkpoints: int = 0
    # Blocks and bytes per block of each block space (specs.block_spaces): one space, `num_blocks` of `block_bytes`.
    space_blocks: tuple[int, ...] = ()
    space_block_bytes: tuple[int, ...] = ()
    # The KV budget the pool did not take (capped by demand): a GPU's decode buffers, copies of the running rows'
    # K/V (runner/decode_buffers.py), may use it.
    spare_bytes: int = 0
    # A vision-language model: the largest image (pixels before its processor) the tower's activations are planned
    # for, and those bytes; None / 0 for a text model.
    image_pixels: int | None = None
    tower_bytes: int = 0

    def describe(self) -> str:
        """A multi-line summary for the CLI and the TUI."""
        (limit_label, limit), *parts = self.breakdown
        width = max(len(label) for label, _ in self.breakdown) + 4
        lines = [f"KV cache plan ({self.backend})", f"  {limit_label:<{width}}{format_size(limit):>10}"]
        for label, size in parts:
            sign = "=" if label == "left over" else "-"
            lines.append(f"  {sign} {label:<{width - 2}}{format_size(size):>10}")
        capacity = "any length" if self.token_capacity is None else f"{self.token_capacity:,} tokens"
        lines.append(
            f"  {self.num_blocks:,} blocks x {self.block_size} tokens, one sequence up to {capacity}; "
            f"{self.bytes_per_token:,} B/token, {format_size(self.block_bytes)}/block"
        )
        if len(self.space_blocks) > 1:
            spaces = " + ".join(
                f"{n:,} x {format_size(b)}" for n, b in zip(self.space_blocks, self.space_block_bytes, strict=True)
            )
            lines.append(f"  block spaces (layer groups of disjoint pools): {spaces}")
        lines.append(f"  blocks: {self.reason}")
        if self.state_bytes:
            lines.append(
                f"  state: {self.num_state_slots} slots + {self.num_checkpoints} checkpoints, "
                f"{format_size(self.state_bytes)} (not in the KV cache's blocks)"
            )
        if self.backend == "cuda" and self.spare_bytes:
            lines.append(
                f"  decode buffers: up to {format_size(self.spare_bytes)} of the left over, copies of the decoding "
                "rows' K/V while they run (runner/decode_buffers.py)"
            )
        lines.append(f"  wired limit: {self.wired_status}")
        return "\n".join(lines)


TOWER_LABEL = "vision tower, the largest image"
TOWER_SHARE = 0.5  # of what the other costs leave, at most, for the tower's activations (unless asked for more)
KV_LINES = ("KV cache", "left over")  # the breakdown's last lines: what the fixed costs leave


def os_reserve_bytes(total_bytes: int) -> int:
    return max(OS_RESERVE_FLOOR, int(total_bytes * OS_RESERVE_FRACTION))


def activation_bytes(model: ModelFacts, max_batch_tokens: int) -> int:
    per_token = (model.hidden_size + model.vocab_size) * ACTIVATION_DTYPE_BYTES
    return max_batch_tokens * per_token * ACTIVATION_SAFETY_FACTOR


# Tokens per sequence that zero-byte blocks (no KV layers: mamba, rwkv) number when neither --cache-tokens
# nor the model's context says (mamba configs name none): memory bounds none, and each block is a Python object.
FREE_BLOCK_TOKENS = 65536


def _demand(
    model: ModelFacts, cache: CacheConfig, seqs: int, caps: Sequence[int | None], free_blocks: bool
) -> tuple[int | None, str]:
    """Blocks the cache could ever use with `seqs` sequences at once, and why (`free_blocks`: they cost no memory)."""
    if cache.cache_tokens is not None:
        per_group = math.ceil(cache.cache_tokens / cache.block_size) + seqs
        blocks = sum(per_group if cap is None else min(per_group, seqs * cap) for cap in caps)
        return blocks, f"--cache-tokens {cache.cache_tokens:,}"
    if model.context_length is not None:
        blocks = seqs * sum(table_lengths(model.context_length, cache.block_size, caps))
        return blocks, f"model context {model.context_length:,} x {seqs} sequences"
    if free_blocks:
        blocks = seqs * sum(table_lengths(FREE_BLOCK_TOKENS, cache.block_size, caps))
        return blocks, (
            f"{FREE_BLOCK_TOKENS:,} tokens x {seqs} sequences (blocks of zero bytes; --cache-tokens for more)"
        )
    return None, ""


def _longest_sequence(model: ModelFacts, cache: CacheConfig, scheduler: SchedulerConfig) -> int:
    """Tokens of the longest single sequence the cache must hold."""
    asked = [n for n in (cache.cache_tokens, model.context_length) if n is not None]
    return min(asked) if asked else scheduler.max_batch_tokens


def _kv_budget(left: int, backend: str, cache: CacheConfig) -> tuple[int, str]:
    kv_memory = cache.kv_memory_bytes
    if kv_memory is not None:
        if kv_memory > left:
            raise InsufficientMemoryError(
                f"{{kv_memory:{format_size(kv_memory)}}} is more than the {format_size(left)} left for the "
                f"KV cache after weights, activations and the reserve; ask for at most {format_size(left)}, "
                "or lower {max_batch_tokens}, or use a smaller model",
                needed_bytes=kv_memory,
                available_bytes=left,
                param="kv_memory",
            )
        return kv_memory, f"limited by --kv-memory {format_size(kv_memory)}"
    if cache.memory_fraction is not None:
        return (
            int(left * cache.memory_fraction),
            f"limited by --memory-fraction {cache.memory_fraction:g} of {format_size(left)}",
        )
    fraction = DEFAULT_KV_FRACTION[backend]
    return int(left * fraction), f"limited by memory (default {fraction:.0%} of the {format_size(left)} left)"


def _check_fixed_costs(limit: int, costs: list[tuple[str, int]], label: str) -> int:
    """Memory left once the fixed costs are paid; raises when nothing is left."""
    left = limit - sum(size for _, size in costs)
    if left > 0:
        return left
    listed = " + ".join(f"{name} {format_size(size)}" for name, size in costs)
    lower = "{max_batch_tokens}" + (
        " or {image_memory_pixels} (the largest image the vision tower is planned for)"
        if any(name.startswith(TOWER_LABEL) for name, _ in costs)
        else ""
    )
    raise InsufficientMemoryError(
        f"{listed} = {format_size(limit - left)} exceed the {label} of {format_size(limit)}, leaving nothing for "
        f"the KV cache; use a smaller or more quantized model, or lower {lower}",
        needed_bytes=limit - left,
        available_bytes=limit,
    )


def _too_small(
    longest: int, need_bytes: int, budget: int, fits_tokens: int, cache: CacheConfig
) -> InsufficientMemoryError:
    """One sequence does not fit the budget; the advice follows the setting that sized it."""
    shrink = f"{{cache_tokens:{fits_tokens}}} or less" if fits_tokens > 0 else None
    if cache.kv_memory is not None:
        param = "kv_memory"
        advice = f"use {{kv_memory:{size_at_least(need_bytes)}}} or more" + (f", or {shrink}" if shrink else "")
    else:
        param = "memory_fraction" if cache.memory_fraction is not None else "cache_tokens"
        advice = (f"use {shrink}, " if shrink else "") + (
            "a larger {kv_memory} or {memory_fraction} if memory allows, lower {max_batch_tokens}, or a smaller model"
        )
    return InsufficientMemoryError(
        f"one {longest:,}-token sequence needs {format_size(need_bytes)} of KV cache but only {format_size(budget)} "
        f"is available for it (room for {fits_tokens:,} tokens); {advice}",
        needed_bytes=need_bytes,
        available_bytes=budget,
        param=param,
    )


def _wired(device: DeviceFacts, cache: CacheConfig, weights_and_kv: int) -> tuple[int | None, str]:
    if device.backend == "cpu":
        return None, "not applicable on CPU (MLX's CPU backend has no wired memory)"
    if device.backend == "cuda":
        return None, "not applicable on CUDA (wired memory, mx.set_wired_limit, is Metal's)"
    if not cache.wire:
        return None, "off (--no-wire)"
    limit = min(weights_and_kv, device.working_set_bytes)
    return limit, f"{format_size(limit)} (weights + KV, at most the recommended working set)"


def plan_memory(
    device: DeviceFacts,
    model: ModelFacts,
    cache: CacheConfig,
    scheduler: SchedulerConfig | None = None,
    *,
    weights_resident: bool = False,
) -> MemoryPlan:
    """Size the paged KV cache for `scheduler`'s step size and sequences (None: SchedulerConfig()).
    See the module docstring for the rules.

    weights_resident: the DeviceFacts were detected after the model was loaded, so on CPU
    "available" already excludes the weights. On a GPU the limit (Metal's working set, CUDA's
    total memory) is a fixed ceiling the weights always count against: the flag changes nothing there.
    """
    scheduler = scheduler or SchedulerConfig()
    if len(model.tower_rungs) > 1:  # the largest image the vision tower is planned for: the largest that fits
        return _plan_with_tower(device, model, cache, scheduler, weights_resident)
    skip_weights = weights_resident and device.backend == "cpu"
    fixed = [
        (device.reserve_label[0], os_reserve_bytes(device.total_bytes)),
        ("model weights", 0 if skip_weights else model.weight_bytes),
        ("activations", activation_bytes(model, scheduler.max_batch_tokens)),
    ]
    if model.takes_images and cache.image_cache_size:
        fixed.append(("encoded images (image_cache_size)", int(cache.image_cache_size)))
    slots, checkpoints, state_bytes = state_plan(model, scheduler)
    if state_bytes:
        fixed.append(
            (
                f"state ({slots} slots + {checkpoints} checkpoints x {format_size(model.state_bytes_per_sequence)})",
                state_bytes,
            )
        )
    tower = model.tower_rungs[0] if model.tower_rungs else None
    if tower is not None:
        label = f"{TOWER_LABEL} (up to {tower.pixels:,} px: {tower.patches:,} patches)"
        fixed.append((label, tower.bytes))
    left = _check_fixed_costs(device.limit_bytes, fixed, device.limit_label)
    budget, budget_reason = _kv_budget(left, device.backend, cache)
    kv = model.kv.quantized(cache.quantization)  # quantized pages: their real bytes (data, scales, biases)
    caps = [spec.max_blocks for spec in kv.table_specs(cache.block_size)]  # as the pools take them
    block = kv.block_bytes(cache.block_size)  # every pool's page in its own K/V widths
    longest = _longest_sequence(model, cache, scheduler)
    spaces = [
        SpaceNeeds(size, tuple(caps[g] for g in groups))
        for size, groups in zip(kv.space_block_bytes(cache.block_size), kv.block_spaces, strict=True)
    ]
    if len(spaces) > 1:
        space_blocks, reason = _size_spaces(spaces, budget, budget_reason, longest, model, cache, scheduler)
    else:
        space_blocks, reason = _size_one_space(caps, block, budget, budget_reason, longest, model, cache, scheduler)
    num_blocks = sum(space_blocks)
    kv_bytes = sum(n * space.block_bytes for n, space in zip(space_blocks, spaces, strict=True))
    wired_bytes, wired_status = _wired(device, cache, model.weight_bytes + kv_bytes)
    breakdown = _breakdown(device, model, scheduler, fixed, kv_bytes, left, skip_weights)
    return MemoryPlan(
        device.backend,
        num_blocks,
        cache.block_size,
        spaces_capacity(space_blocks, cache.block_size, [space.group_max_blocks for space in spaces]),
        kv.bytes_per_token,
        block,
        kv_bytes,
        breakdown,
        reason,
        wired_bytes,
        wired_status,
        state_bytes,
        slots,
        checkpoints,
        space_blocks,
        tuple(space.block_bytes for space in spaces),
        max(0, budget - kv_bytes),
        None if tower is None else tower.pixels,
        0 if tower is None else tower.bytes,
    )


def _plan_with_tower(
    device: DeviceFacts, model: ModelFacts, cache: CacheConfig, scheduler: SchedulerConfig, weights_resident: bool
) -> MemoryPlan:
    """The plan with the largest image the vision tower can be planned for (module docstring): of the rungs whose
    activations take at most TOWER_SHARE of what the other costs leave (else the smallest), the largest with which
    the rest of the plan fits (one sequence of the longest length among them); the smallest's error when none does."""
    without = dataclasses.replace(model, tower_rungs=())
    text_only = plan_memory(device, without, cache, scheduler, weights_resident=weights_resident)
    left = text_only.breakdown[0][1] - sum(size for label, size in text_only.breakdown[1:] if label not in KV_LINES)
    rungs = [r for r in model.tower_rungs if r.bytes <= TOWER_SHARE * left] or [model.tower_rungs[-1]]
    for rung in rungs[:-1]:
        with_rung = dataclasses.replace(model, tower_rungs=(rung,))
        try:
            return plan_memory(device, with_rung, cache, scheduler, weights_resident=weights_resident)
        except InsufficientMemoryError:
            continue
    smallest = dataclasses.replace(model, tower_rungs=(rungs[-1],))
    return plan_memory(device, smallest, cache, scheduler, weights_resident=weights_resident)


def _size_one_space(
    caps: list[int | None],
    block: int,
    budget: int,
    budget_reason: str,
    longest: int,
    model: ModelFacts,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
) -> tuple[tuple[int], str]:
    """The blocks of a model's one block space (every group shares its ids) and why."""
    memory_blocks = budget // block if block else None  # None: blocks of zero bytes, memory bounds none
    need_blocks = sum(table_lengths(longest, cache.block_size, caps))
    if memory_blocks is not None and memory_blocks < need_blocks:
        fits = sequence_capacity(memory_blocks, cache.block_size, caps)
        if fits is None:  # "any length fits" cannot be: `longest` does not
            raise ValueError(f"{memory_blocks} blocks hold any length yet not {longest} tokens")
        raise _too_small(longest, need_blocks * block, budget, fits, cache)
    demand, demand_reason = _demand(model, cache, scheduler.max_num_seqs, caps, free_blocks=not block)
    num_blocks, reason = _block_count(memory_blocks, budget_reason, demand, demand_reason)
    return (num_blocks,), reason


def _size_spaces(
    spaces: list[SpaceNeeds],
    budget: int,
    budget_reason: str,
    longest: int,
    model: ModelFacts,
    cache: CacheConfig,
    scheduler: SchedulerConfig,
) -> tuple[tuple[int, ...], str]:
    """The blocks of each of several block spaces (space_plan.py's rule) and why."""
    bs, seqs = cache.block_size, scheduler.max_num_seqs
    need_bytes = sum(space.blocks_for(longest, bs) * space.block_bytes for space in spaces)
    if need_bytes > budget:
        raise _too_small(longest, need_bytes, budget, fitting_tokens(spaces, budget, bs, longest), cache)
    demands = [_demand(model, cache, seqs, space.group_max_blocks, free_blocks=False) for space in spaces]
    blocks, rings, per_group = size_spaces(spaces, budget, bs, seqs, longest, [d for d, _ in demands])
    # Capped: a full-attention space got all its demand (the ring spaces always get theirs, or what fits).
    capped = [
        why
        for (demand, why), n, space in zip(demands, blocks, spaces, strict=True)
        if space.growing_groups and n == demand
    ]
    return blocks, (
        f"{len(spaces)} block spaces of {', '.join(f'{n:,}' for n in blocks)} blocks: rings for {rings} "
        f"sequences, {per_group:,} blocks per full-attention group; "
        + (f"capped by {capped[0]}" if capped else budget_reason)
    )


def _block_count(
    memory_blocks: int | None, budget_reason: str, demand: int | None, demand_reason: str
) -> tuple[int, str]:
    """The blocks to make and why: what memory allows, capped by what the cache could ever use."""
    if demand is not None and (memory_blocks is None or demand <= memory_blocks):
        allows = "any number: blocks of zero bytes" if memory_blocks is None else f"{memory_blocks:,} blocks"
        return demand, f"capped by {demand_reason} (memory allows {allows})"
    if memory_blocks is None:  # blocks of zero bytes: _demand always sizes them
        raise ValueError("blocks of zero bytes need a demand to size them")
    reason = budget_reason + (f"; {demand_reason} would need {demand:,} blocks" if demand is not None else "")
    return memory_blocks, reason


def state_plan(model: ModelFacts, scheduler: SchedulerConfig) -> tuple[int, int, int]:
    """(state slots, checkpoints, their bytes): one slot per running sequence, planned up front."""
    if not model.state_bytes_per_sequence:
        return 0, 0, 0
    slots = scheduler.max_num_seqs
    checkpoints = CHECKPOINTS_PER_SEQUENCE * slots
    return slots, checkpoints, (slots + checkpoints) * model.state_bytes_per_sequence


def _breakdown(
    device: DeviceFacts,
    model: ModelFacts,
    scheduler: SchedulerConfig,
    fixed: list[tuple[str, int]],
    kv_bytes: int,
    left: int,
    skip_weights: bool,
) -> tuple[tuple[str, int], ...]:
    (_, reserve), (_, weights), (_, activations), *state = fixed
    reserve_label, share_of = device.reserve_label
    weights_label = (
        f"model weights ({format_size(model.weight_bytes)}, already outside available)"
        if skip_weights
        else "model weights"
    )
    return (
        (device.limit_label, device.limit_bytes),
        (
            f"{reserve_label} ({OS_RESERVE_FRACTION:.0%} of {format_size(device.total_bytes)} {share_of}, min 1 GiB)",
            reserve,
        ),
        (weights_label, weights),
        (
            f"activations ({scheduler.max_batch_tokens} tok x {model.hidden_size + model.vocab_size:,} x "
            f"{ACTIVATION_DTYPE_BYTES} B x {ACTIVATION_SAFETY_FACTOR})",
            activations,
        ),
        *state,
        ("KV cache", kv_bytes),
        ("left over", left - kv_bytes),
    )


@contextlib.contextmanager
def wired_limit(
    target: MemoryPlan | int, enabled: bool = True, mx_module=None, streams: Sequence | None = None
) -> Iterator[int | None]:
    """Wire `target` bytes (a plan's weights + KV, or a byte count) while the block runs.

    Never above the device's max_recommended_working_set_size (mx.set_wired_limit raises
    there). On exit, also by exception or Ctrl-C, it synchronizes MLX (the limit must not
    change under an async eval, as mlx-lm's wired_limit does) and restores the previous
    limit. A no-op, yielding None, when disabled, for a plan without a wired limit, or on a
    device that reports no working set (the CPU backend). Yields the limit it set.
    """
    requested = target.wired_limit_bytes if isinstance(target, MemoryPlan) else target
    if not enabled or requested is None:
        yield None
        return
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
        raise ValueError(f"wired limit must be a byte count >= 0, got {requested!r}")
    if mx_module is None:
        import mlx.core as mx_module
    working_set = mx_module.device_info().get("max_recommended_working_set_size")
    if working_set is None:
        yield None
        return
    limit = min(requested, int(working_set))
    previous = mx_module.set_wired_limit(limit)
    try:
        yield limit
    finally:
        try:
            if streams:
                for stream in streams:
                    mx_module.synchronize(stream)
            else:
                mx_module.synchronize()
        finally:
            mx_module.set_wired_limit(previous)
