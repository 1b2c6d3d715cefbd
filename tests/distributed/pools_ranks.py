"""Run under `mlx.launch` (or alone): every rank loads and splits the model in argv[1] as argv[2] says ("tensor",
"pipeline" or "auto"), builds its engine core with the settings in argv[3] (JSON) and prints what it holds as one
JSON line: its layers of the model, its KV pools, its memory plan. test_pipeline_pools.py reads every rank's."""

import json
import re
import sys

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import split_settings
from mlxpaged.distributed.ranks import join
from mlxpaged.distributed.shard import pipeline_stack, shard_model
from mlxpaged.engine.build import build_core
from mlxpaged.engine.metrics import StatsCounter
from mlxpaged.loading.loader import load_local, locate_model

from mlx.utils import tree_flatten

model_dir, parallel, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ranks = join()
ref, path = locate_model(model_dir)
loaded = load_local(ref, path, lazy=ranks is not None)
if ranks is not None:
    ranks = shard_model(loaded.model, loaded.config, ranks, None if parallel == "auto" else parallel)
cache, scheduler = split_settings(settings)
# Every rank builds the same core (the same collectives in the same order), then stops: no engine is started.
built = build_core(loaded, cache, scheduler, stats=StatsCounter(), has_commands=lambda: False, ranks=ranks)
stack = pipeline_stack(loaded.model)
weights = [name for name, _ in tree_flatten(loaded.model.parameters())]
print(
    "RANK "
    + json.dumps(
        {
            "rank": 0 if ranks is None else ranks.rank,
            "parallel": None if ranks is None else ranks.parallel,
            "layers": None if stack is None else [stack.start_idx, stack.end_idx or len(stack.layers)],
            "weight_layers": sorted({int(m.group(1)) for w in weights if (m := re.search(r"layers\.(\d+)\.", w))}),
            "kv_layers": built.kv.num_layers,
            "pools": len(built.kv.pools),
            "pool_shape": list(built.kv.pools[0].shape),
            "bytes_per_block": built.kv.bytes_per_block,
            "num_blocks": built.plan.num_blocks,
        }
    ),
    flush=True,
)
