"""Running the model: one step over a ragged batch (model_runner.py, passes.py), mlx-lm's attention routed to the
pages (routing.py, cache_tree.py), the compiled batch-1 decode pass, deferred writes on a GPU, drafts and their
verification, and the sampler. docs/ARCHITECTURE.md lists each module."""
