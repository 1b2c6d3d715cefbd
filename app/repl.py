"""A plain streaming chat REPL: the `mlxpaged chat` front end until the Textual app lands."""

from __future__ import annotations

import sys

from mlxpaged.blas import blas_status
from mlxpaged.model import baseline_stream, chat_prompt, load_model, print_progress

HELP = "Type a message and press Enter. /reset starts a new chat, /exit (or Ctrl-D) quits."


def run_repl(model_name: str | None, max_tokens: int, temperature: float) -> int:
    print("Loading model...", file=sys.stderr)
    loaded = load_model(model_name, progress=print_progress)
    blas = blas_status()
    print(f"mlxpaged chat - {loaded.name} ({loaded.dtype}, BLAS: {blas.name})")
    if not blas.fast:
        print(f"hint: {blas.detail}")
    print(HELP)
    messages: list[dict] = []
    while True:
        try:
            line = input("\nyou> ").strip()
        except EOFError:
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages.clear()
            print("(new chat)")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        reply = _stream_reply(loaded, messages, max_tokens, temperature)
        messages.append({"role": "assistant", "content": reply})


def _stream_reply(loaded, messages: list[dict], max_tokens: int, temperature: float) -> str:
    prompt = chat_prompt(loaded.tokenizer, messages)
    sys.stdout.write("bot> ")
    pieces, last = [], None
    try:
        for last in baseline_stream(loaded, prompt, max_tokens=max_tokens, temperature=temperature):
            pieces.append(last.text)
            sys.stdout.write(last.text)
            sys.stdout.flush()
    except KeyboardInterrupt:
        sys.stdout.write(" [stopped]")
    if last is not None:
        sys.stdout.write(f"\n     ({last.prompt_tokens} prompt tokens, {last.generation_tps:.1f} tok/s)\n")
    return "".join(pieces)
