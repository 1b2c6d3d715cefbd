"""Drafting with a checkpoint's multi-token-prediction layers (runner/chained_drafter.py, loading/mtp_head.py) on a tiny
random Qwen 3.5 (a hybrid: gated-delta and full-attention layers) with random MTP layers: the model's own tokens
whatever the MTP layers propose, alone and batched, seeded, with a prefix hit, after preemption, with n > 1 forks;
and every draft what the MTP layers compute without pages, from the model's hidden states of a plain forward pass
(the MTP pages, fed one position behind the model, must then be right through all of those)."""

from __future__ import annotations

import dataclasses

from mlxpaged.config import CacheConfig
from mlxpaged.engine.hidden_drafters import mtp_drafter
from mlxpaged.loading.mtp_head import MtpHead
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_core import run_to_completion, token_ids
from tests.engine.test_engine import tokenizer  # noqa: F401  (the fixture, shared)
from tests.engine.test_engine_state import make_core
from tests.tiny_models import random_tokens, tiny_qwen3_5

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True)
PROMPTS = {"a": random_tokens(9, seed=31), "b": random_tokens(26, seed=32), "c": random_tokens(14, seed=33)}


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_5()


@pytest.fixture(scope="module")
def head(model):
    mx.random.seed(12)
    layers = MtpHead(model.args.text_config, num_layers=1)
    layers.update(tree_map(lambda w: w * 3.0 if w.ndim == 2 else w, layers.parameters()))
    mx.eval(layers.parameters())
    return layers


def mtp_core(model, head, tokenizer, continuations: list[list[int]], k: int = 3, **scheduling):
    """A core whose drafts come from `head`, as engine/build.py makes it. Random MTP layers draft nearly nothing a
    tiny random model keeps, so what reaches the verify pass is the known continuation (`continuations`: prompt and
    plain reply of each request) with every third draft run wrong in the middle: drafts are kept and rejected, and
    the MTP layers are fed the kept ones. What they drafted themselves is recorded in `core.proposals`: (the
    request's tokens when it drafted, the drafts)."""
    core = make_core(model, tokenizer, speculative="mtp", num_speculative_tokens=k, **scheduling)
    drafter = mtp_drafter(head, "tiny", core.runner, CacheConfig(block_size=8), mx.float32, vocab_size=256)
    core.speculator.model = drafter
    known_drafts(core, drafter, continuations)
    return core


def known_drafts(core, drafter, continuations: list[list[int]]) -> None:
    """Make `drafter` (attached to `core`) hand the verify pass the known continuation of each request (`continuations`:
    prompt and plain reply), every third draft run wrong in the middle, and record what it drafted itself in
    `core.proposals`: (the request's tokens when it drafted, the drafts)."""
    core.proposals = []
    propose = drafter.propose

    def known(tokens: list[int], k: int) -> list[int]:
        full = next(full for full in continuations if full[: len(tokens)] == tokens)
        draft = list(full[len(tokens) : len(tokens) + k])
        if len(tokens) % 3 == 0:
            draft[len(draft) // 2] = (draft[len(draft) // 2] + 1) % 256
        return draft

    def recorded(chunks, drafting):
        drafts = propose(chunks, drafting)
        core.proposals += [(list(c.request.all_token_ids), d) for (c, _), d in zip(drafting, drafts, strict=True)]
        return [known(list(c.request.all_token_ids), len(d)) for (c, _), d in zip(drafting, drafts, strict=True)]

    drafter.propose = recorded


def run(core, prompts: dict, params) -> dict:
    events = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params, events[rid].append)
    run_to_completion(core)
    assert core.scheduler.kv_manager.stats().num_owned == 0
    assert not core.speculator.model.kept  # finished requests are forgotten
    return {rid: token_ids(e) for rid, e in events.items()}


def plain(model, tokenizer, prompts: dict, params, **scheduling) -> dict:
    return run_plain(make_core(model, tokenizer, **scheduling), prompts, params)


def run_plain(core, prompts, params) -> dict:
    events = {rid: [] for rid in prompts}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, params, events[rid].append)
    run_to_completion(core)
    return {rid: token_ids(e) for rid, e in events.items()}


def unpaged_drafts(model, head, tokens: list[int], k: int) -> list[int]:
    """What the MTP layers draft after `tokens` (the last one is the row's): fed every earlier position with the
    model's hidden state there (a plain forward pass, no cache) and the token after it, then on their own output.
    `model`: mlx-lm's, or a vision-language model's language model as the engine runs it (vision/language.py)."""
    if hasattr(model, "returns_hidden"):
        out: list = []
        model(mx.array([tokens[:-1]]), hidden_out=out)
        hidden, embed, head_of = out[0], model.embed_tokens, model.logits_from_hidden
    else:
        hidden, embed, language = model.model(mx.array([tokens[:-1]])), model.model.embed_tokens, model.language_model
        head_of = language.lm_head if "lm_head" in language else language.model.embed_tokens.as_linear
    cache = [KVCache() for _ in head.layers]
    out = head(embed(mx.array([tokens[1:]])), hidden, cache)
    drafts = []
    for _ in range(k):
        drafts.append(mx.argmax(head_of(out[:, -1]), axis=-1).item())
        out = head(embed(mx.array([[drafts[-1]]])), out[:, -1:], cache)
    return drafts


def check(core, model, head, outputs: dict, expected: dict, reference=None) -> None:
    """The plain tokens; drafts kept and rejected; every draft the drafter made what it computes unpaged
    (`reference(tokens, k)`; default: the MTP layers `head`'s)."""
    assert outputs == expected
    stats = core.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert core.proposals
    reference = reference or (lambda tokens, k: unpaged_drafts(model, head, tokens, k))
    for tokens, drafts in core.proposals:
        assert drafts == reference(tokens, len(drafts)), len(tokens)


def full(prompts: dict, outputs: dict) -> list[list[int]]:
    return [prompts[rid] + outputs[rid] for rid in prompts]


# The checks every hidden-state drafter's tests share. `make(continuations, **scheduling)` builds the drafting core
# (mtp_core, test_dflash.dflash_core, ...); `reference(tokens, k)` is what the drafter must draft after `tokens`;
# `plain_of(prompts, params)` the plain tokens.


def batched_equal_plain(make, plain_of, model, head, params, reference, **scheduling):
    """PROMPTS batched with drafts: the plain tokens, every draft the reference's."""
    expected = plain_of(PROMPTS, params)
    core = make(full(PROMPTS, expected), **scheduling)
    check(core, model, head, run(core, PROMPTS, params), expected, reference)
    return core


def prefix_hit_equals_plain(make, plain_of, model, head, reference, length: int = 40) -> None:
    """The same prompt twice: the second hits the first's blocks, the drafter's pages with them."""
    prompt = random_tokens(length, seed=5)
    expected = plain_of({"p": prompt}, GREEDY)["p"]
    core = make([prompt + expected])
    run(core, {"first": prompt}, GREEDY)
    before = core.scheduler.kv_manager.stats().hit_tokens
    check(core, model, head, run(core, {"second": prompt}, GREEDY), {"second": expected}, reference)
    assert core.scheduler.kv_manager.stats().hit_tokens - before >= (length - 1) // 8 * 8  # every full block


def preempted_equal_plain(make, plain_of, model, head, reference) -> None:
    """A pool too small for all three: sequences are preempted and recomputed, the drafter's pages with them."""
    params = dataclasses.replace(GREEDY, max_tokens=40)
    core = batched_equal_plain(make, plain_of, model, head, params, reference, num_blocks=14, max_num_seqs=3)
    assert core.stats.preemptions > 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_mtp_drafts_give_the_plain_tokens_and_are_what_the_layers_compute(model, head, tokenizer, params):
    expected = plain(model, tokenizer, PROMPTS, params)
    core = mtp_core(model, head, tokenizer, full(PROMPTS, expected))
    check(core, model, head, run(core, PROMPTS, params), expected)


def test_chunks_the_token_budget_cuts_short_draft_from_the_positions_fed_before(model, head, tokenizer):
    """A small step budget splits the chunk that feeds the kept tokens again after a rejection (a model with state
    layers): the part that drafts may find every position it needs fed already, and feeds the last one again."""
    expected = plain(model, tokenizer, PROMPTS, GREEDY)
    core = mtp_core(model, head, tokenizer, full(PROMPTS, expected), max_batch_tokens=10)
    cut = []
    schedule = core.scheduler.schedule

    def watched():
        out = schedule()
        cut.extend(c for c in out.chunks if c.request.output_token_ids and not c.samples)
        return out

    core.scheduler.schedule = watched
    check(core, model, head, run(core, PROMPTS, GREEDY), expected)
    assert cut


def test_alone_equals_plain(model, head, tokenizer):
    prompts = {"b": PROMPTS["b"]}
    expected = plain(model, tokenizer, prompts, GREEDY)
    core = mtp_core(model, head, tokenizer, full(prompts, expected), k=5)
    check(core, model, head, run(core, prompts, GREEDY), expected)


def test_a_prefix_hit_drafts_from_the_mtp_pages_the_first_request_wrote(model, head, tokenizer):
    make, plain_of = mtp_makers(model, head, tokenizer)
    prefix_hit_equals_plain(make, plain_of, model, head, unpaged(model, head))


def test_preempted_sequences_resume_with_the_plain_tokens_and_right_mtp_pages(model, head, tokenizer):
    make, plain_of = mtp_makers(model, head, tokenizer)
    preempted_equal_plain(make, plain_of, model, head, unpaged(model, head))


def mtp_makers(model, head, tokenizer):
    """(make, plain_of) of an MTP head's cores for the shared checks."""
    return (
        lambda continuations, **scheduling: mtp_core(model, head, tokenizer, continuations, **scheduling),
        lambda prompts, params: plain(model, tokenizer, prompts, params),
    )


def unpaged(model, head):
    return lambda tokens, k: unpaged_drafts(model, head, tokens, k)


def test_n_sequences_fork_the_mtp_pages_and_kept_positions_too(model, head, tokenizer):
    params = dataclasses.replace(SEEDED, n=3)
    prompt = {"a": PROMPTS["b"]}

    def by_sequence(core) -> dict:
        events: list = []
        core.add_request("a", prompt["a"], params, events.append)
        run_to_completion(core)
        out: dict = {}
        for e in events:
            if e.token_id is not None:
                out.setdefault(e.index, []).append(e.token_id)
        return out

    expected = by_sequence(make_core(model, tokenizer))
    core = mtp_core(model, head, tokenizer, [prompt["a"] + tokens for tokens in expected.values()])
    assert by_sequence(core) == expected
    assert core.scheduler.kv_manager.stats().num_owned == 0
    assert core.speculator.stats.accepted_tokens > 0
    for tokens, drafts in core.proposals:
        assert drafts == unpaged_drafts(model, head, tokens, len(drafts)), len(tokens)
