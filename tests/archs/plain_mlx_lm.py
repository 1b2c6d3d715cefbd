"""mlx-lm alone (mlxpaged never imported): `python -m tests.archs.plain_mlx_lm MODULE ROUNDS` builds the
tiny model as the harness does and runs generate_step over the harness's prompts ROUNDS times, then
prints "ok": the tiny configs are sound for mlx-lm itself (test_architectures runs it on phi3small, whose first
tiny config wrote out of bounds and crashed the process at random)."""

from __future__ import annotations

import importlib
import sys

from tests.archs.configs import config_for

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generate_step


def main(module: str, rounds: int) -> None:
    mod = importlib.import_module(f"mlx_lm.models.{module}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(config_for(module)))
    model.update(tree_map(lambda p: p * 3.0 if p.ndim == 2 else p, model.parameters()))
    mx.eval(model.parameters())
    for _ in range(rounds):
        for n in (11, 23):
            list(generate_step(mx.array([(7 * i + 3 * n) % 97 + 1 for i in range(n)]), model, max_tokens=10))
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
