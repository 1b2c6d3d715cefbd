"""What the chat app's thread workers tell it, as Textual Messages: a worker posts them with the
thread-safe `post_message` and goes on; the app's `on_...` handlers take them in the order posted."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from textual.message import Message
from textual.message_pump import MessagePump

if TYPE_CHECKING:
    from mlxpaged_app.tui.generation import ReplyRun, ReplyStats


def post_from_thread(target: MessagePump, message: Message) -> bool:
    """`target.post_message(message)`; False when the app has gone and nobody will read it."""
    try:
        return target.post_message(message)
    except RuntimeError:  # the event loop closed between post_message's check and its call
        return False


# --- one reply (generation.ReplyRun) ---------------------------------------------------------
@dataclass
class ReplyStarted(Message):
    """The engine accepted the request: `run.request_id` names it."""

    run: ReplyRun


@dataclass
class ReplyDelta(Message):
    """Text the reply has grown by (one or more tokens' worth)."""

    run: ReplyRun
    text: str


@dataclass
class ReplyFinished(Message):
    run: ReplyRun
    stats: ReplyStats


@dataclass
class ReplyFailed(Message):
    """`rejected`: the engine refused the request (too long, bad settings), so nothing streamed."""

    run: ReplyRun
    error: BaseException
    rejected: bool


# --- loading a model (loading.ModelLoading) --------------------------------------------------
@dataclass
class LoadProgress(Message):
    """load_model's progress callback: `done` of `total` units of `what` (download, convert)."""

    done: int
    total: int
    what: str


@dataclass
class ModelLoaded(Message):
    name: str | None  # as asked for (None: the default model)
    engine: Any  # a protocol.ChatEngine


@dataclass
class LoadFailed(Message):
    name: str | None
    error: BaseException
