"""`mlxpaged serve` on a tiny SmolVLM checkpoint as a live process on loopback, sent images by the official
`openai` (chat and Responses), `anthropic` and `ollama` clients: data URLs, base64 blocks and an http URL from a
loopback file server give the same reply as mlx-vlm's own generate on the same directory; another image with
the same text hits the cache only before the image; a follow-up with the same image reads its tokens from the
cache, also after a restart with the disk tier; bad images get each API's 400 and the server serves on."""

from __future__ import annotations

import base64
import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.app.server.test_server_live import Server, assert_clean_exit, start_server, stop_server
from tests.vision.test_chat_images import picture, png
from tests.vision.tiny_vlm_dirs import (
    write_tiny_gemma3_dir,
    write_tiny_gemma4_dir,
    write_tiny_glm4v_dir,
    write_tiny_mistral3_dir,
    write_tiny_smolvlm_dir,
)

import anthropic
import httpx
import ollama
import openai
import pytest

pytestmark = pytest.mark.slow
MAX_TOKENS = 8
QUESTION = "What is in this picture?"


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(picture(seed))).decode()


@functools.cache
def served(url: str) -> str:
    """The name the server at `url` serves its model by (the first /v1/models lists: --model's)."""
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def chat(server: Server, content: list, history: list | None = None) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    messages = [*(history or []), {"role": "user", "content": content}]
    model = served(server.url)
    return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@contextmanager
def file_server(root: Path) -> Iterator[str]:
    """A loopback HTTP server of `root`'s files: the base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_smolvlm_dir(tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    (root / "seed0.png").write_bytes(png(picture(0)))
    with file_server(root) as url:
        yield root, url


@pytest.fixture(scope="module")
def server(model_dir, images, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-vlm") / "server.log"
    srv = start_server(
        log, "--model", str(model_dir), "--no-kv-disk", "--image-dir", str(images[0]), "--block-size", "8"
    )
    yield srv
    assert_clean_exit(stop_server(srv), log)


@pytest.fixture(scope="module")
def mlx_vlm_text(model_dir):
    return mlx_vlm_replier(model_dir)


def mlx_vlm_replier(model_dir):
    """mlx-vlm's own greedy reply text to one user turn of text and images, on the checkpoint in `model_dir`."""
    from mlx_vlm import load
    from mlx_vlm.generate.dispatch import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template

    vlm, processor = load(str(model_dir))

    def reply(parts: list) -> str:
        images = [p for p in parts if not isinstance(p, str)]
        content = [{"type": "image"} if not isinstance(p, str) else {"type": "text", "text": p} for p in parts]
        prompt = apply_chat_template(
            processor, vlm.config, [{"role": "user", "content": content}], num_images=len(images)
        )
        steps = stream_generate(vlm, processor, prompt, image=images, max_tokens=MAX_TOKENS, temperature=0.0)
        return processor.tokenizer.decode([step.token for step in list(steps)[:MAX_TOKENS]])

    return reply


def test_every_api_sends_the_image_and_gets_mlx_vlms_reply(server, images, mlx_vlm_text):
    every_api_gets(server, images, mlx_vlm_text([picture(0), QUESTION]).strip())


PROCESSOR_WRITERS = {
    "gemma4": write_tiny_gemma4_dir,
    "gemma3": write_tiny_gemma3_dir,
    "mistral3": write_tiny_mistral3_dir,
    "glm4v": write_tiny_glm4v_dir,
}


@pytest.fixture(scope="module", params=sorted(PROCESSOR_WRITERS))
def processor_server(request, images, tmp_path_factory):
    model_dir = PROCESSOR_WRITERS[request.param](tmp_path_factory.mktemp(request.param))
    log = tmp_path_factory.mktemp(f"serve-{request.param}") / "server.log"
    srv = start_server(log, "--model", str(model_dir), "--no-kv-disk", "--image-dir", str(images[0]))
    yield srv, model_dir
    assert_clean_exit(stop_server(srv), log)


def test_checkpoints_with_their_own_processors_answer_every_api_as_mlx_vlm(processor_server, images):
    """Gemma 4's own processor (its list of pixel arrays, its token kinds), each image prefilled whole under a mask
    that lets its tokens see each other (engine/request.py Request.both_ways); Gemma 3's, Hugging Face's own (the
    processor expands its image marker; sliding-window layers, its prefix cache off); Mistral 3's, mlx-vlm's own
    (Pixtral's rows of image tokens and breaks, each image's size in pixels); GLM-4.1V's, mlx-vlm's own over Hugging
    Face's image processor (M-RoPE positions from each image's grid)."""
    server, model_dir = processor_server
    every_api_gets(server, images, mlx_vlm_replier(model_dir)([picture(0), QUESTION]).strip())
    server.blocks_back()


def every_api_gets(server, images, want: str) -> None:
    """The same question with the same image through every API (OpenAI chat by data URL, http URL and local file;
    Anthropic; Ollama; Responses) gets `want`, mlx-vlm's reply."""
    by_data_url = chat(server, [image_part(data_url(0)), {"type": "text", "text": QUESTION}])
    assert by_data_url.choices[0].message.content.strip() == want
    by_http = chat(server, [image_part(f"{images[1]}/seed0.png"), {"type": "text", "text": QUESTION}])
    by_file = chat(server, [image_part(str(images[0] / "seed0.png")), {"type": "text", "text": QUESTION}])
    assert (
        by_http.choices[0].message.content
        == by_file.choices[0].message.content
        == by_data_url.choices[0].message.content
    )
    assert by_data_url.usage.prompt_tokens == by_http.usage.prompt_tokens > 4  # the image's tokens are counted

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": data_url(0).split(",")[1]},
    }
    message = claude.messages.create(
        model=served(server.url),
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}],
        extra_body={"temperature": 0},  # SDK 2.x has no temperature parameter; the server takes it
    )
    assert message.content[0].text.strip() == want

    reply = ollama.Client(host=server.url).chat(
        model=served(server.url),
        messages=[{"role": "user", "content": QUESTION, "images": [png(picture(0))]}],
        options={"temperature": 0, "num_predict": MAX_TOKENS},
    )
    assert reply.message.content.strip() == want

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(
        model=served(server.url),
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(0)},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text.strip() == want


def test_another_image_misses_the_cache_and_the_same_image_hits_it(server):
    text = {"type": "text", "text": "Describe " + "every detail of " * 6 + "this picture."}  # blocks before the image
    first = chat(server, [text, image_part(data_url(1))])
    other = chat(server, [text, image_part(data_url(2))])
    prompt = first.usage.prompt_tokens
    image_start = prompt - 9  # 'User: <text><fake><global-img><image>x4<fake><end>\nAssistant:' ends so
    assert other.usage.prompt_tokens == prompt
    assert other.usage.prompt_tokens_details.cached_tokens <= image_start
    history = [{"role": "user", "content": [text, image_part(data_url(1))]}, first.choices[0].message.model_dump()]
    follow = chat(server, [{"type": "text", "text": "And its colour?"}], history=history)
    assert follow.usage.prompt_tokens_details.cached_tokens >= prompt - 8  # past the image's tokens
    server.blocks_back()


@pytest.mark.parametrize(
    "url, message",
    [
        ("data:image/png;base64,@@@", "image data URL's base64 is invalid"),
        ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "5 bytes that are not an image"),
        ("/etc/passwd", "outside the allowed image directory"),
        ("ftp://example.com/a.png", r"neither a data URL, an http\(s\) URL nor a local file"),
    ],
    ids=["bad-base64", "not-an-image", "outside-image-dir", "other-scheme"],
)
def test_bad_images_get_a_400_and_the_server_serves_on(server, url, message):
    with pytest.raises(openai.BadRequestError, match=message):
        chat(server, [image_part(url), {"type": "text", "text": QUESTION}])
    assert chat(server, [{"type": "text", "text": "Hello"}]).choices[0].message.content is not None
    server.blocks_back()


def test_an_image_url_that_fails_is_a_400_naming_it(server, images):
    with pytest.raises(openai.BadRequestError, match=r"answered HTTP 404"):
        chat(server, [image_part(f"{images[1]}/missing.png")])
    too_many = [image_part(data_url(0))] * 17
    with pytest.raises(openai.BadRequestError, match="17 images in one request, more than the limit of 16"):
        chat(server, too_many)
    response = httpx.post(
        f"{server.url}/v1/messages",
        json={
            "model": served(server.url),
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "@@"}}
                    ],
                }
            ],
        },
        timeout=30,
    )
    assert response.status_code == 400 and response.json()["type"] == "error"  # Anthropic's shape
    assert "base64 is invalid" in response.json()["error"]["message"]


def test_the_same_image_after_a_restart_comes_from_the_disk_tier(model_dir, tmp_path):
    disk = ("--model", str(model_dir), "--kv-disk", str(tmp_path / "kv"), "--block-size", "8")
    content = [image_part(data_url(3)), {"type": "text", "text": QUESTION}]
    server = start_server(tmp_path / "one.log", *disk)
    try:
        first = chat(server, content)
    finally:
        assert_clean_exit(stop_server(server), tmp_path / "one.log")
    server = start_server(tmp_path / "two.log", *disk)
    try:
        again = chat(server, content)
    finally:
        assert_clean_exit(stop_server(server), tmp_path / "two.log")
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens - 1) // 8 * 8


def test_an_image_a_tool_returned_reaches_the_model_in_every_api(server):
    """An agent's tool that reads an image file or takes a screenshot answers with an image inside its result:
    Anthropic's tool_result, an OpenAI tool message, a Responses function_call_output, an Ollama tool message. The
    model's prompt holds the image's tokens (as many as the same image sent by the user adds)."""
    model, url = served(server.url), data_url(4)
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    local = ollama.Client(host=server.url)

    def anthropic_tokens(image: bool) -> int:
        call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "shot.png"}}
        block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]}}
        result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "shot.png:"}]}
        result["content"] += [block] if image else []
        reply = claude.messages.create(
            model=model,
            max_tokens=MAX_TOKENS,
            messages=[
                {"role": "user", "content": "Read shot.png"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result, {"type": "text", "text": QUESTION}]},
            ],
            extra_body={"temperature": 0},
        )
        assert reply.content[0].text
        return reply.usage.input_tokens + reply.usage.cache_read_input_tokens

    def openai_tokens(image: bool) -> int:
        call = {"id": "c1", "type": "function", "function": {"name": "screenshot", "arguments": "{}"}}
        content = [{"type": "text", "text": "taken:"}, *([image_part(url)] if image else [])]
        reply = client.chat.completions.create(
            model=model,
            messages=[
                {"role": "user", "content": "Take a screenshot"},
                {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": content},
                {"role": "user", "content": QUESTION},
            ],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        return reply.usage.prompt_tokens

    def responses_tokens(image: bool) -> int:
        output = [
            {"type": "input_text", "text": "taken:"},
            *([{"type": "input_image", "image_url": url}] if image else []),
        ]
        reply = client.responses.create(
            model=model,
            input=[
                {"role": "user", "content": "Take a screenshot"},
                {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": output},
                {"role": "user", "content": QUESTION},
            ],
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
        return reply.usage.input_tokens

    def ollama_tokens(image: bool) -> int:
        call = {"function": {"name": "screenshot", "arguments": {}}}
        shot = {"images": [url.split(",")[1]]} if image else {}
        reply = local.chat(
            model=model,
            messages=[
                {"role": "user", "content": "Take a screenshot"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "taken:", "tool_name": "screenshot", **shot},
                {"role": "user", "content": QUESTION},
            ],
            options={"temperature": 0, "num_predict": MAX_TOKENS},
        )
        return reply.prompt_eval_count

    by_user = chat(server, [image_part(url), {"type": "text", "text": QUESTION}])
    alone = chat(server, [{"type": "text", "text": QUESTION}])
    image_tokens = by_user.usage.prompt_tokens - alone.usage.prompt_tokens
    assert image_tokens > 4
    for api in (anthropic_tokens, openai_tokens, responses_tokens, ollama_tokens):
        assert api(True) == api(False) + image_tokens, api.__name__
    server.blocks_back()
