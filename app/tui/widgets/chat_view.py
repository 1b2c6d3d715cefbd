"""The conversation view: the system prompt line, user turns, streamed Markdown replies."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mlxpaged_app.tui.generation import ReplyStats

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream


class UserMessage(Vertical):
    def __init__(self, text: str, images: Sequence[str] = ()):
        super().__init__(classes="message user")
        self.text, self.images = text, list(images)

    def compose(self) -> ComposeResult:
        yield Static("You", classes="role")
        for path in self.images:
            yield Static(attachment_line(path), classes="attachment")
        yield Static(Text(self.text), classes="body")


def attachment_line(path: str) -> Text:
    """How the transcript shows an attached image: its file name, and where it is."""
    line = Text("[image] ", style="bold")
    line.append(Path(path).name)
    line.append(f"  {Path(path).parent}", style="dim")
    return line


class AssistantMessage(Vertical):
    """A reply; `append` streams Markdown into it, `finish` adds the per-reply stats line."""

    def __init__(self, model: str, text: str = "", stats: ReplyStats | None = None, stopped: bool = False):
        super().__init__(classes="message assistant")
        self.model, self.text, self.stats, self.stopped = model, text, stats, stopped
        self._stream: MarkdownStream | None = None

    def compose(self) -> ComposeResult:
        yield Static(self.model, classes="role")
        yield Markdown(self.text, classes="body")
        yield Static(self._footer_text(), classes="reply-stats")

    @property
    def markdown(self) -> Markdown:
        return self.query_one(Markdown)

    def start(self) -> None:
        self.query_one(".reply-stats", Static).update(Text("thinking…", style="italic"))
        self._stream = Markdown.get_stream(self.markdown)

    async def append(self, text: str) -> None:
        if not self.text:  # the first text: "thinking…" becomes "generating…", once per reply
            self.query_one(".reply-stats", Static).update(Text("generating… (Esc stops)", style="italic"))
        self.text += text
        if self._stream is not None:
            await self._stream.write(text)

    async def finish(self, stats: ReplyStats | None, error: str | None = None) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        self.stats = stats
        self.stopped = bool(stats and stats.finish_reason == "abort")
        footer = self.query_one(".reply-stats", Static)
        footer.update(Text(error, style="bold red") if error else self._footer_text())

    def _footer_text(self) -> Text:
        return Text(self.stats.describe() if self.stats else "", style="dim")


class ChatLog(VerticalScroll):
    """Pinned to the bottom while a reply streams (anchor), until the user scrolls up."""

    can_focus = False

    def on_mount(self) -> None:
        self.anchor()

    async def show_messages(self, system_prompt: str, messages: list[dict], model: str) -> None:
        await self.remove_children()
        await self.mount(SystemLine(system_prompt))
        widgets = [self._widget_for(m, model) for m in messages]
        if widgets:
            await self.mount_all(widgets)
        self.anchor()

    def _widget_for(self, message: dict, model: str):
        if message["role"] == "user":
            return UserMessage(message["content"], message.get("images") or ())
        return AssistantMessage(
            message.get("model") or model,
            message["content"],
            ReplyStats.from_dict(message.get("stats")),
            message.get("stopped", False),
        )

    async def add(self, widget) -> None:
        await self.mount(widget)
        self.anchor()

    async def remove_from(self, index: int) -> None:
        """Remove the message widgets from `index` (in conversation order) on."""
        messages = [w for w in self.children if isinstance(w, (UserMessage, AssistantMessage))]
        await self.remove_children(messages[index:])

    def set_system_prompt(self, text: str) -> None:
        self.query_one(SystemLine).show(text)


class SystemLine(Static):
    def __init__(self, text: str):
        super().__init__(classes="system-line")
        self.show(text)

    def show(self, text: str) -> None:
        prompt = " ".join(text.split())
        body = Text("System prompt: ", style="bold")
        body.append(prompt if prompt else "the model's default", style="" if prompt else "italic")
        body.append("   (F5 to edit)", style="dim")
        self.update(body)
