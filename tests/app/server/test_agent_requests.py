"""Requests shaped as Codex, opencode and Claude Code send them, through `mlxpaged serve` and the official
`openai` and `anthropic` clients: Codex's /v1/responses body (namespace and hosted tools, include, reasoning,
store, prompt_cache_key, client_metadata), max_tokens past the context in all four APIs, and a client that
hangs up during a long prefill.

Two live servers with the default model: one with a short context (768 tokens: a prompt that nearly fills it
prefills in seconds), one with small engine steps (64 tokens) for the hang-up.
"""

from __future__ import annotations

import re
import time

from tests.app.server.test_agent_units import CODEX_TOOLS
from tests.app.server.test_server_live import KEY, serving

import anthropic
import httpx
import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m"
GREEDY = {"temperature": 0}  # the anthropic SDK 2.x has no sampling parameters; Claude Code sends them
CONTEXT = 768
SENTENCE = " The dragon flew over the old stone bridge."  # 9 tokens in SmolLM2's vocabulary
FILLER = " data"  # one token (both checked below through usage)


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("short"), "--max-model-len", str(CONTEXT), "--log-level", "info") as server:
        yield server


@pytest.fixture(scope="module")
def small_steps(tmp_path_factory):
    with serving(
        tmp_path_factory.mktemp("steps"),
        "--max-batch-tokens",
        "64",
        "--max-model-len",
        "8192",
        "--cache-tokens",
        "8192",
        "--log-level",
        "info",
    ) as server:
        yield server


def _openai(server, timeout: float = 300) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=timeout, max_retries=0)


def _anthropic(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=300, max_retries=0)


# --- Codex's /v1/responses body -----------------------------------------------------------------------------------

CODEX_FIELDS = {
    "include": ["reasoning.encrypted_content"],
    "reasoning": {"effort": "low", "summary": "auto"},
    "store": False,
    "parallel_tool_calls": True,
    "prompt_cache_key": "019a-codex-session",
    "extra_body": {"client_metadata": {"originator": "codex_exec"}},
}
INSTRUCTIONS = "You are a coding agent. Use the tools."
TASK = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Start a helper."}]}]


def test_codex_stream_with_namespace_and_hosted_tools(short):
    client = _openai(short)
    with client.responses.with_streaming_response.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=TASK,
        tools=CODEX_TOOLS,
        tool_choice="auto",
        stream=True,
        max_output_tokens=8,
        temperature=0,
        **CODEX_FIELDS,
    ) as raw:
        warning = raw.headers["x-mlxpaged-warning"]
        kinds = [event.type for event in raw.parse()]
    assert "tools[2] (web_search)" in warning and "tools[3] (image_generation)" in warning and "mcp" in warning
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


def test_a_namespaced_call_and_its_replay(short):
    """Forced, so the tiny model calls; Codex reads the item's namespace and name (its router.rs)."""
    client = _openai(short)
    first = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=TASK,
        tools=CODEX_TOOLS,
        tool_choice={"type": "function", "name": "multi_agent_v1__spawn_agent"},
        max_output_tokens=40,
        temperature=0,
        **CODEX_FIELDS,
    )
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.namespace, call.name) == ("multi_agent_v1", "spawn_agent"), call
    replay = [
        *TASK,
        {
            "type": "function_call",
            "call_id": call.call_id,
            "namespace": call.namespace,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "helper started"},
    ]
    second = client.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=replay,
        tools=CODEX_TOOLS,
        max_output_tokens=4,
        temperature=0,
        **CODEX_FIELDS,
    )
    assert second.status in ("completed", "incomplete")
    # The replayed call renders as the model wrote it: the first turn's prompt is a prefix of the second's.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16


def test_forcing_a_hosted_tool_stays_a_400(short):
    with pytest.raises(openai.BadRequestError) as caught:
        _openai(short).responses.create(
            model=MODEL, input=TASK, tools=CODEX_TOOLS, tool_choice={"type": "web_search"}, max_output_tokens=4
        )
    assert caught.value.body["param"] == "tool_choice" and "web_search" in caught.value.body["message"]


# --- max_tokens past the context: clamped in every API, refused only when the prompt alone does not fit --------


def _words(n: int) -> str:
    """A prompt `n` tokens longer than _words(0) whose reply does not end at once (a page of one repeated word
    makes SmolLM2 answer with its end token)."""
    return "A story:" + SENTENCE * (n // 9) + FILLER * (n % 9) + "\n\nContinue this long story about a dragon."


def _chat(server, n: int, max_tokens: int) -> tuple[str, int, int]:
    r = _openai(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": _words(n)}], max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens


def _completion(server, n: int, max_tokens: int) -> tuple[str, int, int]:
    r = _openai(server).completions.create(model=MODEL, prompt=_words(n), max_tokens=max_tokens, temperature=0)
    return r.choices[0].finish_reason, r.usage.prompt_tokens, r.usage.completion_tokens


def _messages(server, n: int, max_tokens: int) -> tuple[str, int, int]:
    r = _anthropic(server).messages.create(
        model=MODEL, messages=[{"role": "user", "content": _words(n)}], max_tokens=max_tokens, extra_body=GREEDY
    )
    usage = r.usage
    return r.stop_reason, usage.input_tokens + (usage.cache_read_input_tokens or 0), usage.output_tokens


def _responses(server, n: int, max_tokens: int) -> tuple[str, int, int]:
    r = _openai(server).responses.create(model=MODEL, input=_words(n), max_output_tokens=max_tokens, temperature=0)
    return r.status, r.usage.input_tokens, r.usage.output_tokens


APIS = {
    "chat": (_chat, "length"),
    "completions": (_completion, "length"),
    "messages": (_messages, "max_tokens"),
    "responses": (_responses, "incomplete"),
}


@pytest.mark.parametrize("api", APIS)
def test_max_tokens_past_the_context_is_clamped(short, api):
    send, cut = APIS[api]
    _, base, _ = send(short, 0, 1)
    n = CONTEXT - base - 3  # three tokens of room left
    ending, prompt, generated = send(short, n, 32000)
    assert prompt == base + n  # one token per filler word, so the room is exactly three
    assert (ending, prompt + generated) == (cut, CONTEXT)


def _refused(api: str, server, n: int, max_tokens: int) -> tuple[int, str]:
    try:
        APIS[api][0](server, n, max_tokens)
    except (openai.BadRequestError, anthropic.BadRequestError) as exc:
        body = exc.body if api != "messages" else exc.body["error"]
        if api == "messages":
            assert exc.body["type"] == "error" and body["type"] == "invalid_request_error"
        else:
            assert body["code"] == "context_length_exceeded" and body["param"] in ("messages", "prompt", "input")
        return exc.status_code, body["message"]
    pytest.fail(f"{api}: a prompt past the context was served")


@pytest.mark.parametrize("api", APIS)
def test_a_prompt_that_does_not_fit_is_refused_with_the_numbers(short, api):
    status, message = _refused(api, short, CONTEXT + 100, 32000)
    assert status == 400
    prompt = int(re.search(r"the prompt is (\d+) tokens", message).group(1))
    assert prompt > CONTEXT and f"{CONTEXT} tokens" in message
    assert "32000" in message and "--max-model-len" in message and "longer context" in message, message


def test_refusals_and_dropped_tools_are_logged_with_the_endpoint(short):
    _refused("chat", short, CONTEXT + 50, 10)
    _openai(short).responses.create(model=MODEL, input=TASK, tools=CODEX_TOOLS, max_output_tokens=1)
    log = short.log.read_text(errors="replace")
    assert re.search(
        r"refused /v1/chat/completions: 400 context_length_exceeded param=messages "
        r"prompt_tokens=\d+: the prompt is",
        log,
    ), log[-2000:]
    assert re.search(r"POST /v1/responses resp_\w+: hosted tools left out .*tools\[2\] \(web_search\)", log)


# --- a client that hangs up during a long prefill ------------------------------------------------------------------


def _metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


def _until_prefilling(server, deadline: float = 60.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < deadline:
        health = server.health()
        if health["requests_running"] and health["blocks_used"]:
            return
        time.sleep(0.02)
    pytest.fail(f"the request never started: {server.health()}")


def _idle_after(server, deadline: float = 30.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline:
        health = server.health()
        if not (health["requests_running"] or health["requests_waiting"] or health["blocks_used"]):
            return time.monotonic() - start
        time.sleep(0.02)
    pytest.fail(f"the engine kept working after the client left: {server.health()}")


def _long_prompt(word: str) -> str:
    return " ".join(f"{word} {i}" for i in range(1500))  # ~4,500 tokens: tens of 64-token steps


def _abandoned(server, route: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    found = re.search(rf'^mlxpaged_requests_abandoned_total{{model="{MODEL}",route="{route}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _assert_stopped_mid_prefill(server, route: str, before: tuple[float, float, int], seconds: float) -> None:
    cached_before, prompt_before, lines_before = before
    cached = _metric(server, 'mlxpaged_kv_blocks{model="smollm2-135m",state="cached"}') - cached_before
    print(f"\nengine idle {seconds:.2f} s after the hang-up; {cached:.0f} blocks of the prompt had been computed")
    assert seconds < 5.0
    # The blocks computed before the abort stay in the prefix cache: far fewer than the whole prompt's ~280.
    assert cached < 100
    # Logged as left (not only as its 200), and counted: its prompt's ~4,500 tokens among /metrics' prompt tokens.
    deadline = time.monotonic() + 10
    while _abandoned(server, route) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(server, f'mlxpaged_prompt_tokens_total{{model="{MODEL}"}}') - prompt_before > 4000
    left = [line for line in server.log.read_text().splitlines()[lines_before:] if "client left" in line]
    assert len(left) == 1 and f"client left {route} " in left[0] and "withdrawn with" in left[0], left


def _before(server) -> tuple[float, float, int]:
    return (
        _metric(server, 'mlxpaged_kv_blocks{model="smollm2-135m",state="cached"}'),
        _metric(server, f'mlxpaged_prompt_tokens_total{{model="{MODEL}"}}'),
        len(server.log.read_text().splitlines()),
    )


def test_anthropic_stream_hung_up_during_prefill(small_steps):
    before = _before(small_steps)
    with _anthropic(small_steps).messages.stream(
        model=MODEL, max_tokens=32000, extra_body=GREEDY, messages=[{"role": "user", "content": _long_prompt("river")}]
    ) as s:
        assert next(iter(s)).type == "message_start"
        _until_prefilling(small_steps)
    _assert_stopped_mid_prefill(small_steps, "/v1/messages", before, _idle_after(small_steps))


def test_openai_whole_reply_hung_up_during_prefill(small_steps):
    before = _before(small_steps)
    client = _openai(small_steps, timeout=3.0)
    with pytest.raises(openai.APITimeoutError):  # the client gives up and closes the connection
        client.chat.completions.create(
            model=MODEL, max_tokens=100, messages=[{"role": "user", "content": _long_prompt("mountain")}]
        )
    _assert_stopped_mid_prefill(small_steps, "/v1/chat/completions", before, _idle_after(small_steps))
