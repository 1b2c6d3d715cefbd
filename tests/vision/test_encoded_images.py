"""The images a vision model encoded, kept by digest within a byte bound (vision/encoded_images.py), and the
setting and flag that size it. Their use on the engine: tests/vision/test_engine_images.py."""

from __future__ import annotations

import gc

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import CacheConfig
from mlxpaged.errors import ConfigError
from mlxpaged.vision.encoded_images import EncodedImages
from mlxpaged_app.cli import build_parser
from mlxpaged_app.server.flags import cache_settings

import mlx.core as mx
import pytest


def rows(n: int, value: float = 1.0) -> mx.array:
    return mx.full((n, 8), value, dtype=mx.float32)  # n rows of 32 bytes


def test_rows_come_back_only_when_every_image_is_kept_and_the_oldest_go_first():
    kept = EncodedImages(max_bytes=3 * 32 * 4)  # three images of 4 rows
    for i, digest in enumerate("abc"):
        kept.keep(digest, rows(4, i))
    assert kept.rows(["a", "x"]) is None and kept.hits == 0  # all or nothing
    assert [float(r[0, 0]) for r in kept.rows(["c", "a"])] == [2.0, 0.0] and kept.hits == 1
    kept.keep("d", rows(4, 3))  # "b" is the least recently used now
    assert kept.rows(["b"]) is None and kept.rows(["a", "c", "d"]) is not None
    assert kept.nbytes == 3 * 128 and len(kept) == 3
    kept.keep("huge", rows(100))  # more than the whole bound: not kept, nothing dropped for it
    assert kept.rows(["huge"]) is None and len(kept) == 3


def test_a_kept_image_is_a_copy_that_does_not_pin_the_prompts_embeddings():
    kept = EncodedImages(max_bytes=2**20)
    gc.collect()
    before = mx.get_active_memory()
    embeds = mx.random.normal((1, 4000, 1000))  # 16 MB
    mx.eval(embeds)
    kept.keep("a", embeds[0, 100:200])  # 400 KB
    del embeds
    gc.collect()
    assert mx.get_active_memory() - before < 2_000_000


def test_the_setting_and_the_flag():
    assert CacheConfig().image_cache_size == 256 * 10**6
    assert CacheConfig(image_cache_size="1GiB").image_cache_size == 2**30
    assert CacheConfig(image_cache_size=0).image_cache_size == 0  # keeps none
    with pytest.raises(ConfigError, match="image_cache_size"):
        CacheConfig(image_cache_size="lots")
    args = build_parser().parse_args(["serve", "--image-cache-size", "64MB"])
    assert cache_settings(args)["image_cache_size"] == "64MB"
    assert cache_settings(build_parser().parse_args(["serve"]))["image_cache_size"] == "256MB"


@pytest.mark.parametrize(
    ("module", "name", "read"),
    [
        ("gemma3", "attention_mask_4d", False),  # **kwargs in its signature, never read
        ("falcon_ocr", "attention_mask_4d", True),  # kwargs.pop("attention_mask_4d")
        ("qwen3_vl", "visual_pos_masks", True),  # a parameter
        ("qwen3_vl", "deepstack_visual_embeds", True),
    ],
)
def test_what_a_language_model_reads_of_its_embeddings_output(module, name, read):
    import importlib

    from mlxpaged.vision.embedding import reads_argument

    language = importlib.import_module(f"mlx_vlm.models.{module}.language")
    model = language.LanguageModel.__new__(language.LanguageModel)  # the class's forward is what is read
    assert reads_argument(model, name) is read


def test_clear_forgets_every_image():
    kept = EncodedImages(max_bytes=2**20)
    kept.keep("a", rows(4))
    kept.clear()
    assert kept.rows(["a"]) is None and kept.nbytes == 0 and len(kept) == 0
