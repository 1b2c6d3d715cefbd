"""Drafting with the multi-token-prediction layer of the DeepSeek-V3 layout ("nextn": DeepSeek-V3 / Kimi K2, GLM-4.5,
GLM-4.7-Flash; loading/nextn_head.py) on tiny random models of each kind (MLA or GQA attention, MoE): the layer read as
Hugging Face stores it (experts one by one, MLA's fused kv_b_proj), every draft what the layer computes from a plain
forward pass's hidden states by the layer's formula written out here over mlx-lm's own decoder layer (loaded through
mlx-lm's own sanitize as one more layer of the model), the model's own tokens alone, batched, seeded, with a prefix hit
and after preemption, through the public API, and refusals at load with the reason."""

from __future__ import annotations

import dataclasses
import importlib
import json

from mlxpaged import Engine
from mlxpaged.errors import ConfigError
from mlxpaged.loading.mtp_head import find_mtp, load_mtp_head
from mlxpaged.loading.nextn_head import NextnHead
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_mtp import (
    GREEDY,
    SEEDED,
    batched_equal_plain,
    mtp_makers,
    preempted_equal_plain,
    prefix_hit_equals_plain,
)
from tests.engine.test_mtp_load import public_api_equals_plain
from tests.tiny_models import _build, write_tiny_nextn_dir

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import KVCache

KINDS = ["deepseek_v3", "glm4_moe", "glm4_moe_lite"]  # MLA + MoE, GQA + MoE, MLA + MoE (GLM's)
VOCAB = 256  # the drafts the tests compare: argmax over the first 256 ids, as the cores' drafters are built


@dataclasses.dataclass
class Pair:
    kind: str
    path: object
    config: dict
    model: object  # mlx-lm's model, as the checkpoint's weights make it
    head: NextnHead  # the nextn layer as the engine loads it
    raw: dict  # the layer's tensors as stored (names after model.layers.<N>.)
    block: object  # mlx-lm's own decoder layer N, loaded through mlx-lm's sanitize


_PAIRS: dict[str, Pair] = {}


@pytest.fixture(scope="module", params=KINDS)
def pair(request, tmp_path_factory) -> Pair:
    return build_pair(request.param, tmp_path_factory)


# Sampled tokens equal plain decoding's where the model's own are the same in any batch shape. The tiny random
# DeepSeek-V3's are not on every BLAS (its sigmoid group routing turns last-bit differences between pass shapes into
# other experts: this machine's default OpenBLAS kernels gave other seeded tokens batched than alone, CI's Haswell
# ones the same), so it is held to greedy equality only.
@pytest.fixture(scope="module", params=[kind for kind in KINDS if kind != "deepseek_v3"])
def glm_pair(request, tmp_path_factory) -> Pair:
    return build_pair(request.param, tmp_path_factory)


def build_pair(kind: str, tmp_path_factory) -> Pair:
    if kind in _PAIRS:
        return _PAIRS[kind]
    path = write_tiny_nextn_dir(tmp_path_factory.mktemp(kind) / kind, kind)
    config = json.loads((path / "config.json").read_text())
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    model = _build(module, config, seed=5)  # the checkpoint's model: the same seed writes it
    head = load_mtp_head(find_mtp(path, kind), mx.float32)
    stored = mx.load(str(path / "model.safetensors"))
    layer = config["num_hidden_layers"]
    prefix = f"model.layers.{layer}."
    raw = {name[len(prefix) :]: w for name, w in stored.items() if name.startswith(prefix)}
    # mlx-lm's own model of one layer more, its last layer read from the same tensors by its own sanitize
    longer = module.Model(module.ModelArgs.from_dict({**config, "num_hidden_layers": layer + 1}))
    block_tensors = {prefix + n: w for n, w in raw.items() if not n.startswith(OWN)}
    longer.load_weights(list(longer.sanitize(block_tensors).items()), strict=False)
    mx.eval(longer.parameters())
    _PAIRS[kind] = Pair(kind, path, config, model, head, raw, longer.model.layers[layer])
    return _PAIRS[kind]


OWN = ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")


def reference_drafts(pair: Pair, tokens: list[int], k: int) -> list[int]:
    """The layer's drafts after `tokens`, written out (vLLM's DeepSeekMultiTokenPredictorLayer): position q reads the
    model's normed hidden state there and the embedding of token q + 1; the block (mlx-lm's) runs one position at a
    time over a plain KV cache; the LM head reads the norm of the block's output, and the output itself is fed on."""
    raw, eps = pair.raw, pair.config.get("rms_norm_eps", 1e-6)
    hidden = pair.model.model(mx.array([tokens[:-1]]))[0]

    def rms(x, name):
        return mx.fast.rms_norm(x, raw[f"{name}.weight"], eps)

    def step(token: int, h: mx.array, cache) -> mx.array:
        e = raw["embed_tokens.weight"][token]
        x = mx.concatenate([rms(e, "enorm"), rms(h, "hnorm")]) @ raw["eh_proj.weight"].T
        return pair.block(x[None, None], None, cache)[0, 0]

    def draft(out: mx.array) -> int:
        logits = rms(out, "shared_head.norm") @ raw["shared_head.head.weight"].T
        return mx.argmax(logits[:VOCAB]).item()

    cache = KVCache()
    for q in range(len(tokens) - 1):
        out = step(tokens[q + 1], hidden[q], cache)
    drafts = [draft(out)]
    while len(drafts) < k:
        out = step(drafts[-1], out, cache)
        drafts.append(draft(out))
    return drafts


def test_the_layer_loads_as_hugging_face_stores_it(pair):
    """Experts one by one and MLA's fused kv_b_proj, through the model module's own sanitize: the layer written."""
    mx.random.seed(7)  # write_tiny_nextn_dir's layer
    written = NextnHead(pair.config, own_embedding=True, own_head=True)
    written.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, written.parameters()))
    loaded, expected = dict(tree_flatten(pair.head.parameters())), dict(tree_flatten(written.parameters()))
    assert loaded.keys() == expected.keys()
    for name, w in expected.items():
        assert mx.array_equal(loaded[name], w), name


def checks(pair: Pair, tokenizer) -> tuple:
    """(make, plain_of, model, head, reference) for test_mtp's shared checks."""
    make, plain_of = mtp_makers(pair.model, pair.head, tokenizer)
    return make, plain_of, pair.model, pair.head, lambda tokens, k: reference_drafts(pair, tokens, k)


def test_batched_drafts_give_the_plain_tokens_and_are_what_the_layer_computes(pair, tokenizer):
    make, plain_of, model, head, reference = checks(pair, tokenizer)
    batched_equal_plain(make, plain_of, model, head, GREEDY, reference)


def test_seeded_drafts_give_the_plain_sampled_tokens(glm_pair, tokenizer):
    make, plain_of, model, head, reference = checks(glm_pair, tokenizer)
    batched_equal_plain(make, plain_of, model, head, SEEDED, reference)


def test_a_prefix_hit_and_preemption_draft_from_the_right_pages(tokenizer, tmp_path_factory):
    """One kind (MLA) carries the cache's paths: the layer's pages are of the model's kind for every kind."""
    parts = checks(build_pair("deepseek_v3", tmp_path_factory), tokenizer)
    prefix_hit_equals_plain(*parts)
    preempted_equal_plain(*parts)


def test_the_public_api_drafts_with_the_checkpoints_layer_and_gives_the_plain_tokens(glm_pair):
    """On the GLM kinds: mlx-lm's deepseek_v3 drops only layer 61 (DeepSeek-V3's own), so a 4-layer one with its nextn
    layer does not load through mlx-lm."""
    public_api_equals_plain(glm_pair.path, NextnHead)


def test_checkpoints_without_the_layer_or_with_several_are_refused_with_the_reason(tmp_path):
    none = write_tiny_nextn_dir(tmp_path / "none", "glm4_moe_lite", depth=0)
    with pytest.raises(ConfigError, match="ships no multi-token-prediction layer") as info:
        Engine.from_pretrained(str(none), speculative="mtp", cache_tokens=2048)
    assert info.value.param == "speculative"
    config = json.loads((none / "config.json").read_text())
    (none / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    with pytest.raises(ConfigError, match="has 2 nextn layers"):
        find_mtp(none, "two")
