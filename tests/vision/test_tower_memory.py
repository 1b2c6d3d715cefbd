"""What images cost the vision tower (vision/tower_memory.py) against MLX's own peak memory on the CPU, the plan's
choice of the largest image it sets that memory aside for (platform/memory.py), and images larger than that scaled
down before the processor."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import CacheConfig, ConfigError
from mlxpaged.engine.engine import Engine
from mlxpaged.errors import InsufficientMemoryError
from mlxpaged.platform.memory import DeviceFacts, TowerRung, plan_memory
from mlxpaged.vision.images import scaled_to
from mlxpaged.vision.tower_memory import PLAN_MARGIN, Tower, candidate_pixels, largest_image, tower_rungs
from tests.vision.test_chat_images import ask, picture
from tests.vision.tiny_vlm_dirs import write_tiny_gemma4_dir, write_tiny_qwen3_5_dir

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

GB = 10**9


def _built(model_dir: Path, module, vision: dict):
    """mlx-vlm's model for the checkpoint's config with its tower widened by `vision` (random weights)."""
    config = json.loads((model_dir / "config.json").read_text())
    config["vision_config"] = {**config["vision_config"], **vision}
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    model = module.Model(model_config)
    mx.eval(model.parameters())
    return model


def _measured_peak(vlm, processor, pixels: int) -> int:
    """MLX's peak memory over the model's merge of one random square image of `pixels` (tower, projector, merge)."""
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import prepare_inputs

    side = math.isqrt(pixels)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))
    token = getattr(vlm.config, "image_token_id", None) or vlm.config.image_token_index
    text = apply_chat_template(processor, vlm.config, [{"role": "user", "content": [{"type": "image"}]}], num_images=1)
    inputs = prepare_inputs(processor, images=[image], prompts=text, image_token_index=token)
    arrays = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "pixel_values")}
    mx.eval([v for v in inputs.values() if isinstance(v, mx.array)])
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = vlm.get_input_embeddings(inputs["input_ids"], inputs["pixel_values"], **arrays)
    mx.eval(out.inputs_embeds)
    return mx.get_peak_memory() - before


def _widen_qwen(processor) -> None:
    processor.image_processor.max_pixels = 1024 * 1024
    processor.image_processor.size = {"longest_edge": 1024 * 1024, "shortest_edge": 32 * 32}


def _widen_gemma4(processor) -> None:
    processor.image_processor.max_soft_tokens = 1024


@pytest.mark.parametrize(
    "kind, vision",
    [
        ("qwen3_5", {"hidden_size": 128, "intermediate_size": 512, "num_heads": 2}),  # no mask
        ("gemma4", {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 2, "head_dim": 64}),  # a mask
    ],
    ids=["qwen3_5", "gemma4"],
)
def test_the_estimate_bounds_what_the_tower_takes_on_the_cpu(kind, vision, tmp_path):
    """4,096 patches, where the patches' terms outweigh everything else: the plan's figure is at least MLX's peak and
    not far above it."""
    from mlx_vlm.models import gemma4, qwen3_5
    from mlx_vlm.utils import load_processor

    writer, module, widen = {
        "qwen3_5": (write_tiny_qwen3_5_dir, qwen3_5, _widen_qwen),
        "gemma4": (write_tiny_gemma4_dir, gemma4, _widen_gemma4),
    }[kind]
    model_dir = writer(tmp_path / kind)
    vlm = _built(model_dir, module, vision)
    processor = load_processor(model_dir, add_detokenizer=False)
    widen(processor)
    tower = Tower.from_config(vlm.config.vision_config)
    token = getattr(vlm.config, "image_token_id", None) or vlm.config.image_token_index
    largest = largest_image(processor, vlm.config, token, 2_000_000, tower.patch_size)
    assert largest.patches == 4096
    estimate = tower.activation_bytes(largest, 4, "cpu")
    measured = _measured_peak(vlm, processor, 2_000_000)
    assert measured <= estimate <= 2 * measured, (estimate, measured)


def test_fused_attention_leaves_the_scores_out():
    """Metal's fused attention (head dims 64, 80, 128) and CUDA's for half floats keep no scores: what is left is
    linear in the patches."""
    qwen_like = Tower(hidden=1280, intermediate=3420, heads=16, patch_size=14)  # head dim 80
    siglip_like = Tower(hidden=1152, intermediate=4304, heads=16, patch_size=14)  # head dim 72
    small, big = (largest_image_of(patches) for patches in (1024, 4096))
    for backend, dtype in (("metal", 2), ("cuda", 2)):
        assert qwen_like.attention_fused(dtype, backend)
        grown = qwen_like.activation_bytes(big, dtype, backend) / qwen_like.activation_bytes(small, dtype, backend)
        assert grown == pytest.approx(4.0)
    assert not siglip_like.attention_fused(2, "metal") and not qwen_like.attention_fused(4, "cuda")
    assert not qwen_like.attention_fused(2, "cpu")
    cpu = qwen_like.activation_bytes(big, 4, "cpu") - qwen_like.activation_bytes(big, 4, "metal")
    assert cpu == pytest.approx(PLAN_MARGIN * 16 * 4096**2 * 4, abs=2)  # one image's scores, every head


def largest_image_of(patches: int):
    from mlxpaged.vision.tower_memory import LargestImage

    return LargestImage(pixels=patches * 196, patches=patches, scores=patches * patches, values=patches * 588)


DEVICE = DeviceFacts("cpu", total_bytes=16 * GB, available_bytes=8 * GB)


def _facts(rungs: tuple[TowerRung, ...], layers: int = 2):
    from mlxpaged.platform.memory import KVShape, ModelFacts

    kv = KVShape(num_layers=layers, num_kv_heads=8, head_dim=128, dtype_bytes=2)
    return ModelFacts(kv, 1 * GB, 64, 1000, 32768, takes_images=True, tower_rungs=rungs)


RUNGS = (
    TowerRung(50_000_000, 65536, 4 * GB),
    TowerRung(12_500_000, 16384, 1 * GB),
    TowerRung(3_125_000, 4096, GB // 8),
)


def test_the_plan_takes_the_largest_image_whose_tower_fits_in_half_of_what_is_left():
    """8 GB available: 1.6 GB reserve, 1 GB weights, the activations and encoded images; of the ~5 GB left, half
    holds the 12.5 MP rung (1 GB), not the 50 MP one (4 GB). With less memory a smaller rung; with none fitting,
    the smallest."""
    plan = plan_memory(DEVICE, _facts(RUNGS), CacheConfig(cache_tokens=4096))
    assert (plan.image_pixels, plan.tower_bytes) == (12_500_000, 1 * GB)
    assert any(
        label == "vision tower, the largest image (up to 12,500,000 px: 16,384 patches)" for label, _ in plan.breakdown
    )
    tight = DeviceFacts("cpu", total_bytes=16 * GB, available_bytes=int(4.2 * GB))
    assert plan_memory(tight, _facts(RUNGS), CacheConfig(cache_tokens=4096)).image_pixels == 3_125_000
    tighter = DeviceFacts("cpu", total_bytes=16 * GB, available_bytes=int(3.8 * GB))
    assert plan_memory(tighter, _facts(RUNGS), CacheConfig(cache_tokens=4096)).image_pixels == 3_125_000
    text_only = plan_memory(DEVICE, _facts(()), CacheConfig(cache_tokens=4096))
    assert (text_only.image_pixels, text_only.tower_bytes) == (None, 0)


def test_the_tower_leaves_the_kv_cache_room_for_one_sequence_of_the_longest_length():
    """32 layers of 8 x 128 K/V: 16,384 tokens need ~2.1 GB of pages. The 12.5 MP rung is within half of what is left
    but leaves the KV cache (half of the rest on a CPU) too little for that sequence, so the 3.1 MP one is planned."""
    cache = CacheConfig(cache_tokens=16384)
    plan = plan_memory(DEVICE, _facts(RUNGS, layers=32), cache)
    assert plan.image_pixels == 3_125_000 and plan.token_capacity >= 16384
    with pytest.raises(InsufficientMemoryError, match="16,384-token sequence"):
        plan_memory(DEVICE, _facts(RUNGS[1:2], layers=32), cache)  # that rung alone: the plan says why not


def test_an_image_size_asked_for_is_planned_as_asked_and_refused_when_it_cannot_fit():
    asked = (TowerRung(50_000_000, 65536, 8 * GB),)  # image_memory_pixels=50_000_000: one rung
    with pytest.raises(InsufficientMemoryError, match=r"vision tower, the largest image \(up to 50,000,000 px"):
        plan_memory(DEVICE, _facts(asked), CacheConfig(cache_tokens=4096, image_memory_pixels=50_000_000))
    with pytest.raises(InsufficientMemoryError, match="lower max_batch_tokens= or image_memory_pixels="):
        plan_memory(DEVICE, _facts(asked), CacheConfig(cache_tokens=4096, image_memory_pixels=50_000_000))
    assert candidate_pixels(1_000_000) == (1_000_000,)
    assert candidate_pixels(None)[0] == 50_000_000 and len(candidate_pixels(None)) == 8
    with pytest.raises(ConfigError, match="image_memory_pixels"):
        CacheConfig(image_memory_pixels=0)


def test_rungs_hold_the_most_any_smaller_image_costs(tmp_path):
    """Gemma 4's processor rounds a square image to its pooling: a smaller square can make more patches than a
    larger one. Each rung holds the most of every size up to its own."""
    from mlx_vlm.models import gemma4
    from mlx_vlm.utils import load_processor

    model_dir = write_tiny_gemma4_dir(tmp_path / "gemma4")
    vlm = _built(model_dir, gemma4, {})
    processor = load_processor(model_dir, add_detokenizer=False)
    tower = Tower.from_config(vlm.config.vision_config)
    token = vlm.config.image_token_id
    sizes = candidate_pixels(None)
    each = [largest_image(processor, vlm.config, token, size, tower.patch_size).patches for size in sizes]
    assert len(set(each)) > 1 and each != sorted(each, reverse=True)  # not monotone in the size
    rungs = tower_rungs(processor, vlm.config, token, 4, "cpu", sizes)
    for rung in rungs:
        assert rung.patches == max(p for size, p in zip(sizes, each, strict=True) if size <= rung.pixels)
    assert [r.pixels for r in rungs] == sorted((r.pixels for r in rungs), reverse=True)
    assert len({r.bytes for r in rungs}) == len(rungs)  # sizes that cost alike keep the largest


def test_an_image_larger_than_the_plan_is_scaled_down_before_the_processor(tmp_path):
    """image_memory_pixels=1,500: a 50 x 40 picture (2,000 px) reaches the processor as 43 x 34; its digest is the
    picture's as sent, and the reply is the one for the scaled picture."""
    model_dir = write_tiny_qwen3_5_dir(tmp_path / "qwen")
    photo = picture(0, (50, 40))
    assert scaled_to(photo, 1500).size == (43, 34) and scaled_to(photo, 2000) is photo
    with Engine.from_pretrained(str(model_dir), cache_tokens=1024, image_memory_pixels=1500) as engine:
        assert engine.plan.image_pixels == 1500
        sent = engine.chat_prompt(ask("Describe", photo))
        by_hand = engine.chat_prompt(ask("Describe", scaled_to(photo, 1500)))
        assert sent.token_ids == by_hand.token_ids
        assert mx.array_equal(sent.arrays["pixel_values"], by_hand.arrays["pixel_values"])
    with Engine.from_pretrained(str(model_dir), cache_tokens=1024) as engine:
        assert engine.plan.image_pixels == 50_000_000  # the tiny tower fits any image
        unscaled = engine.chat_prompt(ask("Describe", photo))
        assert unscaled.images[0].digest == sent.images[0].digest  # the same picture, as sent
        assert not mx.array_equal(unscaled.arrays["pixel_values"], sent.arrays["pixel_values"])


def test_a_tower_the_estimate_cannot_read_loads_with_a_warning_and_no_tower_line(tmp_path, monkeypatch):
    """An architecture not checked here whose processor or vision config the estimate cannot read still loads (as it
    did before the plan counted the tower), saying so."""
    from mlxpaged.loading.checkpoint import read_before_load
    from mlxpaged.vision import loading

    def unreadable(*args, **kwargs):
        raise ValueError("the vision config names none of num_attention_heads, num_heads")

    monkeypatch.setattr(loading, "tower_rungs", unreadable)
    model_dir = write_tiny_qwen3_5_dir(tmp_path / "qwen")
    with pytest.warns(RuntimeWarning, match="the vision tower's memory for images is not planned"):
        facts, _ = read_before_load(model_dir, "cpu")
    assert facts.takes_images and facts.tower_rungs == ()
