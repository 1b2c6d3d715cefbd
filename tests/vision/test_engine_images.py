"""Prompts with images on the paged engine against mlx-vlm's own generate, token for token, for each architecture
(tiny random models; tests/vision/tiny_vlms.py): alone, batched beside a text request, chunked, preempted, on a
prefix-cache hit past the image, and never hitting the cache past the text before another image."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import split_settings
from mlxpaged.engine.engine import Engine
from mlxpaged.errors import ImagesNotSupportedError
from mlxpaged.loading.loader import LoadedModel
from mlxpaged.loading.model_store import ModelRef
from mlxpaged.vision.checkpoint import MROPE_MODEL_TYPES
from mlxpaged.vision.loading import vision_parts
from mlxpaged.vision.prompt import ImagePrompt
from tests.engine.test_engine import GREEDY, assert_pool_empty, tiny_engine, tokenizer  # noqa: F401
from tests.tiny_models import tiny_llama
from tests.vision.tiny_vlms import ARCHITECTURES, image_prompt, next_turn, text_tokens

import mlx.core as mx
import pytest
from mlx_vlm.generate.ar import generate_step

BLOCK = 8


def vlm_engine(vlm, tokenizer, **settings) -> Engine:
    model, vision = vision_parts(vlm, None)
    loaded = LoadedModel(model, tokenizer, ModelRef("tiny-vlm", "path"), Path("tiny-vlm"), "float32", {}, vision=vision)
    return Engine(loaded, *split_settings({"cache_tokens": 2048, "block_size": BLOCK, **settings}))


def caches_prefixes(engine: Engine) -> bool:
    """False for a model whose prefix cache is off (sliding-window layers: gemma3), whose turns all run cold."""
    return engine.core.scheduler.kv_manager.enable_prefix_cache


def full_blocks(prompt: ImagePrompt) -> int:
    """The tokens of a prompt's full blocks before its last token (which a hit always computes)."""
    return (len(prompt.token_ids) - 1) // BLOCK * BLOCK


def mlx_vlm_greedy(vlm, prompt: ImagePrompt | list[int], max_tokens: int) -> list[int]:
    """mlx-vlm's own generate_step, greedy, over the same token ids and pixels."""
    if isinstance(prompt, ImagePrompt):
        arrays = dict(prompt.arrays)
        ids, pixel_values, mask = prompt.token_ids, arrays.pop("pixel_values"), arrays.pop("attention_mask", None)
    else:
        ids, pixel_values, mask, arrays = prompt, None, None, {}
    steps = generate_step(mx.array([ids]), vlm, pixel_values, mask, max_tokens=max_tokens, temperature=0.0, **arrays)
    return [int(token) for token, _ in steps]


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def vlm(request):
    return ARCHITECTURES[request.param].build()


def test_an_image_prompt_alone_and_beside_a_text_request_equals_mlx_vlm(vlm, tokenizer):
    prompt = image_prompt(vlm, text_tokens(11, seed=1), text_tokens(9, seed=2), seed=0)
    text = text_tokens(13, seed=3)
    want = mlx_vlm_greedy(vlm, prompt, GREEDY.max_tokens)
    with vlm_engine(vlm, tokenizer) as engine:
        assert not engine.core.runner.serial  # ragged batches are exact (runner/batch_check.py)
        alone = engine.generate([prompt], GREEDY)[0]
        both = engine.generate([prompt, text], GREEDY)
        assert_pool_empty(engine)
    assert alone.token_ids == want
    assert both[0].token_ids == want
    assert both[1].token_ids == mlx_vlm_greedy(vlm, text, GREEDY.max_tokens)
    assert alone.prompt_tokens == len(prompt.token_ids)  # the image's tokens count, as mlx-vlm counts them


def test_the_same_image_hits_the_prefix_cache_and_another_image_does_not(vlm, tokenizer):
    before, after = text_tokens(21, seed=4), text_tokens(12, seed=5)  # the image starts in the third block
    first = image_prompt(vlm, before, after, seed=0)
    other = image_prompt(vlm, before, after, seed=1)  # the same token ids, other pixels
    turn = next_turn(first, text_tokens(10, seed=6))
    with vlm_engine(vlm, tokenizer) as engine:
        hits = caches_prefixes(engine)
        cold = engine.generate([first], GREEDY)[0]
        warm = engine.generate([first], GREEDY)[0]
        assert warm.token_ids == cold.token_ids
        assert warm.cached_tokens >= full_blocks(first) if hits else warm.cached_tokens == 0  # the image's too
        swapped = engine.generate([other], GREEDY)[0]
        assert swapped.cached_tokens <= len(before) // BLOCK * BLOCK  # nothing from the block the image starts in
        assert swapped.token_ids == mlx_vlm_greedy(vlm, other, GREEDY.max_tokens)
        follow = engine.generate([turn], GREEDY)[0]
        assert follow.cached_tokens >= full_blocks(first) if hits else follow.cached_tokens == 0
        assert follow.token_ids == mlx_vlm_greedy(vlm, turn, GREEDY.max_tokens)
        assert_pool_empty(engine)
    assert cold.token_ids == mlx_vlm_greedy(vlm, first, GREEDY.max_tokens)


def test_chunked_prefill_and_preemption_of_an_image_prompt_equal_mlx_vlm(vlm, tokenizer):
    prompts = [image_prompt(vlm, text_tokens(5 + 7 * s, seed=s), text_tokens(9, seed=9 + s), seed=s) for s in range(3)]
    want = [mlx_vlm_greedy(vlm, p, GREEDY.max_tokens) for p in prompts]
    with vlm_engine(vlm, tokenizer, max_batch_tokens=8, max_num_seqs=4) as chunked:  # images split across chunks
        assert [c.token_ids for c in chunked.generate(prompts, GREEDY)] == want
    with vlm_engine(vlm, tokenizer, cache_tokens=96, max_num_seqs=3, enable_prefix_cache=False) as tight:
        assert [c.token_ids for c in tight.generate(prompts, GREEDY)] == want
        assert tight.stats()["preemptions"] > 0


def test_gemma4_images_attended_both_ways_in_chunks_smaller_than_an_image_equal_mlx_vlm(tokenizer):
    """Gemma 4's larger models attend both ways within each image: with 3-token chunks the engine still prefills
    each image whole (scheduler.py), batched beside another image prompt, and equals mlx-vlm's generate, which
    prefills such a prompt in one pass. The same prompts attended causally answer otherwise."""
    vlm = ARCHITECTURES["gemma4-both-ways"].build()
    prompts = [image_prompt(vlm, text_tokens(5 + 7 * s, seed=s), text_tokens(9, seed=9 + s), seed=s) for s in range(3)]
    want = [mlx_vlm_greedy(vlm, p, GREEDY.max_tokens) for p in prompts]
    causal = [dataclasses.replace(p, arrays={"pixel_values": p.arrays["pixel_values"]}) for p in prompts]
    assert [mlx_vlm_greedy(vlm, p, GREEDY.max_tokens) for p in causal] != want  # the overlay changes the replies
    with vlm_engine(vlm, tokenizer, max_batch_tokens=3, max_num_seqs=3) as engine:
        assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == want
        assert_pool_empty(engine)


def test_an_image_sent_to_a_text_model_is_refused_naming_it(vlm, tokenizer):
    prompt = image_prompt(vlm, text_tokens(5), text_tokens(5), seed=0)
    with tiny_engine(tiny_llama(), tokenizer) as engine:
        with pytest.raises(ImagesNotSupportedError, match="model 'tiny' takes no images"):
            engine.generate([prompt], GREEDY)
        assert engine.generate([text_tokens(5)], GREEDY)[0].token_ids  # and it serves on


def test_decoding_after_an_image_takes_the_compiled_pass(vlm, tokenizer):
    """Batch-1 decode of a vision-language model's language model runs compiled on the CPU where a text model's
    of the same layers would (full attention only: not gemma3's window layers, nor Qwen3.5's state layers); a model
    whose positions come from the images (M-RoPE) gets each row's start plus its delta as a traced array."""
    prompt = image_prompt(vlm, text_tokens(6), text_tokens(6, seed=1), seed=2)
    with vlm_engine(vlm, tokenizer) as engine:
        leaves = engine.built.layout.kv_leaves
        assert engine.runner.takes_positions == (vlm.config.model_type in MROPE_MODEL_TYPES)
        full_only = all(leaf.kind == "full" for leaf in leaves) and not engine.built.layout.state_leaves
        # PaliGemma 2's (Gemma 2's) attention computes its soft-capped scores itself over the K/V its paged view
        # returned: not routed to the engine's attention, so no compiled pass (which reads the pools only).
        routed = vlm.config.text_config.model_type != "gemma2"
        assert (engine.runner.decoder is not None) == (full_only and routed)
        # Every other layer attends through its paged view; Gemma 4's small models' last layers attend an earlier
        # layer's K/V too (without a cache of their own), so that layer's leaf is read both ways.
        assert all(leaf.routed or leaf.consumers == ("sdpa", "sdpa-other-cache") for leaf in leaves) == routed
        assert engine.generate([prompt], GREEDY)[0].token_ids == mlx_vlm_greedy(vlm, prompt, GREEDY.max_tokens)


def test_on_the_path_a_gpu_takes_decode_queued_ahead_gets_each_rows_positions(vlm, tokenizer, monkeypatch):
    """A GPU queues the next decode pass before reading the last (runner/deferred_writes.py, simulated as CUDA on
    the CPU): M-RoPE rows get their start plus their request's delta there too; batched beside a text request."""
    from mlxpaged.platform import backend
    from mlxpaged.runner import model_runner

    monkeypatch.setattr(model_runner, "MAX_PENDING", 5)  # flush the pending K/V mid-reply
    monkeypatch.setattr(model_runner, "MAX_PENDING_BUFFERED", 5)
    prompt = image_prompt(vlm, text_tokens(7, seed=20), text_tokens(6, seed=21), seed=6)
    text = text_tokens(9, seed=22)
    long = dataclasses.replace(GREEDY, max_tokens=16)
    with backend.simulate("cuda"), vlm_engine(vlm, tokenizer) as engine:
        layout = engine.built.layout
        assert engine.runner.defers == (
            all(leaf.kind == "full" and leaf.routed for leaf in layout.kv_leaves) and not layout.state_leaves
        )
        both = engine.generate([prompt, text], long)
    assert both[0].token_ids == mlx_vlm_greedy(vlm, prompt, long.max_tokens)
    assert both[1].token_ids == mlx_vlm_greedy(vlm, text, long.max_tokens)


def count_tower_runs(vlm, monkeypatch) -> list[bool]:
    """From now on each call of the model's get_input_embeddings appends whether it was given pixels (the vision
    tower ran) to the list returned."""
    towers: list[bool] = []
    real = vlm.get_input_embeddings

    def counting(input_ids, pixel_values=None, **kwargs):
        towers.append(pixel_values is not None)
        return real(input_ids, pixel_values, **kwargs)

    monkeypatch.setattr(vlm, "get_input_embeddings", counting)
    return towers


def test_a_next_turn_whose_image_is_cached_does_not_run_the_vision_tower(vlm, tokenizer, monkeypatch):
    """An agent re-sends the same screenshot every turn: once its tokens come from the prefix cache, the turn's
    new tokens are embedded as text (vision/embedding.py); the reply is still mlx-vlm's."""
    first = image_prompt(vlm, text_tokens(9, seed=7), text_tokens(12, seed=8), seed=3)
    turn = next_turn(first, text_tokens(11, seed=9))
    with vlm_engine(vlm, tokenizer) as engine:
        towers = count_tower_runs(vlm, monkeypatch)
        engine.generate([first], GREEDY)
        assert towers == [True]
        follow = engine.generate([turn], GREEDY)[0]
        if caches_prefixes(engine):  # state models (Qwen3.5) embed it in two chunks: one ends at the last boundary
            assert towers[:2] == [True, False] and not any(towers[2:]), towers
            assert follow.cached_tokens >= first.images[0].start + first.images[0].length
        elif vlm.config.model_type == "paligemma":  # no prefix cache (its prompt attends both ways), none kept
            assert towers == [True, True] and follow.cached_tokens == 0
        else:  # no prefix cache (Gemma 3's sliding windows): the image's kept rows stand in for the tower
            assert towers == [True, False] and follow.cached_tokens == 0
    monkeypatch.undo()
    assert follow.token_ids == mlx_vlm_greedy(vlm, turn, GREEDY.max_tokens)


@pytest.mark.parametrize("keep", [True, False], ids=["kept", "off"])
def test_an_image_sent_again_after_other_text_is_not_encoded_again(vlm, tokenizer, monkeypatch, keep):
    """The same image after other text misses the prefix cache; its rows, kept by digest, stand in for the
    tower's output (the reply is still mlx-vlm's), for every architecture: Gemma 3's 4-D mask is not read by its
    language model (vision/embedding.py `reads_argument`), Qwen3-VL's deepstack features are kept beside the rows
    (vision/encoded_images.py). `image_cache_size=0` keeps none."""
    first = image_prompt(vlm, text_tokens(9, seed=10), text_tokens(7, seed=11), seed=5)
    again = image_prompt(vlm, text_tokens(14, seed=12), text_tokens(5, seed=13), seed=5)  # other text first: a miss
    with vlm_engine(vlm, tokenizer, **({} if keep else {"image_cache_size": 0})) as engine:
        towers = count_tower_runs(vlm, monkeypatch)
        engine.generate([first], GREEDY)
        reply = engine.generate([again], GREEDY)[0]
        assert reply.cached_tokens == 0
    monkeypatch.undo()
    keeps = keep and vlm.config.model_type != "paligemma"  # its merge places features by position: none kept
    assert towers == [True, True] if not keeps else towers == [True, False]  # the text alone, embedded
    assert reply.token_ids == mlx_vlm_greedy(vlm, again, GREEDY.max_tokens)


def test_a_prompt_with_the_pad_token_outside_its_image_is_encoded_not_put_together(tokenizer, monkeypatch):
    """Gemma 3's merge zeroes the pad token's embedding where a text embedding would not: a prompt holding it
    outside its images runs the tower again rather than use the image's kept rows (the reply is mlx-vlm's)."""
    vlm = ARCHITECTURES["gemma3"].build()
    pad = vlm.config.pad_token_id
    first = image_prompt(vlm, text_tokens(9, seed=10), text_tokens(7, seed=11), seed=5)
    padded = image_prompt(vlm, [*text_tokens(13, seed=12), pad], text_tokens(5, seed=13), seed=5)
    with vlm_engine(vlm, tokenizer) as engine:
        towers = count_tower_runs(vlm, monkeypatch)
        engine.generate([first], GREEDY)
        reply = engine.generate([padded], GREEDY)[0]
    monkeypatch.undo()
    assert towers[:2] == [True, True]
    assert reply.token_ids == mlx_vlm_greedy(vlm, padded, GREEDY.max_tokens)


def test_forgetting_the_encoded_images_runs_the_tower_again(tokenizer, monkeypatch):
    """`Engine.forget_encoded_images` (benchmarks' cold turn): the same prompt after it, the prefix cache emptied too,
    encodes its image again."""
    vlm = ARCHITECTURES["idefics3"].build()
    prompt = image_prompt(vlm, text_tokens(9, seed=10), text_tokens(7, seed=11), seed=5)
    with vlm_engine(vlm, tokenizer) as engine:
        towers = count_tower_runs(vlm, monkeypatch)
        for forget in (False, True):
            engine.pool.reset_prefix_cache()
            if forget:
                engine.forget_encoded_images()
            engine.generate([prompt], GREEDY)
        engine.pool.reset_prefix_cache()
        engine.generate([prompt], GREEDY)
    monkeypatch.undo()
    assert towers == [True, True, False]  # encoded; encoded again once forgotten; kept since
