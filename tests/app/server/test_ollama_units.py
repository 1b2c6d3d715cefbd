"""The Ollama adapter's parts without a server: keep_alive durations (every API's parser), options, model names,
message conversion, model descriptions, the reply budget's per-request context, and errors in Ollama's shape by path."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from mlxpaged_app.server.chat.spec import JsonObjectOutput, JsonSchemaOutput, ReasoningDelta, TextDelta
from mlxpaged_app.server.engine_client import GenerationFailed
from mlxpaged_app.server.errors import APIError, error_response, invalid_param, model_not_found
from mlxpaged_app.server.middleware import needs_key
from mlxpaged_app.server.model_registry import UNSET
from mlxpaged_app.server.ollama import options as opts
from mlxpaged_app.server.ollama.convert import chat_messages
from mlxpaged_app.server.ollama.model_info import human_number, parameter_count
from mlxpaged_app.server.ollama.models import served_model, tagged
from mlxpaged_app.server.ollama.protocol import ChatRequest, Message, Options
from mlxpaged_app.server.ollama.shapes import ChatShape
from mlxpaged_app.server.param_names import OLLAMA_CHAT
from mlxpaged_app.server.reply_budget import reply_budget
from mlxpaged_app.server.serving import request_keep_alive, stream_events
from tests.tiny_models import tiny_llama

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from pydantic import ValidationError


@pytest.mark.parametrize(
    ("sent", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("2h45m30.5s", 2 * 3600 + 45 * 60 + 30.5),
        (".5h", 1800.0),
        ("300ms", 0.3),
        ("0", 0.0),
        ("300", 300.0),
        (300.0, 300.0),
        (0.0, 0.0),
        ("10us", 1e-5),
        ("+5m", 300.0),
        (-1.0, None),  # never unload
        ("-1", None),
        ("-5m", None),
    ],
)
def test_keep_alive_durations(sent, seconds):
    assert request_keep_alive(sent) == (None if seconds is None else pytest.approx(seconds))
    assert request_keep_alive(None) is UNSET  # not sent: the model keeps its own


@pytest.mark.parametrize("sent", ["", "m", "5 minutes", "5mx", "nan", "inf", "1.2.3s", ".s"])
def test_keep_alive_that_is_not_a_duration_is_a_400(sent):
    with pytest.raises(APIError) as refused:
        request_keep_alive(sent)
    assert refused.value.status == 400 and refused.value.param == "keep_alive"


def test_options_map_to_this_servers_sampling_fields():
    options = Options.model_validate(
        {"repeat_penalty": 1.1, "seed": -1, "top_k": -5, "temperature": 0, "num_predict": 100.0, "mirostat": 2}
    )
    assert options.num_predict == 100 and isinstance(options.num_predict, int)  # Go reads 100.0 as 100 too
    sampling = opts.sampling_request(options)
    assert sampling.model_fields_set == {"repetition_penalty", "top_k", "temperature"}  # seed -1: random
    assert (sampling.repetition_penalty, sampling.top_k, sampling.temperature) == (1.1, 0, 0.0)
    assert opts.reply_length(options) == (100, False)
    assert opts.reply_length(Options(num_predict=-1)) == opts.reply_length(Options(num_predict=-2)) == (None, True)
    assert opts.reply_length(None) == (None, False)
    with pytest.raises(ValidationError):
        Options.model_validate({"num_predict": 2.5})
    with pytest.raises(ValidationError):
        Options.model_validate({"use_mmap": 1})


def test_num_ctx_narrows_the_context_and_never_widens_it():
    assert opts.context_limit(Options(num_ctx=512), 4096) == 512
    assert opts.context_limit(Options(num_ctx=8192), 4096) is None  # runs within the server's context
    assert opts.context_limit(None, 4096) is None
    with pytest.raises(APIError):
        opts.context_limit(Options(num_ctx=0), 4096)


def test_format_think_and_logprobs():
    assert opts.output_format(None) is None and opts.output_format("") is None
    assert opts.output_format("json") == JsonObjectOutput()
    assert opts.output_format({"type": "object"}) == JsonSchemaOutput({"type": "object"}, strict=False)
    with pytest.raises(APIError):
        opts.output_format(["json"])
    assert opts.reasoning("max", "m", thinks=True).kwargs() == {"enable_thinking": True, "reasoning_effort": "high"}
    assert opts.reasoning(False, "m", thinks=False).kwargs() == {"enable_thinking": False}
    with pytest.raises(APIError):
        opts.reasoning(True, "m", thinks=False)
    assert opts.logprobs(None, 5) == (False, 0) and opts.logprobs(True, None) == (True, 0)
    with pytest.raises(APIError):
        opts.logprobs(True, 21)


def _state(*names: str):
    """A server whose registry knows `names` (each one model, named by itself)."""

    async def lookup(name, keep_alive, kind):
        if name not in names:
            raise model_not_found(name, list(names))
        return name

    return SimpleNamespace(served_model=lookup)


def test_served_model_takes_the_latest_tag():
    state = _state("smollm2-135m", "odd:latest")

    def served(requested):
        return asyncio.run(served_model(state, requested))

    assert served("smollm2-135m") == served("smollm2-135m:latest") == "smollm2-135m"
    assert served("odd:latest") == "odd:latest"  # a name that has the tag itself is still found
    assert tagged("smollm2-135m") == "smollm2-135m:latest" and tagged("m:q4") == "m:q4"
    for requested, status in (("smollm2-135m:q4", 404), ("llama3.2", 404), ("", 400), (None, 400)):
        with pytest.raises(APIError) as refused:
            served(requested)
        assert refused.value.status == status


def test_chat_messages_tie_tool_results_to_their_calls():
    calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {"zone": "CET"}}, "id": "t1"},
        {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
    ]
    body = ChatRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "User", "content": "Weather?"},
                {"role": "assistant", "content": "", "thinking": "hm", "tool_calls": calls},
                {"role": "tool", "tool_name": "get_weather", "content": "21"},
                {"role": "tool", "tool_call_id": "t1", "content": "14:05"},
            ],
        }
    )
    user, assistant, weather, time_ = chat_messages(body.messages or [])
    assert user == {"role": "user", "content": "Weather?"}
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_0", "t1", "call_2"]
    assert assistant["reasoning_content"] == "hm" and assistant["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }
    assert weather == {"role": "tool", "content": "21", "tool_call_id": "call_2", "name": "get_weather"}  # latest
    assert time_ == {"role": "tool", "content": "14:05", "tool_call_id": "t1", "name": "get_time"}
    with pytest.raises(APIError):
        chat_messages([Message(role="robot", content="x")])
    # Images (base64) come before the text, decoded; a vision model reads them, a text model refuses them at render.
    [turn] = chat_messages([Message(role="user", content="x", images=["aGk="])])
    assert turn["content"] == [{"type": "image", "image": b"hi"}, {"type": "text", "text": "x"}]
    with pytest.raises(APIError, match=r"messages\[0\]\.images\[0\] is not valid base64"):
        chat_messages([Message(role="user", content="x", images=["@@"])])
    with pytest.raises(APIError, match="only user and tool messages carry images"):
        chat_messages([Message(role="assistant", content="x", images=["aGk="])])


@pytest.mark.parametrize(
    ("count", "shown"),  # Ollama's own table (format/format_test.go)
    [
        (0, "0"),
        (999, "999"),
        (1000, "1K"),
        (1001, "1K"),
        (1000000, "1M"),
        (125000000, "125M"),
        (500500000, "500.50M"),
        (500550000, "500.55M"),
        (1000000000, "1B"),
        (2800000000, "2.8B"),
        (2850000000, "2.9B"),
        (1000000000000, "1000B"),
    ],
)
def test_parameter_size_as_ollama_writes_it(count, shown):
    assert human_number(count) == shown


@pytest.mark.parametrize("bits", [None, 3, 4, 8])
def test_parameter_count_of_a_checkpoint_equals_the_models_own(tmp_path, bits):
    """Counted from the safetensors headers, packed quantized weights unpacked; against the float model's count."""
    model = tiny_llama()
    expected = sum(value.size for _, value in tree_flatten(model.parameters()))
    config: dict = {"model_type": "llama"}
    if bits is not None:
        nn.quantize(model, group_size=32, bits=bits)
        config["quantization"] = {"group_size": 32, "bits": bits}
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert parameter_count(tmp_path, config) == expected


def test_reply_budget_within_a_requests_own_context():
    state = SimpleNamespace(context_limit=100, cache_limits_context=False, default_max_tokens=16)
    assert reply_budget(state, 30, None, OLLAMA_CHAT) == 16
    assert reply_budget(state, 30, None, OLLAMA_CHAT, limit=50, to_context_end=True) == 20
    assert reply_budget(state, 30, None, OLLAMA_CHAT, to_context_end=True) == 70
    assert reply_budget(state, 30, 500, OLLAMA_CHAT, limit=60) == 30
    with pytest.raises(APIError) as narrow:
        reply_budget(state, 60, None, OLLAMA_CHAT, limit=50)
    assert "options.num_ctx" in narrow.value.message and "100" in narrow.value.message
    with pytest.raises(APIError) as wide:
        reply_budget(state, 120, None, OLLAMA_CHAT, limit=500)
    assert "options.num_ctx" not in wide.value.message and "--max-model-len" in wide.value.message


def test_errors_take_ollamas_shape_under_api():
    error = invalid_param("options.temperature", "options.temperature must be a number")
    ollama = error_response(error, "/api/chat")
    assert ollama.status_code == 400 and json.loads(ollama.body) == {"error": "options.temperature must be a number"}
    openai = json.loads(error_response(error, "/v1/chat/completions").body)
    assert openai["error"]["param"] == "options.temperature"
    assert needs_key("/api/chat") and needs_key("/api/tags") and needs_key("/v1/models")
    assert not needs_key("/api/version") and not needs_key("/") and not needs_key("/health")


def test_a_failure_mid_stream_is_one_error_line_after_the_ndjson_lines():
    """Ollama's streamed error: the lines so far, then `{"error": ...}` (the status is out already)."""

    async def items():
        yield 0, [TextDelta("Hi"), ReasoningDelta("hm")]
        raise GenerationFailed("generation failed: the engine stopped")

    async def collect() -> list[bytes]:
        shape = ChatShape("m", run=None, token_text=None)  # type: ignore[arg-type]  # neither is read on failure
        return [frame async for frame in stream_events(shape, items(), usage=dict)]

    frames = asyncio.run(collect())
    assert all(frame.endswith(b"\n") and frame.count(b"\n") == 1 for frame in frames)
    first, last = (json.loads(frame) for frame in frames)
    assert first["message"] == {"role": "assistant", "content": "Hi", "thinking": "hm"} and first["done"] is False
    assert last == {"error": "generation failed: the engine stopped"}
    assert ChatShape.media_type == "application/x-ndjson"
