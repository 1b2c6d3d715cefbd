"""Drafting with MiMo's first multi-token-prediction layer (loading/mimo_mtp_head.py) on a tiny random MiMo with two
random MTP layers stored as the checkpoints store them: every draft what the layer computes by vLLM's formula
written out here (the hidden state first, then the token's embedding) over mlx-lm's own decoder layer given the
layer's tensors, the model's own tokens alone, batched, seeded, with a prefix hit, through the public API, and the
checkpoint without them refused with the reason."""

from __future__ import annotations

import json

from mlxpaged import Engine
from mlxpaged.errors import ConfigError
from mlxpaged.loading.mimo_mtp_head import MimoMtpHead
from mlxpaged.loading.mtp_head import find_mtp, load_mtp_head
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_mtp import GREEDY, SEEDED, batched_equal_plain, mtp_makers, prefix_hit_equals_plain
from tests.engine.test_mtp_load import public_api_equals_plain
from tests.tiny_models import _build, write_tiny_mimo_dir

import mlx.core as mx
import pytest
from mlx_lm.models import mimo
from mlx_lm.models.cache import KVCache

VOCAB = 256  # the cores' drafters take the argmax over the first 256 ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_mimo_dir(tmp_path_factory.mktemp("mimo") / "mimo")


@pytest.fixture(scope="module")
def config(checkpoint):
    return json.loads((checkpoint / "config.json").read_text())


@pytest.fixture(scope="module")
def model(config):
    return _build(mimo, config, seed=5)  # the checkpoint's model: the same seed writes it


@pytest.fixture(scope="module")
def head(checkpoint):
    return load_mtp_head(find_mtp(checkpoint, "tiny"), mx.float32)


@pytest.fixture(scope="module")
def reference(checkpoint, config, model):
    """(tokens, k) -> the first MTP layer's drafts after `tokens`, its formula written out over the stored tensors
    and a decoder layer of mlx-lm's given the layer's own, one position at a time on a plain KV cache."""
    stored = mx.load(str(checkpoint / "model.safetensors"))
    raw = {n.removeprefix("model.mtp_layers.0."): w for n, w in stored.items() if n.startswith("model.mtp_layers.0.")}
    block = mimo.TransformerBlock(mimo.ModelArgs.from_dict(config))
    block.load_weights(
        [(n, w) for n, w in raw.items() if n.split(".")[0] in ("self_attn", "mlp")]
        + [(n, w) for n, w in raw.items() if n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
    )
    eps, embed = config["rms_norm_eps"], model.model.embed_tokens

    def rms(x, name):
        return mx.fast.rms_norm(x, raw[f"{name}.weight"], eps)

    def step(token: int, h: mx.array, cache) -> mx.array:
        x = mx.concatenate([rms(h, "hidden_layernorm"), rms(embed(mx.array(token)), "token_layernorm")])
        x = x @ raw["input_proj.weight"].T
        return rms(block(x[None, None], None, cache)[0, 0], "final_layernorm")

    def drafts(tokens: list[int], k: int) -> list[int]:
        hidden = model.model(mx.array([tokens[:-1]]))[0]
        cache = KVCache()
        for q in range(len(tokens) - 1):
            out = step(tokens[q + 1], hidden[q], cache)
        made = []
        for _ in range(k):
            made.append(mx.argmax(model.lm_head(out)[:VOCAB]).item())
            out = step(made[-1], out, cache)
        return made

    return drafts


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_drafts_give_the_plain_tokens_and_are_what_the_layer_computes(
    model, head, reference, tokenizer, params
):
    assert isinstance(head, MimoMtpHead)
    batched_equal_plain(*mtp_makers(model, head, tokenizer), model, head, params, reference)


def test_a_prefix_hit_drafts_from_the_pages_the_first_request_wrote(model, head, reference, tokenizer):
    prefix_hit_equals_plain(*mtp_makers(model, head, tokenizer), model, head, reference)


def test_the_public_api_drafts_with_the_first_mtp_layer_and_gives_the_plain_tokens(checkpoint, tmp_path):
    public_api_equals_plain(checkpoint, MimoMtpHead)
    none = write_tiny_mimo_dir(tmp_path / "none", depth=0)
    with pytest.raises(ConfigError, match="ships no multi-token-prediction layer"):
        Engine.from_pretrained(str(none), speculative="mtp", cache_tokens=2048)
