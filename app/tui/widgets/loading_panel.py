"""The loading panel, shown above the status line while a model is fetched, converted and loaded.

A panel, not a modal screen: the message box below it keeps the focus, so what the user types
while the model loads stays in the box (a modal screen would receive, and drop, those keys).
"""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static

HINT = "Downloads and conversions happen once; later loads take a few seconds."


class LoadingPanel(Vertical):
    can_focus = False

    def compose(self) -> ComposeResult:
        yield Static(id="loading-title", classes="panel-title")
        yield Static(id="loading-stage")
        yield ProgressBar(total=None, show_eta=False, id="loading-progress")
        yield Static(HINT, classes="dialog-hint")

    def start(self, model: str | None) -> None:
        self.query_one("#loading-title", Static).update(f"Loading {model or 'the default model'}")
        self.show_stage("loading the weights and sizing the KV cache…")
        self.display = True

    def show_progress(self, done: int, total: int, what: str) -> None:
        """From load_model's progress callback (download / convert), relayed to the UI thread."""
        self.query_one("#loading-stage", Static).update(what)
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)

    def show_stage(self, what: str) -> None:
        self.query_one("#loading-stage", Static).update(what)
        self.query_one(ProgressBar).update(total=None, progress=0)

    def stop(self) -> None:
        self.display = False
