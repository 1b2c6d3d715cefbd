"""Ctrl+O: saved conversations, most recent first; Enter reopens one."""

from __future__ import annotations

import time
from typing import ClassVar

from mlxpaged_app.tui.store import Conversation

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option


def _label(conversation: Conversation, current_id: str | None) -> Text:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(conversation.updated))
    text = Text(f"{when}  ", style="dim")
    text.append(conversation.title, style="bold" if conversation.id == current_id else "")
    text.append(f"  {conversation.turns} turns · {conversation.model or 'default model'}", style="dim")
    return text


class HistoryScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, conversations: list[Conversation], current_id: str | None):
        super().__init__()
        self.conversations, self.current_id = conversations, current_id

    def compose(self) -> ComposeResult:
        with Vertical(id="history-dialog", classes="dialog"):
            yield Static("Conversations", classes="dialog-title")
            yield OptionList(
                *[Option(_label(c, self.current_id), id=c.id) for c in self.conversations], id="history-list"
            )
            hint = "Enter reopens; Esc cancels." if self.conversations else "No saved conversations yet."
            yield Static(hint, classes="dialog-hint")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
