"""`mlxpaged chat --plain`: the line-mode chat over the paged engine (app/repl.py).

Fast: the conversation loop over a fake engine, and the CLI's refusals. Slow: the real model as a
subprocess with piped stdin, its answer compared with the Python API's for the same settings.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

from mlxpaged.engine.engine import StreamDelta
from mlxpaged.errors import RequestTooLongError
from mlxpaged.loading.generation_defaults import NO_DEFAULTS
from mlxpaged_app.cli import main
from mlxpaged_app.repl import PlainChat
from mlxpaged_app.tui.settings import ChatSettings

import pytest

FRANCE = "What is the capital of France?"


class FakeEngine:
    """Replies "<n>:<last user text>" in two deltas; a user text in `refuse` is too long, as the engine says."""

    def __init__(self, refuse: tuple[str, ...] = ()) -> None:
        self.refuse, self.conversations, self.params, self.adapters = refuse, [], [], []
        self.generation_defaults = NO_DEFAULTS

    def chat_tokens(self, messages: list[dict]) -> list[dict]:
        self.conversations.append(messages)
        return messages

    def stream(self, prompt: list[dict], params, adapter: str | None = None):
        """A generator, like Engine.stream: the request is checked at the first `next`."""
        self.params.append(params)
        self.adapters.append(adapter)
        text = prompt[-1]["content"]
        if text in self.refuse:
            raise RequestTooLongError(5000, params.max_tokens, 4096, "model context")
        yield StreamDelta("r", f"{len(self.conversations)}:", token_id=1)
        yield StreamDelta("r", text, token_id=2, finish_reason="stop", prompt_tokens=7, completion_tokens=2)


def chat(engine: FakeEngine, lines: str, system: str = "be brief") -> tuple[str, PlainChat]:
    out = io.StringIO()
    plain = PlainChat(engine, ChatSettings(temperature=0.0, max_tokens=9, seed=3), system)
    plain.run(io.StringIO(lines), out, interactive=False)
    return out.getvalue(), plain


def test_turns_are_kept_reset_clears_them_and_exit_stops_reading():
    engine = FakeEngine()
    out, _ = chat(engine, "hi\n\nagain\n/reset\nnew\n/exit\nnever sent\n")
    assert out == "1:hi\n2:again\n3:new\n"
    system = {"role": "system", "content": "be brief"}
    assert engine.conversations == [
        [system, {"role": "user", "content": "hi"}],
        [
            system,
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "1:hi"},
            {"role": "user", "content": "again"},
        ],
        [system, {"role": "user", "content": "new"}],
    ]
    assert {(p.temperature, p.max_tokens, p.seed) for p in engine.params} == {(0.0, 9, 3)}


def test_a_blank_system_prompt_sends_none():
    engine = FakeEngine()
    chat(engine, "hi\n", system="  ")
    assert engine.conversations == [[{"role": "user", "content": "hi"}]]


def test_a_refused_turn_is_dropped_with_the_reason_and_the_chat_goes_on(capsys):
    engine = FakeEngine(refuse=("too long",))
    out, plain = chat(engine, "hi\ntoo long\nagain\n")
    assert out == "1:hi\n3:again\n"  # nothing of the refused turn on stdout
    assert "error: prompt (5000 tokens) + max_tokens (9)" in capsys.readouterr().err
    assert [m["content"] for m in plain.turns] == ["hi", "1:hi", "again", "3:again"]


def test_cli_refuses_bad_settings_before_loading(capsys):
    assert main(["chat", "--plain", "--resume"]) == 2
    assert "--plain keeps none" in capsys.readouterr().err
    assert main(["chat", "--plain", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature" in err and "Loading" not in err


@pytest.mark.slow
def test_piped_question_gets_the_engines_answer_and_eof_exits_0(default_loaded):
    from mlxpaged.config import CacheConfig
    from mlxpaged.engine.engine import Engine
    from mlxpaged.sampling_params import SamplingParams

    # ~1,000 tokens: past the 512-token cache (768 with its per-sequence slack), so refused with the
    # numbers, and the chat goes on to EOF
    long_line = "word " * 1000
    command = [
        sys.executable,
        "-m",
        "mlxpaged_app.cli",
        "chat",
        "--plain",
        "--temperature",
        "0",
        "--max-tokens",
        "20",
        "--cache-tokens",
        "512",
    ]
    env = {k: v for k, v in os.environ.items() if k != "MLXPAGED_API_KEY"}
    done = subprocess.run(
        command, input=f"{FRANCE}\n{long_line}\n", capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    with Engine(default_loaded, CacheConfig(cache_tokens=512)) as engine:
        expected = engine.chat([{"role": "user", "content": FRANCE}], SamplingParams(temperature=0.0, max_tokens=20))
    assert "Paris" in expected.text
    assert done.stdout == expected.text + "\n"
    assert "exceeds the" in done.stderr and "tok/s" in done.stderr and "Traceback" not in done.stderr


def test_every_turn_runs_with_the_chats_adapter():
    """`chat --plain --lora PATH`: each turn names the adapter; without one, none."""
    engine = FakeEngine()
    PlainChat(engine, ChatSettings(), "", adapter="pirate").run(io.StringIO("hi\nagain\n"), io.StringIO(), False)
    chat(engine, "plain\n")
    assert engine.adapters == ["pirate", "pirate", None]


def test_the_chat_apps_engine_submits_every_turn_with_its_adapter():
    """`chat --lora PATH` (the Textual app): the engine it gets submits with the adapter, named after the directory."""
    from mlxpaged_app.tui.protocol import AdaptedChatEngine, adapter_name

    submitted = []

    class Engine:
        loaded = "the model"

        def submit(self, prompt, params, sink, adapter=None):
            submitted.append((prompt, adapter))
            return "req-1"

    engine = AdaptedChatEngine(Engine(), adapter_name("/adapters/pirate/"))
    assert engine.submit([1, 2], None, print) == "req-1" and submitted == [([1, 2], "pirate")]
    assert engine.loaded == "the model"  # the rest is the engine's own
