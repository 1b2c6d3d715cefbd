"""Getting a model: presets and the local store (model_store.py), the GGUF conversion of the embedded model (gguf.py),
what a checkpoint tells before loading (checkpoint.py), the mlx-lm load itself (loader.py), the cache layout from a
lazy forward (probe.py), the model's sampling defaults (generation_defaults.py) and progress reports (progress.py)."""
