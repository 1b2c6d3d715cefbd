"""The paged engine across processes with MLX's own distributed runtime (mx.distributed, `mlx.launch`):
tensor parallel with mlx-lm's `model.shard(group)`; rank 0 schedules and samples and sends each step's plan
to the other ranks, which run the same passes (docs/design/issue26-distributed.md)."""
