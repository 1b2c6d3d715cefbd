"""A checkpoint's MTP layers through the public API (`Engine.from_pretrained(..., speculative="mtp")`): read from
its `mtp.*` tensors (which mlx-lm drops), planned before any weight is read, refused at load with the reason (no MTP
layers, a model whose MTP layers are not built here, settings that contradict them), exact against plain decoding,
with 8-bit pages too; and the layers drafting what mlx-vlm's own Qwen 3.5 MTP drafter drafts."""

from __future__ import annotations

import json

from mlxpaged import Engine, SamplingParams
from mlxpaged.errors import ConfigError, InsufficientMemoryError
from mlxpaged.loading.mtp_head import find_mtp, load_mtp_head
from tests.engine.test_mtp import unpaged_drafts
from tests.tiny_models import add_mtp_layers, random_tokens, write_tiny_model_dir

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    qwen = {"model_type": "qwen3_5", "dtype": "float32", "seed": 3, "layers": 4, "head_dim": 32}
    return {
        "mtp": add_mtp_layers(write_tiny_model_dir(root / "mtp", **qwen)),
        "no-mtp": write_tiny_model_dir(root / "no-mtp", **qwen),
        "llama": write_tiny_model_dir(root / "llama", "llama", dtype="float32", seed=1),
    }


def generate(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, GREEDY)]


def public_api_equals_plain(path, head_class) -> None:
    """`Engine.from_pretrained(path, speculative="mtp")`: the plain tokens, drafts made by a head of `head_class`."""
    prompts = [random_tokens(n, seed=n, vocab=49152) for n in (9, 30, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    with Engine.from_pretrained(str(path), cache_tokens=2048) as engine:
        expected = [c.token_ids for c in engine.generate(prompts, params)]
    with Engine.from_pretrained(str(path), speculative="mtp", num_speculative_tokens=3, cache_tokens=2048) as engine:
        assert [c.token_ids for c in engine.generate(prompts, params)] == expected
        stats = engine.stats()
        assert stats["speculative"] == "mtp" and stats["spec_draft_tokens_total"] > 0
        assert isinstance(engine.built.hidden_drafter.head, head_class)


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_mtp_layers_give_the_plain_tokens(dirs, kv_bits):
    prompts = [random_tokens(n, seed=n, vocab=49152) for n in (9, 30, 17)]
    settings = {"cache_tokens": 2048, **({"kv_bits": kv_bits} if kv_bits else {})}
    with Engine.from_pretrained(str(dirs["mtp"]), **settings) as engine:
        expected = generate(engine, prompts)
    with Engine.from_pretrained(str(dirs["mtp"]), speculative="mtp", num_speculative_tokens=3, **settings) as engine:
        assert generate(engine, prompts) == expected
        stats = engine.stats()
        assert stats["speculative"] == "mtp" and stats["spec_draft_tokens_total"] > 0
        mtp = engine.built.hidden_drafter
        assert len(mtp.head.layers) == 1 and mtp.kv.space_blocks == engine.kv.space_blocks
        # one block id stands for a page in the model's pools and the MTP layers': the plan counted both per block
        assert engine.plan.block_bytes == engine.kv.bytes_per_block + mtp.kv.bytes_per_block


def test_mtp_drafts_under_a_grammar_give_the_plain_constrained_tokens(dirs):
    from tests.engine.test_speculative_grammar import replies

    prompts = [random_tokens(n, seed=n, vocab=49152) for n in (7, 15)]
    params = SamplingParams(temperature=0.0, max_tokens=30)
    with Engine.from_pretrained(str(dirs["mtp"]), cache_tokens=2048) as engine:
        plain = replies(engine, prompts, params)
    with Engine.from_pretrained(str(dirs["mtp"]), cache_tokens=2048, speculative="mtp") as engine:
        assert replies(engine, prompts, params) == plain
        assert engine.stats()["spec_draft_tokens_total"] > 0


def test_a_checkpoint_without_mtp_layers_is_refused_before_it_is_read(dirs):
    with pytest.raises(ConfigError, match="ships no multi-token-prediction layers") as info:
        Engine.from_pretrained(str(dirs["no-mtp"]), speculative="mtp", cache_tokens=2048)
    assert info.value.param == "speculative"
    with pytest.raises(ConfigError, match="is a 'llama' model"):
        Engine.from_pretrained(str(dirs["llama"]), speculative="mtp", cache_tokens=2048)


def test_a_draft_model_with_mtp_is_refused(dirs):
    with pytest.raises(ConfigError, match="not speculative='mtp'"):
        Engine.from_pretrained(str(dirs["mtp"]), draft_model=str(dirs["mtp"]), speculative="mtp")


def test_mtp_pages_that_do_not_fit_are_refused_before_any_weight_is_read(dirs, monkeypatch):
    from mlxpaged.engine import engine as engine_module

    class Loading(Exception):
        pass

    def load_local(*args, **kwargs):
        raise Loading

    monkeypatch.setattr(engine_module, "load_local", load_local)
    per_token = 2 * 2 * 2 * 32 * 4  # the model's 2 full-attention layers: K and V, 2 heads of 32, float32
    settings = {"kv_memory": per_token * 2048, "max_model_len": 2000}
    with pytest.raises(Loading):  # the model alone fits: its load starts
        Engine.from_pretrained(str(dirs["mtp"]), **settings)
    with pytest.raises(InsufficientMemoryError):  # with the MTP layer's pages, a third more per token
        Engine.from_pretrained(str(dirs["mtp"]), speculative="mtp", **settings)


def test_the_mtp_layers_draft_what_mlx_vlms_qwen3_5_mtp_drafter_drafts(dirs):
    from mlx_lm import load
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel

    model, _ = load(str(dirs["mtp"]))
    head = load_mtp_head(find_mtp(dirs["mtp"], "tiny"), mx.float32)
    config = json.loads((dirs["mtp"] / "config.json").read_text())
    reference = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": config}))
    reference.load_weights(list(tree_flatten(head.parameters())), strict=True)
    reference.reset(model)
    for seed in range(3):
        prompt = random_tokens(20 + seed, seed=seed, vocab=49152)
        hidden = model.model(mx.array([prompt]))
        bonus = mx.argmax(model(mx.array([prompt]))[:, -1], axis=-1).item()
        reference.reset(model)
        reference.prefill_from_target_hidden(mx.array([prompt]), hidden, bonus, None, greedy=True)
        theirs = reference.draft_block(bonus, hidden[:, -1:], None, block_size=5, sampler=None, greedy=True)
        assert theirs.tolist()[0] == unpaged_drafts(model, head, [*prompt, bonus], 4)


def test_a_hugging_face_checkpoints_zero_centred_norms_are_shifted_as_mlx_lm_shifts_the_models(dirs, tmp_path):
    """An unconverted checkpoint (conv1d weights as Hugging Face stores them) keeps RMSNorm weights zero-centred: the
    MTP layers' are read + 1, as mlx-lm reads the model's."""
    converted = load_mtp_head(find_mtp(dirs["mtp"], "tiny"), mx.float32)
    weights = {f"mtp.{name}": w - 1.0 if "norm" in name else w for name, w in tree_flatten(converted.parameters())}
    weights["model.language_model.layers.0.linear_attn.conv1d.weight"] = mx.zeros((96, 1, 3))  # [C, 1, K]
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    (tmp_path / "config.json").write_text((dirs["mtp"] / "config.json").read_text())
    original = load_mtp_head(find_mtp(tmp_path, "hf"), mx.float32)
    for (name, mine), (_, theirs) in zip(
        tree_flatten(original.parameters()), tree_flatten(converted.parameters()), strict=True
    ):
        assert mx.allclose(mine, theirs, atol=1e-6).item(), name


def test_a_vision_language_checkpoint_drafts_with_its_mtp_layers_with_and_without_images(tmp_path):
    """A Qwen 3.5 checkpoint loaded with its vision tower: the model's hidden states come from mlx-vlm's language
    model (`return_hidden`); the plain tokens with images and without, and for prompts without images every draft
    what the MTP layers compute without pages."""
    from tests.vision.test_chat_images import ask, picture
    from tests.vision.tiny_vlm_dirs import write_tiny_qwen3_5_dir

    model_dir = add_mtp_layers(write_tiny_qwen3_5_dir(tmp_path / "vlm"))
    chats = [ask(picture(1), "What is this?"), ask("Tell me a story"), ask(picture(2), "And this one?")]
    short = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with Engine.from_pretrained(str(model_dir), cache_tokens=2048) as engine:
        expected = [engine.chat(chat, short).token_ids for chat in chats]
    with Engine.from_pretrained(
        str(model_dir), cache_tokens=2048, speculative="mtp", num_speculative_tokens=3
    ) as engine:
        assert engine.loaded.vision is not None
        drafter, proposals = engine.built.hidden_drafter, []
        propose = drafter.propose

        def recorded(chunks, drafting):
            drafts = propose(chunks, drafting)
            rows = zip(drafting, drafts, strict=True)
            proposals.extend((list(c.request.all_token_ids), d) for (c, _), d in rows if not c.request.images)
            return drafts

        drafter.propose = recorded
        assert [engine.chat(chat, short).token_ids for chat in chats] == expected
        assert engine.stats()["spec_draft_tokens_total"] > 0
    assert proposals  # of the chat without images
    for tokens, drafts in proposals:
        assert drafts == unpaged_drafts(engine.model, drafter.head, tokens, len(drafts))
