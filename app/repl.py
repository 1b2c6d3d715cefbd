"""`mlxpaged chat --plain`: a line-mode chat over the paged `Engine`, for ssh sessions and pipes.

Each input line is a user turn and its reply streams to stdout; loading, the banner, per-reply
stats and errors go to stderr, so `echo "question" | mlxpaged chat --plain` prints only the answer.
Sampling settings are the chat app's (ChatSettings: unset temperature / top_p are the model's); a blank
system prompt leaves the model's own.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from mlxpaged.engine.engine import Engine, RequestFailedError
from mlxpaged.loading.progress import print_progress
from mlxpaged.platform.blas import blas_status
from mlxpaged_app.tui.generation import ReplyStats
from mlxpaged_app.tui.protocol import adapter_name
from mlxpaged_app.tui.settings import ChatSettings

HELP = "Type a message and press Enter. /reset starts a new chat, /exit (or Ctrl-D) quits; Ctrl-C stops a reply."


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_plain_chat(
    model: str | None,
    settings: ChatSettings,
    system: str,
    cache_tokens: int,
    speculative: str | None = None,
    kv_disk: dict | None = None,
    kv_bits: int | None = None,
    lora: str | None = None,
    draft: dict | None = None,
) -> int:
    """Chat until EOF or /exit (exit code 0); `lora`: an adapter directory every turn runs with; `draft`: a draft
    model (Engine.from_pretrained's draft_model and num_speculative_tokens)."""
    say(f"Loading {model or 'the default model'}...")
    adapter = adapter_name(lora) if lora else None
    with Engine.from_pretrained(
        model,
        print_progress,
        {adapter: lora} if adapter and lora else None,
        cache_tokens=cache_tokens,
        kv_bits=kv_bits,
        speculative=speculative,
        **(kv_disk or {}),
        **(draft or {}),
    ) as engine:
        blas = blas_status()
        say(
            f"mlxpaged chat - {engine.loaded.name} ({engine.loaded.dtype}, BLAS: {blas.name}); "
            f"{settings.describe(engine.generation_defaults)}"
        )
        if not blas.fast:
            say(f"hint: {blas.detail}")
        interactive = sys.stdin.isatty()
        if interactive:
            say(HELP)
        PlainChat(engine, settings, system, adapter).run(sys.stdin, sys.stdout, interactive)
    return 0


class PlainChat:
    """The conversation and its loop: read a line, stream the reply, keep both turns."""

    def __init__(self, engine, settings: ChatSettings, system: str, adapter: str | None = None) -> None:
        self.engine, self.params = engine, settings.sampling_params(engine.generation_defaults)
        self.adapter = adapter  # the engine's adapter every turn runs with (chat --lora)
        self.system = [{"role": "system", "content": system}] if system.strip() else []  # as the chat app does
        self.turns: list[dict] = []

    def run(self, lines: TextIO, out: TextIO, interactive: bool) -> None:
        while (line := _read_line(lines, interactive)) is not None:
            if line in ("/exit", "/quit"):
                return
            if line == "/reset":
                self.turns.clear()
                say("(new chat)")
            elif line:
                self.reply(line, out, interactive)

    def reply(self, text: str, out: TextIO, interactive: bool) -> None:
        """Stream one reply and keep both turns; a refused or failed turn is dropped, and said why."""
        messages = self.system + self.turns + [{"role": "user", "content": text}]
        stream = self.engine.stream(self.engine.chat_tokens(messages), self.params, adapter=self.adapter)
        try:
            reply, stats = _stream_to(out, stream, "bot> " if interactive else "")
        except (ValueError, RequestFailedError) as exc:  # too long for the context or the cache; an engine failure
            say(f"error: {exc}")
            return
        self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
        say(f"({stats.describe()})")


def _read_line(lines: TextIO, interactive: bool) -> str | None:
    """The next line, stripped; None at end of input."""
    if interactive:
        try:
            return input("\nyou> ").strip()
        except EOFError:
            return None
    line = lines.readline()
    return line.strip() if line else None


def _stream_to(out: TextIO, stream, prefix: str) -> tuple[str, ReplyStats]:
    """Write the deltas to `out` as they come; Ctrl-C stops the reply (the engine frees its blocks).
    The request is submitted at the first `next`, so a refusal raises before anything is written."""
    started = time.perf_counter()
    pieces, final, first_token = [], None, None
    try:
        for delta in stream:
            if not pieces:
                out.write(prefix)
            if first_token is None and delta.token_id is not None:
                first_token = time.perf_counter()
            pieces.append(delta.text)
            out.write(delta.text)
            out.flush()
            final = delta if delta.finish_reason is not None else final
    except KeyboardInterrupt:
        out.write(" [stopped]")
    finally:
        stream.close()  # aborts the request if it has not finished
    out.write("\n")
    out.flush()
    return "".join(pieces), _reply_stats(final, started, first_token)


def _reply_stats(final, started: float, first_token: float | None) -> ReplyStats:
    """The chat app's per-reply stats: tokens/s counts from the first token on."""
    if final is None:  # stopped before the engine's final event
        return ReplyStats(finish_reason="abort")
    ended, rate = time.perf_counter(), None
    if first_token is not None and final.completion_tokens > 1 and ended > first_token:
        rate = (final.completion_tokens - 1) / (ended - first_token)
    ttft = first_token - started if first_token is not None else None
    return ReplyStats(
        final.prompt_tokens, final.cached_tokens, final.completion_tokens, ttft, rate, final.finish_reason
    )
