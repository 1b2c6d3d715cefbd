"""`mlxpaged bench hybrid` on a small hybrid: it prints each round and a ratio computed from the medians it measured."""

from __future__ import annotations

import re
import statistics

from mlxpaged_app.bench.hybrid import run


def test_the_ratio_is_the_ratio_of_the_printed_medians(capsys):
    paged, mlx_lm = run(hidden=256, layers=4, tokens=4, prompt_tokens=8, rounds=2)
    out = capsys.readouterr().out
    rounds = [
        tuple(map(float, m)) for m in re.findall(r"generate_step\s+([\d.]+) tok/s\s+paged engine\s+([\d.]+)", out)
    ]
    assert len(rounds) == 2 and paged > 0 and mlx_lm > 0
    assert "state" in out and "slots" in out
    last = out.strip().splitlines()[-1]
    assert last == f"median decode: paged {paged:.1f} tok/s, mlx-lm {mlx_lm:.1f} tok/s, ratio {paged / mlx_lm:.2f}"
    # The printed rounds are rounded to 0.1: their medians agree with the returned ones to that rounding.
    assert abs(statistics.median(r[1] for r in rounds) - paged) <= 0.05 + 1e-9
    assert abs(statistics.median(r[0] for r in rounds) - mlx_lm) <= 0.05 + 1e-9
