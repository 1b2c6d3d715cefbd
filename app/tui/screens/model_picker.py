"""F4: switch model: presets and local models, or any name / path / hub id typed in; the model the chat has
loaded is marked with the memory it holds (weights, KV cache and state, as its memory plan counts them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from mlxpaged.units import format_size

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, OptionList, Static
from textual.widgets.option_list import Option


@dataclass(frozen=True)
class ModelChoice:
    name: str
    description: str
    local_bytes: int | None  # None: not downloaded / converted yet
    is_default: bool = False


ModelLister = Callable[[], list[ModelChoice]]


def list_model_choices() -> list[ModelChoice]:
    from mlxpaged.loading.loader import default_dtype
    from mlxpaged.loading.model_store import list_models

    return [
        ModelChoice(r.name, r.description, r.size_bytes if r.path else None, r.is_default)
        for r in list_models(default_dtype())
    ]


def loaded_memory(engine) -> int | None:
    """Bytes the loaded engine holds: its weights, KV cache and state slots (None without an engine)."""
    if engine is None:
        return None
    try:
        plan = engine.plan
        return int(engine.facts.weight_bytes + plan.kv_bytes + getattr(plan, "state_bytes", 0))
    except AttributeError:  # an engine without a plan (a test double): the label says only "loaded"
        return None


def _label(choice: ModelChoice, current: str | None, current_bytes: int | None = None) -> Text:
    text = Text(f"{choice.name:<18}", style="bold" if choice.name == current else "")
    where = format_size(choice.local_bytes) if choice.local_bytes is not None else "download"
    text.append(f"{where:>10}  ", style="green" if choice.local_bytes is not None else "yellow")
    text.append(choice.description, style="dim")
    if choice.name == current:
        held = f", {format_size(current_bytes)} in memory" if current_bytes is not None else ""
        text.append(f"  (loaded{held})", style="italic")
    return text


class ModelPickerScreen(ModalScreen[str | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, lister: ModelLister, current: str | None, current_bytes: int | None = None):
        super().__init__()
        self.lister, self.current, self.current_bytes = lister, current, current_bytes

    def compose(self) -> ComposeResult:
        with Vertical(id="model-dialog", classes="dialog"):
            yield Static("Switch model", classes="dialog-title")
            yield OptionList(id="model-list")
            yield Input(
                placeholder="…or type a preset, a model directory or a Hugging Face repo id",
                id="model-name",
                compact=True,
            )
            yield Static(
                "Enter loads the model; Esc cancels. Models marked download need internet once.", classes="dialog-hint"
            )

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        try:
            choices = self.lister()
        except Exception as exc:  # a broken presets file must not take the app down
            self.query_one(".dialog-hint", Static).update(f"cannot list models: {exc}")
            choices = []
        options.add_options([Option(_label(c, self.current, self.current_bytes), id=c.name) for c in choices])
        names = [c.name for c in choices]
        if names:
            options.highlighted = names.index(self.current) if self.current in names else 0
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.value.strip():
            self.dismiss(event.value.strip())

    def action_cancel(self) -> None:
        self.dismiss(None)
