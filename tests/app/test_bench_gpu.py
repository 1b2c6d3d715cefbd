"""`mlxpaged bench gpu` end to end on a tiny random bf16 model: every row of the summary is printed with a
numeric ratio computed from the printed figures, and the verdict follows the ratio and the target. Timings
are never asserted: the targets may be met or missed here."""

from __future__ import annotations

import re
from argparse import ArgumentTypeError

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.engine.engine import Engine
from mlxpaged.platform import backend
from mlxpaged_app.bench.baseline import mlx_lm_side, weight_dtype
from mlxpaged_app.bench.gpu import parse_concurrency, parse_parts
from mlxpaged_app.bench.gpu_report import COMMIT_ENV, SummaryRow, git_commit, summary_table
from mlxpaged_app.cli import build_parser, main
from tests.app.printed_ratios import from_rounded
from tests.tiny_models import write_tiny_llama_dir

import pytest

ROW = re.compile(
    r"^(?P<what>.+?)\s{2,}(?P<mlx_lm>-|\d+\.\d+)\s+(?P<ours>\d+\.\d+)\s+(?P<ratio>\d+\.\d+)(?P<unit>[x%])"
    r"\s+(?P<target>(?:>=|<=) [\d.]+[x%]|-)\s+(?P<met>met|missed|-)$"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama_dir(tmp_path_factory.mktemp("tiny") / "model", dtype="bfloat16")


def summary_rows(out: str) -> dict[str, re.Match]:
    table = out[out.index("\nsummary") :].splitlines()[2:]
    assert table[1].startswith("----")
    rows = [ROW.match(line) for line in table[2:]]
    assert all(rows), table
    return {row["what"]: row for row in rows}


def test_bench_gpu_prints_every_row_with_ratios_from_its_figures(tiny_dir, capsys):
    argv = [
        "bench",
        "gpu",
        "--model",
        str(tiny_dir),
        "--tokens",
        "4",
        "--runs",
        "1",
        "--sizes",
        "64,128",
        "--concurrency",
        "2,3",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^device: .+ \(MLX's CPU backend", out, re.M)
    assert re.search(r"^mlx 0\.\d+\.\d+, mlx-lm 0\.\d+\.\d+, mlxpaged commit \S+", out, re.M)
    # The checkpoint's dtype and each side's: on the CPU both sides run the engine's float32 model, and say so.
    assert "checkpoint bfloat16; mlxpaged weights float32; mlx-lm weights float32" in out
    assert "mlx-lm side: the engine's loaded model (float32" in out
    rows = summary_rows(out)
    assert list(rows) == [
        "batch-1 decode, tok/s",
        "2 concurrent, aggregate tok/s",
        "3 concurrent, aggregate tok/s",
        "cold TTFT at 64 (23 tokens), s",
        "cold TTFT at 128 (87 tokens), s",
        "cached prefix at 64 + 8 new, TTFT s (% of cold)",
        "cached prefix at 128 + 8 new, TTFT s (% of cold)",
    ]
    for what, row in rows.items():
        ours, ratio = float(row["ours"]), float(row["ratio"])
        assert ours > 0 and ratio > 0
        if row["unit"] == "%":  # the cached time as a share of the engine's cold time at the same size
            size = re.search(r"at (\d+) ", what)[1]
            cold = float(next(r for k, r in rows.items() if k.startswith(f"cold TTFT at {size} "))["ours"])
            assert from_rounded(ratio, 100 * ours, cold, 0.1, 0.0005 * 100, 0.0005), (what, ratio, ours, cold)
        elif "TTFT" in what:  # seconds: mlx-lm's time over ours
            theirs = float(row["mlx_lm"])
            assert from_rounded(ratio, theirs, ours, 0.01, 0.0005, 0.0005), (what, ratio, theirs, ours)
        else:  # tok/s: ours over mlx-lm's
            theirs = float(row["mlx_lm"])
            assert from_rounded(ratio, ours, theirs, 0.01, 0.05, 0.05), (what, ratio, ours, theirs)
        if row["target"] == "-":
            assert row["met"] == "-"
            continue
        goal, half_step = float(row["target"][3:-1]), 0.05 if row["unit"] == "%" else 0.005
        if abs(ratio - goal) > half_step:  # the verdict reads the unrounded ratio: at the goal it may go either way
            met = ratio >= goal if row["target"].startswith(">=") else ratio <= goal
            assert row["met"] == ("met" if met else "missed")
    # Only the largest size's cached prefix carries the <= 5% target; the others are context.
    assert rows["cached prefix at 128 + 8 new, TTFT s (% of cold)"]["target"] == "<= 5%"
    assert rows["cached prefix at 64 + 8 new, TTFT s (% of cold)"]["target"] == "-"


def test_parts_runs_only_what_is_named(tiny_dir, capsys):
    assert main(["bench", "gpu", "--model", str(tiny_dir), "--tokens", "2", "--runs", "1", "--parts", "decode"]) == 0
    out = capsys.readouterr().out
    assert list(summary_rows(out)) == ["batch-1 decode, tok/s"]
    assert "engine: at most 2048 tokens per step" in out


def test_max_batch_tokens_sets_the_engines_step_budget(tiny_dir, capsys):
    command = ["bench", "gpu", "--model", str(tiny_dir), "--tokens", "2", "--runs", "1", "--parts", "decode"]
    assert main([*command, "--max-batch-tokens", "4096"]) == 0
    assert "engine: at most 4096 tokens per step" in capsys.readouterr().out


def test_on_a_gpu_the_mlx_lm_side_is_its_own_untouched_load(tiny_dir):
    with Engine.from_pretrained(str(tiny_dir), cache_tokens=256) as engine:
        with backend.simulate("cuda"):
            side = mlx_lm_side(engine)
        assert side.loaded.model is not engine.loaded.model
        assert weight_dtype(side.loaded.model) == "bfloat16" and side.loaded.dtype == "bfloat16"
        assert "its own copy, mlx_lm.load(" in side.note and "untouched (bfloat16)" in side.note
        assert mlx_lm_side(engine).loaded is engine.loaded  # the CPU backend shares the engine's float32 model


def test_flags_parse_and_refuse_bad_input():
    args = build_parser().parse_args(
        ["bench", "gpu", "--concurrency", "16,64", "--sizes", "2048,8192", "--parts", "batch,ttft"]
    )
    assert (args.what, args.concurrency, args.sizes, args.parts) == ("gpu", (16, 64), (2048, 8192), ("batch", "ttft"))
    with pytest.raises(ArgumentTypeError, match="got '16x'"):
        parse_concurrency("16x")
    with pytest.raises(ArgumentTypeError, match=r"at least 1, got \[4, 0\]"):
        parse_concurrency("4,0")
    with pytest.raises(ArgumentTypeError, match="some of decode,batch,ttft, got 'decode,prefill'"):
        parse_parts("decode,prefill")


def test_summary_verdicts_follow_the_direction_of_each_target():
    rows = [
        SummaryRow("faster", "1.0", "2.0", 2.0, "x", 1.0),
        SummaryRow("slower", "2.0", "1.0", 0.5, "x", 1.0),
        SummaryRow("small share", "-", "0.1", 4.0, "%", 5.0, higher_is_better=False),
        SummaryRow("big share", "-", "0.5", 50.0, "%", 5.0, higher_is_better=False),
        SummaryRow("context", "-", "0.5", 50.0, "%", None, higher_is_better=False),
    ]
    got = {
        what: (row["ratio"] + row["unit"], row["target"], row["met"])
        for what, row in summary_rows("\nsummary\n" + summary_table(rows)).items()
    }
    assert got == {
        "faster": ("2.00x", ">= 1x", "met"),
        "slower": ("0.50x", ">= 1x", "missed"),
        "small share": ("4.0%", "<= 5%", "met"),
        "big share": ("50.0%", "<= 5%", "missed"),
        "context": ("50.0%", "-", "-"),
    }


def test_the_named_commit_wins_over_a_copied_checkouts_git(monkeypatch):
    """The GPU kit's copy carried a stale .git: the header printed an old commit "+dirty" instead of the one run."""
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", git_commit())  # this checkout's own
    monkeypatch.setenv(COMMIT_ENV, "66d19eb")
    assert git_commit() == "66d19eb"
