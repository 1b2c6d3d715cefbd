"""Images in the chat app: `/image PATH` attaches one to the next message, the transcript shows it, the engine gets
it as an image part, a saved conversation keeps it; a bad path is refused at once, an image the model refuses
comes back with its message. Against the scripted fake engine, and on a tiny SmolVLM checkpoint against
Engine.chat with the same image."""

from __future__ import annotations

from mlxpaged.engine.engine import Engine
from mlxpaged.errors import ImagesNotSupportedError
from mlxpaged.sampling_params import SamplingParams
from mlxpaged_app.tui.settings import ChatSettings
from mlxpaged_app.tui.store import ConversationStore
from mlxpaged_app.tui.widgets.chat_view import UserMessage
from tests.app.tui.tui_support import SIZE, FakeEngine, make_app, send_and_wait, wait_for

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.asyncio


def write_picture(path, seed: int = 0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(path)
    return path


async def type_command(pilot, text: str) -> None:
    """A line typed and sent as it is (paths hold keys `press` names otherwise)."""
    pilot.app.chat_input.text = text
    await pilot.press("enter")
    await pilot.pause()


def status(app) -> str:
    return str(app.status_line.render())


async def test_an_attached_image_goes_with_the_next_message_and_stays_in_the_transcript(tmp_path):
    picture = write_picture(tmp_path / "cat.png")
    engine = FakeEngine()
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await type_command(pilot, f"/image {picture}")
        assert app.attached == [str(picture.resolve())] and app.chat_input.text == ""
        assert "Attached cat.png: it goes with your next message" in status(app)
        assert engine.submitted == []  # nothing is sent until the message is
        await send_and_wait(pilot, "what is this")
        assert engine.images_seen == [str(picture.resolve())]
        assert app.attached == [] and "Attached" not in status(app)
        [user] = app.query(UserMessage)
        assert user.images == [str(picture.resolve())] and user.text == "what is this"
        assert "[image] cat.png" in str(user.query_one(".attachment").render())
        message = app.conversation.messages[0]
        assert message == {"role": "user", "content": "what is this", "images": [str(picture.resolve())]}
        assert app.conversation.chat_messages()[0]["content"] == [
            {"type": "image", "image": str(picture.resolve())},
            {"type": "text", "text": "what is this"},
        ]
        await send_and_wait(pilot, "and now?")  # the next turn sends the image again, where it was
        assert engine.images_seen == [str(picture.resolve())] * 2
    saved = ConversationStore(tmp_path / "chats").load(app.conversation.id)
    assert saved.messages[0]["images"] == [str(picture.resolve())]


async def test_a_reopened_conversation_shows_its_images(tmp_path):
    picture = write_picture(tmp_path / "dog.png")
    first = make_app(tmp_path, FakeEngine())
    async with first.run_test(size=SIZE) as pilot:
        await type_command(pilot, f"/image {picture}")
        await send_and_wait(pilot, "describe it")
    reopened = make_app(tmp_path, FakeEngine(), conversation=ConversationStore(tmp_path / "chats").latest())
    async with reopened.run_test(size=SIZE) as pilot:
        await pilot.pause()
        [user] = reopened.query(UserMessage)
        assert "[image] dog.png" in str(user.query_one(".attachment").render())


async def test_a_path_that_is_no_file_is_refused_and_nothing_is_attached(tmp_path):
    app = make_app(tmp_path, FakeEngine())
    async with app.run_test(size=SIZE) as pilot:
        await type_command(pilot, f"/image {tmp_path / 'missing.png'}")
        assert app.attached == []
        assert app.chat_input.text == f"/image {tmp_path / 'missing.png'}"  # left to correct
        await type_command(pilot, "/image")
        assert app.attached == [] and app.conversation.messages == []


async def test_an_image_the_model_refuses_comes_back_with_its_message(tmp_path):
    picture = write_picture(tmp_path / "cat.png")
    engine = FakeEngine()
    engine.submit_error = ImagesNotSupportedError("model 'fake-model' takes no images: it is a text model")
    app = make_app(tmp_path, engine)
    async with app.run_test(size=SIZE) as pilot:
        await type_command(pilot, f"/image {picture}")
        await type_command(pilot, "what is this")
        await wait_for(pilot, lambda: app.reply is None and app.chat_input.text == "what is this")
        assert app.conversation.messages == [] and list(app.query(UserMessage)) == []
        assert app.attached == [str(picture.resolve())]  # attached again, for another model or another try
        assert "Attached cat.png: it goes with your next message" in status(app)


@pytest.mark.slow
async def test_a_vision_model_in_the_chat_app_answers_as_engine_chat_does(tmp_path):
    from tests.vision.tiny_vlm_dirs import write_tiny_smolvlm_dir

    picture = write_picture(tmp_path / "cat.png", seed=3)
    engine = Engine.from_pretrained(str(write_tiny_smolvlm_dir(tmp_path / "smolvlm")), cache_tokens=1024)
    app = make_app(tmp_path, engine, settings=ChatSettings(temperature=0.0, max_tokens=8))
    try:
        async with app.run_test(size=SIZE) as pilot:
            await type_command(pilot, f"/image {picture}")
            await send_and_wait(pilot, "what is in this picture", timeout=120)
        reply = app.conversation.messages[1]
        want = engine.chat(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": str(picture)},
                        {"type": "text", "text": "what is in this picture"},
                    ],
                }
            ],
            SamplingParams(temperature=0.0, max_tokens=8),
        )
        assert reply["content"] == want.text
        assert reply["stats"]["prompt_tokens"] == want.prompt_tokens  # the image's tokens are counted
        assert want.cached_tokens > 0  # the same image and text: the app's turn left them in the prefix cache
    finally:
        engine.close()
