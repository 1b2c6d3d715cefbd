"""Tiny random vision-language models of mlx-vlm's architectures, built in code (float32, seeded), and prompts
for them: each image's tokens expanded as the model's processor would, and random pixels in the layout its
processor gives.

Every model shares the vocabulary: ids below TEXT_VOCAB are text, the image token is VOCAB - 1.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.vision.loading import image_token_id
from mlxpaged.vision.prompt import ImagePrompt, image_spans
from tests.tiny_models import random_tokens

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map, tree_map_with_path

VOCAB = 256
TEXT_VOCAB = VOCAB - 16  # the ids above are the models' special ones (the image token is VOCAB - 1)
IMAGE_SIZE, PATCH = 56, 14  # a 4 x 4 grid of patches


@dataclass(frozen=True)
class TinyVLM:
    """An architecture's tiny model: `build()` makes it; an image is `tokens_per_image` image tokens between
    `around` (the markers its processor puts before and after them), and a prompt of `length` tokens with one
    image of `pixels` [3, H, W] takes the arrays `arrays(pixels, length)`."""

    name: str
    build: Callable[[], object]
    tokens_per_image: int
    arrays: Callable[[np.ndarray, int], dict[str, mx.array]]
    around: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    token_types: bool = False  # its processor also gives each token's kind (Gemma 4: 1 at image tokens)


# What every tiny language model and tower share; each architecture adds its own.
TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
}
TOWER = {"hidden_size": 32, "intermediate_size": 64, "patch_size": PATCH}
QWEN2_TEXT = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}
QWEN3_TEXT = {"rms_norm_eps": 1e-6, "head_dim": 16, "rope_theta": 5_000_000.0, "max_position_embeddings": 4096}
# Qwen's markers around an image's tokens (its get_rope_index finds images by the start marker).
QWEN_START, QWEN_END, QWEN_VIDEO = VOCAB - 3, VOCAB - 4, VOCAB - 2
GEMMA4_START, GEMMA4_END = VOCAB - 3, VOCAB - 4  # its processor's begin / end of image markers
QWEN_IDS = {"image_token_id": VOCAB - 1, "video_token_id": QWEN_VIDEO, "vision_start_token_id": QWEN_START}


def _built(model_type: str, text: dict, vision: dict, **config):
    """mlx-vlm's model of `model_type`: its language model TEXT updated with `text` (None: a key its config has
    not), its tower `vision`, seeded."""
    module = importlib.import_module(f"mlx_vlm.models.{model_type}")
    model_config = module.ModelConfig(
        text_config=module.TextConfig(**{k: v for k, v in {**TEXT, **text}.items() if v is not None}),
        vision_config=module.VisionConfig(**vision),
        model_type=model_type,
        **config,
    )
    return _seeded(lambda: module.Model(model_config))


def _mrope(kind: str) -> dict:
    """Qwen's positions in three sections (time, rows, columns) of a 16-wide head's 8 rotated pairs (a new dict
    each time: configs rewrite theirs)."""
    return {"rope_scaling": {"type": kind, "mrope_section": [4, 2, 2]}}


def _idefics3():
    text = {"model_type": "idefics3", "rms_norm_eps": 1e-5}
    vision = {**TOWER, "model_type": "idefics3", "num_hidden_layers": 1, "num_attention_heads": 2}
    return _built("idefics3", text, {**vision, "image_size": IMAGE_SIZE, "num_channels": 3}, image_token_id=VOCAB - 1)


def _gemma3():
    text = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 3,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,  # window layers, then a full one: the hybrid pattern of the real ones
        "sliding_window_pattern": 3,
        "mm_tokens_per_image": 4,  # the 4 x 4 patches pooled 2 x 2
    }
    vision = {**TOWER, "model_type": "siglip_vision_model", "num_hidden_layers": 1, "num_attention_heads": 2}
    return _built(
        "gemma3",
        text,
        {**vision, "image_size": IMAGE_SIZE},
        image_token_index=VOCAB - 1,
        hidden_size=64,
        vocab_size=VOCAB,
    )


def _llava():
    vision = {**TOWER, "model_type": "clip_vision_model", "num_attention_heads": 2, "image_size": IMAGE_SIZE}
    vision |= {"num_hidden_layers": 2, "projection_dim": 32}  # the features come from the second-to-last layer
    return _built("llava", {"model_type": "llama"}, vision, image_token_index=VOCAB - 1, vocab_size=VOCAB)


def _mistral3():
    text = {"model_type": "mistral", "rms_norm_eps": 1e-5, "head_dim": 16, "rope_theta": 10000.0}
    vision = {**TOWER, "num_hidden_layers": 1, "head_dim": 16, "num_attention_heads": 2, "image_size": IMAGE_SIZE}
    return _built("mistral3", text, vision, image_token_index=VOCAB - 1, vocab_size=VOCAB)  # Pixtral's tower


def _qwen2_vl():
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "patch_size": PATCH}
    text = {"model_type": "qwen2_vl", **QWEN2_TEXT, **_mrope("mrope")}
    return _built("qwen2_vl", text, vision, **QWEN_IDS, vocab_size=VOCAB)  # its config has no end marker


def _qwen2_5_vl():
    vision = {**TOWER, "depth": 2, "out_hidden_size": 64, "num_heads": 2, "fullatt_block_indexes": [1]}
    vision["window_size"] = 2 * PATCH  # windows of one merged token (2 x 2 patches): windowed and full layers differ
    text = {"model_type": "qwen2_5_vl", **QWEN2_TEXT, **_mrope("mrope")}
    return _built("qwen2_5_vl", text, vision, **QWEN_IDS, vision_end_token_id=QWEN_END, vocab_size=VOCAB)


# Qwen3-VL's tower, deepstack included: its first layer's features go into the language model's first layer too
QWEN3_TOWER = {**TOWER, "depth": 2, "out_hidden_size": 64, "num_heads": 2, "num_position_embeddings": 16}
QWEN3_TOWER["deepstack_visual_indexes"] = [0]


def _qwen3_vl():
    text = {"model_type": "qwen3_vl", **QWEN3_TEXT, **_mrope("default")}
    return _built("qwen3_vl", text, QWEN3_TOWER, **QWEN_IDS, vision_end_token_id=QWEN_END, vocab_size=VOCAB)


def _qwen3_vl_moe():
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []}
    text = {"model_type": "qwen3_vl_moe", **QWEN3_TEXT, **_mrope("default"), **experts, "moe_intermediate_size": 32}
    return _built("qwen3_vl_moe", text, QWEN3_TOWER, **QWEN_IDS, vision_end_token_id=QWEN_END, vocab_size=VOCAB)


def _qwen3_5(model_type: str = "qwen3_5", **extra):
    """Qwen3.5: gated-delta (state) layers with one full-attention layer after them, M-RoPE on a quarter of the
    head, Qwen3-VL's tower without deepstack."""
    rope = {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 100000, "partial_rotary_factor": 0.5}
    text = {"model_type": model_type, "rms_norm_eps": 1e-6, "head_dim": 16, "max_position_embeddings": 4096}
    text |= {"rope_parameters": rope, "num_hidden_layers": 4}
    text |= {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16}
    text |= {"linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 2, **extra}
    tower = {**QWEN3_TOWER, "deepstack_visual_indexes": []}
    return _built(model_type, text, tower, **QWEN_IDS, vision_end_token_id=QWEN_END, vocab_size=VOCAB)


def _qwen3_5_moe():
    experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    experts |= {"shared_expert_intermediate_size": 32, "intermediate_size": None}  # experts only
    return _qwen3_5("qwen3_5_moe", **experts)


def _glm4v():
    """GLM-4.1V / 4.5V: M-RoPE on half of each 16-wide head (Qwen's markers and grids), a Qwen2.5-VL-like tower."""
    text = {"model_type": "glm4v_text", "rms_norm_eps": 1e-5, "partial_rotary_factor": 0.5, "pad_token_id": 0}
    text |= {"rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]}, "max_position_embeddings": 4096}
    vision = {**TOWER, "model_type": "glm4v", "depth": 2, "num_heads": 2, "out_hidden_size": 64}
    vision |= {"image_size": IMAGE_SIZE}
    ids = {**QWEN_IDS, "image_token_index": VOCAB - 1, "video_token_index": QWEN_VIDEO}
    return _built("glm4v", text, vision, **ids, vision_end_token_id=QWEN_END, vocab_size=VOCAB, hidden_size=64)


def _gemma4(both_ways: bool = False):
    """Gemma 4: window layers of 8 with a full one after them, its own tower (4 x 4 patches pooled 2 x 2). The small
    ones (E2B / E4B) take per-layer inputs and share their last layers' K/V and are causal throughout; the large ones
    attend both ways within each image (`use_bidirectional_attention: "vision"`) and read values from their full
    layers' keys. Their post-norms are made louder: at unit scale a random model's residual (the scaled embedding)
    drowns every layer and it echoes its last token."""
    text = {"model_type": "gemma4_text", "head_dim": 16, "global_head_dim": 16, "sliding_window": 8}
    text |= {"sliding_window_pattern": 3, "vocab_size_per_layer_input": VOCAB}
    if both_ways:
        text |= {"num_hidden_layers": 3, "use_bidirectional_attention": "vision", "attention_k_eq_v": True}
        text |= {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "num_global_key_value_heads": 1}
    else:
        text |= {"num_hidden_layers": 4, "hidden_size_per_layer_input": 8, "num_kv_shared_layers": 1}
    vision = {**TOWER, "model_type": "gemma4_vision", "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"num_key_value_heads": 2, "head_dim": 16, "pooling_kernel_size": 2, "position_embedding_size": 64}
    vision |= {"default_output_length": 4}
    ids = {"image_token_id": VOCAB - 1, "boi_token_id": GEMMA4_START, "eoi_token_id": GEMMA4_END}
    model = _built("gemma4", text, vision, **ids, audio_token_id=VOCAB - 5, vocab_size=VOCAB, hidden_size=64)
    louder_post_norms(model)
    mx.eval(model.parameters())
    model.tiny_name = "gemma4-both-ways" if both_ways else "gemma4"  # two kinds of one model type
    return model


def louder_post_norms(vlm) -> None:
    """The language model's norms after each attention and MLP x5: at unit scale a random Gemma 4's scaled embedding
    drowns every layer, and it echoes its last token."""
    louder = tree_map_with_path(
        lambda path, p: p * 5.0 if ".post_" in f".{path}" and p.ndim == 1 else p, vlm.language_model.parameters()
    )
    vlm.language_model.update(louder)


def _gemma4_pixels(pixels: np.ndarray, length: int) -> dict[str, mx.array]:
    """Gemma 4's processor's pixels: in [0, 1] (its tower maps them to [-1, 1])."""
    return {"pixel_values": mx.array((pixels[None] + 1) / 2)}


def _paligemma():
    """PaliGemma: a Gemma language model attending both ways over the whole prompt (a prefix-LM: mlx-vlm's default
    for it) after a SigLIP tower's 16 patches, one token each; its merge zeroes the pad token (kept out of the text)."""
    text = {"model_type": "gemma", "head_dim": 16, "use_bidirectional_attention": True}
    vision = {**TOWER, "model_type": "siglip_vision_model", "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": IMAGE_SIZE, "projection_dim": 64}
    ids = {"image_token_index": VOCAB - 1, "pad_token_id": VOCAB - 2}
    return _built("paligemma", text, vision, **ids, hidden_size=64, vocab_size=VOCAB)


def _paligemma2():
    """PaliGemma 2: PaliGemma with Gemma 2's language model (soft-capped attention scores and logits, window layers of
    8 every other layer), its whole prompt attended both ways."""
    text = {"model_type": "gemma2", "head_dim": 16, "use_bidirectional_attention": True, "sliding_window": 8}
    text |= {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}
    vision = {**TOWER, "model_type": "siglip_vision_model", "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": IMAGE_SIZE, "projection_dim": 64}
    ids = {"image_token_index": VOCAB - 1, "pad_token_id": VOCAB - 2}
    return _built("paligemma", text, vision, **ids, hidden_size=64, vocab_size=VOCAB)


def _qwen_patches(pixels: np.ndarray, length: int) -> dict[str, mx.array]:
    """Qwen's processor's layout: the image as flattened patches [t * h * w, channels * 2 * 14 * 14] (the frame
    twice: its temporal patch is 2) and its grid (t, h, w) in patches."""
    channels, height, width = pixels.shape
    rows, columns = height // PATCH, width // PATCH
    frames = np.stack([pixels, pixels])  # [2, C, H, W]
    patches = frames.reshape(2, channels, rows, PATCH, columns, PATCH).transpose(2, 4, 1, 0, 3, 5)
    return {
        "pixel_values": mx.array(patches.reshape(rows * columns, -1)),
        "image_grid_thw": mx.array([[1, rows, columns]]),
    }


def _seeded(make, scale: float = 3.0):
    """The model of `make()` from seed 0, float32, matrices x3 so attention is far from uniform (as tests/archs
    does for text models)."""
    mx.random.seed(0)
    model = make()
    model.update(tree_map(lambda p: p.astype(mx.float32) * (scale if p.ndim == 2 else 1.0), model.parameters()))
    mx.eval(model.parameters())
    return model


def _pixel_values(pixels: np.ndarray, length: int) -> dict[str, mx.array]:
    return {"pixel_values": mx.array(pixels[None])}  # [images, channels, height, width]


ARCHITECTURES = {
    arch.name: arch
    for arch in (
        # idefics3 / SmolVLM: [batch, images, channels, H, W]; its pixel shuffle (scale 2) makes 4 tokens
        TinyVLM("idefics3", _idefics3, 4, lambda pixels, length: {"pixel_values": mx.array(pixels[None, None])}),
        # gemma3 takes the processor's attention mask over the prompt too (its merge builds a 4-D mask of it)
        TinyVLM(
            "gemma3",
            _gemma3,
            4,
            lambda pixels, length: {**_pixel_values(pixels, length), "attention_mask": mx.ones((1, length), mx.int32)},
        ),
        TinyVLM("llava", _llava, 16, _pixel_values),  # one token per patch
        # mistral3 / pixtral: each image's size in pixels; 2 x 2 patches merged per token
        TinyVLM(
            "mistral3",
            _mistral3,
            4,
            lambda pixels, length: {**_pixel_values(pixels, length), "image_sizes": mx.array([list(pixels.shape[1:])])},
        ),
        # M-RoPE (vision/positions.py): a 4 x 4 grid, 2 x 2 patches merged per token
        TinyVLM("qwen2_5_vl", _qwen2_5_vl, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        TinyVLM("qwen3_vl", _qwen3_vl, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        TinyVLM("qwen2_vl", _qwen2_vl, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        TinyVLM("qwen3_vl_moe", _qwen3_vl_moe, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        TinyVLM("qwen3_5", _qwen3_5, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        TinyVLM("qwen3_5_moe", _qwen3_5_moe, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        TinyVLM("glm4v", _glm4v, 4, _qwen_patches, ((QWEN_START,), (QWEN_END,))),
        # paligemma: one token per patch; the processor's attention mask over the prompt (its merge reads it)
        TinyVLM(
            "paligemma",
            _paligemma,
            16,
            lambda pixels, length: {**_pixel_values(pixels, length), "attention_mask": mx.ones((1, length), mx.int32)},
        ),
        TinyVLM(
            "paligemma2",
            _paligemma2,
            16,
            lambda pixels, length: {**_pixel_values(pixels, length), "attention_mask": mx.ones((1, length), mx.int32)},
        ),
        # gemma4: its processor gives each token's kind, which the large ones' language model reads (both ways)
        TinyVLM("gemma4", _gemma4, 4, _gemma4_pixels, ((GEMMA4_START,), (GEMMA4_END,)), token_types=True),
        TinyVLM(
            "gemma4-both-ways",
            lambda: _gemma4(both_ways=True),
            4,
            _gemma4_pixels,
            ((GEMMA4_START,), (GEMMA4_END,)),
            token_types=True,
        ),
    )
}


def text_tokens(n: int, seed: int = 0) -> list[int]:
    """Random text ids (never a model's image token)."""
    return random_tokens(n, seed=seed, vocab=TEXT_VOCAB)


def pixels(seed: int) -> np.ndarray:
    """One image's pixels [3, H, W] in [-1, 1] (as the processors normalize them)."""
    return np.random.default_rng(seed).uniform(-1, 1, (3, IMAGE_SIZE, IMAGE_SIZE)).astype(np.float32)


def image_prompt(vlm, before: list[int], after: list[int], seed: int) -> ImagePrompt:
    """`before` + one image's tokens + `after`, the image random pixels of `seed` (its digest names the seed)."""
    arch = ARCHITECTURES[getattr(vlm, "tiny_name", vlm.config.model_type)]
    image = image_token_id(vlm)
    token_ids = [*before, *arch.around[0], *([image] * arch.tokens_per_image), *arch.around[1], *after]
    arrays = arch.arrays(pixels(seed), len(token_ids))
    if arch.token_types:
        arrays["mm_token_type_ids"] = mx.array([[int(t == image) for t in token_ids]], dtype=mx.int32)
    digest = hashlib.sha256(f"pixels-{seed}".encode()).hexdigest()
    return ImagePrompt(token_ids, image_spans(token_ids, image, [digest]), arrays)


def next_turn(prompt: ImagePrompt, more: list[int]) -> ImagePrompt:
    """`prompt` followed by `more` text, as the processor gives a longer conversation: its arrays over the prompt's
    tokens (the attention mask, each token's kind) cover the new text too."""
    arrays = dict(prompt.arrays)
    for name, fill in (("attention_mask", 1), ("mm_token_type_ids", 0)):
        if name in arrays:
            extra = mx.full((1, len(more)), fill, dtype=arrays[name].dtype)
            arrays[name] = mx.concatenate([arrays[name], extra], axis=1)
    return ImagePrompt(prompt.token_ids + more, prompt.images, arrays)
