"""`GET /metrics` for every model: each loaded model's samples carry a `model` label, and each metric family's
HELP and TYPE lines appear once (the text format requires it), its samples from every model under them. Then
the server's own: HTTP requests, the process's memory, the budget, and per model loaded / memory / loads."""

from __future__ import annotations

import os

from mlxpaged_app.server.metrics import _label, _metric
from mlxpaged_app.server.state import ServerState

import psutil


def render_metrics(state: ServerState) -> str:
    families: dict[str, list[str]] = {}
    _merge(families, state.metrics.render_requests())
    _merge(families, _server_memory(state))
    _merge(families, _models(state))
    for served in list(state.registry.loaded.values()):
        if served.unloaded:
            continue
        stats = served.engine.stats() if served.kind == "generate" else None  # an embedder has no engine gauges
        lines = served.metrics.render(stats, served.in_flight, served.admission.capacity)
        _merge(families, lines, f'model="{_label(served.model_id)}"')
    return "".join(line + "\n" for lines in families.values() for line in lines)


def _merge(families: dict[str, list[str]], lines: list[str], label: str | None = None) -> None:
    """Add rendered lines to their families (named by their # HELP line), `label` put first in each sample; a
    family already written keeps its HELP and TYPE lines and gains the samples."""
    name, new = "", False
    for line in lines:
        if line.startswith("# HELP "):
            name = line.split(" ", 3)[2]
            new = name not in families
            families.setdefault(name, [])
        if line.startswith("# "):
            if new:
                families[name].append(line)
        else:
            families[name].append(line if label is None else _labelled(line, label))


def _labelled(sample: str, label: str) -> str:
    """`name{a="1"} 2` -> `name{<label>,a="1"} 2`; `name 2` -> `name{<label>} 2`."""
    name, value = sample.rsplit(" ", 1)
    if name.endswith("}"):
        head, tail = name.split("{", 1)
        return f"{head}{{{label},{tail} {value}"
    return f"{name}{{{label}}} {value}"


def _server_memory(state: ServerState) -> list[str]:
    registry = state.registry
    samples = [
        ('{kind="process_resident"}', psutil.Process(os.getpid()).memory_info().rss),
        ('{kind="models_held"}', registry.held_bytes()),
    ]
    if registry.policy.budget_bytes is not None:
        samples.append(('{kind="budget"}', registry.policy.budget_bytes))
    return _metric(
        "memory_bytes",
        "gauge",
        "Memory: per model its KV cache, device limit and wired limit; the process RSS, the bytes loaded models "
        "hold and the --max-memory budget.",
        samples,
    )


def _models(state: ServerState) -> list[str]:
    registry = state.registry
    loaded = [s for s in registry.loaded.values() if not s.unloaded]
    names = sorted({*registry.loads, *(s.model_id for s in loaded)})
    lines = _metric(
        "model_loaded",
        "gauge",
        "1 while the model is loaded.",
        [(f'{{model="{_label(n)}"}}', int(n in registry.loaded)) for n in names],
    )
    lines += _metric(
        "model_memory_bytes",
        "gauge",
        "Memory a loaded model holds: weights, KV cache, state slots, activations.",
        [(f'{{model="{_label(s.model_id)}"}}', s.cost.total) for s in loaded],
    )
    lines += _metric(
        "model_loads_total",
        "counter",
        "Loads of each model.",
        [(f'{{model="{_label(n)}"}}', registry.loads[n]) for n in names],
    )
    lines += _metric(
        "model_unloads_total",
        "counter",
        "Unloads of each model (idle keep-alive, or to make room).",
        [(f'{{model="{_label(n)}"}}', registry.unloads[n]) for n in names],
    )
    return lines
