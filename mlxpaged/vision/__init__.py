"""Images in: vision-language models on the paged engine (issue 37).

mlx-vlm (the `mlxpaged[vision]` extra) defines the vision towers, projectors, processors and the language models
of these checkpoints; the language model runs on the paged engine as text models do, fed the prompt's merged
embeddings where its images are. Nothing here is imported unless a vision checkpoint or an image is in play.

- checkpoint.py: is a model directory a vision-language checkpoint, and can this install load it
- language.py: the language model as the engine runs every model (mlx-lm's calling convention)
"""
