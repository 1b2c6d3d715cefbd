"""F3: sampling settings (temperature, top_p, max tokens, seed) in a modal form."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

from mlxpaged_app.tui.settings import ChatSettings

FIELDS = (  # (input id, label, hint)
    ("temperature", "Temperature", "0 is greedy; higher is more varied"),
    ("top_p", "Top p", "nucleus sampling, in (0, 1]"),
    ("max_tokens", "Max tokens", "per reply"),
    ("seed", "Seed", "empty: random; a number repeats replies"),
)


class SettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: ChatSettings):
        super().__init__()
        self.settings = settings

    def compose(self) -> ComposeResult:
        values = {"temperature": f"{self.settings.temperature:g}", "top_p": f"{self.settings.top_p:g}",
                  "max_tokens": str(self.settings.max_tokens),
                  "seed": "" if self.settings.seed is None else str(self.settings.seed)}
        with Vertical(id="settings-dialog", classes="dialog"):
            yield Static("Sampling settings", classes="dialog-title")
            with Grid(id="settings-grid"):
                for name, label, hint in FIELDS:
                    yield Label(label)
                    yield Input(values[name], placeholder="random" if name == "seed" else "", id=f"setting-{name}", compact=True)
                    yield Label(hint, classes="dialog-hint")
            yield Static("", id="settings-error")
            with Horizontal(classes="dialog-buttons"):
                yield Button("Apply", variant="primary", id="apply")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#setting-temperature", Input).focus()

    def on_input_submitted(self) -> None:
        self.action_apply()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "apply":
            self.action_apply()
        else:
            self.action_cancel()

    def action_apply(self) -> None:
        values = {name: self.query_one(f"#setting-{name}", Input).value for name, *_ in FIELDS}
        try:
            settings = ChatSettings.parse(**values)
        except ValueError as exc:
            self.query_one("#settings-error", Static).update(str(exc))
            return
        self.dismiss(settings)

    def action_cancel(self) -> None:
        self.dismiss(None)
