"""Paged-attention kernels: ``reference`` (pure MLX, every backend), ``cpu_attention`` and ``numpy_attention`` (MLX's
CPU backend), ``paged_attention`` (the Metal decode kernel, source in ``paged_attention.metal``, checked by
``self_check``) and ``bench`` (``mlxpaged bench kernel``). The engine goes through ``mlxpaged.kernels.attention``,
which picks between them."""
