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
    assert cache_settings(build_parser().parse_args(["serve", "--speculative", "mtp"]))["speculative"] == "mtp"
    assert build_parser().parse_args(["chat", "--speculative", "mtp"]).speculative == "mtp"
    dflash = build_parser().parse_args(["serve", "--speculative", "dflash", "--draft-model", "z-lab/drafter"])
    assert cache_settings(dflash)["speculative"] == "dflash" and dflash.draft_model == "z-lab/drafter"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--speculative", "eagle"])


def test_draft_model_flags_reach_the_engine_settings():
    from mlxpaged_app.cli import draft_settings

    serve = build_parser().parse_args(["serve", "--draft-model", "qwen3-0.6b", "--num-draft-tokens", "3"])
    assert serve.draft_model == "qwen3-0.6b" and cache_settings(serve)["num_speculative_tokens"] == 3
    chat = build_parser().parse_args(["chat", "--draft-model", "qwen3-0.6b", "--num-draft-tokens", "5"])
    assert draft_settings(chat) == {"draft_model": "qwen3-0.6b", "num_speculative_tokens": 5}
    assert draft_settings(build_parser().parse_args(["chat"])) == {}


def test_bench_spec_with_drafters_prints_each_level_with_equal_outputs(tmp_path, capsys):
    """The oracle keeps every draft; a draft model adds the batch-1 line beside mlx-lm's own draft_model path (tiny
    random models of the real tokenizer: the logic, not the speed)."""
    from tests.tiny_models import write_tiny_model_dir

    target = write_tiny_model_dir(tmp_path / "target", "llama", dtype="float32", seed=1)
    draft = write_tiny_model_dir(tmp_path / "draft", "llama", dtype="float32", seed=2, layers=1)
    common = {"model": str(target), "tokens": 6, "runs": 1, "concurrency": (1, 2), "num_draft_tokens": 3}
    assert bench_spec(Namespace(drafter="oracle", draft_model=None, **common)) == 0
    assert bench_spec(Namespace(drafter="ngram", draft_model=str(draft), **common)) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "1", "2"] and all("equal" in r for r in rows)
    assert rows[0][4] == rows[1][4] == "100%"  # the oracle: every draft kept
    batch1 = next(line for line in out.splitlines() if "mlx-lm draft" in line)
    assert "mlxpaged draft / mlx-lm draft" in batch1 and batch1.rstrip().endswith("equal")


def test_bench_spec_with_mtp_layers_prints_each_level_with_equal_outputs(tmp_path, capsys):
    from tests.tiny_models import add_mtp_layers, write_tiny_model_dir

    model = add_mtp_layers(write_tiny_model_dir(tmp_path / "mtp", "qwen3_5", dtype="float32", seed=3, layers=4))
    common = {"model": str(model), "tokens": 6, "runs": 1, "concurrency": (1, 2), "num_draft_tokens": 3}
    assert bench_spec(Namespace(drafter="mtp", draft_model=None, **common)) == 0
    out = capsys.readouterr().out
    assert "drafter: the model's MTP layers" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all("equal" in r for r in rows)


@pytest.mark.parametrize("drafter", ["dflash", "eagle3"])
def test_bench_spec_with_a_drafter_checkpoint_prints_each_level_with_equal_outputs(tmp_path, capsys, drafter):
    from tests.engine import test_dflash, test_eagle3
    from tests.tiny_models import write_tiny_model_dir

    model = write_tiny_model_dir(tmp_path / "target", "llama", dtype="float32", seed=1, layers=3)
    if drafter == "dflash":
        path = test_dflash.write_drafter_dir(tmp_path / drafter, test_dflash.random_drafter())
    else:
        config = {**test_eagle3.CONFIG, "transformer_layer_config": {**test_eagle3.LAYER, "vocab_size": 49152}}
        path = test_eagle3.write_head_dir(tmp_path / drafter, test_eagle3.random_head(config), config)
    common = {"model": str(model), "tokens": 6, "runs": 1, "concurrency": (1, 2), "num_draft_tokens": 3}
    assert bench_spec(Namespace(drafter=drafter, draft_model=str(path), **common)) == 0
    out = capsys.readouterr().out
    assert ("DFlash drafter" if drafter == "dflash" else "EAGLE-3 head") in out and "mlx-lm draft" not in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2"] and all("equal" in r for r in rows)
