"""F1: every key binding, grouped."""

from __future__ import annotations

from typing import ClassVar

from mlxpaged_app.tui.keys import HELP_SECTIONS, key_label

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def help_table() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(justify="right", style="bold", no_wrap=True)
    table.add_column()
    for i, (section, keys) in enumerate(HELP_SECTIONS):
        table.add_row("", Text(section, style="bold underline"), end_section=False)
        for key, what in keys:
            keys = [key] if key.startswith("/") else [k.strip() for k in key.split("/")]
            table.add_row(" / ".join(key_label(k) for k in keys), what)
        if i < len(HELP_SECTIONS) - 1:
            table.add_row("", "")
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,f1,q", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-dialog", classes="dialog"):
            yield Static("Keys", classes="dialog-title")
            yield Static(help_table())
            yield Static("Esc closes this help.", classes="dialog-hint")
