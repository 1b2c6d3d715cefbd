"""F3: sampling settings (temperature, top_p, max tokens, seed) in a modal form."""

from __future__ import annotations

from typing import ClassVar

from mlxpaged.loading.generation_defaults import NO_DEFAULTS, GenerationDefaults
from mlxpaged_app.tui.settings import ChatSettings

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static

FIELDS = (  # (input id, label, hint)
    ("temperature", "Temperature", "0 is greedy; empty: the model's"),
    ("top_p", "Top p", "nucleus sampling, in (0, 1]; empty: the model's"),
    ("max_tokens", "Max tokens", "per reply"),
    ("seed", "Seed", "empty: random; a number repeats replies"),
)


class SettingsScreen(ModalScreen[ChatSettings | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, settings: ChatSettings, defaults: GenerationDefaults = NO_DEFAULTS):
        super().__init__()
        self.settings, self.defaults = settings, defaults

    def compose(self) -> ComposeResult:
        s, model = self.settings, self.settings.sampling_params(self.defaults)
        values = {
            "temperature": "" if s.temperature is None else f"{s.temperature:g}",
            "top_p": "" if s.top_p is None else f"{s.top_p:g}",
            "max_tokens": str(s.max_tokens),
            "seed": "" if s.seed is None else str(s.seed),
        }
        placeholders = {
            "temperature": f"model: {model.temperature:g}",
            "top_p": f"model: {model.top_p:g}",
            "seed": "random",
        }
        with Vertical(id="settings-dialog", classes="dialog"):
            yield Static("Sampling settings", classes="dialog-title")
            with Grid(id="settings-grid"):
                for name, label, hint in FIELDS:
                    yield Label(label)
                    yield Input(
                        values[name], placeholder=placeholders.get(name, ""), id=f"setting-{name}", compact=True
                    )
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
