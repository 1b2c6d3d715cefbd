"""The live block map: one half-character cell per KV block (or per group of blocks on
large pools), coloured by who holds it."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from rich.style import Style
from rich.text import Text
from textual.widget import Widget

# Ascending priority: a grouped cell shows its busiest block, so one live block stays visible.
CLASSES = ("free", "cached", "other", "shared", "current")
LABELS = {
    "current": "this reply",
    "shared": "shared",
    "other": "other requests",
    "cached": "cached (free)",
    "free": "free",
}
LEGEND_LINES = (("current", "shared", "other"), ("cached", "free"))
COLOURS = {"current": "#3fb950", "shared": "#d29922", "other": "#bc8cff", "cached": "#388bfd", "free": "#30363d"}
_RANK = {name: i for i, name in enumerate(CLASSES)}
MAX_ROWS = 8  # text rows; each holds two rows of cells (upper / lower half blocks)


def classify(states: Sequence[str], current_blocks: Iterable[int]) -> list[str]:
    """Engine block states ("free" / "owned" / "shared" / "cached") -> map classes: an owned
    block is "current" when the reply being generated holds it, else "other"."""
    current = set(current_blocks)
    out = []
    for block, state in enumerate(states):
        if state == "owned":
            out.append("current" if block in current else "other")
        else:
            out.append(state if state in _RANK else "other")
    return out


def group_size(num_blocks: int, capacity: int) -> int:
    """Blocks per cell so that `num_blocks` fit in `capacity` cells."""
    return max(1, math.ceil(num_blocks / max(capacity, 1)))


def group(classes: Sequence[str], size: int) -> list[str]:
    return [max(classes[i : i + size], key=_RANK.__getitem__) for i in range(0, len(classes), size)]


def legend(classes: Sequence[str]) -> Text:
    counts = Counter(classes)
    text = Text()
    for i, line in enumerate(LEGEND_LINES):
        text.append("\n" if i else "")
        for name in line:
            text.append("■ ", Style(color=COLOURS[name]))
            label = "other" if name == "other" else LABELS[name]
            text.append(f"{label} {counts.get(name, 0):,}  ")
    return text


class BlockMap(Widget):
    """Render with `show(states, current_blocks)`; reads left to right, top to bottom."""

    DEFAULT_CSS = "BlockMap { height: auto; }"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.classes_by_block: list[str] = []

    def show(self, states: Sequence[str], current_blocks: Iterable[int]) -> None:
        classes = classify(states, current_blocks)
        if classes != self.classes_by_block:
            resized = len(classes) != len(self.classes_by_block)
            self.classes_by_block = classes
            self.refresh(layout=resized)

    def layout_for(self, width: int) -> tuple[int, list[str]]:
        """(blocks per cell, cell classes) at this width."""
        size = group_size(len(self.classes_by_block), max(width, 1) * MAX_ROWS * 2)
        return size, group(self.classes_by_block, size)

    def get_content_height(self, container, viewport, width: int) -> int:
        _, cells = self.layout_for(width)
        return max(1, math.ceil(len(cells) / max(width, 1) / 2))

    def render(self) -> Text:
        width = max(self.size.width, 1)
        _, cells = self.layout_for(width)
        text = Text(no_wrap=True, overflow="crop")
        rows = math.ceil(len(cells) / width)
        for pair in range(0, rows, 2):
            if pair:
                text.append("\n")
            top, bottom = cells[pair * width : (pair + 1) * width], cells[(pair + 1) * width : (pair + 2) * width]
            for i, upper in enumerate(top):
                lower = bottom[i] if i < len(bottom) else None
                text.append("▀", Style(color=COLOURS[upper], bgcolor=COLOURS[lower] if lower else None))
        if not cells:
            text.append("(no engine)", Style(dim=True))
        return text
