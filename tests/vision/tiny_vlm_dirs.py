"""Tiny random vision-language checkpoints on disk, complete enough for mlx-vlm's `load` and
`Engine.from_pretrained` alike: config.json, random weights, the default model's tokenizer with the model's
image tokens added, and the processor (its chat template and image processor), all offline.

SmolVLM (idefics3): SmolLM2's tokenizer is SmolVLM's own text tokenizer, images of at most 56 px become one tile
of 4 image tokens (pixel shuffle 2 over 4x4 patches of 14 px), between SmolVLM's markers.

Qwen3.5: gated-delta layers and full attention with M-RoPE positions, Qwen3-VL's tower; SmolLM2's tokenizer with
Qwen's vision tokens, mlx-vlm's own (torch-free) Qwen3-VL processor; an image is resized to at most 64 x 64 px,
patches of 16 px merged 2 x 2 (one token per 32 x 32 px), between Qwen's start and end markers.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.loading.loader import locate_model

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SMOLVLM_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]


QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def write_tiny_qwen3_5_dir(out: Path, seed: int = 0) -> Path:
    """A 4-layer random Qwen3.5 checkpoint in `out` (two gated-delta layers, each before a full-attention one)."""
    from mlx_vlm.models import qwen3_5

    out = Path(out)
    tokenizer = _save_tokenizer(out, QWEN_TOKENS, QWEN_TEMPLATE)
    (out / "chat_template.jinja").write_text(QWEN_TEMPLATE)
    images = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 32 * 32}
    images |= {"max_pixels": 64 * 64, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    (out / "preprocessor_config.json").write_text(json.dumps(images, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({"image_processor": images}, indent=2) + "\n")
    (out / "video_preprocessor_config.json").write_text(json.dumps(images, indent=2) + "\n")
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in zip(
            ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
            QWEN_TOKENS,
            strict=True,
        )
    }
    rope = {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 100000, "partial_rotary_factor": 0.5}
    text = {
        "model_type": "qwen3_5",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 2048,
        "rope_parameters": rope,
    }
    vision = {
        "model_type": "qwen3_5",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [],
    }
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = {"model_type": "qwen3_5", **ids, "eos_token_id": eos, "text_config": text, "vision_config": vision}
    return _save_random(out, qwen3_5, config, seed)


GEMMA4_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Gemma 4's tokenizer names its image, audio and video tokens and the image's markers (extra special tokens).
GEMMA4_TOKENS = {
    "image_token": "<|image|>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
    "audio_token": "<|audio|>",
    "boa_token": "<start_of_audio>",
    "eoa_token": "<end_of_audio>",
    "video_token": "<|video|>",
}


def write_tiny_gemma4_dir(out: Path, seed: int = 0, both_ways: bool = True) -> Path:
    """A 3-layer random Gemma 4 checkpoint in `out` (two window layers of 8, a full one) with mlx-vlm's own
    (torch-free) Gemma 4 processor: an image is resized to at most 36 patches of 8 px keeping its aspect, pooled
    2 x 2 (its token count follows its shape), between Gemma's markers. `both_ways`: as the larger Gemma 4 models,
    each image's tokens attend each other both ways (else causal, as the small ones)."""
    from mlx_vlm.models import gemma4
    from transformers import AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(locate_model(None)[1], extra_special_tokens=GEMMA4_TOKENS)
    tokenizer.chat_template = GEMMA4_TEMPLATE
    tokenizer.save_pretrained(out)
    (out / "chat_template.jinja").write_text(GEMMA4_TEMPLATE)
    images = {"patch_size": 8, "max_soft_tokens": 9, "pooling_kernel_size": 2, "do_normalize": False}
    (out / "processor_config.json").write_text(json.dumps({"image_processor": images}, indent=2) + "\n")
    ids = {f"{name[:-6]}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in GEMMA4_TOKENS.items()}
    text = {
        "model_type": "gemma4_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "vocab_size": len(tokenizer),
        "vocab_size_per_layer_input": len(tokenizer),
        "use_bidirectional_attention": "vision" if both_ways else None,
        "max_position_embeddings": 2048,
    }
    vision = {
        "model_type": "gemma4_vision",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "patch_size": 8,
        "pooling_kernel_size": 2,
        "position_embedding_size": 64,
        "default_output_length": 4,
    }
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = {"model_type": "gemma4", **ids, "eos_token_id": eos, "text_config": text, "vision_config": vision}
    config |= {"hidden_size": 64, "vocab_size": len(tokenizer), "audio_config": None}
    return _save_random(out, gemma4, config, seed, louder_post_norms=True)


GEMMA3_TEMPLATE = (
    "{% for message in messages %}<start_of_turn>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<start_of_image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
# Gemma 3's tokenizer names the image's markers and its soft token (extra special tokens), as the real one does.
GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def write_tiny_gemma3_dir(out: Path, seed: int = 0) -> Path:
    """A 3-layer random Gemma 3 checkpoint in `out` (two window layers of 8, a full one) with Hugging Face's
    (torch-free) Gemma 3 processor: an image is resized to 56 x 56 px, 4 x 4 patches of 14 px pooled to 4 soft tokens,
    between Gemma's markers (the processor's own expansion of `<start_of_image>`)."""
    from mlx_vlm.models import gemma3
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(locate_model(None)[1], extra_special_tokens=GEMMA3_TOKENS)
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=False)
    Gemma3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA3_TEMPLATE
    ).save_pretrained(out)
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,
        "sliding_window_pattern": 3,
        "mm_tokens_per_image": 4,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 2048,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 14,
        "image_size": 56,
    }
    eos = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    config = {
        "model_type": "gemma3",
        "image_token_index": tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS["image_token"]),
        "boi_token_index": tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS["boi_token"]),
        "eoi_token_index": tokenizer.convert_tokens_to_ids(GEMMA3_TOKENS["eoi_token"]),
        "mm_tokens_per_image": 4,
        "hidden_size": 64,
        "vocab_size": len(tokenizer),
        "eos_token_id": eos,
        "text_config": text,
        "vision_config": vision,
    }
    return _save_random(
        out,
        gemma3,
        config,
        seed,
        louder_post_norms=True,
        tied_head=True,
        amplified="multi_modal_projector",
    )


MISTRAL3_TEMPLATE = (
    "<s>{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]{% else %}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{{ part['text'] }}{% endfor %}{% endif %}</s>{% endif %}{% endfor %}"
)
# Pixtral's image markers, special tokens of Mistral's tokenizer (here added to SmolLM2's).
MISTRAL3_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]", "[/INST]"]


def write_tiny_mistral3_dir(out: Path, seed: int = 0) -> Path:
    """A 2-layer random Mistral 3 checkpoint in `out` (Pixtral's tower) with mlx-vlm's own (torch-free) Mistral 3
    processor, as it loads one from a real checkpoint's files: an image is resized to at most 56 px on its longer
    side, in patches of 14 px merged 2 x 2, so each 28 x 28 px is one [IMG] token, a row of them ended by
    [IMG_BREAK] and the image by [IMG_END]."""
    from mlx_vlm.models import mistral3

    out = Path(out)
    tokenizer = _save_tokenizer(out, MISTRAL3_TOKENS, MISTRAL3_TEMPLATE)
    images = {"size": {"longest_edge": 56}, "patch_size": {"height": 14, "width": 14}}
    (out / "preprocessor_config.json").write_text(json.dumps({**images, "processor_class": "PixtralProcessor"}))
    text = {
        "model_type": "mistral",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 2048,
    }
    vision = {
        "model_type": "pixtral",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "head_dim": 16,
        "patch_size": 14,
        "image_size": 56,
    }
    config = {
        "model_type": "mistral3",
        "image_token_index": tokenizer.convert_tokens_to_ids("[IMG]"),
        "spatial_merge_size": 2,
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "text_config": text,
        "vision_config": vision,
    }
    return _save_random(out, mistral3, config, seed)


GLM4V_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|begin_of_image|><|image|><|end_of_image|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# GLM-4.1V / 4.5V's image and video markers, special tokens of its tokenizer (here added to SmolLM2's).
GLM4V_TOKENS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>", "<|end_of_video|>"]
GLM4V_TOKENS += ["<|video|>", "<|user|>", "<|assistant|>"]


def write_tiny_glm4v_dir(out: Path, seed: int = 0) -> Path:
    """A 2-layer random GLM-4.1V checkpoint in `out` with mlx-vlm's own GLM-4V processor over Hugging Face's
    (torch-free) GLM-4V image processor, as mlx-vlm loads one from a real checkpoint's files: an image is resized to
    at most 56 x 56 px (multiples of 28), patches of 14 px merged 2 x 2, its <|image|> expanded to one token per
    28 x 28 px between its begin and end markers; M-RoPE positions from the grid."""
    from mlx_vlm.models import glm4v

    out = Path(out)
    tokenizer = _save_tokenizer(out, GLM4V_TOKENS, GLM4V_TEMPLATE)
    images = {
        "image_processor_type": "Glm4vImageProcessor",
        "size": {"shortest_edge": 28 * 28, "longest_edge": 56 * 56},  # pixels, as Qwen2-VL's min / max pixels
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(images))
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in GLM4V_IDS.items()}
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    text = {
        "model_type": "glm4v_text",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "partial_rotary_factor": 0.5,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]},
        "max_position_embeddings": 4096,
        "vocab_size": len(tokenizer),
        "eos_token_id": [eos],
        "pad_token_id": 0,
    }
    vision = {
        "model_type": "glm4v",
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 14,
        "image_size": 56,
        "out_hidden_size": 64,
    }
    config = {"model_type": "glm4v", **ids, "hidden_size": 64, "vocab_size": len(tokenizer), "eos_token_id": [eos]}
    config |= {"text_config": text, "vision_config": vision}
    return _save_random(out, glm4v, config, seed)


GLM4V_IDS = {
    "image_token_id": "<|image|>",
    "image_token_index": "<|image|>",
    "video_token_id": "<|video|>",
    "video_token_index": "<|video|>",
    "vision_start_token_id": "<|begin_of_image|>",
    "vision_end_token_id": "<|end_of_image|>",
}


def write_tiny_smolvlm_dir(out: Path, seed: int = 0) -> Path:
    """A 2-layer random SmolVLM-shaped (idefics3) checkpoint in `out`."""
    text = {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4}
    text |= {"num_key_value_heads": 2, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}
    vision = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}
    vision |= {"image_size": 56, "patch_size": 14}
    images = {"size": {"longest_edge": 56}, "max_image_size": {"longest_edge": 56}, "do_image_splitting": False}
    return write_smolvlm_dir(out, text, vision, images, scale_factor=2, seed=seed)


# SmolVLM-256M-Instruct's shapes (its config.json and processor: SmolLM2-135M's text model, a 12-layer SigLIP tower
# on 512 px tiles of 16 px patches, pixel shuffle 4: 64 tokens a tile, images split into tiles up to 2048 px).
SMOLVLM_256M_TEXT = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
}
SMOLVLM_256M_VISION = {
    "num_hidden_layers": 12,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
}
SMOLVLM_256M_IMAGES = {
    "size": {"longest_edge": 2048},
    "max_image_size": {"longest_edge": 512},
    "do_image_splitting": True,
}


def write_smolvlm_dir(
    out: Path, text: dict, vision: dict, images: dict, scale_factor: int, seed: int = 0, weight_scale: float = 3.0
) -> Path:
    """A random SmolVLM (idefics3) checkpoint of these shapes in `out`, with SmolLM2's tokenizer (SmolVLM's own text
    tokenizer) and HF's Idefics3 processor over `images` (its image processor's resize / split settings)."""
    from mlx_vlm.models import idefics3
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(locate_model(None)[1])
    tokenizer.add_special_tokens({"additional_special_tokens": SMOLVLM_TOKENS})
    tile, patch = vision["image_size"], vision["patch_size"]
    Idefics3Processor(
        image_processor=Idefics3ImageProcessorPil(do_resize=True, **images),
        tokenizer=tokenizer,
        image_seq_len=(tile // patch) ** 2 // scale_factor**2,
        chat_template=SMOLVLM_TEMPLATE,
    ).save_pretrained(out)
    text = {"model_type": "idefics3", "vocab_size": len(tokenizer), **text}
    vision = {"model_type": "idefics3", "num_channels": 3, **vision}
    config = {
        "model_type": "idefics3",
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "scale_factor": scale_factor,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<end_of_utterance>"),
        "text_config": text,
        "vision_config": vision,
    }
    return _save_random(out, idefics3, config, seed, weight_scale=weight_scale)


def _save_tokenizer(out: Path, special: list[str], template: str):
    """The default model's tokenizer with the model's `special` tokens and chat `template`, saved in `out`."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(locate_model(None)[1])
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out)
    return tokenizer


def _save_random(
    out: Path,
    module,
    config: dict,
    seed: int,
    louder_post_norms: bool = False,
    weight_scale: float = 3.0,
    tied_head: bool = False,
    amplified: str | None = None,
) -> Path:
    """mlx-vlm's model of `module` (its `config`, text and vision configs read as the module's) from `seed`, saved in
    `out` with `config` as its config.json. `louder_post_norms`:
    the norms after each attention and MLP x5 (Gemma 4: at unit scale its scaled embedding drowns every layer of a
    random model, which then echoes its last token). `tied_head`: without the language model's LM head, which is its
    embedding then (as the real checkpoints store it; both libraries tie it). `amplified`: the parameters under this
    path x10 (Gemma 3's projector: its image features are otherwise lost beside the scaled text embeddings)."""
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    # Matrices x3: attention far from uniform, so the greedy tokens depend on what the image is.
    model.update(tree_map(lambda p: p * (weight_scale if p.ndim == 2 else 1.0), model.parameters()))
    if louder_post_norms:
        from tests.vision.tiny_vlms import louder_post_norms as louder

        louder(model)
    weights = dict(tree_flatten(model.parameters()))
    if amplified is not None:
        weights = {name: w * 10.0 if name.startswith(amplified) else w for name, w in weights.items()}
    if tied_head:
        del weights["language_model.lm_head.weight"]
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
