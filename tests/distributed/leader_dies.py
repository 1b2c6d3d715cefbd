"""Run over 2 ranks (tests/distributed/launch.py): rank 0 decodes once, then its process dies; the other ranks
must notice and stop (test_leader_lost.py)."""

import os
import sys

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.distributed.follower import LeaderLostError
from mlxpaged.distributed.start import start_engine
from mlxpaged.sampling_params import SamplingParams

try:
    engine = start_engine(sys.argv[1], cache_tokens=1024, block_size=16)
except LeaderLostError as exc:
    print(f"LEADER LOST: {exc}", flush=True)
    sys.exit(1)
if engine is not None:
    engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))
    print("RANK 0 DIES", flush=True)
    # No close: the followers get no stop message. Status 0, or the launcher would SIGTERM them itself (mlx.launch
    # and run_script stop the job when a rank fails), racing their own detection, which is what the test checks.
    os._exit(0)
