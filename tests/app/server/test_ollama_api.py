"""The Ollama API through `mlxpaged serve` and the official `ollama` client, on the real default model (SmolLM2):
chat and generate (whole and streamed as NDJSON), tags, show, ps, version, `/`, structured `format`, options
(temperature, seed, num_predict, num_ctx, stop), logprobs, load / unload replies, and errors in Ollama's shape.

One server per module (started with an API key: /api/ needs it too); replies are kept short. Tool calls and
thinking run on the scripted model in test_ollama_tools.py.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from tests.app.server.test_server_live import KEY, serving

import httpx
import jsonschema
import ollama
import pytest
from tokenizers import Tokenizer

pytestmark = pytest.mark.slow
SMOL = "smollm2-135m"
AUTH = {"Authorization": f"Bearer {KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}
TIMINGS = (
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    with serving(tmp_path_factory.mktemp("ollama"), "--max-body-size", "64KB") as server:
        yield ollama.Client(host=server.url, headers=AUTH, timeout=300), server


@pytest.fixture(scope="module")
def http(smol):
    _, server = smol
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as client:
        yield client


def _tokenizer() -> Tokenizer:
    from mlxpaged.loading.loader import locate_model

    _, path = locate_model()
    return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))


def _parses_as_rfc3339(text: str) -> bool:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).tzinfo is not None


# --- probes and model listings ---------------------------------------------------------------------------------


def test_root_and_version_answer_without_the_key(smol):
    _, server = smol
    root = httpx.get(server.url + "/", timeout=30)
    assert root.status_code == 200 and root.text == "Ollama is running"
    assert httpx.head(server.url + "/", timeout=30).status_code == 200
    version = httpx.get(server.url + "/api/version", timeout=30).json()["version"]
    assert [int(part) for part in version.split(".")] >= [0, 9, 0]  # clients gate `think` and tools on it


def test_the_key_guards_the_api(smol):
    _, server = smol
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.url, timeout=30).list()
    assert refused.value.status_code == 401 and "API key" in refused.value.error
    raw = httpx.get(server.url + "/api/tags", timeout=30)
    assert raw.status_code == 401 and set(raw.json()) == {"error"}


def test_tags_show_and_ps_describe_the_served_model(smol, http):
    client, _ = smol
    [listed] = client.list().models
    assert listed.model == f"{SMOL}:latest" and listed.size > 0 and len(listed.digest) == 64
    assert listed.details.family == "llama" and listed.details.format == "safetensors"
    assert listed.details.parameter_size.endswith("M")
    card = http.get("/v1/models").json()["data"][0]
    shown = client.show(SMOL)
    assert shown.capabilities == ["completion", "tools"]  # SmolLM2 does not think
    info = shown.modelinfo
    assert info["general.architecture"] == "llama" and info["llama.context_length"] == card["max_model_len"]
    assert info["general.parameter_count"] > 100_000_000
    defaults = card["mlxpaged"]["sampling_defaults"]  # the model's own, as /v1/models reports them
    assert dict(line.split() for line in shown.parameters.splitlines()) == {k: str(v) for k, v in defaults.items()}
    assert "{%" in shown.template  # the model's own (Jinja) chat template
    [loaded] = client.ps().models
    assert loaded.model == listed.model and loaded.digest == listed.digest
    assert loaded.context_length == card["max_model_len"] and loaded.size > listed.size  # weights + KV cache
    left = loaded.expires_at - dt.datetime.now(dt.UTC)  # the default keep-alive (5 minutes) after its last use
    assert dt.timedelta(minutes=4) < left <= dt.timedelta(minutes=5, seconds=1)
    assert http.head("/api/tags").status_code == 200


# --- chat and generate -------------------------------------------------------------------------------------------


def test_chat_whole_reply(smol, http):
    client, _ = smol
    reply = client.chat(model=SMOL, messages=FRANCE, options={**GREEDY, "num_predict": 20})
    assert reply.model == SMOL and reply.done and reply.done_reason == "stop"
    assert reply.message.role == "assistant" and "Paris" in reply.message.content
    assert _parses_as_rfc3339(reply.created_at)
    assert all(isinstance(reply[name], int) for name in TIMINGS)
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration > 0
    openai = http.post("/v1/chat/completions", json={"model": SMOL, "messages": FRANCE, "max_tokens": 1}).json()
    assert reply.prompt_eval_count == openai["usage"]["prompt_tokens"] and 0 < reply.eval_count <= 20


def test_chat_stream_matches_the_whole_reply(smol):
    client, _ = smol
    whole = client.chat(model=SMOL, messages=FRANCE, options={**GREEDY, "num_predict": 12})
    parts = list(client.chat(model=SMOL, messages=FRANCE, options={**GREEDY, "num_predict": 12}, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    last = parts[-1]
    assert last.message.content == "" and last.done_reason == whole.done_reason
    assert last.eval_count == whole.eval_count and last.prompt_eval_count == whole.prompt_eval_count
    assert all(p.total_duration is None for p in parts[:-1])  # timings only on the last line


def test_name_with_latest_tag_and_the_reply_names_it_so(smol):
    client, _ = smol
    reply = client.chat(model=f"{SMOL}:latest", messages=FRANCE, options={**GREEDY, "num_predict": 4})
    assert reply.model == f"{SMOL}:latest" and reply.eval_count == 4 and reply.done_reason == "length"


def test_generate_stream_whole_and_context(smol):
    client, _ = smol
    ask = "Name one colour."
    whole = client.generate(model=SMOL, prompt=ask, options={**GREEDY, "num_predict": 6})
    parts = list(client.generate(model=SMOL, prompt=ask, options={**GREEDY, "num_predict": 6}, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done and not parts[0].done
    assert parts[-1].context == whole.context
    # context: the prompt's token ids, then the reply's
    assert len(whole.context) == whole.prompt_eval_count + whole.eval_count
    assert _tokenizer().decode(whole.context[whole.prompt_eval_count :]) == whole.response
    follow = client.generate(model=SMOL, prompt="Another.", context=whole.context, options={**GREEDY, "num_predict": 3})
    assert follow.prompt_eval_count > len(whole.context)  # the old conversation, then the new turn


def test_raw_generate_sends_the_prompt_as_it_is(smol):
    client, _ = smol
    prompt = "The capital of France is"
    reply = client.generate(model=SMOL, prompt=prompt, raw=True, options={**GREEDY, "num_predict": 4})
    assert reply.prompt_eval_count == len(_tokenizer().encode(prompt, add_special_tokens=False).ids)
    assert reply.context is None and reply.response.startswith(" ")  # continues the text, no template, no context
    assert "Paris" in reply.response


# --- options ----------------------------------------------------------------------------------------------------


def test_temperature_zero_is_deterministic_and_a_seed_reproduces(smol):
    client, _ = smol
    greedy = [client.chat(model=SMOL, messages=FRANCE, options={**GREEDY, "num_predict": 10}) for _ in range(2)]
    assert greedy[0].message.content == greedy[1].message.content
    hot = {"temperature": 1.5, "top_k": 0, "top_p": 1.0, "seed": 11, "num_predict": 10}
    seeded = [client.chat(model=SMOL, messages=FRANCE, options=hot) for _ in range(2)]
    assert seeded[0].message.content == seeded[1].message.content


def test_num_predict_ends_with_length(smol):
    client, _ = smol
    reply = client.generate(model=SMOL, prompt="Write a long story about a dragon.", options={"num_predict": 3})
    assert reply.done_reason == "length" and reply.eval_count == 3


def test_num_predict_minus_one_runs_to_the_end_of_num_ctx(smol):
    client, _ = smol
    ask = [{"role": "user", "content": "Count from 1 to 500, one number a line."}]
    probe = client.chat(model=SMOL, messages=ask, options={**GREEDY, "num_predict": 1})
    num_ctx = probe.prompt_eval_count + 7
    reply = client.chat(model=SMOL, messages=ask, options={**GREEDY, "num_predict": -1, "num_ctx": num_ctx})
    assert reply.done_reason == "length" and reply.prompt_eval_count + reply.eval_count == num_ctx


def test_stop_strings(smol):
    client, _ = smol
    reply = client.chat(model=SMOL, messages=FRANCE, options={**GREEDY, "num_predict": 20, "stop": ["Paris"]})
    assert "Paris" not in reply.message.content and reply.done_reason == "stop"


def test_format_json_and_a_schema(smol):
    client, _ = smol
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    anything = client.chat(model=SMOL, messages=ask, format="json", options={**GREEDY, "num_predict": 40})
    assert anything.message.content.startswith("{")
    if anything.done_reason == "stop":  # an object the model keeps growing may be cut by num_predict
        assert isinstance(json.loads(anything.message.content), dict)
    shaped = client.chat(model=SMOL, messages=ask, format=PERSON, options={**GREEDY, "num_predict": 60})
    assert shaped.done_reason == "stop"
    jsonschema.validate(json.loads(shaped.message.content), PERSON)
    generated = client.generate(model=SMOL, prompt="A person as JSON:", format=PERSON, options={"num_predict": 60})
    jsonschema.validate(json.loads(generated.response), PERSON)


def test_logprobs(smol, http):
    client, _ = smol
    reply = client.chat(
        model=SMOL, messages=FRANCE, logprobs=True, top_logprobs=2, options={**GREEDY, "num_predict": 5}
    )
    assert len(reply.logprobs) == reply.eval_count
    first = reply.logprobs[0]
    assert first.logprob <= 0 and len(first.top_logprobs) == 2
    assert first.top_logprobs[0].logprob == pytest.approx(first.logprob)  # greedy: the top token was taken


# --- load, unload, errors ---------------------------------------------------------------------------------------


def test_load_and_unload_replies(smol):
    client, _ = smol
    loaded = client.chat(model=SMOL, messages=[])
    assert loaded.done and loaded.done_reason == "load" and loaded.message.content == ""
    unloaded = client.generate(model=SMOL, keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload" and unloaded.response == ""
    kept = client.generate(model=SMOL, prompt="Hi", keep_alive="1h30m", options={"num_predict": 2})
    assert kept.done_reason == "length"


def test_unknown_model_is_a_404(smol):
    client, _ = smol
    for call in (
        lambda: client.chat(model="llama3.2", messages=FRANCE),
        lambda: client.generate(model="llama3.2", prompt="Hi"),
        lambda: client.show("llama3.2"),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            call()
        assert refused.value.status_code == 404 and "llama3.2" in refused.value.error


def test_bad_options_are_400s_naming_the_option(smol):
    client, _ = smol
    for options, named in (
        ({"temperature": "hot"}, "options.temperature"),
        ({"num_predict": 2.5}, "options.num_predict"),
        ({"temperature": -1}, "temperature"),
        ({"stop": "x"}, "options.stop"),
        ({"num_ctx": 0}, "options.num_ctx"),
    ):
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model=SMOL, messages=FRANCE, options=options)
        assert refused.value.status_code == 400 and named in refused.value.error, options


@pytest.mark.parametrize(
    ("path", "body", "said"),
    [
        ("/api/chat", b"{not json", "malformed JSON"),
        ("/api/chat", b"", "empty"),
        ("/api/chat", {"messages": FRANCE}, "'model' is required"),
        ("/api/chat", {"model": SMOL, "messages": FRANCE, "think": True}, "does not support thinking"),
        ("/api/chat", {"model": SMOL, "messages": FRANCE, "think": "extreme"}, "invalid think value"),
        ("/api/chat", {"model": SMOL, "messages": FRANCE, "keep_alive": "5 minutes"}, "keep_alive"),
        ("/api/chat", {"model": SMOL, "messages": FRANCE, "format": "xml"}, "invalid format"),
        ("/api/chat", {"model": SMOL, "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        ("/api/chat", {"model": SMOL, "messages": FRANCE, "options": {"num_ctx": 8}}, "options.num_ctx"),
        ("/api/chat", {"model": SMOL, "messages": [{"role": "user", "content": "hi " * 6000}]}, "does not fit"),
        ("/api/chat", {"model": SMOL, "messages": FRANCE, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/api/generate", {"model": SMOL, "prompt": "x", "suffix": "y"}, "suffix"),
        ("/api/generate", {"model": SMOL, "prompt": "x", "raw": True, "system": "y"}, "raw mode"),
        ("/api/generate", {"model": SMOL, "prompt": "x", "images": ["aGk="]}, "images"),
        ("/api/generate", {"model": SMOL, "prompt": "x", "context": [10**9]}, "out of range"),
    ],
)
def test_bad_input_is_a_400_in_ollamas_shape(http, path, body, said):
    response = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert set(response.json()) == {"error"} and said in response.json()["error"]


def test_unknown_route_and_method_in_ollamas_shape(http):
    assert http.post("/api/pull", json={"model": SMOL}).json().keys() == {"error"}
    wrong = http.get("/api/chat")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_leaving_a_stream_frees_its_blocks(smol, http):
    _, server = smol
    body = {"model": SMOL, "prompt": "Write a long story about a dragon.", "options": {"num_predict": 1000}}
    with http.stream("POST", "/api/generate", json=body) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        reading = response.iter_lines()  # kept: a dropped line iterator closes the connection when collected
        lines = [json.loads(next(reading)) for _ in range(3)]
        assert [line["done"] for line in lines] == [False] * 3
        assert server.health()["blocks_used"] > 0
    server.blocks_back()


def test_readme_example_runs(smol):
    """The README's Ollama example as written, pointed at this server."""
    _, server = smol
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    code = readme.split("### The Ollama API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    code = code.replace("ollama.Client()", f"ollama.Client(host={server.url!r}, headers={AUTH!r})")
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert "Paris" in scope["reply"].message.content and scope["reply"].done_reason == "stop"
    jsonschema.validate(json.loads(scope["shaped"].message.content), scope["person"])
