"""The paged engine across processes with MLX's own distributed runtime (mx.distributed, `mlx.launch`):
tensor parallel with mlx-lm's `model.shard(group)`; rank 0 schedules and samples and sends each step's plan
to the other ranks, which run the same passes (docs/design/issue26-distributed.md)."""

# How long rank 0 waits on the other ranks through one engine step before it fails the requests in flight and
# exits (watchdog.py says why it bounds the whole step; serve's --rank-timeout sets it). Here, free of MLX, so
# the CLI's flags can show it. Generous: a long prefill chunk of a large model on a slow machine, or a first
# compile of a new shape, takes seconds; a killed rank is seen much sooner (a failed collective, mlx.launch's
# SIGTERM).
DEFAULT_RANK_TIMEOUT_S = 120.0
