"""Getting a model: presets and the local store (model_store.py), the GGUF conversion of the embedded model (gguf.py),
what a checkpoint tells before loading (checkpoint.py) and the mlx-lm load itself (loader.py)."""
