"""Tiny random vision-language checkpoints on disk, complete enough for mlx-vlm's `load` and
`Engine.from_pretrained` alike: config.json, random weights, the default model's tokenizer with the model's
image tokens added, and the processor (its chat template and image processor), all offline.

SmolVLM (idefics3): SmolLM2's tokenizer is SmolVLM's own text tokenizer, images of at most 56 px become one tile
of 4 image tokens (pixel shuffle 2 over 4x4 patches of 14 px), between SmolVLM's markers.
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


def write_tiny_smolvlm_dir(out: Path, seed: int = 0) -> Path:
    """A 2-layer random SmolVLM-shaped (idefics3) checkpoint in `out`."""
    from mlx_vlm.models import idefics3
    from transformers import AutoTokenizer, Idefics3ImageProcessorPil, Idefics3Processor

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(locate_model(None)[1])
    tokenizer.add_special_tokens({"additional_special_tokens": SMOLVLM_TOKENS})
    images = Idefics3ImageProcessorPil(
        do_resize=True, size={"longest_edge": 56}, max_image_size={"longest_edge": 56}, do_image_splitting=False
    )
    Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=SMOLVLM_TEMPLATE
    ).save_pretrained(out)
    text = {
        "model_type": "idefics3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(tokenizer),
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 2048,
    }
    vision = {
        "model_type": "idefics3",
        "num_hidden_layers": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 14,
        "num_channels": 3,
    }
    config = {
        "model_type": "idefics3",
        "image_token_id": tokenizer.convert_tokens_to_ids("<image>"),
        "scale_factor": 2,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<end_of_utterance>"),
        "text_config": text,
        "vision_config": vision,
    }
    model_config = idefics3.ModelConfig.from_dict(config)
    model_config.text_config = idefics3.TextConfig.from_dict(text)
    model_config.vision_config = idefics3.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    model = idefics3.Model(model_config)
    # Matrices x3: attention far from uniform, so the greedy tokens depend on what the image is.
    model.update(tree_map(lambda p: p * (3.0 if p.ndim == 2 else 1.0), model.parameters()))
    mx.save_safetensors(
        str(out / "model.safetensors"), dict(tree_flatten(model.parameters())), metadata={"format": "mlx"}
    )
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
