"""Settings for the paged KV cache (CacheConfig) and the scheduler (SchedulerConfig), validated when built.

Every check raises ConfigError (a ValueError) naming the setting and the bad value, for the
interface the user called (mlxpaged.errors); nothing here asserts.
Sizes ("2GB", CacheConfig's kv_memory as the CLI's --kv-memory) are read by mlxpaged.units.parse_size.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxpaged.cache.kv_quant import KV_BITS, KV_GROUP_SIZES, KVQuantization, kv_quantization  # noqa: F401  (the flags read KV_BITS, KV_GROUP_SIZES here)
from mlxpaged.errors import ConfigError
from mlxpaged.platform import backend
from mlxpaged.units import parse_size
from mlxpaged.validation import require_bool, require_int, require_number

VALID_BLOCK_SIZES = (8, 16, 32)  # the paged-attention kernel's block sizes
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CACHE_TOKENS = 32768  # cap by demand: a local app rarely needs more resident context
DEFAULT_KV_DISK_SIZE = "20GB"  # the disk tier's LRU limit (CacheConfig.kv_disk_size, --kv-disk-size)
DEFAULT_IMAGE_CACHE_SIZE = "256MB"  # encoded images kept by a vision model (CacheConfig.image_cache_size)
# The largest image a request may send, before the processor resizes it (a 8k x 6k photo is 48 MP; --max-image-pixels):
# the largest the memory plan may set the vision tower's activations aside for (CacheConfig.image_memory_pixels).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
SPECULATIVE_METHODS = (None, "ngram", "draft", "mtp", "dflash", "eagle3")  # SchedulerConfig.speculative


@dataclass(frozen=True)
class CacheConfig:
    """How big the paged KV cache may be and how it is used.

    Size it by at most one of `kv_memory` (bytes, or a size as the CLI takes it: "2GB",
    "512MiB"; stored as bytes) or `memory_fraction` (of the memory left for the cache after
    weights, activations and the OS reserve; see mlxpaged.platform.memory). Neither: a backend default.
    `cache_tokens` caps the cache at the context you need in total across sequences (a reply's
    length is SamplingParams.max_tokens). `wire=False` leaves the Metal wired limit alone.
    `kv_disk` keeps the prefix cache's full blocks on disk too, across processes (cache/disk_tier.py):
    False (the library's default: no writes a script did not ask for), True (the user's cache directory,
    `default_kv_disk_dir()`), or a directory; `kv_disk_size` bounds it (bytes or "20GB"; LRU beyond).
    `kv_bits` 8 or 4 stores K/V pages quantized (group-wise affine, `kv_group_size` elements per scale and
    bias, as `mx.quantize`; cache/kv_quant.py): about 1.8x / 3.5x the tokens in the same memory. None: the
    model's KV dtype. `kv_group_size` None: 32 for 8-bit pages, 64 for 4-bit ones (kv_quant.py says why).
    `image_cache_size` bounds the images a vision-language model keeps encoded (bytes or "256MB"; 0: none kept;
    vision/encoded_images.py). `image_memory_pixels` is the largest image (pixels before the model's processor resizes
    it) the memory plan sets the vision tower's activations aside for (vision/tower_memory.py); None: the largest of
    50 MP, 25 MP, ... 0.4 MP that fits (platform/memory.py). A larger image is scaled down to it. How many tokens and
    sequences one step takes is SchedulerConfig's. Bad values raise ConfigError (a ValueError).
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_memory: int | str | None = None
    memory_fraction: float | None = None
    cache_tokens: int | None = None
    wire: bool = True
    enable_prefix_cache: bool = True
    kv_disk: bool | str | os.PathLike = False
    kv_disk_size: int | str = DEFAULT_KV_DISK_SIZE
    kv_bits: int | None = None
    kv_group_size: int | None = None
    image_cache_size: int | str = DEFAULT_IMAGE_CACHE_SIZE
    image_memory_pixels: int | None = None

    def __post_init__(self) -> None:
        require_int("block_size", self.block_size, low=1, setting=True)
        if self.block_size not in VALID_BLOCK_SIZES:
            raise ConfigError(
                f"{{block_size:{self.block_size}}} must be one of {VALID_BLOCK_SIZES}", param="block_size"
            )
        if self.cache_tokens is not None:
            require_int("cache_tokens", self.cache_tokens, low=1, setting=True)
        if self.kv_memory is not None:
            self._set_kv_memory(self.kv_memory)
        if self.memory_fraction is not None:
            require_number("memory_fraction", self.memory_fraction, 0.0, 1.0, low_open=True, setting=True)
        if self.kv_memory is not None and self.memory_fraction is not None:
            raise ConfigError(
                f"set only one of {{kv_memory}} ({self.kv_memory:,} bytes) and {{memory_fraction}} "
                f"({self.memory_fraction}): both size the KV cache",
                param="kv_memory",
            )
        require_bool("wire", self.wire, setting=True)
        require_bool("enable_prefix_cache", self.enable_prefix_cache, setting=True)
        if not isinstance(self.kv_disk, bool | str | os.PathLike) or self.kv_disk == "":
            raise ConfigError(f"{{kv_disk:{self.kv_disk!r}}} must be True, False or a directory", param="kv_disk")
        size = parse_size(self.kv_disk_size, param="kv_disk_size")
        if size == 0:
            raise ConfigError(f"{{kv_disk_size:{self.kv_disk_size!r}}} must be more than 0 bytes", param="kv_disk_size")
        object.__setattr__(self, "kv_disk_size", size)  # frozen: bytes from here on
        object.__setattr__(self, "image_cache_size", parse_size(self.image_cache_size, param="image_cache_size"))
        if self.image_memory_pixels is not None:
            require_int("image_memory_pixels", self.image_memory_pixels, low=1, setting=True)
        if self.kv_bits is not None:
            require_int("kv_bits", self.kv_bits, low=1, setting=True)
        if self.kv_group_size is not None:
            require_int("kv_group_size", self.kv_group_size, low=1, setting=True)
        self.quantization  # noqa: B018  (checks kv_bits and kv_group_size together)

    @property
    def quantization(self) -> KVQuantization | None:
        """The K/V pages' quantization (None: full precision)."""
        return kv_quantization(self.kv_bits, self.kv_group_size)

    def _set_kv_memory(self, value: int | str) -> None:
        size = parse_size(value, param="kv_memory")
        if size == 0:
            raise ConfigError(f"{{kv_memory:{value!r}}} must be more than 0 bytes", param="kv_memory")
        object.__setattr__(self, "kv_memory", size)  # frozen: bytes from here on

    @property
    def kv_disk_dir(self) -> Path | None:
        """The disk tier's directory, or None when it is off."""
        if self.kv_disk is False:
            return None
        return default_kv_disk_dir() if self.kv_disk is True else Path(self.kv_disk).expanduser()

    @property
    def kv_memory_bytes(self) -> int | None:
        """`kv_memory` in bytes (a size string was parsed when the config was made)."""
        if isinstance(self.kv_memory, str):
            raise TypeError(f"kv_memory {self.kv_memory!r} was not parsed")
        return self.kv_memory


@dataclass(frozen=True)
class SchedulerConfig:
    """How much work one engine step takes. `max_batch_tokens` bounds one model step (prefill
    chunks included) and so the activation headroom the memory plan sets aside; `max_num_seqs`
    bounds concurrent sequences. `speculative="ngram"` drafts up to `num_speculative_tokens` tokens
    per decoding sequence from its own prompt and output and verifies them in one pass
    (engine/drafting.py); "draft" drafts with a draft model, "mtp" with the checkpoint's multi-token-prediction
    layers (loading/mtp_head.py), "dflash" / "eagle3" with a DFlash drafter / an EAGLE-3 head given as the draft model
    (loading/dflash_model.py, loading/eagle3_model.py).
    `max_model_len` overrides the model's context (prompt + reply tokens per
    request; None: the model's own): longer than the model was trained on runs, as RoPE extrapolates,
    with no promise about quality. Bad values raise ConfigError (a ValueError)."""

    # Default: the backend's (platform/backend.py `Tuning.max_batch_tokens`: 2048 on the CPU and Metal, 8192 on CUDA).
    max_batch_tokens: int = dataclasses.field(default_factory=lambda: backend.tuning().max_batch_tokens)
    max_num_seqs: int = 16
    speculative: str | None = None
    # 7: the verify chunk [last, d1..d7] is 8 tokens, the compiled pass's largest, and OpenBLAS's gemm
    # costs about the same at 4 to 8 rows (30 layers: 36 vs 38.5 ms). bench spec, 3 runs, quiet machine:
    # k <= 5 gave 2.21x / 1.66x / 1.08x (code edit / quote summary / free text), k <= 7 2.14x / 1.86x / 1.11x
    # (the summary's decode steps 33 -> 29).
    num_speculative_tokens: int = 7
    max_model_len: int | None = None
    # Milliseconds one step may take, the decoding streams' tokens included: prefill chunks are sized to fit, by
    # what they were measured to cost (engine/step_budget.py). None: chunks are bounded by max_batch_tokens only.
    # Default: the backend's (platform/backend.py `Tuning.step_budget_ms`).
    step_budget_ms: float | None = dataclasses.field(default_factory=lambda: backend.tuning().step_budget_ms)
    # Milliseconds a step may take when it carries a chunk of a prompt that arrived after a stream decoding beside it
    # began (what a stream waits for a token while later prompts prefill), at most step_budget_ms; applies only with a
    # step budget. None: the step budget. Default: the backend's (platform/backend.py `Tuning.streams_step_budget_ms`).
    streams_step_budget_ms: float | None = dataclasses.field(
        default_factory=lambda: backend.tuning().streams_step_budget_ms
    )
    # Milliseconds a step may take when it carries a chunk of a long prompt (more prefill left than max_batch_tokens)
    # beside decoding streams, at most streams_step_budget_ms; applies only with a step budget. None: the streams'.
    # Default: the backend's (platform/backend.py `Tuning.long_prompt_step_budget_ms`).
    long_prompt_step_budget_ms: float | None = dataclasses.field(
        default_factory=lambda: backend.tuning().long_prompt_step_budget_ms
    )

    def __post_init__(self) -> None:
        require_int("max_batch_tokens", self.max_batch_tokens, low=1, setting=True)
        require_int("max_num_seqs", self.max_num_seqs, low=1, setting=True)
        if self.max_model_len is not None:
            require_int("max_model_len", self.max_model_len, low=1, setting=True)
        if self.max_batch_tokens < self.max_num_seqs:
            # Otherwise some decoding sequences would get no token in a step (the scheduler's rule,
            # checked here so a bad setting fails before the model and the pool are loaded).
            raise ConfigError(
                f"{{max_batch_tokens:{self.max_batch_tokens}}} must be >= {{max_num_seqs:{self.max_num_seqs}}}",
                param="max_batch_tokens",
            )
        if self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"{{speculative:{self.speculative!r}}} must be one of {SPECULATIVE_METHODS}", param="speculative"
            )
        require_int("num_speculative_tokens", self.num_speculative_tokens, low=1, high=16, setting=True)
        for name in ("step_budget_ms", "streams_step_budget_ms", "long_prompt_step_budget_ms"):
            if getattr(self, name) is not None:
                require_number(name, getattr(self, name), 0, low_open=True, setting=True)


def default_kv_disk_dir() -> Path:
    """$MLXPAGED_KV_DISK, else `kv` in the platform's user cache directory (platformdirs)."""
    override = os.environ.get("MLXPAGED_KV_DISK")
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_path

    return user_cache_path("mlxpaged", appauthor=False) / "kv"


def split_settings(settings: Mapping[str, Any]) -> tuple[CacheConfig, SchedulerConfig]:
    """Keyword settings (Engine.from_pretrained's) as the two configs, by field name; a name that is
    neither's raises ConfigError naming it. Values are any (Any): each config checks its own fields."""
    fields = {config: {f.name for f in dataclasses.fields(config)} for config in (CacheConfig, SchedulerConfig)}
    unknown = [name for name in settings if not any(name in names for names in fields.values())]
    if unknown:
        known = sorted(fields[CacheConfig] | fields[SchedulerConfig])
        raise ConfigError(f"unknown setting {unknown[0]!r}; the settings are {', '.join(known)}", param=unknown[0])
    cache, scheduler = ({k: v for k, v in settings.items() if k in fields[c]} for c in (CacheConfig, SchedulerConfig))
    return CacheConfig(**cache), SchedulerConfig(**scheduler)
