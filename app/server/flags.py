"""`mlxpaged serve` flags and the checks on them (kept light: the CLI imports this to build its parser)."""

from __future__ import annotations

import argparse
import ipaddress
import os

from mlxpaged.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_IMAGE_CACHE_SIZE,
    DEFAULT_KV_DISK_SIZE,
    KV_BITS,
    KV_GROUP_SIZES,
    SchedulerConfig,
)
from mlxpaged.distributed import DEFAULT_RANK_TIMEOUT_S

API_KEY_ENV = "MLXPAGED_API_KEY"
SPECULATIVE_HELP = (
    "ngram: prompt-lookup speculative decoding (drafts copied from the prompt and the reply so far, "
    "verified in one pass; same output, faster when replies quote their input); mtp: drafts from the model's own "
    "multi-token-prediction layers, for checkpoints that ship them (Qwen3.5 / 3.6 with mtp.* tensors); dflash: with "
    "--draft-model a DFlash drafter published for the model, which drafts a block of tokens in one pass; eagle3: with "
    "--draft-model an EAGLE-3 head published for the model"
)

DRAFT_MODEL_HELP = (
    "a smaller model of the same tokenizer (preset, path or repo id) that drafts tokens the model checks in one pass: "
    "same output, faster when its drafts are often right (Qwen3-0.6B for Qwen3-8B, say)"
)
NUM_DRAFT_TOKENS_HELP = (
    "tokens drafted per step at most (--speculative ngram / mtp or --draft-model; each sequence's count adapts to "
    "how many are kept; default: 7)"
)


def add_draft_arguments(group) -> None:
    """--draft-model and --num-draft-tokens (serve, chat)."""
    group.add_argument("--draft-model", default=None, metavar="NAME", help=DRAFT_MODEL_HELP)
    group.add_argument("--num-draft-tokens", type=int, default=None, metavar="N", help=NUM_DRAFT_TOKENS_HELP)


KV_BITS_HELP = (
    "store the KV cache quantized at 8 or 4 bits per element (about 1.9x / 3.5x the tokens of float16 in the "
    "same memory; default: the model's dtype)"
)


class ServeError(Exception):
    """A setting that stops the server from starting; the message says what to change."""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("network and security")
    net.add_argument("--model", "-m", default=None, help="preset name, local path or Hugging Face repo id")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    net.add_argument("--port", type=int, default=8000, help="port (0 picks a free one; default: 8000)")
    net.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})",
    )
    net.add_argument(
        "--allow-no-key",
        action="store_true",
        help="allow binding a non-loopback address without an API key (anyone on the network can use it)",
    )
    net.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser requests from ORIGIN (repeatable; default: no CORS)",
    )
    net.add_argument(
        "--max-body-size",
        default="50MB",
        help="largest request body, e.g. 4MB (default: 50MB: images come base64 in the body)",
    )
    add_image_arguments(parser.add_argument_group("images (vision-language models)"))
    limits = parser.add_argument_group("requests")
    limits.add_argument(
        "--max-queue",
        type=int,
        default=64,
        help="requests that may wait beyond the running batch; more get 429 (default: 64)",
    )
    limits.add_argument(
        "--default-max-tokens",
        type=int,
        default=None,
        help="reply length when a request sets none (default: the model's max_new_tokens, else "
        "1024; clipped to the context)",
    )
    limits.add_argument(
        "--generation-config",
        choices=["auto", "none"],
        default="auto",
        help="auto: fields a request leaves unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max tokens) take the model's generation_config.json values; "
        "none: the plain API defaults (temperature 1.0, top_p 1.0). Default: auto",
    )
    limits.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish at shutdown (default: 10)",
    )
    limits.add_argument(
        "--rank-timeout",
        type=float,
        default=DEFAULT_RANK_TIMEOUT_S,
        help="under mlx.launch: seconds rank 0 waits on the other ranks through one engine step before it fails "
        "the requests in flight and exits non-zero (a hung rank; a killed one is seen sooner). Generous by "
        f"default, as a long prefill chunk of a large model is one step (default: {DEFAULT_RANK_TIMEOUT_S:g})",
    )
    limits.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    limits.add_argument("--no-access-log", action="store_true", help="do not log every request")
    add_model_arguments(parser)
    cache = parser.add_argument_group("KV cache and memory")
    cache.add_argument(
        "--cache-tokens",
        type=int,
        default=None,
        help="KV cache capacity in tokens, across sequences (a reply's length: --default-max-tokens)",
    )
    cache.add_argument("--kv-memory", default=None, help="cache size in bytes or units, e.g. 2GB")
    cache.add_argument("--memory-fraction", type=float, default=None, help="share of free memory for the cache")
    cache.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    cache.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="tokens per engine step, prefill chunks included (default: 2048; 8192 on CUDA)",
    )
    cache.add_argument(
        "--step-budget-ms",
        type=float,
        default=None,
        help="milliseconds one engine step may take: a long prompt's prefill chunks are sized to fit beside the "
        "streams decoding, as measured while serving (default 2000 on the CPU, 1000 on a GPU; 0: chunks bounded "
        "by --max-batch-tokens only)",
    )
    cache.add_argument(
        "--streams-step-budget-ms",
        type=float,
        default=None,
        help="milliseconds a step may take when it carries a prefill chunk of a prompt that arrived after a stream "
        "decoding beside it began (an agent's next turn while the others stream): what a stream waits for its next "
        "token; prompts already waiting then (a burst, a batch) keep --step-budget-ms; at most --step-budget-ms "
        "(default 1000 on the CPU, the step budget on a GPU; 0: the step budget)",
    )
    cache.add_argument(
        "--long-prompt-step-budget-ms",
        type=float,
        default=None,
        help="milliseconds a step may take when it carries a chunk of a long prompt (more than --max-batch-tokens "
        "left to prefill) beside streams decoding, at most --streams-step-budget-ms (default 750 on the CPU, the "
        "streams' budget on a GPU; 0: the streams' budget)",
    )
    cache.add_argument(
        "--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs, help="sequences decoded together"
    )
    cache.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context per request in tokens instead of the model's own (longer: RoPE extrapolates, "
        "no promise about quality)",
    )
    cache.add_argument("--no-wire", action="store_true", help="leave the Metal wired limit alone")
    cache.add_argument("--no-prefix-cache", action="store_true", help="do not reuse cached prompt blocks")
    cache.add_argument(
        "--speculative", choices=["ngram", "mtp", "dflash", "eagle3"], default=None, help=SPECULATIVE_HELP
    )
    add_draft_arguments(cache)
    cache.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None, help=KV_BITS_HELP)
    cache.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=None,
        help="elements per scale and bias of quantized K/V (default: 32 for --kv-bits 8, 64 for --kv-bits 4)",
    )
    add_kv_disk_arguments(cache)
    parser.add_argument_group("across processes (under mlx.launch)").add_argument(
        "--pipeline",
        action="store_true",
        help="split the model by layers over the ranks (mlx-lm's pipeline parallel); default: by heads (tensor "
        "parallel) where the model can be, else by layers",
    )


def add_kv_disk_arguments(group) -> None:
    """The prefix cache's disk tier, on by default in `serve` and `chat` (README: "The prefix cache on disk")."""
    where = group.add_mutually_exclusive_group()
    where.add_argument(
        "--kv-disk",
        default=None,
        metavar="DIR",
        help="keep the prefix cache's blocks in DIR too, across restarts (default: on, in the user cache "
        "directory, e.g. ~/.cache/mlxpaged/kv; $MLXPAGED_KV_DISK overrides)",
    )
    group.add_argument(
        "--kv-disk-size",
        default=DEFAULT_KV_DISK_SIZE,
        help=f"disk the prefix cache may use; least recently used blocks go past it (default: {DEFAULT_KV_DISK_SIZE})",
    )
    where.add_argument("--no-kv-disk", action="store_true", help="keep the prefix cache in memory only")


def kv_disk_settings(args: argparse.Namespace) -> dict:
    """CacheConfig's kv_disk and kv_disk_size from the flags: on unless --no-kv-disk."""
    if args.no_kv_disk:
        return {"kv_disk": False}
    return {"kv_disk": args.kv_disk or True, "kv_disk_size": args.kv_disk_size}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("several models (loaded on demand by a request's `model`)")
    models.add_argument(
        "--max-memory",
        default=None,
        help="memory for all loaded models together (weights, KV caches, activations), e.g. 12GB; idle models are "
        "unloaded to make room, and a model that cannot fit is refused (default: the machine's, as the memory "
        "plan counts it: device limit less the OS reserve)",
    )
    models.add_argument(
        "--keep-alive",
        default="5m",
        help="how long an idle model stays loaded: a duration (5m, 1h, 30s) or seconds; 0 unloads it after each "
        "request, -1 never (default: 5m; a request's `keep_alive` field overrides it for its model)",
    )
    models.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="NAME",
        help="load NAME at startup and never unload it (repeatable)",
    )
    models.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the LoRA / DoRA adapter in directory PATH (mlx_lm.lora's adapters.safetensors and "
        "adapter_config.json) on --model as the model NAME (also BASE:NAME); a bare PATH is named after its "
        "directory (repeatable: requests for every adapter and the base model share each batch)",
    )
    models.add_argument(
        "--max-loras",
        type=int,
        default=8,
        metavar="N",
        help="adapters from the model store one model keeps attached at once; past it the least recently used idle "
        "one is detached (default: 8; --lora adapters stay and are not counted)",
    )
    models.add_argument(
        "--load-timeout",
        type=float,
        default=300.0,
        help="seconds a request waits for its model to load before a 503 (default: 300)",
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name other than localhost: may resolve anywhere
        return False


def check_bind(host: str, api_key: str | None, allow_no_key: bool) -> None:
    if api_key or allow_no_key or is_loopback(host):
        return
    raise ServeError(
        f"refusing to listen on {host} (not a loopback address) without an API key: anyone who "
        f"can reach this machine could use the model. Set --api-key (or ${API_KEY_ENV}), or pass "
        "--allow-no-key to do it anyway."
    )


def cache_settings(args: argparse.Namespace) -> dict:
    """CacheConfig and SchedulerConfig fields from the flags (Engine.from_pretrained splits them); sizes
    stay text ("2GB"): CacheConfig reads them and its errors name the setting, which the runner renders
    as its flag (mlxpaged.errors)."""
    settings = {
        "block_size": args.block_size,
        "max_num_seqs": args.max_num_seqs,
        "wire": not args.no_wire,
        "enable_prefix_cache": not args.no_prefix_cache,
        "speculative": args.speculative,
        # The disk tier is a tier of the prefix cache: with the cache off there is nothing to keep (and no warning).
        **({"kv_disk": False} if args.no_prefix_cache else kv_disk_settings(args)),
        "kv_group_size": args.kv_group_size,
    }
    for name in ("cache_tokens", "memory_fraction", "kv_memory", "max_model_len", "kv_bits", "max_batch_tokens"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    if getattr(args, "num_draft_tokens", None) is not None:
        settings["num_speculative_tokens"] = args.num_draft_tokens
    if args.step_budget_ms is not None:
        settings["step_budget_ms"] = args.step_budget_ms or None  # 0: no budget
    if args.streams_step_budget_ms is not None:
        settings["streams_step_budget_ms"] = args.streams_step_budget_ms or None  # 0: the step budget
    if args.long_prompt_step_budget_ms is not None:
        settings["long_prompt_step_budget_ms"] = args.long_prompt_step_budget_ms or None  # 0: the streams' budget
    if getattr(args, "image_cache_size", None) is not None:  # serve's image flags
        settings["image_cache_size"] = args.image_cache_size
    if getattr(args, "image_memory_pixels", None) is not None:  # the tower's activations: planned for these images
        settings["image_memory_pixels"] = args.image_memory_pixels
    return settings


def add_image_arguments(group) -> None:
    group.add_argument(
        "--no-image-urls",
        action="store_true",
        help="do not fetch http(s) image URLs in requests (data URLs still work)",
    )
    group.add_argument(
        "--image-dir",
        default=None,
        metavar="DIR",
        help="let requests name local image files under DIR (file:// URLs or paths; default: none)",
    )
    group.add_argument("--max-images", type=int, default=16, help="images one request may send (default: 16)")
    group.add_argument(
        "--max-image-pixels",
        type=int,
        default=50_000_000,
        help="pixels of one image before the model's processor resizes it (default: 50,000,000)",
    )
    group.add_argument(
        "--image-memory-pixels",
        type=int,
        default=None,
        metavar="N",
        help="the largest image (pixels, before the model's processor) the vision tower's memory is planned for; "
        "larger images are scaled down to it (default: the largest of 50M, 25M, ... that fits)",
    )
    group.add_argument(
        "--image-cache-size",
        default=DEFAULT_IMAGE_CACHE_SIZE,
        metavar="SIZE",
        help="memory for images the model encoded, kept so an image sent again is not encoded again; "
        f"0 keeps none (default: {DEFAULT_IMAGE_CACHE_SIZE})",
    )


def image_policy(args: argparse.Namespace):
    from pathlib import Path

    from mlxpaged_app.server.images import ImagePolicy

    for flag in ("max_images", "max_image_pixels"):
        if getattr(args, flag) < 1:
            raise ServeError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    image_dir = None if args.image_dir is None else Path(args.image_dir).expanduser()
    if image_dir is not None and not image_dir.is_dir():
        raise ServeError(f"--image-dir {args.image_dir}: not a directory")
    return ImagePolicy(
        fetch_urls=not args.no_image_urls,
        image_dir=image_dir,
        max_images=args.max_images,
        max_pixels=args.max_image_pixels,
    )


def server_config(args: argparse.Namespace):
    from mlxpaged.units import parse_size
    from mlxpaged_app.server.state import ServerConfig

    for name in ("max_queue", "default_max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < (0 if name == "max_queue" else 1):
            raise ServeError(
                f"--{name.replace('_', '-')} must be >= {0 if name == 'max_queue' else 1}, got {getattr(args, name)}"
            )
    if args.drain_timeout < 0:
        raise ServeError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.max_loras < 1:
        raise ServeError(f"--max-loras must be >= 1, got {args.max_loras}")
    return ServerConfig(
        api_key=args.api_key,
        max_body_size=parse_size(args.max_body_size, param="max_body_size"),
        max_queue=args.max_queue,
        default_max_tokens=args.default_max_tokens,
        cors_origins=tuple(args.cors_origin),
        images=image_policy(args),
        max_loras=args.max_loras,
    )


def lora_flags(values: list[str]) -> dict[str, str]:
    """--lora NAME=PATH (or a bare PATH, named after its directory) -> {NAME: PATH}; ValueError for a name given
    twice."""
    adapters: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = os.path.basename(os.path.normpath(value)), value
        if not name or not path:
            raise ValueError(f"--lora {value!r}: expected NAME=PATH or PATH")
        if name in adapters:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        adapters[name] = path
    return adapters
