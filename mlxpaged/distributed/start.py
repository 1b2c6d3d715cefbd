"""Starting an engine in every process `mlx.launch` started: each rank loads the model and keeps its shard;
rank 0 gets the Engine (it serves and schedules), the others follow its plan until it closes.

    engine = start_engine("my-model", cache_tokens=4096)   # every rank runs this line
    if engine is not None:                                 # rank 0 only
        with engine: ...

Alone (no `mlx.launch`, or a group of one) it is Engine.from_pretrained.
"""

from __future__ import annotations

from mlxpaged.config import DEFAULT_CACHE_TOKENS, CacheConfig, SchedulerConfig, split_settings
from mlxpaged.distributed import DEFAULT_RANK_TIMEOUT_S
from mlxpaged.distributed.channel import PlanChannel
from mlxpaged.distributed.follower import follow
from mlxpaged.distributed.ranks import Ranks, join
from mlxpaged.distributed.shard import shard_model
from mlxpaged.embedding.model_files import refuse_generation
from mlxpaged.engine.build import build_core
from mlxpaged.engine.engine import Engine
from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.loading.loader import LoadedModel, load_local, locate_model
from mlxpaged.loading.progress import Progress


def start_engine(
    model: str | None = None,
    progress: Progress | None = None,
    parallel: str | None = None,
    rank_timeout_s: float = DEFAULT_RANK_TIMEOUT_S,
    **settings,
) -> Engine | None:
    """Rank 0: the Engine over this group (or alone: Engine.from_pretrained). Other ranks: run rank 0's plan
    until its engine closes, then return None. Settings as Engine.from_pretrained's, the same on every rank.
    `parallel`: "tensor" or "pipeline" to force one (shard.py); None: tensor where the model shards, else
    pipeline. Alone it plays no part. `rank_timeout_s`: rank 0's bound on one step across the ranks (past it,
    or when a step fails, rank 0 fails the requests in flight and exits non-zero: distributed/watchdog.py)."""
    ranks = join(timeout_s=rank_timeout_s)
    if ranks is None:
        return Engine.from_pretrained(model, progress, **settings)
    settings.setdefault("cache_tokens", DEFAULT_CACHE_TOKENS)
    cache, scheduler = split_settings(settings)
    ref, path = locate_model(model, progress if ranks.leads else None)
    refuse_generation(path, ref.name, ref.preset.options if ref.preset else None)  # on every rank alike
    loaded = load_local(ref, path, lazy=True)  # sharded before any weight is read, as mlx-lm's sharded_load
    ranks = shard_model(loaded.model, loaded.config, ranks, parallel)
    if ranks.leads:
        return Engine(loaded, cache, scheduler, ranks=ranks)
    run_follower(loaded, cache, scheduler, ranks)
    return None


def run_follower(loaded: LoadedModel, cache: CacheConfig, scheduler: SchedulerConfig, ranks: Ranks) -> int:
    """Build the very core rank 0 builds (the same probes, checks and warm-up passes, so the same collectives
    in the same order), then run its plan; returns the number of steps run."""
    built = build_core(loaded, cache, scheduler, stats=StatsCounter(), has_commands=lambda: False, ranks=ranks)
    built.core.warm_up()
    return follow(built.core.runner, PlanChannel(ranks))
