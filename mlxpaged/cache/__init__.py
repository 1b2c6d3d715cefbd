"""The paged KV cache: the block pool (blocks, hashes, LRU; plain Python), the per-request cache manager with one
manager per layer spec (specs.py), the MLX page pools (kv_cache.py) and the views mlx-lm models write and read
through."""
