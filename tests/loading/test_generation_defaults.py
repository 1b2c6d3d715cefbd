"""The model's own sampling defaults (mlxpaged.loading.generation_defaults) and where they apply.

Fast: parsing generation_config.json, the preset filling gaps, conversion writing them, precedence
(request > model > API) on both endpoints over the server's fake engine, --generation-config, /v1/models,
the chat app's settings, chat --plain, doctor. Slow: the real default model carries its card's settings,
and a request without temperature samples exactly as one with temperature=0.2, top_p=0.9.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from mlxpaged.engine.engine import Engine
from mlxpaged.loading import model_store as models
from mlxpaged.loading.generation_defaults import (
    NO_DEFAULTS,
    GenerationConfigError,
    GenerationDefaults,
    load_defaults,
    parse_generation_config,
)
from mlxpaged.loading.gguf import convert_gguf
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.cli import build_parser
from mlxpaged_app.doctor import FAIL, OK, ModelOnDisk, check_sampling_defaults
from mlxpaged_app.repl import PlainChat
from mlxpaged_app.server.api_server import create_app
from mlxpaged_app.server.launcher import with_sampling_defaults
from mlxpaged_app.server.params import sampling_kwargs
from mlxpaged_app.server.state import ServerConfig
from mlxpaged_app.tui.settings import ChatSettings
from tests.app.server.test_server_unit import CHAT, FakeEngine, client_for
from tests.app.tui.tui_support import SIZE, make_app, send_and_wait
from tests.app.tui.tui_support import FakeEngine as FakeChatEngine

import httpx
import mlx.core as mx
import pytest

MODEL = GenerationDefaults({"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 7}, "generation_config.json")
SMOLLM2_CARD = {"temperature": 0.2, "top_p": 0.9}


def model_dir(tmp_path: Path, generation: object) -> Path:
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    text = generation if isinstance(generation, str) else json.dumps(generation)
    (path / "generation_config.json").write_text(text)
    return path


def preset(**generation) -> models.Preset:
    return models.Preset("p1", "path", "a preset", {"path": "x"}, generation)


# --- reading the defaults -------------------------------------------------------------------------


def test_only_the_sampling_keys_are_taken_and_renamed(tmp_path):
    path = model_dir(
        tmp_path,
        {
            "bos_token_id": 1,
            "eos_token_id": [2, 3],
            "do_sample": True,
            "temperature": 0.6,
            "top_p": 0.95,
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "max_new_tokens": 300,
            "pad_token_id": None,
            "transformers_version": "4.46",
        },
    )
    defaults = load_defaults(path)
    assert defaults == GenerationDefaults(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "max_tokens": 300},
        "generation_config.json",
    )


def test_nulls_are_unset_and_top_k_minus_one_is_off():
    assert parse_generation_config({"temperature": None, "top_k": -1}, "f") == {"top_k": 0}


@pytest.mark.parametrize(
    "content,says",
    [
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"temperature": True}, "temperature must be a number"),
        ({"top_p": 1.5}, "top_p must be in (0.0, 1.0], got 1.5"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0.0, got 0"),
        ("[1, 2]", "expected a JSON object, got a JSON list"),
        ('{"temperature": 0.2,', "is not valid JSON: Expecting property name enclosed in double quotes at line 1"),
    ],
)
def test_bad_values_are_refused_with_the_file_named(tmp_path, content, says):
    path = model_dir(tmp_path, content)
    with pytest.raises(GenerationConfigError) as caught:
        load_defaults(path, preset(temperature=0.2))
    message = str(caught.value)
    assert str(path / "generation_config.json") in message and says in message


def test_a_bad_preset_table_names_presets_toml():
    with pytest.raises(GenerationConfigError, match=r"presets.toml \[presets.'p1'.generation\]: top_p must be in"):
        load_defaults(None, preset(top_p=0))


def test_the_preset_fills_only_what_the_file_lacks(tmp_path):
    assert load_defaults(
        model_dir(tmp_path, {"temperature": 0.7}), preset(temperature=0.2, top_p=0.9)
    ) == GenerationDefaults({"temperature": 0.7, "top_p": 0.9}, "generation_config.json + preset p1")
    assert load_defaults(tmp_path / "absent", preset(top_p=0.9)) == GenerationDefaults({"top_p": 0.9}, "preset p1")
    assert load_defaults(tmp_path / "absent") == NO_DEFAULTS and NO_DEFAULTS.source == "none"
    full = load_defaults(model_dir(tmp_path, {"temperature": 0.3, "top_p": 0.8}), preset(temperature=0.2, top_p=0.9))
    assert full.source == "generation_config.json"


def test_presets_toml_generation_table_and_the_default_model_card(tmp_path):
    toml = tmp_path / "presets.toml"
    toml.write_text(
        'default = "a"\n[presets.a]\nsource = "hub"\nrepo = "x/y"\n[presets.a.generation]\ntemperature = 0.3\n'
    )
    _, presets = models.load_presets(toml)
    assert presets["a"].generation == {"temperature": 0.3} and "generation" not in presets["a"].options
    default, shipped = models.load_presets(models._CHECKOUT_MODELS / "presets.toml")
    assert shipped[default].generation == SMOLLM2_CARD


def tiny_gguf(path: Path) -> Path:
    """A one-layer llama GGUF with a six-token GPT-2 vocabulary: enough for convert_gguf."""
    hidden, ff, tokens = 16, 32, ["<s>", "</s>", "<unk>", "a", "b", "ab"]

    def u32(n: int) -> mx.array:
        return mx.array(n, dtype=mx.uint32)

    meta = {
        "general.architecture": "llama",
        "llama.embedding_length": u32(hidden),
        "llama.block_count": u32(1),
        "llama.attention.head_count": u32(2),
        "llama.attention.head_count_kv": u32(2),
        "llama.feed_forward_length": u32(ff),
        "llama.context_length": u32(64),
        "llama.attention.layer_norm_rms_epsilon": mx.array(1e-5),
        "llama.rope.freq_base": mx.array(1e4),
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": ["a b"],
        "tokenizer.ggml.token_type": mx.array([3, 3, 3, 1, 1, 1], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(0),
        "tokenizer.ggml.eos_token_id": u32(1),
        "tokenizer.ggml.unknown_token_id": u32(2),
        "tokenizer.ggml.add_bos_token": mx.array(False),
    }
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (hidden, hidden),
        "attn_v": (hidden, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ff, hidden),
        "ffn_up": (ff, hidden),
        "ffn_down": (hidden, ff),
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
    }
    weights = {f"blk.0.{name}.weight": mx.ones(shape) for name, shape in shapes.items()}
    weights.update({"token_embd.weight": mx.zeros((len(tokens), hidden)), "output_norm.weight": mx.ones((hidden,))})
    mx.save_gguf(str(path), weights, meta)
    return path


def test_provisioning_writes_the_preset_generation_into_the_new_model(tmp_path, monkeypatch):
    monkeypatch.setenv(models.MODELS_DIR_ENV, str(tmp_path / "store"))
    monkeypatch.setattr(models, "_fetch_gguf", lambda p, workdir, progress: tiny_gguf(workdir / "tiny.gguf"))
    gguf_preset = models.Preset("tiny", "pypi-gguf", "", {}, {"temperature": 0.2, "top_p": 0.9})
    path = models.provision(models.ModelRef("tiny", "pypi-gguf", gguf_preset), "float32")
    written = json.loads((path / "generation_config.json").read_text())
    assert written == {"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.2, "top_p": 0.9}
    assert load_defaults(path, gguf_preset) == GenerationDefaults(SMOLLM2_CARD, "generation_config.json")


def test_conversion_without_generation_writes_bos_eos_only(tmp_path):
    out = convert_gguf(tiny_gguf(tmp_path / "t.gguf"), tmp_path / "out")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": 1}


def test_engine_default_sampling_params(tmp_path):
    engine = Engine.__new__(Engine)  # the two methods need only `loaded`: no model, no engine thread
    engine.loaded = SimpleNamespace(path=model_dir(tmp_path, {"temperature": 0.2}), ref=SimpleNamespace(preset=None))
    assert engine.default_sampling_params() == SamplingParams(temperature=0.2)
    assert engine.default_sampling_params(temperature=0.0, max_tokens=5) == SamplingParams(
        temperature=0.0, max_tokens=5
    )
    assert SamplingParams().temperature == 1.0  # the plain default does not move


# --- the server -----------------------------------------------------------------------------------


def sampled(engine: FakeEngine) -> tuple:
    p = engine.submitted[-1][1]
    return p.temperature, p.top_p, p.top_k, p.max_tokens


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "path,body", [("/v1/chat/completions", {"messages": CHAT["messages"]}), ("/v1/completions", {"prompt": "hi"})]
)
async def test_precedence_request_then_model_then_api(path, body):
    engine = FakeEngine()
    async with client_for(engine, sampling_defaults=MODEL) as client:
        await client.post(path, json=body)
        assert sampled(engine) == (0.2, 0.9, 40, 7)  # all the model's
        await client.post(path, json={**body, "temperature": 0.7, "top_k": -1, "max_tokens": 3})
        assert sampled(engine) == (0.7, 0.9, 0, 3)  # what the request sent wins; -1 is "off"
        await client.post(path, json={**body, "temperature": None, "top_p": 1.0})
        assert sampled(engine) == (0.2, 1.0, 40, 7)  # null is "not sent"
    async with client_for(engine) as client:
        await client.post(path, json=body)
        assert sampled(engine) == (1.0, 1.0, 0, 1024)  # no model defaults: the API's


def test_the_merge_takes_any_request_shape():
    """Other APIs (the chat pipeline's SamplingRequest, Anthropic's) pass objects whose None fields were not sent."""
    sent = SimpleNamespace(temperature=0.5, top_p=None, top_k=-1)  # no min_p / repetition_penalty at all
    assert sampling_kwargs(MODEL, sent) == {"temperature": 0.5, "top_p": 0.9, "top_k": 0}
    assert sampling_kwargs(NO_DEFAULTS, SimpleNamespace()) == {}


@pytest.mark.asyncio
async def test_default_max_tokens_flag_beats_the_model_and_both_are_clipped():
    engine = FakeEngine()
    engine.plan.token_capacity = 30
    async with client_for(engine, sampling_defaults=MODEL, default_max_tokens=5) as client:
        await client.post("/v1/completions", json={"prompt": "hi"})
        assert sampled(engine)[3] == 5
    long_model = GenerationDefaults({"max_tokens": 500}, "generation_config.json")
    async with client_for(engine, sampling_defaults=long_model) as client:
        await client.post("/v1/completions", json={"prompt": "x" * 20})
        assert sampled(engine)[3] == 10  # 30 - 20: what still fits


@pytest.mark.asyncio
async def test_a_bad_request_value_is_still_the_clients_400():
    async with client_for(FakeEngine(), sampling_defaults=MODEL) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, "top_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


@pytest.mark.asyncio
async def test_models_route_shows_what_applies():
    async with client_for(FakeEngine(), sampling_defaults=MODEL) as client:
        cards = [(await client.get("/v1/models")).json()["data"][0], (await client.get("/v1/models/fake-model")).json()]
    for card in cards:
        shown = {key: card["mlxpaged"][key] for key in ("sampling_defaults", "source", "default_max_tokens")}
        assert shown == {"sampling_defaults": MODEL.values, "source": "generation_config.json", "default_max_tokens": 7}
        assert card["mlxpaged"]["loaded"] is True  # beside what the model registry reports


class EngineWithDefaults(FakeEngine):
    def __init__(self, defaults: GenerationDefaults) -> None:
        super().__init__()
        self.reads = 0
        self._defaults = defaults

    @property
    def generation_defaults(self) -> GenerationDefaults:
        self.reads += 1
        return self._defaults


@pytest.mark.asyncio
async def test_generation_config_flag_auto_and_none():
    args = build_parser().parse_args(["serve"])
    assert args.generation_config == "auto" and args.default_max_tokens is None
    engine = EngineWithDefaults(MODEL)
    auto = with_sampling_defaults(ServerConfig(), engine, args.generation_config)
    none = with_sampling_defaults(
        ServerConfig(), engine, build_parser().parse_args(["serve", "--generation-config", "none"]).generation_config
    )
    assert auto.sampling_defaults == MODEL and engine.reads == 1  # none never reads the model's file
    assert none.sampling_defaults.values == {} and "--generation-config none" in none.sampling_defaults.source
    app = create_app(engine, none)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        await client.post("/v1/chat/completions", json={"messages": CHAT["messages"]})
    assert sampled(engine) == (1.0, 1.0, 0, 1024)


def test_generation_config_flag_refuses_other_values(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert "invalid choice: 'vllm'" in capsys.readouterr().err


# --- the chat app, chat --plain and doctor ---------------------------------------------------------


def test_chat_settings_leave_temperature_and_top_p_to_the_model():
    assert ChatSettings().sampling_params(MODEL) == SamplingParams(temperature=0.2, top_p=0.9, top_k=40, max_tokens=512)
    assert ChatSettings(temperature=0.0).sampling_params(MODEL).temperature == 0.0
    assert ChatSettings().sampling_params().temperature == 1.0
    assert ChatSettings().describe(MODEL).startswith("temperature 0.2 (model) · top_p 0.9 (model) · max 512")
    assert ChatSettings(top_p=0.5).describe(MODEL).startswith("temperature 0.2 (model) · top_p 0.5 · max")
    assert ChatSettings.parse("", " ", "100", "") == ChatSettings(None, None, 100, None)
    args = build_parser().parse_args(["chat"])
    assert (args.temperature, args.top_p) == (None, None)


@pytest.mark.asyncio
async def test_chat_app_replies_with_the_model_defaults(tmp_path):
    engine = FakeChatEngine()
    engine.generation_defaults = MODEL
    app = make_app(tmp_path, engine, settings=ChatSettings(max_tokens=64))
    async with app.run_test(size=SIZE) as pilot:
        await send_and_wait(pilot, "hi")
        assert "temperature 0.2 (model)" in str(app.status_line.render())
    p = engine.submitted[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.2, 0.9, 40, 64)


def test_plain_chat_uses_the_model_defaults_unless_told():
    engine = SimpleNamespace(generation_defaults=MODEL)
    assert PlainChat(engine, ChatSettings(), "").params.temperature == 0.2
    assert PlainChat(engine, ChatSettings(temperature=0.0), "").params.temperature == 0.0


def test_doctor_line(tmp_path):
    name, _ = models.load_presets()

    def on_disk(path: Path) -> ModelOnDisk:
        return ModelOnDisk(name, "float32", path, {}, 1)

    check = check_sampling_defaults(on_disk(model_dir(tmp_path, {"temperature": 0.5})))
    assert (check.status, check.detail) == (
        OK,
        "temperature 0.5, top_p 0.9 (from generation_config.json + preset smollm2-135m)",
    )
    assert check_sampling_defaults(on_disk(None)).detail == "temperature 0.2, top_p 0.9 (from preset smollm2-135m)"
    bad = check_sampling_defaults(on_disk(model_dir(tmp_path, {"temperature": -1})))
    assert bad.status == FAIL and "generation_config.json: temperature must be" in bad.detail


# --- the real default model -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.asyncio
async def test_default_model_samples_with_its_card_settings(default_loaded):
    with Engine(default_loaded) as engine:
        assert engine.generation_defaults.values == SMOLLM2_CARD
        assert engine.default_sampling_params() == SamplingParams(**SMOLLM2_CARD)
        config = with_sampling_defaults(ServerConfig(), engine, "auto")
        app = create_app(engine, config)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120
        ) as client:

            async def answer(**fields) -> str:
                body = {
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "max_tokens": 24,
                    "seed": 3,
                    **fields,
                }
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["message"]["content"]

            unset, card, api = await answer(), await answer(**SMOLLM2_CARD), await answer(temperature=1.0, top_p=1.0)
    assert unset == card
    assert unset != api  # the comparison can fail: the API defaults sample something else with this seed
