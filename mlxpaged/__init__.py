"""mlxpaged: local LLM inference on MLX with a paged KV cache."""

# Must run before anything imports mlx.core (see blas.py).
from mlxpaged.blas import blas_status, load_fast_blas

load_fast_blas()

__version__ = "0.1.0"
__all__ = ["blas_status", "__version__"]
