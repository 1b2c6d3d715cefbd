"""F5: edit the system prompt."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static, TextArea

HINT = (
    "Sent before every turn. Empty: the model's own default. Changing it changes the prompt's "
    "first tokens, so the next turn cannot reuse cached blocks."
)


class SystemPromptScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, prompt: str):
        super().__init__()
        self.prompt = prompt

    def compose(self) -> ComposeResult:
        with Vertical(id="system-dialog", classes="dialog"):
            yield Static("System prompt", classes="dialog-title")
            yield TextArea(self.prompt, id="system-text", soft_wrap=True, tab_behavior="focus")
            yield Static(HINT + "  Ctrl+S saves, Esc cancels.", classes="dialog-hint")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.action_save() if event.button.id == "save" else self.action_cancel()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
