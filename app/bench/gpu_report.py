"""What `mlxpaged bench gpu` prints around its measurements: the environment header and the summary table."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

COMMIT_ENV = "MLXPAGED_COMMIT"  # for checkouts copied without .git (the GPU kit): the caller names the commit


def git_commit() -> str:
    """$MLXPAGED_COMMIT when set (the caller knows: a copied checkout may carry a stale .git, as the GPU kit's did,
    which printed an old commit "+dirty"), else the checkout's commit ("+dirty" when tracked files changed), else a
    reason."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        head = _git("rev-parse", "--short=12", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return f"unknown (no git checkout here; set {COMMIT_ENV})"


def _git(*args: str) -> str:
    """git's output, stripped, run in this checkout; raises when git is missing or fails."""
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


GRAPHS_VAR = "MLX_USE_CUDA_GRAPHS"  # MLX's CUDA backend reads it once, at the process's first GPU command


def environment_lines() -> list[str]:
    """Device, backend, versions and the levers set (decode attention, CUDA graphs, the recorder thread, compiled
    batches): what a reader needs to know where the figures come from."""
    import os

    from mlxpaged.kernels.attention import resolved_backend
    from mlxpaged.platform import backend
    from mlxpaged.runner import decode_pass, recorder

    import mlx.core as mx
    import mlx_lm

    info = mx.device_info()
    name = info.get("device_name") or info.get("name") or "unnamed"
    return [
        f"device: {name} ({backend.describe()}, default device {mx.default_device()})",
        f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, mlxpaged commit {git_commit()}",
        f"decode attention: {resolved_backend()}; MLX_USE_CUDA_GRAPHS={os.environ.get(GRAPHS_VAR, 'unset (on)')}",
        f"{recorder.ENV_VAR}={os.environ.get(recorder.ENV_VAR, 'unset (off)')}; "
        f"{decode_pass.ROWS_ENV_VAR}={os.environ.get(decode_pass.ROWS_ENV_VAR, 'unset (the backend tuning)')}",
    ]


@dataclass(frozen=True)
class SummaryRow:
    """One target: `ratio` is mlxpaged against mlx-lm (x: > 1 is mlxpaged ahead) or a percentage (%)."""

    what: str
    mlx_lm: str
    mlxpaged: str
    ratio: float
    unit: str  # "x" or "%"
    goal: float | None  # None: shown for context, no target
    higher_is_better: bool = True

    @property
    def target(self) -> str:
        if self.goal is None:
            return "-"
        return f"{'>=' if self.higher_is_better else '<='} {self.goal:g}{self.unit}"

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return "-"
        met = self.ratio >= self.goal if self.higher_is_better else self.ratio <= self.goal
        return "met" if met else "missed"

    @property
    def ratio_text(self) -> str:
        return f"{self.ratio:.2f}x" if self.unit == "x" else f"{self.ratio:.1f}%"


def summary_table(rows: list[SummaryRow]) -> str:
    """Fixed-width columns: what, mlx-lm, mlxpaged, ratio, target, met/missed."""
    header = ("what", "mlx-lm", "mlxpaged", "ratio", "target", "met")
    cells = [header] + [(r.what, r.mlx_lm, r.mlxpaged, r.ratio_text, r.target, r.verdict) for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    return "\n".join([lines[0], "-" * len(lines[0]), *lines[1:]])
