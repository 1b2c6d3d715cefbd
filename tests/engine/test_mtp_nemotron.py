"""Drafting with Nemotron-H's multi-token-prediction module (loading/nemotron_mtp_head.py) on a tiny random Nemotron-H
(attention, Mamba 2 and MoE blocks: a hybrid whose state rolls back after a rejected draft) with a random MTP module of
an attention and an MoE block: read as the checkpoint stores it, every draft what mlx-vlm's own Nemotron-H MTP drafter
drafts from the same weights over a plain forward pass's hidden states, the model's own tokens alone, batched, seeded,
with a prefix hit and after preemption, through the public API, and refusals with the reason."""

from __future__ import annotations

import dataclasses
import json

from mlxpaged import Engine
from mlxpaged.errors import ConfigError
from mlxpaged.loading.mtp_head import find_mtp, load_mtp_head
from mlxpaged.loading.nemotron_mtp_head import NemotronMtpHead
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
from tests.tiny_models import NEMOTRON_H, _build, hugging_face_nemotron_mtp, write_tiny_nemotron_dir

import mlx.core as mx
import pytest

VOCAB = 256  # the cores' drafters take the argmax over the first 256 ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_nemotron_dir(tmp_path_factory.mktemp("nemotron") / "nemotron")


@pytest.fixture(scope="module")
def model():
    from mlx_lm.models import nemotron_h

    return _build(nemotron_h, NEMOTRON_H, seed=5)  # the checkpoint's model: the same seed writes it


@pytest.fixture(scope="module")
def head(checkpoint):
    return load_mtp_head(find_mtp(checkpoint, "tiny"), mx.float32)


@pytest.fixture(scope="module")
def reference(model, head):
    """(tokens, k) -> the k drafts mlx-vlm's NemotronHMTPDraftModel makes after `tokens` (the last is the row's) from
    the same weights, fed every earlier position's hidden state of a plain forward pass (its embedding and LM head the
    model's, bound by hand: mlx-vlm's `bind` wants its own Nemotron-H class)."""
    from mlx_vlm.speculative.drafters.nemotron_h_mtp.config import NemotronHMTPConfig
    from mlx_vlm.speculative.drafters.nemotron_h_mtp.nemotron_h_mtp import NemotronHMTPDraftModel

    theirs = NemotronHMTPDraftModel(NemotronHMTPConfig(text_config=dict(NEMOTRON_H)))
    stored = hugging_face_nemotron_mtp(head, len(head.layers))
    theirs.load_weights(list(theirs.sanitize(stored).items()), strict=True)
    embed, lm_head = model.backbone.embeddings, model.lm_head

    def drafts(tokens: list[int], k: int) -> list[int]:
        hidden = model.backbone(mx.array([tokens[:-1]]))  # after its final norm
        cache = theirs.make_cache()
        out, _ = theirs._forward_hidden(embed(mx.array([tokens[1:]])), hidden, None, cache)
        made = []
        for _ in range(k):
            made.append(mx.argmax(lm_head(out[:, -1])[..., :VOCAB], axis=-1).item())
            out, _ = theirs._forward_hidden(embed(mx.array([[made[-1]]])), out[:, -1:], None, cache)
        return made

    return drafts


def test_the_module_loads_as_the_checkpoint_stores_it(head):
    assert isinstance(head, NemotronMtpHead) and [layer.block_type for layer in head.layers] == ["*", "E"]
    assert head.paged_layers == 1  # the attention block's pages; the MoE block has none


# The seeded draws of this hybrid are exact only away from a near-tie: its verify pass (k + 1 tokens through the Mamba
# layers' chunked scan) and a decode step (one token) give logits that differ in the last float32 bits (mlx-lm's own
# model, a 4-token pass against 4 steps: up to 4e-6 apart), and a draw that lands that close to a boundary between two
# tokens picks either. Seed 5 lands there with the CPU backend's SwiGLU (runner/activation_routing.py), 6 with mlx-lm's,
# 11 with both, 7 with neither (session 33).
HYBRID_SEEDED = dataclasses.replace(SEEDED, seed=7)


@pytest.mark.parametrize("params", [GREEDY, HYBRID_SEEDED], ids=["greedy", "seeded"])
def test_batched_drafts_give_the_plain_tokens_and_are_mlx_vlms(model, head, reference, tokenizer, params):
    batched_equal_plain(*mtp_makers(model, head, tokenizer), model, head, params, reference)


def test_a_prefix_hit_and_preemption_draft_from_the_right_pages(model, head, reference, tokenizer):
    prefix_hit_equals_plain(*mtp_makers(model, head, tokenizer), model, head, reference)
    preempted_equal_plain(*mtp_makers(model, head, tokenizer), model, head, reference)


def test_the_public_api_drafts_with_the_checkpoints_module_and_gives_the_plain_tokens(checkpoint):
    public_api_equals_plain(checkpoint, NemotronMtpHead)


def test_checkpoints_without_the_module_or_with_other_blocks_are_refused_with_the_reason(tmp_path):
    none = write_tiny_nemotron_dir(tmp_path / "none", with_mtp=False)
    with pytest.raises(ConfigError, match="ships no multi-token-prediction module"):
        Engine.from_pretrained(str(none), speculative="mtp", cache_tokens=2048)
    other = write_tiny_nemotron_dir(tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "mtp_hybrid_override_pattern": "ME"}))
    with pytest.raises(ConfigError, match="MTP module has blocks 'ME'"):
        find_mtp(other, "other")
