"""The message box: multi-line; Enter sends, Ctrl+J (or Shift+Enter where the terminal reports it)
inserts a newline."""

from __future__ import annotations

from typing import ClassVar

from textual import events
from textual.binding import Binding, BindingType
from textual.message import Message
from textual.widgets import TextArea

PLACEHOLDER = "Message — Enter sends · Ctrl+J new line · F1 all keys"


class ChatInput(TextArea):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("ctrl+j,shift+enter", "newline", "New line", show=False)]

    class Submitted(Message):
        def __init__(self, text: str):
            super().__init__()
            self.text = text

    def __init__(self, **kwargs):
        super().__init__(
            soft_wrap=True,
            show_line_numbers=False,
            tab_behavior="focus",
            placeholder=PLACEHOLDER,
            compact=True,
            highlight_cursor_line=False,
            **kwargs,
        )

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        await super()._on_key(event)

    def action_newline(self) -> None:
        self.insert("\n")
