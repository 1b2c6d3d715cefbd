"""ChatApp: the `mlxpaged chat` Textual app. Layout, key actions and conversation state;
replies run through `replies.ReplyFlow`, model loading through `loading.ModelLoading` (their
workers post the Messages of messages.py)."""

from __future__ import annotations

from pathlib import Path

from mlxpaged.loading.generation_defaults import NO_DEFAULTS, GenerationDefaults
from mlxpaged_app.tui.keys import APP_BINDINGS
from mlxpaged_app.tui.loading import ModelLoading
from mlxpaged_app.tui.memory_use import MemoryProbe, probe_memory
from mlxpaged_app.tui.protocol import ChatEngine, EngineFactory
from mlxpaged_app.tui.replies import ReplyFlow
from mlxpaged_app.tui.screens.help import HelpScreen
from mlxpaged_app.tui.screens.history import HistoryScreen
from mlxpaged_app.tui.screens.model_picker import (
    ModelLister,
    ModelPickerScreen,
    list_model_choices,
    loaded_memory,
)
from mlxpaged_app.tui.screens.settings import SettingsScreen
from mlxpaged_app.tui.screens.system_prompt import SystemPromptScreen
from mlxpaged_app.tui.settings import ChatSettings
from mlxpaged_app.tui.store import Conversation, ConversationStore
from mlxpaged_app.tui.widgets.chat_input import ChatInput
from mlxpaged_app.tui.widgets.chat_view import ChatLog
from mlxpaged_app.tui.widgets.engine_panel import EnginePanel
from mlxpaged_app.tui.widgets.loading_panel import LoadingPanel

from textual.app import App, ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Static

PANEL_MIN_WIDTH = 100  # below this many columns the engine panel starts hidden (F2 shows it)
# The engine panel samples the engine on a timer: its block states, cache counters, rates and memory
# change on the engine's own thread with no event to wait on. Replies never wait for this timer.
PANEL_REFRESH_S = 0.25


class ChatApp(ModelLoading, ReplyFlow, App[int]):
    CSS_PATH = Path(__file__).with_name("chat.tcss")  # absolute: subclasses live elsewhere
    TITLE = "mlxpaged chat"
    BINDINGS = APP_BINDINGS

    def __init__(
        self,
        engine_factory: EngineFactory,
        *,
        model: str | None = None,
        settings: ChatSettings | None = None,
        store: ConversationStore | None = None,
        conversation: Conversation | None = None,
        system_prompt: str = "",
        engine: ChatEngine | None = None,
        model_lister: ModelLister = list_model_choices,
        memory_probe: MemoryProbe = probe_memory,
        show_engine_panel: bool | None = None,
    ):
        super().__init__()
        self.engine_factory, self.model_name, self.engine = engine_factory, model, engine
        self.settings = settings or ChatSettings()
        self.store = store or ConversationStore.default()
        self.conversation = conversation or Conversation.new(model, system_prompt)
        self.model_lister, self.memory_probe = model_lister, memory_probe
        self.show_engine_panel = show_engine_panel
        self.init_replies()
        self.init_loading()
        if conversation is not None and conversation.messages and conversation.messages[-1]["role"] == "user":
            self.waiting_in = self.conversation  # reopened unanswered (`chat --resume`): answered once a model is ready

    # --- layout ------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="▦")
        with Horizontal(id="body"):
            with Vertical(id="chat-column"):
                yield ChatLog(id="chat-log")
                yield LoadingPanel(id="loading-panel")
                yield Static(id="status")
                yield ChatInput(id="prompt")
            yield EnginePanel(id="engine-panel")
        yield Footer(show_command_palette=False)  # Ctrl+P still opens it; F1 lists it

    async def on_mount(self) -> None:
        # Widgets are looked up on the main screen: app.query_one searches whatever is on top.
        main = self.screen
        self.chat_log, self.chat_input = main.query_one(ChatLog), main.query_one(ChatInput)
        self.engine_panel, self.status_line = main.query_one(EnginePanel), main.query_one("#status", Static)
        self.loading_panel = main.query_one(LoadingPanel)
        if self.show_engine_panel is None:
            self.show_engine_panel = self.size.width >= PANEL_MIN_WIDTH
        self.engine_panel.display = self.show_engine_panel
        await self.show_conversation()
        self.set_interval(PANEL_REFRESH_S, self.refresh_engine_panel)
        self.chat_input.focus()
        if self.engine is None:
            self.load_model(self.model_name)
        else:
            await self.engine_ready(self.engine)

    def on_unmount(self) -> None:
        if self.reply is not None:  # let the reply's worker thread end with the app
            self.reply.stop()

    @property
    def model_label(self) -> str:
        return self.engine.loaded.name if self.engine is not None else (self.model_name or "assistant")

    async def show_conversation(self) -> None:
        c = self.conversation
        await self.chat_log.show_messages(c.system_prompt, c.messages, self.model_label)
        self.update_status()

    def update_status(self, text: str | None = None) -> None:
        if text is None:
            if self.loading_model:
                text = (
                    "Loading the model… your message is sent once the model is ready."
                    if self.waiting_question
                    else "Loading the model… type away: Enter sends once the model is ready."
                )
            elif self.engine is None:
                text = "No model loaded: F4 picks one."
            else:
                text = f"Ready · {self.settings.describe(self.engine.generation_defaults)}"
            if self.attached:  # first: a narrow status line cuts its end
                names = ", ".join(Path(path).name for path in self.attached)
                text = f"Attached {names}: it goes with your next message · {text}"
        self.status_line.update(text)

    def refresh_engine_panel(self) -> None:
        panel = self.engine_panel
        if not panel.display or not panel.is_attached:
            return
        if self.engine is None:
            panel.show_no_engine("No model loaded.")
            return
        try:
            panel.show_engine(self.engine, self.current_request_id, self.memory_probe(self.engine))
        except Exception as exc:  # a snapshot failing must not take the app down
            panel.show_no_engine(f"engine stats unavailable: {exc}")

    def save_conversation(self) -> None:
        if not self.conversation.messages:
            return
        try:
            self.store.save(self.conversation)
        except OSError as exc:
            self.notify(f"Could not save the conversation: {exc}", severity="warning", timeout=8)

    # --- actions -----------------------------------------------------------------------------
    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_toggle_engine(self) -> None:
        panel = self.engine_panel
        panel.display = not panel.display
        self.refresh_engine_panel()

    def action_settings(self) -> None:
        self.push_screen(SettingsScreen(self.settings, self.model_defaults), self.apply_settings)

    @property
    def model_defaults(self) -> GenerationDefaults:
        """The loaded model's sampling defaults: what unset temperature / top_p follow."""
        return self.engine.generation_defaults if self.engine is not None else NO_DEFAULTS

    def apply_settings(self, settings: ChatSettings | None) -> None:
        if settings is not None:
            self.settings = settings
            self.notify(f"Next replies: {settings.describe(self.model_defaults)}", title="Settings")
            if not self.reply_running:
                self.update_status()

    def action_system_prompt(self) -> None:
        self.push_screen(SystemPromptScreen(self.conversation.system_prompt), self.apply_system_prompt)

    def apply_system_prompt(self, text: str | None) -> None:
        if text is not None and text != self.conversation.system_prompt:
            self.conversation.system_prompt = text
            self.chat_log.set_system_prompt(text)
            self.save_conversation()
            self.notify("The system prompt applies from the next reply.", title="System prompt")

    def action_pick_model(self) -> None:
        if self.reply is not None:
            self.notify("Press Esc to stop the reply before switching model.", severity="warning")
            return
        if self.loading_model:
            self.notify("A model is loading: pick another once it is ready.", severity="warning")
            return
        picker = ModelPickerScreen(self.model_lister, self.model_label, loaded_memory(self.engine))
        self.push_screen(picker, self.switch_model)

    def switch_model(self, name: str | None) -> None:
        if name is not None:
            self.load_model(name)

    async def action_new_chat(self) -> None:
        self.abandon_reply()
        self.conversation = Conversation.new(self.model_label, self.conversation.system_prompt)
        self.chat_input.clear()
        await self.show_conversation()
        self.chat_input.focus()
        self.notify("New chat.")

    def action_open_conversation(self) -> None:
        self.push_screen(HistoryScreen(self.store.list(), self.conversation.id), self.open_conversation)

    async def open_conversation(self, conversation_id: str | None) -> None:
        if conversation_id is None:
            return
        try:
            conversation = self.store.load(conversation_id)
        except (OSError, ValueError, TypeError) as exc:
            self.notify(f"Cannot open that conversation: {exc}", severity="error")
            return
        self.abandon_reply()
        self.conversation = conversation
        await self.show_conversation()
        if conversation.model and self.engine is not None and conversation.model != self.model_label:
            self.notify(
                f"Saved with {conversation.model}; replies now come from {self.model_label} (F4 switches).", timeout=8
            )

    def close_engine(self) -> None:
        """Stop any reply and release the engine (after the app exits)."""
        self.abandon_reply()
        if self.engine is not None:
            self.engine.close()
            self.engine = None
