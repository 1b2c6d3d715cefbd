"""Chats with images through the Python API on tiny checkpoints on disk (SmolVLM; Qwen3.5, whose language model
mixes gated-delta layers with M-RoPE attention; Gemma 4; Gemma 3 with Hugging Face's own processor; Mistral 3 and
GLM-4.1V with mlx-vlm's own processors), each with its own processor, against mlx-vlm's own
`stream_generate` on the same directory: the same tokens, the same prompt length; an image given as a path, bytes,
a data URL or a PIL image is the same image; the next turn reads the image's tokens from the prefix cache; and
every bad image is refused with a message that says what is wrong."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import zlib

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.engine.engine import Engine
from mlxpaged.errors import ImageInputError, ImagesNotSupportedError, UnsupportedModelError
from mlxpaged.sampling_params import SamplingParams
from mlxpaged.vision import checkpoint
from tests.vision.tiny_vlm_dirs import (
    write_tiny_gemma3_dir,
    write_tiny_gemma4_dir,
    write_tiny_glm4v_dir,
    write_tiny_mistral3_dir,
    write_tiny_qwen3_5_dir,
    write_tiny_smolvlm_dir,
)

import numpy as np
import pytest
from PIL import Image

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def picture(seed: int, size: tuple[int, int] = (50, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image(source) -> dict:
    return {"type": "image", "image": source}


def ask(*parts) -> list[dict]:
    """One user message: strings are text, anything else an image (or a part given whole)."""
    content = [
        p if isinstance(p, dict) else {"type": "text", "text": p} if isinstance(p, str) else image(p) for p in parts
    ]
    return [{"role": "user", "content": content}]


WRITERS = {
    "smolvlm": write_tiny_smolvlm_dir,
    "qwen3_5": write_tiny_qwen3_5_dir,
    "gemma4": write_tiny_gemma4_dir,
    "gemma3": write_tiny_gemma3_dir,
    "mistral3": write_tiny_mistral3_dir,
    "glm4v": write_tiny_glm4v_dir,
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def model_dir(request, tmp_path_factory):
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.from_pretrained(str(model_dir), cache_tokens=1024, block_size=8) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(model_dir):
    """mlx-vlm's own reply to a conversation: (tokens, prompt tokens)."""
    from mlx_vlm import load
    from mlx_vlm.generate.dispatch import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    vlm, processor = load(str(model_dir))

    def reply(messages: list[dict]) -> tuple[list[int], int]:
        images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if "image" in p]
        bare = [
            {**m, "content": [{"type": "image"} if "image" in p else p for p in m["content"]]}
            if isinstance(m["content"], list)
            else m
            for m in messages
        ]
        prompt = apply_chat_template(processor, vlm.config, bare, num_images=len(images))
        steps = list(
            stream_generate(vlm, processor, prompt, image=images, max_tokens=GREEDY.max_tokens, temperature=0.0)
        )
        return [s.token for s in steps][: GREEDY.max_tokens], steps[0].prompt_tokens

    return reply


def test_a_chat_with_two_images_equals_mlx_vlm_token_for_token(engine, reference):
    messages = ask("Look at", picture(0), "and at", picture(1, (30, 56)), "What differs?")
    got = engine.chat(messages, GREEDY)
    tokens, prompt_tokens = reference(messages)
    assert got.token_ids == tokens
    assert got.prompt_tokens == prompt_tokens  # the images' tokens counted as mlx-vlm counts them
    other = engine.chat(ask("Look at", picture(2), "and at", picture(1, (30, 56)), "What differs?"), GREEDY)
    assert other.token_ids != got.token_ids  # the reply depends on the image


def test_a_path_bytes_a_data_url_and_a_pil_image_are_the_same_image(engine, tmp_path):
    photo = picture(3)
    path = tmp_path / "picture.png"
    path.write_bytes(png(photo))
    data_url = "data:image/png;base64," + base64.b64encode(png(photo)).decode()
    sources = (str(path), path, png(photo), data_url, photo)
    prompts = [engine.chat_prompt(ask("Describe", image(source))) for source in sources]
    assert len({p.images[0].digest for p in prompts}) == 1
    assert len({tuple(p.token_ids) for p in prompts}) == 1
    jpeg = io.BytesIO()
    photo.save(jpeg, format="JPEG", quality=70)  # lossy: other pixels, another image
    assert engine.chat_prompt(ask("Describe", jpeg.getvalue())).images[0].digest != prompts[0].images[0].digest


def test_the_next_turn_with_the_same_image_reads_its_tokens_from_the_cache(engine, reference, monkeypatch):
    """From the prefix cache; for a model whose prefix cache is off (Gemma 4's sliding windows) the image's rows
    kept from the first turn stand in for the vision tower."""
    from tests.vision.test_engine_images import count_tower_runs

    first = ask("What is in", picture(4), "this picture?")
    reply = engine.chat(first, GREEDY)
    follow = [*first, {"role": "assistant", "content": reply.text}, {"role": "user", "content": "And its colour?"}]
    prompt = engine.chat_prompt(follow)
    towers = count_tower_runs(engine.loaded.vision.model, monkeypatch)
    again = engine.chat(follow, GREEDY)
    image = prompt.images[0]
    if engine.core.scheduler.kv_manager.enable_prefix_cache:
        assert again.cached_tokens >= image.start + image.length  # the image's tokens came from the cache
    else:
        assert again.cached_tokens == 0 and not any(towers)
    monkeypatch.undo()
    assert again.token_ids == reference(follow)[0]


def test_a_text_only_chat_on_a_vision_model_equals_mlx_vlm(engine, reference):
    messages = [{"role": "user", "content": "Say something."}]
    assert engine.chat(messages, GREEDY).token_ids == reference(messages)[0]


def truncated_png() -> bytes:
    data = png(picture(5))
    return data[: len(data) // 2]


def huge_png_header() -> bytes:
    """A real PNG whose header claims 10,000 x 10,000 pixels (its CRC fixed): refused before decoding."""
    data = bytearray(png(picture(6, (8, 8))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = (10_000).to_bytes(4, "big") * 2
    data[ihdr + 17 : ihdr + 21] = zlib.crc32(bytes(data[ihdr : ihdr + 17])).to_bytes(4, "big")
    return bytes(data)


@pytest.mark.parametrize(
    "source, message",
    [
        (b"definitely not an image", r"image 1: 23 bytes that are not an image in a format this server reads"),
        (truncated_png(), r"image 1: the PNG data is damaged or truncated"),
        (huge_png_header(), r"image 1 has 10000x10000 = 100,000,000 pixels, more than the limit of 50,000,000"),
        ("/nonexistent/picture.png", r"image 1: cannot read '/nonexistent/picture.png' \(No such file or directory\)"),
        ("data:image/png;base64,@@@", r"an image data URL's base64 is invalid"),
        (3.5, r"image 1: expected a path, bytes or a PIL image, got float"),
    ],
    ids=["not-an-image", "truncated", "too-many-pixels", "missing-file", "bad-base64", "wrong-type"],
)
def test_bad_images_are_refused_with_what_is_wrong_and_the_engine_serves_on(engine, source, message):
    with pytest.raises(ImageInputError, match=message):
        engine.chat(ask("Describe", image(source)), GREEDY)
    assert engine.chat(ask("Describe", picture(7)), GREEDY).token_ids


def test_too_many_images_are_refused(engine):
    with pytest.raises(ImageInputError, match="17 images in one request, more than the limit of 16"):
        engine.chat_prompt(ask(*[picture(i, (8, 8)) for i in range(17)]))


def test_without_the_vision_extra_an_image_is_refused_naming_the_install(model_dir, reference, monkeypatch):
    """mlx-lm has no idefics3 or glm4v: SmolVLM and GLM-4.1V are refused at load. It has Qwen3.5's language model
    (Gemma's, Mistral 3's): the checkpoint loads as a text model, answers text as mlx-vlm does, and refuses an image
    naming the install."""
    monkeypatch.setattr(checkpoint, "vision_installed", lambda: False)
    kind = json.loads((model_dir / "config.json").read_text())["model_type"]
    install = r"pip install 'mlxpaged\[vision\]'"
    if importlib.util.find_spec(f"mlx_lm.models.{kind}") is None:
        with pytest.raises(UnsupportedModelError, match=rf"{kind}.*vision-language.*{install}"):
            Engine.from_pretrained(str(model_dir), cache_tokens=256)
        return
    with Engine.from_pretrained(str(model_dir), cache_tokens=256) as text_only:
        with pytest.raises(ImagesNotSupportedError, match=rf"loaded as a text model.*{install}"):
            text_only.chat(ask("Describe", picture(8)), GREEDY)
        text = [{"role": "user", "content": "Say something."}]
        assert text_only.chat(text, GREEDY).token_ids == reference(text)[0]
