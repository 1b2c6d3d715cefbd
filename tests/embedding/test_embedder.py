"""Embedder on tiny random qwen3 embedding models (tiny_embedding.py) against a plain forward pass.

The reference is computed by hand: mlx-lm's own `load` and `model.model(...)` on one unpadded input at a time,
no cache, float32, pooled and normalized in NumPy. Tolerance: TOLERANCE on vectors of norm 1 (float32; a padded
batch has other matmul shapes than one input alone, so the sums round differently, ~2e-7 measured).
"""

from __future__ import annotations

from mlxpaged import Embedder
from mlxpaged.errors import EmbeddingInputError, InputTooLongError, NotAnEmbeddingModelError
from tests.embedding.tiny_embedding import PROMPTS, write_tiny_embedding_dir

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

TOLERANCE = 1e-5
TEXTS = [
    "hello world",
    "a much longer sentence, with quite a few more tokens in it than the others have",
    "x",
    "The capital of France is Paris.",
    "",  # the default tokenizer adds no special tokens: refused as empty where used
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedding-models")
    return {pooling: write_tiny_embedding_dir(root / pooling, pooling) for pooling in ("last", "mean", "cls")} | {
        "raw": write_tiny_embedding_dir(root / "raw", "mean", normalize=False)
    }


@pytest.fixture(scope="module")
def embedders(model_dirs):
    return {name: Embedder.from_pretrained(str(path)) for name, path in model_dirs.items()}


def reference(model_dir, texts: list[str], pooling: str, normalize: bool = True) -> np.ndarray:
    """mlx-lm's model, one unpadded input at a time, pooled by hand."""
    model, tokenizer = load(str(model_dir))
    rows = []
    for text in texts:
        hidden = np.array(model.model(mx.array([tokenizer.encode(text)]))[0].astype(mx.float32))
        vector = {"last": hidden[-1], "mean": hidden.mean(axis=0), "cls": hidden[0]}[pooling]
        rows.append(vector / np.linalg.norm(vector) if normalize else vector)
    return np.stack(rows)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_vectors_equal_a_plain_forward_pass_with_the_same_pooling(model_dirs, embedders, pooling):
    texts = TEXTS[:4]
    result = embedders[pooling].embed(texts)
    assert result.forward_passes == 1  # four inputs of different lengths, right-padded into one pass
    assert result.vectors.shape == (4, 64) and result.vectors.dtype == np.float32
    np.testing.assert_allclose(result.vectors, reference(model_dirs[pooling], texts, pooling), atol=TOLERANCE)
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1.0, atol=1e-6)


def test_no_normalize_module_returns_the_pooled_vector(model_dirs, embedders):
    texts = TEXTS[:3]
    expected = reference(model_dirs["raw"], texts, "mean", normalize=False)
    np.testing.assert_allclose(embedders["raw"].embed(texts).vectors, expected, atol=TOLERANCE * 10, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_batch_equals_its_inputs_one_by_one(embedders, pooling):
    embedder = embedders[pooling]
    texts = [f"input number {i} " + "word " * (i * 3) for i in range(12)]
    batched = embedder.embed(texts)
    alone = np.stack([embedder.embed([text]).vectors[0] for text in texts])
    assert batched.forward_passes == 1
    np.testing.assert_allclose(batched.vectors, alone, atol=TOLERANCE)
    assert batched.token_counts == [embedder.embed([t]).token_counts[0] for t in texts]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_a_small_token_budget_splits_passes_and_chunks_long_inputs(model_dirs, pooling):
    """max_batch_tokens=8: several passes, and inputs longer than 8 tokens run in chunks through the cache."""
    small = Embedder.from_pretrained(str(model_dirs[pooling]), max_batch_tokens=8)
    texts = TEXTS[:4]
    result = small.embed(texts)
    assert result.forward_passes > 1 and max(result.token_counts) > 8
    np.testing.assert_allclose(result.vectors, reference(model_dirs[pooling], texts, pooling), atol=TOLERANCE)


def test_token_arrays_are_taken_as_they_are(embedders):
    embedder = embedders["last"]
    ids = [embedder.tokenizer.encode(text) for text in TEXTS[:3]]
    np.testing.assert_allclose(embedder.embed(ids).vectors, embedder.embed(TEXTS[:3]).vectors, atol=TOLERANCE)
    assert embedder.embed(ids).token_counts == [len(row) for row in ids]


def test_dimensions_truncate_and_normalize_again(embedders):
    full = embedders["last"].embed(TEXTS[:3]).vectors
    short = embedders["last"].embed(TEXTS[:3], dimensions=16).vectors
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert short.shape == (3, 16)
    np.testing.assert_allclose(short, expected, atol=1e-6)
    raw_full = embedders["raw"].embed(TEXTS[:3]).vectors  # no Normalize module: truncation only
    np.testing.assert_allclose(embedders["raw"].embed(TEXTS[:3], dimensions=5).vectors, raw_full[:, :5], atol=1e-6)


@pytest.mark.parametrize("dimensions", [0, 65, -1, 2.5, True])
def test_dimensions_out_of_range_are_refused_naming_the_width(embedders, dimensions):
    with pytest.raises(EmbeddingInputError, match="from 1 to 64") as raised:
        embedders["last"].embed(["hi"], dimensions=dimensions)
    assert raised.value.param == "dimensions"


def test_an_input_past_the_context_is_refused_with_the_numbers_or_truncated(tmp_path):
    embedder = Embedder.from_pretrained(str(write_tiny_embedding_dir(tmp_path / "short", "last", context=16)))
    long_ids = list(range(1, 41))
    with pytest.raises(InputTooLongError, match="input 1 has 40 tokens, more than the model's context of 16") as raised:
        embedder.embed([[5, 6], long_ids])
    assert (raised.value.index, raised.value.tokens, raised.value.limit) == (1, 40, 16)
    truncated = embedder.embed([long_ids], truncate=True)
    assert truncated.token_counts == [16]
    np.testing.assert_allclose(truncated.vectors, embedder.embed([long_ids[:16]]).vectors, atol=TOLERANCE)
    text = "word " * 50
    assert embedder.embed([text], truncate=True).token_counts == [16]
    with pytest.raises(InputTooLongError, match=f"input 0 has {len(embedder.tokenizer.encode(text))} tokens"):
        embedder.embed([text])


@pytest.mark.parametrize(
    ("inputs", "match"),
    [
        ([], "no inputs"),
        ([""], "input 0 is empty"),
        ([[1, 2], []], "input 1 is empty"),
        ([[1, 49152]], "input 0 holds 49152, not a token id"),
        ([[1, True]], "holds True"),
        ([[1, None]], "holds None"),
        (["text", [1, 2]], "input 0 is a str; inputs are all texts or all token arrays"),
    ],
)
def test_bad_inputs_are_refused_naming_the_input(embedders, inputs, match):
    with pytest.raises(EmbeddingInputError, match=match) as raised:
        embedders["last"].embed(inputs)
    assert raised.value.param == "input"


def test_a_prompt_goes_before_each_text(embedders):
    embedder = embedders["mean"]
    with_prompt = embedder.embed(["what is MLX?"], prompt_name="query").vectors
    by_hand = embedder.embed([PROMPTS["query"] + "what is MLX?"]).vectors
    np.testing.assert_allclose(with_prompt, by_hand, atol=TOLERANCE)
    with pytest.raises(
        EmbeddingInputError, match="unknown prompt_name 'passage'; this model's prompts: document, query"
    ):
        embedder.embed(["x"], prompt_name="passage")


def test_the_official_flat_checkpoint_layout_loads_and_equals_the_mlx_layout(tmp_path, embedders):
    """Qwen3-Embedding's own files: backbone keys without `model.`, untied and no lm_head.weight (mlx-lm's load
    refuses them). Same seed as the mlx-layout model: the same vectors."""
    flat = write_tiny_embedding_dir(tmp_path / "flat", "last", layout="flat")
    with pytest.raises(ValueError):
        load(str(flat))
    embedder = Embedder.from_pretrained(str(flat))
    assert "lm_head" not in embedder.loaded.model
    np.testing.assert_allclose(embedder.embed(TEXTS[:3]).vectors, embedders["last"].embed(TEXTS[:3]).vectors, atol=0)


def test_the_lm_head_is_not_loaded(embedders):
    assert "lm_head" not in embedders["last"].loaded.model  # the checkpoint has one (untied); nothing reads it


def test_a_generative_model_is_refused_with_the_reason(tmp_path):
    generative = write_tiny_embedding_dir(tmp_path / "gen", sentence_transformers=False)
    with pytest.raises(NotAnEmbeddingModelError, match="not an embedding model: its directory has no sentence-tr"):
        Embedder.from_pretrained(str(generative))
    with pytest.raises(NotAnEmbeddingModelError, match="smollm2-135m-float32 is not an embedding model"):
        Embedder.from_pretrained("smollm2-135m")  # the embedded default model: refused before its weights load


def test_a_closed_embedder_refuses_calls(model_dirs):
    from mlxpaged.errors import EngineClosedError

    with Embedder.from_pretrained(str(model_dirs["last"])) as embedder:
        assert embedder.embed(["hi"]).vectors.shape == (1, 64)
    with pytest.raises(EngineClosedError):
        embedder.embed(["hi"])


def test_the_engine_refuses_an_embedding_model(model_dirs):
    from mlxpaged import Engine
    from mlxpaged.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"is an embedding model .* load it with mlxpaged\.Embedder"):
        Engine.from_pretrained(str(model_dirs["last"]))


def test_half_precision_weights_become_float32_on_the_cpu_backend(tmp_path):
    """As the engine's loader does (loader.fit_dtypes): float32 is the CPU backend's fast dtype; a GPU keeps
    the checkpoint's."""
    from mlxpaged.platform import backend

    from mlx.utils import tree_flatten

    embedder = Embedder.from_pretrained(str(write_tiny_embedding_dir(tmp_path / "bf16", "mean", dtype="bfloat16")))
    expected = "float32" if backend.current() == "cpu" else "bfloat16"
    assert embedder.loaded.dtype == expected
    assert {v.dtype for _, v in tree_flatten(embedder.loaded.model.parameters())} == {getattr(mx, expected)}
    assert embedder.embed(["hi"]).vectors.dtype == np.float32
