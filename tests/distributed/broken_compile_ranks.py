"""greedy_ranks.py with the compiled decode pass failing to trace on every rank but 0 (as a pipeline stage's
rank-dependent code did before DecodeView had `keys`): every rank must fall back to eager decoding alike."""

import os
import runpy
import sys
from pathlib import Path

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.runner import decode_pass


def _fails_to_trace(self, *args):
    raise AttributeError("this rank's stage cannot be traced (test)")


if os.environ.get("MLX_RANK", "0") != "0":
    decode_pass.CompiledDecode._trace = _fails_to_trace  # bound by mx.compile when each engine is built
sys.argv = [str(Path(__file__).with_name("greedy_ranks.py")), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
