"""The README's supported-architectures table, generated from the architecture sweep (never hand-edited).

    python -m tests.archs.arch_table                  # run the sweep (a few minutes), print the table
    python -m tests.archs.arch_table --readme README.md   # and rewrite the README's table section
    python -m tests.archs.arch_table --results sweep.jsonl   # from saved `python -m tests.archs.sweep` output

tests/engine/test_architectures.py fails when the README's table differs from the one a sweep renders.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from tests.archs.configs import VLM_WRAPPERS
from tests.archs.scenarios import SCENARIOS

START, END = "<!-- arch-table:start -->", "<!-- arch-table:end -->"
SCENARIO_TITLES = {
    "alone": "alone",
    "batched": "batched",
    "chunked": "chunked prefill",
    "prefix": "prefix hit",
    "preempt": "preempted",
    "n2": "n = 2",
    "empty": "pool empty",
}
HEADER = (
    "| architecture | layer caches | verdict | "
    + " | ".join(SCENARIO_TITLES[s] for s in SCENARIOS)
    + " | prefix cache | passes | attention |\n"
    + "|---" * (len(SCENARIOS) + 6)
    + "|"
)
ACCEPTANCE = 0.95  # issue 14: at least this share of the architectures mlx-lm runs here pass


def render(verdicts: dict[str, dict]) -> str:
    """The count lines and the table, in module order."""
    verdicts = dict(sorted(verdicts.items()))
    rows = [_row(v) for v in verdicts.values()]
    return "\n".join([*summary(verdicts), "", HEADER, *rows])


def summary(verdicts: dict[str, dict]) -> list[str]:
    """The pass-rate line (over the architectures mlx-lm itself runs here) and the per-scenario counts."""
    counts = Counter(v["status"] for v in verdicts.values())
    runnable = len(verdicts) - counts["cannot-run"]
    rate = counts["paged"] / runnable if runnable else 0.0
    per_scenario = Counter(
        name for v in verdicts.values() for name, why in v.get("scenarios", {}).items() if why == "pass"
    )
    return [
        f"{counts['paged']} of the {runnable} architectures mlx-lm runs here ({rate:.0%}; the goal is "
        f"{ACCEPTANCE:.0%}) are served paged with every scenario token for token equal to mlx-lm's greedy "
        f"output; {counts['refused']} {'is' if counts['refused'] == 1 else 'are'} refused when the engine is built, "
        "naming the layer and why" + _others(counts) + f"; {counts['cannot-run']} "
        "cannot run in mlx-lm itself here.",
        "",
        "Passing, per scenario: " + ", ".join(f"{SCENARIO_TITLES[s]} {per_scenario[s]}" for s in SCENARIOS) + ".",
    ]


def _others(counts: Counter) -> str:
    others = {k: n for k, n in counts.items() if k not in ("paged", "refused", "cannot-run")}
    return "".join(f"; {n} {status}" for status, n in sorted(others.items()))


def _row(v: dict) -> str:
    name = v["module"] + (" (VLM, text)" if v["module"] in VLM_WRAPPERS else "")
    cells = [name, _kinds(v.get("kinds", [])), _verdict(v), *_scenario_cells(v), _prefix(v), _mode(v), _attention(v)]
    return "| " + " | ".join(cells) + " |"


def _scenario_cells(v: dict) -> list[str]:
    scenarios = v.get("scenarios", {})
    return [("ok" if scenarios[s] == "pass" else "**fail**") if s in scenarios else "-" for s in SCENARIOS]


def _kinds(kinds: list[str]) -> str:
    counts = Counter(kinds)  # first-seen order
    return ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in counts.items()) or "-"


def _verdict(v: dict) -> str:
    status = v["status"]
    if status == "refused":
        return "refused: " + ", ".join(v.get("labels") or ["see error"])
    if status == "cannot-run":
        return "mlx-lm cannot run it here: " + v["reason"]
    return status if status == "paged" else f"{status}: {v.get('reason', '')[:120].replace('|', '/')}"


def _ran(v: dict) -> bool:
    return "scenarios" in v


def _prefix(v: dict) -> str:
    if not _ran(v):
        return "-"
    if not v.get("prefix_cache"):
        return "no"
    return "state checkpoints at block boundaries" if "state" in v.get("kinds", []) else "yes"


def _mode(v: dict) -> str:
    """How the engine runs the model's requests: batched, or one sequence per pass (serial_reason)."""
    return ("one sequence" if v.get("serial") else "batched") if _ran(v) else "-"


def _attention(v: dict) -> str:
    if not _ran(v):
        return "-"
    if not any(kind not in ("state", "unused") for kind in v.get("kinds", [])):
        return "none (state only)"
    if not v.get("routed"):
        return "model's own, over gathered K/V"
    if not v.get("all_routed"):  # latent or shared K/V, model-built masks: routing.py keeps those calls gathered
        return "paged decode where the call allows it, gathered K/V for the rest"
    kinds = {kind.split()[0] for kind in v.get("kinds", [])} & {"window", "chunked"}
    return f"paged decode (full layers), gathered ({' and '.join(sorted(kinds))} layers)" if kinds else "paged decode"


def replace_section(readme: str, table: str) -> str:
    """The README with the text between the table markers replaced."""
    if START not in readme or END not in readme:
        raise ValueError(f"the README has no {START} ... {END} section to replace")
    head, rest = readme.split(START, 1)
    return f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}"


def section(readme: str) -> str:
    """The table currently between the markers."""
    return readme.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, help="sweep output (JSON lines) instead of running the sweep")
    parser.add_argument("--readme", type=Path, help="rewrite this README's table section")
    args = parser.parse_args(argv)
    if args.results:
        verdicts = {v["module"]: v for v in map(json.loads, args.results.read_text().splitlines())}
    else:
        from tests.archs.sweep import sweep

        verdicts = sweep()["cpu"]
    table = render(verdicts)
    print(table)
    if args.readme:
        args.readme.write_text(replace_section(args.readme.read_text(), table))


if __name__ == "__main__":
    main(sys.argv[1:])
