"""Running the model: one step over a ragged batch (model_runner.py), the compiled batch-1 decode pass and the
sampler."""
