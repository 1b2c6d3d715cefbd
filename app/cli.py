"""The `mlxpaged` command: chat | serve | bench | models | pull | doctor | launch."""

from __future__ import annotations

import argparse
import sys

import mlxpaged
from mlxpaged.config import DEFAULT_CACHE_TOKENS
from mlxpaged.errors import MlxpagedError, user_message
from mlxpaged.platform.blas import blas_status
from mlxpaged.units import format_size


def cmd_models(args: argparse.Namespace) -> int:
    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import list_adapters, list_models, models_dir

    rows = list_models(default_dtype())
    loaded = server_models(args.server) if args.server else None
    print(f"Models ({default_dtype()} store: {models_dir()})\n")
    served = f"{'LOADED':<17} " if loaded is not None else ""
    print(f"  {'NAME':<16} {'SOURCE':<10} {'LOCAL':<9} {served}DESCRIPTION")
    for row in rows:
        name = row.name + (" *" if row.is_default else "")
        local = format_size(row.size_bytes) if row.path else "no"
        state = f"{loaded_column(loaded, row.name):<17} " if loaded is not None else ""
        print(f"  {name:<16} {row.source:<10} {local:<9} {state}{row.description}")
    adapters = list_adapters()
    if adapters:
        print(f"\n  {'ADAPTER':<16} {'BASE':<26} {'LOCAL':<9} (a request names it as its model: NAME or BASE:NAME)")
        for adapter in adapters:
            print(f"  {adapter.name:<16} {adapter.base or '(names none)':<26} {format_size(adapter.size_bytes):<9}")
    print("\n  * default model. `mlxpaged pull NAME` fetches a model; hub models need internet once.")
    if loaded is not None:
        print(f"  LOADED: what the server at {args.server} holds now, and the memory each model holds there.")
    if args.verbose:
        print_doctor()
    return 0


def server_models(url: str) -> dict:
    from mlxpaged_app.loaded_models import ServerQueryError, loaded_on_server

    try:
        return loaded_on_server(url)
    except ServerQueryError as exc:
        print(f"mlxpaged models: {exc}; showing the store only\n", file=sys.stderr)
        return {}


def loaded_column(loaded: dict, name: str) -> str:
    from mlxpaged_app.loaded_models import find_loaded

    model = find_loaded(loaded, name)
    if model is None:
        return "-"
    return f"yes, {format_size(model.memory_bytes)}" + (" (pinned)" if model.pinned else "")


def print_doctor() -> None:
    from mlxpaged.platform import backend

    import mlx.core as mx

    status = blas_status()
    print(f"\nBLAS:    {status.name}" + (f" ({status.path})" if status.path else "") + f" - {status.detail}")
    print(f"MLX:     {mx.__version__}, device {mx.default_device()}")
    print(f"Backend: {backend.describe()}")


def cmd_pull(args: argparse.Namespace) -> int:
    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import provision, remove_partial_conversions, resolve
    from mlxpaged.loading.progress import print_progress

    remove_partial_conversions()
    ref = resolve(args.model)
    path = provision(ref, default_dtype(), print_progress)
    print(f"{ref.name}: ready at {path}")
    return 0


def kv_disk_settings(args: argparse.Namespace) -> dict:
    from mlxpaged_app.server.flags import kv_disk_settings as settings

    return settings(args)


def cmd_chat(args: argparse.Namespace) -> int:
    if args.plain:
        return cmd_plain_chat(args)
    from mlxpaged_app.tui import run_chat

    try:
        return run_chat(
            args.model,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            system=args.system,
            resume=args.resume,
            cache_tokens=args.cache_tokens,
            speculative=args.speculative,
            kv_disk=kv_disk_settings(args),
            kv_bits=args.kv_bits,
            lora=args.lora,
            draft=draft_settings(args),
        )
    except ValueError as exc:  # bad sampling settings, before the app starts
        print(f"mlxpaged chat: {user_message(exc, 'cli')}", file=sys.stderr)
        return 2


def draft_settings(args: argparse.Namespace) -> dict:
    """Engine.from_pretrained's draft_model and draft length from --draft-model and --num-draft-tokens."""
    settings: dict = {"draft_model": args.draft_model} if args.draft_model else {}
    if args.num_draft_tokens is not None:
        settings["num_speculative_tokens"] = args.num_draft_tokens
    return settings


def cmd_plain_chat(args: argparse.Namespace) -> int:
    from mlxpaged.loading.loader import UnsupportedModelError
    from mlxpaged.platform.memory import InsufficientMemoryError
    from mlxpaged_app.repl import run_plain_chat
    from mlxpaged_app.tui.settings import ChatSettings

    if args.resume:
        print("mlxpaged chat: --resume reopens a conversation of the chat app; --plain keeps none", file=sys.stderr)
        return 2
    try:
        settings = ChatSettings(
            temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed
        )
        return run_plain_chat(
            args.model,
            settings,
            args.system,
            args.cache_tokens,
            args.speculative,
            kv_disk_settings(args),
            args.kv_bits,
            args.lora,
            draft_settings(args),
        )
    except ValueError as exc:  # bad sampling or cache settings, before the first turn
        print(f"mlxpaged chat: {exc}", file=sys.stderr)
        return 2
    except (InsufficientMemoryError, UnsupportedModelError) as exc:
        print(f"mlxpaged chat: {exc}", file=sys.stderr)
        return 1


def cmd_serve(args: argparse.Namespace) -> int:
    from mlxpaged_app.server.launcher import run_serve

    return run_serve(args)


def prefill_sizes(text: str) -> tuple[int, ...]:
    """`--sizes` parsed by the prefill bench, imported only when given (the bench package loads mlx-lm)."""
    from mlxpaged_app.bench.prefill import parse_sizes

    return parse_sizes(text)


def concurrency_levels(text: str) -> tuple[int, ...]:
    """`--concurrency` parsed by the gpu bench, imported only when given (the bench package loads mlx-lm)."""
    from mlxpaged_app.bench.gpu import parse_concurrency

    return parse_concurrency(text)


def soak_duration(text: str) -> float:
    """`--soak`'s duration in seconds ("30m", "1h", "90s" or seconds)."""
    from mlxpaged_app.server.keep_alive import KeepAliveError, parse_keep_alive

    try:
        seconds = parse_keep_alive(text)
    except KeepAliveError:
        seconds = None
    if seconds is None or seconds <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration: use 30m, 1h, 90s or seconds")
    return seconds


def process_counts(text: str) -> tuple[int, ...]:
    from mlxpaged_app.bench.distributed import parse_processes

    return parse_processes(text)


def bench_parts(text: str) -> tuple[str, ...]:
    from mlxpaged_app.bench.gpu import parse_parts

    return parse_parts(text)


def cmd_bench(args: argparse.Namespace) -> int:
    from mlxpaged_app.bench import run_bench

    return run_bench(args)


def cmd_doctor(args: argparse.Namespace) -> int:
    from mlxpaged_app.doctor import cmd_doctor as run_doctor

    return run_doctor(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxpaged", description="Local LLM inference on MLX with a paged KV cache.")
    parser.add_argument("--version", action="version", version=f"mlxpaged {mlxpaged.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    from mlxpaged_app.server.flags import (
        KV_BITS,
        KV_BITS_HELP,
        SPECULATIVE_HELP,
        add_draft_arguments,
        add_kv_disk_arguments,
        add_serve_arguments,
    )

    chat = sub.add_parser("chat", help="chat with a model in the terminal (a Textual app; F1 lists the keys)")
    chat.add_argument("--model", "-m", default=None, help="preset name, local path or Hugging Face repo id")
    chat.add_argument("--max-tokens", type=int, default=512, help="tokens per reply")
    chat.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: the model's recommended value (its generation_config.json), else 1.0",
    )
    chat.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    chat.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    chat.add_argument("--system", default="", help="system prompt (default: the model's own)")
    chat.add_argument(
        "--lora",
        default=None,
        metavar="PATH",
        help="chat with the LoRA / DoRA adapter in PATH (mlx_lm.lora's adapter directory) on the model",
    )
    chat.add_argument(
        "--resume",
        action="store_true",
        help="reopen the last saved conversation (its earlier turns' KV comes from the disk tier: no re-prefill)",
    )
    chat.add_argument("--cache-tokens", type=int, default=DEFAULT_CACHE_TOKENS, help="KV cache capacity in tokens")
    chat.add_argument(
        "--speculative", choices=["ngram", "mtp", "dflash", "eagle3"], default=None, help=SPECULATIVE_HELP
    )
    add_draft_arguments(chat)
    chat.add_argument("--kv-bits", type=int, choices=KV_BITS, default=None, help=KV_BITS_HELP)
    chat.add_argument(
        "--plain",
        action="store_true",
        help="a plain line-mode chat instead of the app (for pipes and ssh; replies on stdout)",
    )
    add_kv_disk_arguments(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP endpoint on localhost")
    add_serve_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks against mlx-lm")
    bench.add_argument(
        "what",
        choices=[
            "decode",
            "batch",
            "prefix",
            "prefill",
            "memory",
            "kernel",
            "server",
            "constraints",
            "spec",
            "hybrid",
            "gpu",
            "restart",
            "kv",
            "distributed",
            "vision",
            "fleet",
            "lora",
        ],
        help="decode: batch-1 tok/s vs mlx-lm; batch: 16 concurrent requests vs mlx-lm "
        "batch_generate (--lengths skewed: 16 and 64 of 128-8k tokens); prefix: time to first token, cached vs "
        "cold; prefill: cold and "
        "cached time to first token at 1k-16k tokens vs mlx-lm; memory: KV bytes "
        "paged vs mlx-lm; kernel: paged attention vs contiguous SDPA; server: "
        "mlxpaged serve vs mlx_lm.server at 1/8/32 clients; constraints: decode step "
        "time with and without grammar masks at batch 1 and 16; spec: batch-1 decode with "
        "and without prompt-lookup speculation, repetitive and free-text tasks; hybrid: batch-1 "
        "decode of a random Qwen 3.5-style hybrid (state slots + paged KV) vs mlx-lm; gpu: every "
        "issue-21 target in one run (decode, 16/64 concurrent, cold TTFT at 2k/8k, cached "
        "8k prefix) vs plain mlx-lm on the model's own dtype, and a met/missed summary; restart: time to "
        "first token of an 8k-token prompt cold, from the RAM prefix cache and from the disk tier after a "
        "real process restart; kv: quantized KV pages "
        "(8 and 4 bits) vs full precision: capacity, perplexity on a held-out text, greedy agreement, decode tok/s; "
        "distributed: time to first token and decode tok/s in 1, 2 and 4 processes (mlx.launch, ring backend on "
        "loopback), and whether each gave 1 process's tokens; vision (--model: a vision-language model's directory): "
        "cold time to first token of an image prompt, the same image's next turn, and 8 concurrent image requests, "
        "each vs mlx-vlm's own generate / batch_generate; fleet: an agent fleet (a shared long system prompt, "
        "several turns each, streaming) against mlxpaged serve, mlx_lm.server and mlx-vlm's server, one after "
        "another: wall time, time to first token, inter-token latency, tok/s, peak memory; lora: 16 concurrent "
        "requests over 1, 4 and 16 LoRA adapters vs the base model alone, and batch-1 decode with an adapter vs "
        "mlx-lm's generate_step on load(model, adapter_path)",
    )
    bench.add_argument("--model", "-m", default=None)
    bench.add_argument(
        "--tokens", type=int, default=None, help="tokens to generate per request (default 128; distributed: 16)"
    )
    bench.add_argument("--runs", type=int, default=None, help="timed runs (default 3; distributed: 1)")
    bench.add_argument(
        "--processes",
        type=process_counts,
        default=None,
        help="distributed: process counts, comma-separated (default 1,2,4; 1 always runs, the reference)",
    )
    bench.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="restart: prompt length in tokens (default 8000); kv: the long-prompt decode line's prompt (default "
        "2048 tokens of the held-out text; 0: only the short prompt)",
    )
    bench.add_argument(
        "--sizes",
        type=prefill_sizes,
        default=None,
        help="prefill, gpu: prompt sizes in tokens, comma-separated (prefill default "
        "1024,4096,8192,16384; gpu default 2048,8192)",
    )
    bench.add_argument(
        "--concurrency",
        type=concurrency_levels,
        default=None,
        help="gpu, batch: concurrent requests per batch run, comma-separated (gpu default 16,64; batch default 16, "
        "with --lengths skewed 16,64); spec with a drafter: default 1,4,16",
    )
    bench.add_argument("--agents", type=int, default=None, help="fleet: agents at once (default 8)")
    bench.add_argument("--turns", type=int, default=None, help="fleet: turns per agent (default 4)")
    bench.add_argument(
        "--long",
        action="store_true",
        help="fleet: one more agent sends a prompt of 3/4 of the context once the fleet is under way",
    )
    bench.add_argument(
        "--soak",
        type=soak_duration,
        default=None,
        metavar="DURATION",
        help="fleet: run mlxpaged serve alone under the fleet for DURATION (30m, 90s), clients hanging up at random; "
        "report memory growth, blocks left owned, failures and 5xx",
    )
    bench.add_argument(
        "--servers",
        type=lambda text: tuple(text.split(",")),
        default=None,
        help="fleet: which servers, comma-separated, of mlxpaged,mlx_lm.server,mlx-vlm (default all installed)",
    )
    bench.add_argument(
        "--lengths",
        choices=["uniform", "skewed"],
        default="uniform",
        help="batch: prompt lengths uniform over 256-512 tokens (default) or skewed, log-uniform over 128-8192 "
        "(an agent fleet's mix)",
    )
    bench.add_argument(
        "--parts",
        type=bench_parts,
        default=None,
        help="gpu: run only some of decode,batch,ttft (default all); kv: decode (the decode-speed part alone); lora: "
        "batch or decode",
    )
    bench.add_argument(
        "--drafter",
        choices=["ngram", "oracle", "mtp", "dflash", "eagle3"],
        default="ngram",
        help="spec: prompt lookup on repetitive and free-text tasks at batch 1 (default), or an oracle drafting the "
        "plain run's own tokens at no cost, at --concurrency 1,4,16 (the machinery's ceiling), or the model's own MTP "
        "layers, or a DFlash drafter or an EAGLE-3 head (--draft-model PATH), at --concurrency 1,4,16",
    )
    bench.add_argument(
        "--draft-model",
        default=None,
        metavar="NAME",
        help="spec: draft with this model at --concurrency 1,4,16, and beside mlx-lm's own draft_model at batch 1",
    )
    bench.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        help="spec with --drafter oracle / mtp or --draft-model: k (default 4)",
    )
    bench.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prefill, gpu: context in tokens instead of the model's own (16384 for the default "
        "model's 8192: RoPE extrapolates; timings only, no promise about quality)",
    )
    bench.add_argument(
        "--max-batch-tokens",
        type=int,
        default=None,
        help="gpu: tokens one engine step may take, prefill chunks included (default the backend's: 2048, CUDA 8192): "
        "to measure another chunk size on a GPU",
    )
    bench.add_argument(
        "--kv-group-size",
        type=int,
        choices=(64, 32),
        default=None,
        help="kv: elements per scale and bias of the quantized pages (default: 32 at 8 bits, 64 at 4)",
    )
    bench.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="prefill: time to first token in wall time (default) or in this process's CPU "
        "time, steadier on a shared machine",
    )
    bench.set_defaults(func=cmd_bench)

    models = sub.add_parser("models", help="list presets and local models")
    models.add_argument("--verbose", "-v", action="store_true", help="also show BLAS and MLX device")
    models.add_argument(
        "--server",
        nargs="?",
        const="http://127.0.0.1:8000",
        default=None,
        metavar="URL",
        help="also show which models a running `mlxpaged serve` has loaded and their memory "
        "(default URL: http://127.0.0.1:8000; the key from $MLXPAGED_API_KEY)",
    )
    models.set_defaults(func=cmd_models)

    pull = sub.add_parser("pull", help="download / convert a model into the local store")
    pull.add_argument("model", nargs="?", default=None, help="preset, path or hub id (default: the default preset)")
    pull.set_defaults(func=cmd_pull)

    doctor = sub.add_parser(
        "doctor", help="check this machine and the default model; paste the output into bug reports"
    )
    doctor.add_argument("--load", action="store_true", help="also load the default model and time a short generation")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.set_defaults(func=cmd_doctor)

    from mlxpaged_app.launch import add_launch_parser

    add_launch_parser(sub, sorted(sub.choices))  # the commands above, under mlx.launch
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except MlxpagedError as exc:  # a bad model name, too little memory...: one line, no traceback
        print(f"mlxpaged: {exc.render('cli')}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
