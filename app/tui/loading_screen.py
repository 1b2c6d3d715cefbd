"""The loading screen shown while a model is fetched, converted and loaded."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import ProgressBar, Static


class LoadingScreen(ModalScreen[None]):
    def __init__(self, model: str | None):
        super().__init__()
        self.model = model or "the default model"

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-dialog", classes="dialog"):
            yield Static(f"Loading {self.model}", classes="dialog-title")
            yield Static("loading the weights and sizing the KV cache…", id="loading-stage")
            yield ProgressBar(total=None, show_eta=False, id="loading-progress")
            yield Static("Downloads and conversions happen once; later loads take a few seconds.",
                         classes="dialog-hint")

    def show_progress(self, done: int, total: int, what: str) -> None:
        """From load_model's progress callback (download / convert), relayed to the UI thread."""
        self.query_one("#loading-stage", Static).update(what)
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)

    def show_stage(self, what: str) -> None:
        self.query_one("#loading-stage", Static).update(what)
        self.query_one(ProgressBar).update(total=None)
