"""Paged-attention kernels: ``reference`` (pure MLX, every backend), ``paged_attention`` (the Metal
decode kernel, source in ``paged_attention.metal``) and ``bench`` (``mlxpaged bench kernel``).
The engine goes through ``mlxpaged.kernels.attention``, which picks between them."""
