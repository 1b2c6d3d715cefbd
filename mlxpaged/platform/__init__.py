"""The machine: which backend MLX computes on and its constants (backend.py), a fast BLAS before MLX (blas.py),
glibc malloc thresholds (malloc.py), device memory facts, the KV memory plan and the wired limit (memory.py,
model_facts.py)."""
