"""Loading and switching models behind a loading screen (a mixin of ChatApp).

The factory runs in a thread worker; load_model's progress callback is relayed to the screen.
A failed load leaves the previous engine in place, and the app usable either way.
"""

from __future__ import annotations

from textual import work

from mlxpaged_app.tui.errors import error_text
from mlxpaged_app.tui.loading_screen import LoadingScreen


class ModelLoading:
    def init_loading(self) -> None:
        self.loading_screen: LoadingScreen | None = None
        self._last_percent: tuple[str, int] | None = None

    @property
    def loading_model(self) -> bool:
        return self.loading_screen is not None

    def load_model(self, name: str | None) -> None:
        if self.loading_screen is not None:
            return
        self.loading_screen = LoadingScreen(name)
        self.push_screen(self.loading_screen)
        self.sub_title = f"loading {name or 'the default model'}…"
        self.update_status("Loading the model…")
        self._load_engine(name)

    @work(thread=True, group="load", exit_on_error=False)
    def _load_engine(self, name: str | None) -> None:
        try:
            engine = self.engine_factory(name, self._relay_progress)
        except Exception as exc:  # unknown model, no network, unsupported architecture, memory
            self._relay(self.engine_failed, name, exc)
            return
        if not self._relay(self.engine_loaded, name, engine):
            engine.close()  # the app went away while we were loading

    def _relay(self, callback, *args) -> bool:
        try:
            self.call_from_thread(callback, *args)
            return True
        except RuntimeError:
            return False

    def _relay_progress(self, done: int, total: int, what: str) -> None:
        percent = (what, 100 * done // max(total, 1))
        if percent != self._last_percent:  # one UI update per percent, not per megabyte
            self._last_percent = percent
            self._relay(self._show_progress, done, total, what)

    def _show_progress(self, done: int, total: int, what: str) -> None:
        if self.loading_screen is not None:
            self.loading_screen.show_progress(done, total, what)

    def _close_loading_screen(self) -> None:
        if self.loading_screen is not None:
            self.loading_screen.dismiss()
            self.loading_screen = None

    def engine_loaded(self, name: str | None, engine) -> None:
        self._close_loading_screen()
        old, self.engine = self.engine, engine
        if old is not None and old is not engine:
            self.run_worker(old.close, thread=True, group="close", exit_on_error=False)
            self.notify(f"Now chatting with {engine.loaded.name}.", title="Model loaded")
        self.engine_ready(engine)

    def engine_ready(self, engine) -> None:
        self.model_name = engine.loaded.name
        self.sub_title = engine.loaded.name
        self.update_status()
        self.refresh_engine_panel()
        # The loading screen is still being dismissed here; lay the main screen out again once it is
        # back on top, or the engine panel stays unpainted until the next keystroke.
        self.call_after_refresh(self._repaint_main_screen)

    def _repaint_main_screen(self) -> None:
        self.screen.refresh(layout=True)
        self.refresh_engine_panel()

    def engine_failed(self, name: str | None, error: BaseException) -> None:
        self._close_loading_screen()
        still = f" Still chatting with {self.engine.loaded.name}." if self.engine is not None else \
            " Press F4 to pick another model."
        self.notify(error_text(error) + still, title=f"Could not load {name or 'the default model'}",
                    severity="error", timeout=15)
        self.sub_title = self.engine.loaded.name if self.engine is not None else "no model loaded"
        self.update_status()
