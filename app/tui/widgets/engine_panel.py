"""The engine panel: cache counters, the live block map, memory plan and memory in use."""

from __future__ import annotations

import os
from typing import Any

from mlxpaged.units import format_size
from mlxpaged_app.tui.memory_use import MemoryUse
from mlxpaged_app.tui.widgets.block_map import BlockMap, legend

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static


class EnginePanel(VerticalScroll):
    can_focus = False

    def compose(self) -> ComposeResult:
        yield Static("Engine", classes="panel-title")
        yield Static(id="engine-stats")
        yield Static(id="block-map-title", classes="panel-title")
        yield BlockMap(id="block-map")
        yield Static(id="block-legend")
        yield Static("Memory", classes="panel-title")
        yield Static(id="engine-memory")
        yield Static(id="engine-plan")

    def show_engine(self, engine: Any, request_id: str | None, memory: MemoryUse) -> None:
        """Redraw from a fresh engine snapshot (UI thread; the engine calls are cheap reads)."""
        stats = engine.stats()
        current = engine.request_blocks(request_id) if request_id else []
        block_map = self.query_one(BlockMap)
        block_map.show(engine.block_states(), current)
        self.query_one("#engine-stats", Static).update(stats_text(stats))
        per_cell, _ = block_map.layout_for(block_map.size.width or _fallback_width(self))
        title = "Block map" + (f" (1 cell = {per_cell} blocks)" if per_cell > 1 else " (1 cell = 1 block)")
        self.query_one("#block-map-title", Static).update(title)
        self.query_one("#block-legend", Static).update(legend(block_map.classes_by_block))
        self.query_one("#engine-memory", Static).update(memory_text(engine.plan, memory))
        self.query_one("#engine-plan", Static).update(plan_table(engine.plan.describe()))

    def show_no_engine(self, why: str) -> None:
        self.query_one(BlockMap).show([], [])
        self.query_one("#engine-stats", Static).update(why)
        for name in ("#block-legend", "#engine-memory", "#engine-plan", "#block-map-title"):
            self.query_one(name, Static).update("")


def _fallback_width(panel: EnginePanel) -> int:
    return max(panel.size.width - 4, 1)


def stats_text(stats: dict) -> Text:
    total, free, cached = stats["blocks_total"], stats["blocks_free"], stats["blocks_cached"]
    plan = stats.get("memory_plan")
    block_size = getattr(plan, "block_size", None)
    ttft = stats.get("last_time_to_first_token")
    rows = [
        ("KV blocks", f"{total:,}" + (f" \N{MULTIPLICATION SIGN} {block_size} tokens" if block_size else "")),
        ("  in use", f"{stats['blocks_used']:,}"),
        ("  cached", f"{cached:,} (free, reusable)"),
        ("  empty", f"{free - cached:,}"),
        ("prefix hits", f"{100 * stats['prefix_hit_rate']:.0f}% · {stats['prefix_hit_tokens']:,} tokens"),
        *_tier_rows(stats),
        ("requests", f"{stats['requests_running']} running · {stats['requests_waiting']} waiting"),
        ("decode", f"{stats['generation_tokens_per_s']:.1f} tok/s"),
        ("processed", f"{stats['processed_tokens_per_s']:.1f} tok/s"),
        ("last TTFT", "-" if ttft is None else f"{ttft:.2f} s"),
    ]
    if stats.get("preemptions"):
        rows.append(("preemptions", f"{stats['preemptions']:,}"))
    if stats.get("speculative"):  # drafts kept of drafts verified, so a user sees whether it pays
        rate = stats.get("spec_acceptance_rate")
        rows.append(
            (
                "speculative",
                # a draft model by its name (its directory's, for a path)
                f"{_drafter(stats)} · "
                + (
                    "no drafts yet"
                    if rate is None
                    else f"{100 * rate:.0f}% of {stats['spec_draft_tokens_total']:,} drafts kept"
                ),
            )
        )
    attention = stats.get("attention")
    if attention:  # which attention path runs, so a kernel that fell back to the reference is visible
        rows.append(("attention", attention["path"]))
    if stats.get("backend_description"):  # what MLX computes on (platform/backend.py)
        rows.append(("backend", stats["backend_description"]))
    return _rows(rows)


def _tier_rows(stats: dict) -> list[tuple[str, str]]:
    """The prefix cache's tiers: tokens each saved, and the disk tier's bytes (when the engine has one). One figure
    or two a row: the panel has 46 columns of text, and a longer row wraps its last word to the line's start."""
    if "ram_hit_tokens" not in stats:
        return []
    rows = [("  RAM", f"{stats['ram_hit_tokens']:,} tokens saved")]
    if stats.get("disk_tier"):
        rows.append(("  disk", f"{stats['disk_hit_tokens']:,} tokens saved"))
        used, limit = format_size(stats["disk_used_bytes"]), format_size(stats["disk_limit_bytes"])
        rows.append(("disk tier", f"{used} of {limit}"))
        rows.append(("  read", format_size(stats["disk_read_bytes"])))
        written = format_size(stats["disk_written_bytes"])
        if "disk_state_hits" in stats:  # a state model's checkpoints, kept beside its blocks (state_tiering.py)
            rows.append(("  written", f"{written} · states {format_size(stats['disk_state_written_bytes'])}"))
            rows.append(("  states", f"{stats['disk_state_hits']:,} resumed · {stats['disk_state_written']:,} written"))
        else:
            rows.append(("  written", written))
    elif stats.get("disk_tier_off"):
        rows.append(("disk tier", f"off: {stats['disk_tier_off']}"))
    return rows


def memory_text(plan: Any, memory: MemoryUse) -> Text:
    rows = [("KV pool", f"{format_size(getattr(plan, 'kv_bytes', None))} (planned)")]
    if memory.mlx_active is not None:
        rows.append(("MLX active", f"{format_size(memory.mlx_active)} (peak {format_size(memory.mlx_peak)})"))
    if memory.device_total:  # CUDA: the GPU's own memory, apart from the host's
        rows.append(("device", f"{format_size(memory.device_used)} of {format_size(memory.device_total)} used"))
    rows.append(("process", f"{format_size(memory.process_rss)} resident"))
    if memory.host_total:
        rows.append(("host", f"{format_size(memory.host_used)} of {format_size(memory.host_total)} used"))
    return _rows(rows)


def plan_table(description: str) -> Table:
    """MemoryPlan.describe() laid out for a narrow panel: labels wrap, amounts stay right-aligned."""
    title, *lines = description.splitlines()
    table = Table.grid(padding=(0, 1), expand=True)
    table.add_column(ratio=1, style="dim")
    table.add_column(justify="right", no_wrap=True, style="dim")
    table.add_row(Text(title, style="bold"), "")
    for line in lines:
        label, _, amount = line.strip().rpartition("  ")
        if label and amount.strip().endswith("B"):
            table.add_row(label.strip(), amount.strip())
        else:
            table.add_row(line.strip(), "")
    return table


def _rows(rows: list[tuple[str, str]]) -> Text:
    text = Text()
    for i, (label, value) in enumerate(rows):
        text.append(("\n" if i else "") + f"{label:<12}", style="bold" if not label.startswith(" ") else "")
        text.append(value)
    return text


def _drafter(stats: dict) -> str:
    """What drafts: "ngram", or the draft model's name."""
    draft = stats.get("draft_model")
    return f"draft {os.path.basename(os.path.normpath(draft)) or draft}" if draft else str(stats["speculative"])
