"""Loading and switching models behind the loading panel (a mixin of ChatApp).

The factory runs in a thread worker, which posts LoadProgress (from load_model's progress callback),
then ModelLoaded or LoadFailed; the `on_...` handlers below take them on the UI thread.
The message box stays usable throughout: a question sent meanwhile waits (replies.py) and is
answered by whichever engine is ready first. A failed load leaves the previous engine in place.
"""

from __future__ import annotations

from mlxpaged_app.tui.errors import error_text
from mlxpaged_app.tui.messages import LoadFailed, LoadProgress, ModelLoaded, post_from_thread

from textual import work


class ModelLoading:
    def init_loading(self) -> None:
        self.loading_model = False
        self._last_percent: tuple[str, int] | None = None

    def load_model(self, name: str | None) -> None:
        if self.loading_model:
            return
        self.loading_model = True
        self.loading_panel.start(name)
        self.sub_title = f"loading {name or 'the default model'}…"
        self.update_status()
        self._load_engine(name)

    @work(thread=True, group="load", exit_on_error=False)
    def _load_engine(self, name: str | None) -> None:
        try:
            engine = self.engine_factory(name, self._post_progress)
        except Exception as exc:  # unknown model, no network, unsupported architecture, memory
            post_from_thread(self, LoadFailed(name, exc))
            return
        if not post_from_thread(self, ModelLoaded(name, engine)):
            engine.close()  # the app went away while we were loading

    def _post_progress(self, done: int, total: int, what: str) -> None:
        """load_model's progress callback (on the worker thread)."""
        percent = (what, 100 * done // max(total, 1))
        if percent != self._last_percent:  # one UI update per percent, not per megabyte
            self._last_percent = percent
            post_from_thread(self, LoadProgress(done, total, what))

    def on_load_progress(self, message: LoadProgress) -> None:
        if self.loading_model:
            self.loading_panel.show_progress(message.done, message.total, message.what)

    def _finish_loading(self) -> None:
        self.loading_model = False
        self.loading_panel.stop()

    async def on_model_loaded(self, message: ModelLoaded) -> None:
        engine = message.engine
        self._finish_loading()
        old, self.engine = self.engine, engine
        if old is not None and old is not engine:
            self.run_worker(old.close, thread=True, group="close", exit_on_error=False)
            self.notify(f"Now chatting with {engine.loaded.name}.", title="Model loaded")
        await self.engine_ready(engine)

    async def engine_ready(self, engine) -> None:
        self.model_name = engine.loaded.name
        self.sub_title = engine.loaded.name
        self.update_status()
        self.refresh_engine_panel()
        await self.answer_waiting_question()

    async def on_load_failed(self, message: LoadFailed) -> None:
        self._finish_loading()
        if self.engine is not None:
            still = f" Still chatting with {self.engine.loaded.name}."
        elif self.waiting_question:
            still = " Your message waits for a model: press F4 to pick another."
        else:
            still = " Press F4 to pick another model."
        self.notify(
            error_text(message.error) + still,
            title=f"Could not load {message.name or 'the default model'}",
            severity="error",
            timeout=15,
        )
        self.sub_title = self.engine.loaded.name if self.engine is not None else "no model loaded"
        self.update_status()
        if self.engine is not None:
            await self.answer_waiting_question()
