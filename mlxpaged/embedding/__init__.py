"""Embeddings: `Embedder` (embedder.py) runs an embedding model over batches of texts or token arrays.

model_files.py reads the sentence-transformers files (which models are embedding models, pooling, normalization,
prompts); load.py loads the model through mlx-lm without its LM head; memory.py checks it fits before loading;
inputs.py tokenizes and checks lengths; batching.py groups inputs into forward passes by a token budget; body.py
finds the transformer body; forward.py runs one right-padded pass; pooling.py pools, truncates and normalizes."""
