"""`serve --pipeline`: the flag reaches start_engine's `parallel` on every rank (rank 0 through the registry's
EngineSettings, the others through ranks.py), and alone, with no ranks to split over, it is refused."""

from __future__ import annotations

from mlxpaged.config import split_settings
from mlxpaged_app.cli import build_parser
from mlxpaged_app.server.flags import ServeError
from mlxpaged_app.server.launcher import build_registry
from mlxpaged_app.server.ranks import distributed_settings, parallel_setting

import pytest


def test_pipeline_flag_is_the_parallel_setting_apart_from_the_cache_settings(monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    parser = build_parser()
    forced, default = parser.parse_args(["serve", "--pipeline"]), parser.parse_args(["serve"])
    assert parallel_setting(forced) == "pipeline" and parallel_setting(default) is None
    split_settings(distributed_settings(forced))  # no `parallel` among the cache and scheduler settings


def test_pipeline_without_mlx_launch_is_refused(monkeypatch):
    monkeypatch.delenv("MLX_RANK", raising=False)
    args = build_parser().parse_args(["serve", "--pipeline"])
    with pytest.raises(ServeError, match=r"--pipeline splits the model over the processes mlx\.launch starts"):
        build_registry(args, None)
