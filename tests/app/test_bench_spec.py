"""`mlxpaged bench spec` on the real default model at a few tokens (timings never asserted), and the
`--speculative` flags of serve and chat."""

from argparse import Namespace

from mlxpaged_app.bench.spec import TASKS, bench_spec
from mlxpaged_app.cli import build_parser
from mlxpaged_app.server.flags import cache_settings

import pytest


@pytest.mark.slow
def test_bench_prints_each_task_with_equal_outputs_and_the_median_paired_ratio(capsys):
    assert bench_spec(Namespace(model=None, tokens=12, runs=2)) == 0
    out = capsys.readouterr().out
    for task, (kind, _) in TASKS.items():
        line = next(line for line in out.splitlines() if line.strip().startswith(task))
        fields = line[len(task) + 2 :].split()
        assert fields[0] == kind and "equal" in fields
        ratio = float(fields[4].rstrip("x"))
        plain_steps, spec_steps = int(fields[6]), int(fields[8])  # "N -> M"
        assert plain_steps == int(fields[1]) - 1 and 0 < spec_steps <= plain_steps and float(fields[9].rstrip("x")) > 0
        pairs = [float(x) for x in line.split("per-run ratios ")[1].split(";")[0].split(", ")]
        assert len(pairs) == 2 and ratio == pytest.approx(sum(pairs) / 2, abs=0.006)  # median of two


def test_speculative_flags_reach_the_engine_settings():
    serve = build_parser().parse_args(["serve", "--speculative", "ngram"])
    assert cache_settings(serve)["speculative"] == "ngram"
    assert cache_settings(build_parser().parse_args(["serve"]))["speculative"] is None
    assert build_parser().parse_args(["chat", "--speculative", "ngram"]).speculative == "ngram"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--speculative", "eagle"])
